"""Chat templates: a list of messages rendered to one prompt string, as the model was trained.

The template is the model's own Jinja source (`chat_template` in a Hugging Face checkpoint's
tokenizer_config.json or chat_template.jinja, `tokenizer.chat_template` in a GGUF file), rendered
in a sandboxed, immutable Jinja environment with the globals `transformers` provides, so a
template written for `apply_chat_template` renders the same string here. A template comes from a
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
import json

from common.errors import InvalidArgument, ModelLoadError, short_repr as _short

DUMMY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_MESSAGES = 4096


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "chat template"):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source, self.bos_token, self.eos_token, self.origin = source, bos_token, eos_token, origin
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ModelLoadError(f"{origin}: not a valid Jinja template ({e})") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """messages (checked by check_messages) to the prompt text; a template that raises says why."""
        from jinja2 import TemplateError

        messages = check_messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except TemplateError as e:
            raise InvalidArgument(f"messages cannot be rendered by the {self.origin}: {e}") from e


def check_messages(messages) -> list[dict]:
    """OpenAI-style messages: a non-empty list of {"role", "content"}, content a string or a list
    of {"type": "text", "text"} parts (joined). Returns plain {"role", "content": str} maps."""
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
        if role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role={_short(role)} is invalid; allowed: {', '.join(ROLES)}")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise InvalidArgument(f"messages[{i}].content[{j}]={_short(part)} is invalid; allowed: "
                                          '{"type": "text", "text": "..."} (no images or audio)')
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content={_short(content)} is invalid; allowed: a string or a "
                                  "list of text parts")
        out.append({"role": role, "content": content})
    return out


def hf_chat_template(path, bos_token: str = "", eos_token: str = "") -> ChatTemplate | None:
    """The chat template of a Hugging Face checkpoint directory: chat_template.jinja, else
    tokenizer_config.json's chat_template (a string, or a list of named templates: "default")."""
    jinja_file = path / "chat_template.jinja"
    config_file = path / "tokenizer_config.json"
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{config_file}: cannot read ({e})") from e
    bos = _token_text(config.get("bos_token")) or bos_token
    eos = _token_text(config.get("eos_token")) or eos_token
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(), bos, eos, origin=str(jinja_file))
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    return ChatTemplate(source, bos, eos, origin=f"{config_file} chat_template")


def _token_text(token) -> str:
    if isinstance(token, dict):  # {"content": "<s>", "lstrip": ...}
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _tojson(value, indent=None, ensure_ascii=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=False)


def _raise_exception(message):
    from jinja2 import TemplateError

    raise TemplateError(message)
