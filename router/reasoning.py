"""A reasoning model's thinking split from its answer (`--reasoning-parser`, vLLM's flag and
names), shown as the message's `reasoning` and `reasoning_content` (vLLM's field and DeepSeek's)
beside `content`:

- qwen3 (Qwen3's hybrid models): the output opens `<think>` itself when it thinks (a chat
  template given `enable_thinking: false` writes an empty `<think></think>` into the prompt
  instead), and what follows up to `</think>` is the reasoning; an output that does not open it is
  all answer;
- deepseek_r1 (DeepSeek-R1 and its distills, QwQ-32B, Qwen3's Thinking-2507 models): the template
  opens `<think>` in the prompt, so the output is reasoning from its first token up to `</think>`
  (a `<think>` it writes anyway is left out).

A response held to JSON (response_format, a named or required tool call) thinks first, as vLLM's
does: its structured output begins after `</think>` (thinking_end), the thinking before it free.
Where the prompt has closed the thinking already (a template given `enable_thinking: false`), or
the tags are no short run of the model's tokens, it is held to JSON from its first token and shown
as all answer. (A grammar of the request's own, structured_outputs, holds the output from its
first token: it may spell out the thinking itself.)

An output cut before `</think>` is all reasoning, with no answer. The newlines around the tags are
left out; an output without them is shown as it is. A stream sends each part as it comes, holding back what could begin a tag.
"""

from __future__ import annotations

from common.sampling_params import MAX_AFTER_TOKENS
from common.text import partial_tag_at

START, END = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, name: str, opens_in_prompt: bool):
        self.name, self.opens_in_prompt = name, opens_in_prompt

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output, each None if empty."""
        reasoning, content = self.stream().feed(text, True)
        return reasoning or None, content or None


class ReasoningStream:
    """Text in, (reasoning, content) pieces out, as the output comes."""

    def __init__(self, parser: ReasoningParser):
        self.state = "opening"  # then "reasoning" and/or "content"
        self.opened = parser.opens_in_prompt  # the prompt opened <think>: the output need not
        self.held = ""  # text not yet shown: a tag may begin in it, or leading newlines
        self.started = False  # the current part has shown something (newlines before it are dropped)

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        if self.state == "opening":  # does the output open <think>?
            body = self.held.lstrip()
            if body.startswith(START):
                self.state, self.held = "reasoning", body[len(START):]
            elif START.startswith(body) and not finished:
                return "", ""
            else:  # an answer alone is shown as it is written
                self.state = "reasoning" if self.opened else "content"
                self.started = not self.opened
        if self.state == "reasoning":
            end = self.held.find(END)
            if end >= 0:
                reasoning, _ = self._part(self.held[:end], True)
                self.held = self.held[end + len(END):]
                self.state, self.started = "content", False
            else:
                upto = len(self.held) if finished else partial_tag_at(self.held, END)
                reasoning, back = self._part(self.held[:upto], True)
                self.held = back + self.held[upto:]
                if finished:
                    return reasoning, ""
        if self.state == "content":
            content, _ = self._part(self.held, False)
            self.held = ""
        return reasoning, content

    def _part(self, piece: str, hold_trailing: bool) -> tuple[str, str]:
        """(what of piece shows, the newlines held back): the newlines that open a part are left
        out, and the reasoning's trailing ones wait for what follows them (left out before END)."""
        if not self.started:
            piece = piece.lstrip("\n")
        back = ""
        if hold_trailing:
            kept = piece.rstrip("\n")
            piece, back = kept, piece[len(kept):]
        self.started = self.started or bool(piece)
        return piece, back


PARSERS = {p.name: p for p in (ReasoningParser("qwen3", False), ReasoningParser("deepseek_r1", True))}


def thinking_end(tokenizer, prompt_ids: list[int]) -> list[int] | None:
    """The token ids with which the output ends its thinking, where the prompt leaves the model to
    think before its structured output (which begins after them: SamplingParams'
    structured_outputs_after). None where the prompt has just closed the thinking (`</think>` and
    only whitespace after it: a template given enable_thinking: false), or where the tags are not
    single tokens: a tag of several (`</`, `think`, `>`) is spelled otherwise in other text
    (`>\n\n` one token), and its run might never be seen (vLLM too takes one token), unless the
    tokenizer spells every text one way (a byte a token)."""
    prompt_ids = list(prompt_ids)
    start, end = (tokenizer.encode(tag, add_special_tokens=False) for tag in (START, END))
    if not end or len(end) > MAX_AFTER_TOKENS or (
            max(len(start), len(end)) > 1 and not getattr(tokenizer, "one_spelling", False)):
        return None
    closed = _last_run(prompt_ids, end)
    if closed > _last_run(prompt_ids, start):
        after = prompt_ids[closed + len(end):]
        if len(after) <= MAX_AFTER_TOKENS and not tokenizer.decode(after).strip():
            return None
    return end


def _last_run(ids: list[int], run: list[int]) -> int:
    """Where run last begins in ids, or -1."""
    n = len(run)
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == run[0] and ids[i:i + n] == run:
            return i
    return -1
