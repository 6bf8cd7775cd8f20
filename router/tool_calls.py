"""OpenAI's tool calling, on structured outputs. `tools` reach the chat template, and a
`tool_choice` that names a function, or "required", holds the output to the JSON of such calls
(common/structured_output.py), which the response then shows as the message's `tool_calls`: no
parser has to find calls in free text, and every call parses. vLLM serves these two the same way.

"auto" (OpenAI's default when tools are given) lets the model choose between text and calls, which
takes a parser for the model family's call format (router/tool_parsers.py): the server's
--tool-call-parser, without which "auto" is refused, as vLLM refuses it without
--enable-auto-tool-choice. "none" shows the tools to the template and generates text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from common import structured_output
from common.errors import InvalidArgument, short_repr
from router.tool_parsers import PARSERS, AutoCallStream, ToolParser, call

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}}
NAMED = '{"type": "function", "function": {"name": ...}}'
CHOICES = f'"none", "auto" (with --tool-call-parser), "required" or {NAMED}'
TOOL = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'


@dataclass
class Tools:
    """A chat request's tools and what it asks of them."""
    tools: list[dict]  # as given: the chat template's `tools`
    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the function a named choice calls
    parallel: bool = True  # "required" or "auto" may make several calls
    parameters: dict[str, dict] = field(default_factory=dict)  # each function's parameters schema
    parser: ToolParser | None = None  # "auto": the calls in the model's text

    @property
    def calls(self) -> bool:
        """The output is held to tool calls, not text."""
        return self.choice in ("named", "required")

    def stream(self):
        """What shows a streamed choice's text: None for text alone."""
        if self.choice == "auto":
            return AutoCallStream(self.parser, self.message)
        return CallStream(self) if self.calls else None

    def message(self, text: str) -> dict:
        """A whole output as the assistant's message: content, tool_calls, or both ("auto")."""
        if self.choice == "auto":
            content, calls = self.parser.parse(text, self.parameters)
            calls = calls if self.parallel else calls[:1]
            return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        calls = self.tool_calls(text) if self.calls else None
        if calls is None:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": None, "tool_calls": calls}

    def structured_outputs(self) -> dict | None:
        """The JSON the output is held to: a named function's arguments, or a list of calls."""
        if self.choice == "named":  # parse() checked it: not compiled again
            return structured_output.Checked({"json": self.parameters[self.name]})
        if self.choice in ("none", "auto"):
            return None
        one_of = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                   "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/{name}"}}}
                  for name in self.parameters]
        return {"json": {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                         "items": {"anyOf": one_of},
                         "$defs": {name: _rooted(params, f"#/$defs/{name}") for name, params in self.parameters.items()}}}

    def tool_calls(self, text: str) -> list[dict] | None:
        """The calls a finished output makes, as OpenAI shows them. A named function's arguments are
        the text, whole or cut by max_tokens (as a stream shows them); "required" calls need whole
        JSON, else None."""
        if self.choice == "named":
            return [call(self.name, text)]
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return [call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]

    @property
    def finish_reason(self) -> str:
        """OpenAI's for a whole output: "stop" for a call it was told to make, else "tool_calls"."""
        return "stop" if self.choice == "named" else "tool_calls"


def _rooted(schema, root: str):
    """A schema moved from the root of a document to `root`: its references within itself ("#",
    "#/$defs/...", as Pydantic writes them) made to point there."""
    if isinstance(schema, dict):
        return {k: root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rooted(v, root)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rooted(v, root) for v in schema]
    return schema


def parse(body: dict, parallel: bool = True, parser: str | None = None) -> Tools | None:
    """The tools of a chat body, checked: InvalidArgument naming the field and what is allowed.
    parallel: its parallel_tool_calls (checked by the caller); parser: the server's
    --tool-call-parser, which "auto" needs."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidArgument(f"tool_choice={short_repr(choice)} needs tools; allowed without tools: \"none\"",
                                  param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools={short_repr(tools)} is invalid; allowed: a list of at most {MAX_TOOLS} {TOOL}",
                              param="tools")
    parameters = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not set(fn) <= {"name", "description", "parameters", "strict"}:
            raise InvalidArgument(f"tools[{i}]={short_repr(tool)} is invalid; allowed: {TOOL}", param="tools")
        name, params = fn.get("name"), fn.get("parameters", NO_PARAMETERS)
        if not isinstance(name, str) or not NAME.fullmatch(name) or name in parameters:
            raise InvalidArgument(f"tools[{i}].function.name={short_repr(name)} is invalid; allowed: a name of "
                                  "1-64 letters, digits, _ or -, unique among the tools", param="tools")
        if not isinstance(params, dict) or not isinstance(fn.get("description", ""), str):
            raise InvalidArgument(f"tools[{i}].function={short_repr(fn)} is invalid; allowed: a string "
                                  "description and a JSON schema of the parameters", param="tools")
        if params.get("type", "object") != "object":  # arguments are a JSON object, as OpenAI requires
            raise InvalidArgument(f"tools[{i}].function.parameters.type={short_repr(params['type'])} is invalid; "
                                  'allowed: "object"', param="tools")
        # whatever the choice: a schema the model's calls could never be held to is an error now, by name
        structured_output.check({"json": params}, "tools", f"tools[{i}].function.parameters")
        parameters[name] = params or NO_PARAMETERS
    if choice in (None, "auto"):
        if parser is None:
            raise InvalidArgument('tool_choice "auto" (the default with tools) lets the model choose between text '
                                  "and calls, which needs a parser for its call format: start the server with "
                                  f"--tool-call-parser ({', '.join(PARSERS)}); allowed without one: \"none\", \"required\" or {NAMED}",
                                  param="tool_choice")
        return Tools(tools, "auto", parallel=parallel, parameters=parameters, parser=PARSERS[parser])
    if choice in ("none", "required"):
        return Tools(tools, choice, parallel=parallel, parameters=parameters)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in parameters:
        raise InvalidArgument(f"tool_choice={short_repr(choice)} is invalid; allowed: {CHOICES}, naming one of "
                              f"the tools ({', '.join(parameters)})", param="tool_choice")
    return Tools(tools, "named", name, parameters=parameters)


class CallStream:
    """A streamed choice's tool calls. A named function's arguments stream as the text comes (the
    first delta with the call's id and name); "required" calls are held until the output is whole
    JSON, since a call's name comes before its arguments end, then sent each whole."""

    def __init__(self, tools: Tools):
        self.tools, self.started, self.held = tools, False, ""

    def delta(self, text: str, finished: bool) -> dict:
        """The delta for the choice's next text (the last when finished); {} when nothing shows."""
        if self.tools.choice == "named":
            if not text:
                return {}
            piece = {"function": {"arguments": text}} if self.started else call(self.tools.name, text)
            self.started = True
            return {"tool_calls": [{"index": 0, **piece}]}
        self.held += text
        if not finished:
            return {}
        calls = self.tools.tool_calls(self.held)
        if calls is None:  # cut short by max_tokens: the text as it is
            return {"content": self.held} if self.held else {}
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
