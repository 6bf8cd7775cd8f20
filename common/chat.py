"""Chat templates: a list of messages rendered to one prompt string, as the model was trained.

The template is the model's own Jinja source (`chat_template` in a Hugging Face checkpoint's
tokenizer_config.json or chat_template.jinja, `tokenizer.chat_template` in a GGUF file), rendered
in a sandboxed, immutable Jinja environment with the globals, filters and tags `transformers`
provides, and the variables it defines, so a template written for `apply_chat_template` renders
the same string here. A template comes from a
model file, which is data: the sandbox keeps it from reaching Python objects.

The rendered text usually carries the model's special tokens (BOS included) itself, so it is
encoded without adding special tokens, as `transformers` does.

The embedded dummy models have no template of their own; they get DUMMY_CHAT_TEMPLATE:

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>
"""

from __future__ import annotations

import datetime
import functools
import json
from dataclasses import dataclass

from common.errors import InvalidArgument, ModelLoadError, nested, short_repr as _short

DUMMY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MAX_MESSAGES = 4096
_TEXT_PARTS = ("text", "refusal")  # a content part's type, and the key that holds its text
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' mark of where the last message's content ends


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "chat template",
                 **other_tokens: str):
        """other_tokens: more of SPECIAL_TOKENS by name (pad_token="<pad>"). The template sees those
        given as variables, as transformers defines a tokenizer's special tokens; an empty one is absent."""
        from jinja2 import TemplateError

        self.source, self.origin = source, origin
        tokens = dict(bos_token=bos_token, eos_token=eos_token, **other_tokens)
        self.tokens = {name: text for name, text in tokens.items() if text}
        try:
            self._template = _environment().from_string(source)
        except TemplateError as e:
            raise ModelLoadError(f"{origin}: not a valid Jinja template ({e})") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
               **extra) -> str:
        """messages (checked by check_messages) to the prompt text, with the variables transformers'
        apply_chat_template defines (extra overrides the tokens); a template that fails says why.
        continue_final_message: the prompt ends inside the last message, for the model to go on
        with it (a prefilled answer), as transformers cuts it: after a tag put at its end."""
        messages = check_messages(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidArgument("continue_final_message=true with add_generation_prompt=true is invalid: the "
                                      "prompt cannot both open a new turn and go on with the last; allowed: "
                                      "add_generation_prompt=false with it", param="continue_final_message")
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + CONTINUE_TAG}
        variables = {"tools": None, "documents": None, **self.tokens, **extra}
        try:
            text = self._template.render(variables, messages=messages, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # raise_exception, or a Python error in what the template called (a TypeError...)
            raise InvalidArgument(f"messages cannot be rendered by the {self.origin}: "
                                  f"{type(e).__name__}: {e}") from e
        return _cut_at_tag(text, self.origin) if continue_final_message else text


def _cut_at_tag(text: str, origin: str) -> str:
    """A rendered chat cut where its last message's content ended (CONTINUE_TAG); where the
    template strips a message's trailing space, cut before the space it left."""
    at = text.rfind(CONTINUE_TAG.strip())
    if at < 0:
        raise InvalidArgument(f"continue_final_message=true cannot continue the last message: the {origin} does not "
                              "end it with its content as given; allowed: add_generation_prompt=true",
                              param="continue_final_message")
    return text[:at] if text.startswith(CONTINUE_TAG, at) else text[:at].rstrip()


TEMPLATE_OWN = ("messages", "tools", "documents", "add_generation_prompt",
                "continue_final_message")  # set by the request's own fields


@dataclass(frozen=True)
class TemplateArgs:
    """What a chat request asks of the chat template beside its messages: OpenAI's tools, vLLM's
    chat_template_kwargs, and where the prompt ends: a new assistant turn opened
    (add_generation_prompt) or the last message left open (continue_final_message)."""
    tools: list[dict] | None = None
    kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


def check_template_kwargs(kwargs) -> dict | None:
    """vLLM's chat_template_kwargs: more variables for the chat template (enable_thinking, ...),
    JSON data under names the request's own fields do not set; InvalidArgument otherwise."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise InvalidArgument(f"chat_template_kwargs={_short(kwargs)} is invalid; allowed: an object of template "
                              'variables, e.g. {"enable_thinking": false}', param="chat_template_kwargs")
    taken = sorted(k for k in kwargs if k in TEMPLATE_OWN or k in SPECIAL_TOKENS)
    if taken:
        raise InvalidArgument(f"chat_template_kwargs sets {taken}; allowed: other names ({', '.join(TEMPLATE_OWN)} "
                              "and the special tokens come from the request and the model)",
                              param="chat_template_kwargs")
    _check_data(kwargs, "chat_template_kwargs", param="chat_template_kwargs")
    return kwargs


def check_messages(messages) -> list[dict]:
    """OpenAI-style messages: a non-empty list of objects with a role (any non-empty string) and a
    content, a string or a list of {"type": "text", "text"} parts (joined by newlines, as vLLM
    joins them; an OpenAI "refusal" part counts as its text, as in vLLM). Other keys (name,
    tool_calls, tool_call_id...) reach the template as vLLM passes them: those that are null
    dropped, an assistant's tool call arguments sent as a JSON string parsed; their values must be
    JSON data. Returns copies whose content is a string."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument(f"messages={_short(messages)} is invalid; allowed: a non-empty list of "
                              '{"role": ..., "content": ...} objects')
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"messages has {len(messages)} entries; allowed: at most {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidArgument(f"messages[{i}]={_short(m)} is invalid; allowed: an object with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidArgument(f"messages[{i}].role={_short(role)} is invalid; allowed: a non-empty string "
                                  "(system, user, assistant, tool...)")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in _TEXT_PARTS or not isinstance(part.get(kind), str):
                    raise InvalidArgument(f"messages[{i}].content[{j}]={_short(part)} is invalid; allowed: "
                                          '{"type": "text", "text": "..."} or {"type": "refusal", "refusal": '
                                          '"..."} (no images or audio)')
                parts.append(part[kind])
            content = "\n".join(parts)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content={_short(content)} is invalid; allowed: a string or a "
                                  "list of text parts")
        for key, value in m.items():
            if not isinstance(key, str):
                raise InvalidArgument(f"messages[{i}] has the key {_short(key)}; allowed: string keys")
            if key not in ("role", "content"):
                _check_data(value, f"messages[{i}].{key}")
        m = {**{key: value for key, value in m.items() if value is not None}, "content": content}
        if role == "assistant":  # its reasoning under both names (router/openai_responses.py): templates read either
            for name, other in (("reasoning", "reasoning_content"), ("reasoning_content", "reasoning")):
                if name in m and other not in m:
                    m[other] = m[name]
        if role == "assistant" and isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_arguments_parsed(call, f"messages[{i}].tool_calls[{j}]")
                               for j, call in enumerate(m["tool_calls"])]
        out.append(m)
    return out


def _arguments_parsed(call, name: str):
    """A tool call whose function's arguments OpenAI's clients send as a JSON string, with them
    as the object templates expect (vLLM parses them so too)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        raise InvalidArgument(f"{name}.function.arguments={_short(function['arguments'])} is invalid; allowed: "
                              "a JSON object, or a string of one") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _check_data(value, name: str, param: str | None = None) -> None:
    for v in nested(value):
        if not (v is None or isinstance(v, (str, int, float, list))
                or isinstance(v, dict) and all(isinstance(key, str) for key in v)):
            raise InvalidArgument(f"{name}={_short(value)} is invalid; allowed: JSON data (strings, numbers, "
                                  "booleans, null, lists, objects with string keys)", param=param)


def hf_chat_template(path, bos_token: str = "", eos_token: str = "") -> ChatTemplate | None:
    """The chat template of a Hugging Face checkpoint directory: chat_template.jinja, else
    tokenizer_config.json's chat_template (a string, or a list of named templates: "default").
    Its special tokens are transformers': tokenizer_config.json's, and where that file predates
    added_tokens_decoder, special_tokens_map.json's over them (a string, or {"content": ...})."""
    jinja_file = path / "chat_template.jinja"
    config_file = path / "tokenizer_config.json"
    config = json_object(config_file)
    tokens = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
    if "added_tokens_decoder" not in config:  # transformers reads the legacy file only then
        legacy = json_object(path / "special_tokens_map.json")
        tokens.update({name: _token_text(legacy[name]) for name in SPECIAL_TOKENS if name in legacy})
    tokens["bos_token"] = tokens["bos_token"] or bos_token
    tokens["eos_token"] = tokens["eos_token"] or eos_token
    if jinja_file.is_file():
        try:
            text = jinja_file.read_text(encoding="utf-8")
        except (OSError, ValueError) as e:  # ValueError: bytes that are not UTF-8
            raise ModelLoadError(f"{jinja_file}: cannot read ({e}); allowed: a Jinja template in UTF-8") from None
        return ChatTemplate(text, origin=str(jinja_file), **tokens)
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    return ChatTemplate(source, origin=f"{config_file} chat_template", **tokens)


def json_object(file) -> dict:
    """A checkpoint's JSON file of settings, {} where there is none."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, or bytes that are not UTF-8
        raise ModelLoadError(f"{file}: cannot read ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: holds {_short(data)}; allowed: a JSON object")
    return data


def _token_text(token) -> str:
    if isinstance(token, dict):  # {"content": "<s>", "lstrip": ...}
        token = token.get("content")
    return token if isinstance(token, str) else ""


@functools.cache
def _environment():
    """A sandboxed, immutable Jinja environment as transformers' (_compile_jinja_template)."""
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %}...{% endgeneration %}: transformers marks the assistant's text with it
        for training masks; it renders its body, in a scope of its own as there."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    from jinja2 import TemplateError

    raise TemplateError(message)
