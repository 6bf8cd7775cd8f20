"""Tool calls found in a model's free text: what tool_choice "auto" needs, where the model chooses
between answering and calling. Each model family writes calls its own way, so the server is told
which (`--tool-call-parser`, vLLM's flag and names):

- hermes (Qwen2.5, Qwen3, Hermes, and most models trained on Hermes' format):
  `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, one block per call;
- llama3_json (Llama 3.1 to 3.3): the message is `{"name": "f", "parameters": {...}}`, optionally
  after `<|python_tag|>`, several separated by `;`.

Text before the first call is the message's content. Calls that do not parse, lack their
arguments' key or name a function the request did not offer leave the whole text as content (a
JSON answer such as {"name": "Bob", "age": 30} is not a call). A stream sends the content as it comes, holding back what could
begin a call, and the calls once the output is whole.
"""

from __future__ import annotations

import json
import re
import uuid

from common.text import partial_tag_at


def call(name: str, arguments: str) -> dict:
    """A tool call as OpenAI shows it; arguments: a JSON string."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolParser:
    name = ""

    def start(self, text: str) -> int | None:
        """Where the calls begin in text, or None while they have not."""
        raise NotImplementedError

    def held_from(self, text: str) -> int:
        """Where text stops being surely content: from there on it may be the beginning of a call."""
        raise NotImplementedError

    def calls(self, section: str) -> list[dict] | None:
        """The calls of the text from start() on, as OpenAI shows them; None if they do not parse."""
        raise NotImplementedError

    def parse(self, text: str, names=None) -> tuple[str | None, list[dict]]:
        """(content, calls) of a whole output: content None where only calls were written. names:
        the functions a call may name (None: any)."""
        at = self.start(text)
        calls = None if at is None else self.calls(text[at:])
        if calls and names is not None and any(c["function"]["name"] not in names for c in calls):
            calls = None
        if not calls:
            return text, []
        return (text[:at] if text[:at].strip() else None), calls


def _call_of(obj, key: str) -> dict | None:
    """A call from {"name": ..., key: {...}} (the object also as a JSON string, or null), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not {key, "arguments"} & set(obj):
        return None
    arguments = obj.get(key, obj.get("arguments"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    arguments = {} if arguments is None else arguments
    if not isinstance(arguments, dict):
        return None
    return call(obj["name"], json.dumps(arguments, ensure_ascii=False))


class Hermes(ToolParser):
    name = "hermes"
    START = "<tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)

    def start(self, text):
        at = text.find(self.START)
        return None if at < 0 else at

    def held_from(self, text):
        return partial_tag_at(text, self.START)

    def calls(self, section):
        out = []
        for block in self.BLOCK.findall(section):
            try:
                made = _call_of(json.loads(block), "arguments")
            except ValueError:
                return None
            if made is None:
                return None
            out.append(made)
        return out or None


class Llama3Json(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def start(self, text):
        body = text.lstrip()
        if body.startswith(self.TAG) or body.startswith("{"):
            return len(text) - len(body)
        return None

    def held_from(self, text):
        body = text.lstrip()
        return len(text) - len(body) if self.TAG.startswith(body) else len(text)  # "" (all blank) included

    def calls(self, section):
        rest, out = section.strip().removeprefix(self.TAG).strip(), []
        decoder = json.JSONDecoder()
        while rest:
            try:
                obj, end = decoder.raw_decode(rest)
            except ValueError:
                return None
            made = _call_of(obj, "parameters")
            if made is None:
                return None
            out.append(made)
            rest = rest[end:].strip().removeprefix(";").strip()
        return out or None


PARSERS = {p.name: p for p in (Hermes(), Llama3Json())}


class AutoCallStream:
    """A streamed choice under tool_choice "auto": content deltas while the text is surely content;
    once the output is whole, what its whole message (`message`: Tools.message) adds, the calls
    among it, so a stream shows what a response would."""

    def __init__(self, parser: ToolParser, message):
        self.parser, self.message, self.text, self.sent, self.calls_at = parser, message, "", 0, None

    def delta(self, text: str, finished: bool) -> dict:
        self.text += text
        if finished:
            whole = self.message(self.text)
            delta = {"content": rest} if (rest := (whole["content"] or "")[self.sent:]) else {}
            if "tool_calls" in whole:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(whole["tool_calls"])]
            return delta
        if self.calls_at is None:
            self.calls_at = self.parser.start(self.text)
        upto = self.calls_at if self.calls_at is not None else self.parser.held_from(self.text)
        if not self.text[:upto].strip():
            return {}  # blank so far: content only if something else follows (parse's None)
        delta = {"content": self.text[self.sent:upto]} if upto > self.sent else {}
        self.sent = max(self.sent, upto)
        return delta
