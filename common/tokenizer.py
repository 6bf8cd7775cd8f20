"""Tokenizers: a byte-level one for the embedded dummy models (no files), and Hugging Face
`tokenizer.json` files through the `tokenizers` library (no `transformers`).

Both carry the model's chat template (common/chat.py), or None, and `encode_chat` turns messages
into prompt ids the way `transformers`' apply_chat_template does: render, then encode without
adding special tokens (the template writes them)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from common.chat import DUMMY_CHAT_TEMPLATE, ChatTemplate
from common.errors import InvalidArgument, ModelLoadError
from common.text import utf8


def check_encoded(ids: list[int], vocab_size: int) -> None:
    """The ids a tokenizer gave for a text must index the model's embedding. A tokenizer that
    outgrows the weights is the model file's fault; refused per request, it cannot crash a step."""
    if ids and max(ids) >= vocab_size:
        raise InvalidArgument(f"the tokenizer gave token id {max(ids)} for this text; the model's vocabulary is "
                              f"[0, {vocab_size}): its tokenizer and weights disagree", param="prompt")


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """Token ids a client (or a peer) sent must be ints that index the model's embedding."""
    # exact ints within the vocabulary, tested in C (a decode worker checks 1,000 ids a handoff);
    # an int subclass (not bool) fails the fast test but is allowed
    if ids and not (set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) < vocab_size):
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"prompt token ids {bad[:5]} are invalid; allowed: integers in [0, {vocab_size})",
                                  param="prompt")


# A text this long is tokenized by encode_batch, which lets go of the GIL while it runs (encode does
# not): /tokenize's 4 MB on a thread held the router's event loop, /health with it, 8 s; now 0.3 s
LONG_TEXT_CHARS = 1 << 16
CONTEXT_FULL = "maximum context length"  # what a refusal of a prompt too long says, in OpenAI's words


def check_prompt_length(ids: list[int], max_model_len: int, param: str = "prompt",
                        more_than: bool = False) -> None:
    """A prompt must have a token, and leave one of the context for the output. The words are
    OpenAI's and vLLM's, which clients look for. param: the request's field (a chat's messages);
    more_than: ids are the tokens of the prompt's head only."""
    if not ids:
        raise InvalidArgument("prompt is empty; allowed: at least one token", param=param)
    if len(ids) >= max_model_len:
        raise InvalidArgument(f"prompt has {'more than ' if more_than else ''}{len(ids)} tokens but the model's "
                              f"{CONTEXT_FULL} is {max_model_len} tokens; allowed: at most {max_model_len - 1}, "
                              "leaving one for the output", param=param)


class _ChatMixin:
    chat_template: ChatTemplate | None = None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None,
                    continue_final_message: bool = False) -> list[int]:
        """tools: OpenAI's function tools, for a template that shows them to the model;
        template_kwargs: more of its variables (vLLM's chat_template_kwargs: enable_thinking...);
        continue_final_message: the prompt ends inside the last message (ChatTemplate.render)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools, template_kwargs,
                                            continue_final_message), add_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None,
                    continue_final_message: bool = False) -> str:
        """The text encode_chat tokenizes (without special tokens of its own)."""
        if self.chat_template is None:
            raise InvalidArgument("this model has no chat template; send a prompt instead of messages")
        return self.chat_template.render(messages, add_generation_prompt, continue_final_message,
                                         **(template_kwargs or {}), tools=tools)

    def encode_turn(self, text: str) -> list[int]:
        """text as a user's message through the chat template, or as plain text where the model has none."""
        if self.chat_template is None:
            return self.encode(text)
        return self.encode_chat([{"role": "user", "content": text}])


class ByteTokenizer(_ChatMixin):
    """Ids 0..255 are the UTF-8 bytes of the text; 256 is BOS and 257 EOS, shown as <s> and </s>
    where special tokens are shown. Ids past 257 (the model's padded vocabulary) decode to nothing.
    Nothing is added by encode."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258
    one_spelling = True  # every text is one run of tokens, a byte each, wherever it stands (router/reasoning.py)
    SPECIALS = {256: b"<s>", 257: b"</s>"}

    def __init__(self):
        self.chat_template = ChatTemplate(DUMMY_CHAT_TEMPLATE, origin="dummy chat template")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(utf8(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return b"".join(map(self.token_bytes, ids)).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for: a special token's name, b"" for padding."""
        return bytes([token]) if 0 <= token < 256 else self.SPECIALS.get(token, b"")

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it (transformers' convert_ids_to_tokens): a byte as
        the character of its value, as byte-level vocabularies (ByT5's) spell it."""
        return [self.token_bytes(i).decode("latin-1") for i in ids]


class HFTokenizer(_ChatMixin):
    """A `tokenizers` Tokenizer: a checkpoint's tokenizer.json, or one built in memory (GGUF).
    Special tokens (BOS) are added as its post-processor says, as `transformers` would."""

    def __init__(self, tokenizer, chat_template: ChatTemplate | None = None):
        self._tok = tokenizer
        self._special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self.chat_template = chat_template
        self.vocab_size = 1 + max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)  # ids below it

    @classmethod
    def from_file(cls, path: Path, chat_template: ChatTemplate | None = None) -> "HFTokenizer":
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own exception types
            raise ModelLoadError(f"{path}: not a readable tokenizer.json ({e})") from e
        return cls(tok, chat_template)

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` itself (structured outputs hand its JSON to llguidance)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        utf8(text)
        if len(text) > LONG_TEXT_CHARS:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for, a partial UTF-8 character's included (decode() makes
        those U+FFFD): a byte-level vocabulary's spelling mapped back to bytes; a SentencePiece
        piece with its word boundary as a space, or its byte (<0xNN>, byte fallback); any other
        token as decode() shows it alone, a special one's text included (as vLLM's logprobs show it)."""
        piece = self._tok.id_to_token(token)
        if piece is None or token in self._special:
            return self.decode([token], skip_special_tokens=False).encode("utf-8")
        if self._spelling == "sentencepiece":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        if self._spelling and all(c in self._spelling for c in piece):
            return bytes(self._spelling[c] for c in piece)
        return self.decode([token]).encode("utf-8")

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it (transformers' convert_ids_to_tokens: "Ġthe")."""
        return [self._tok.id_to_token(i) for i in ids]

    @functools.cached_property
    def _spelling(self) -> dict[str, int] | str:
        """How the vocabulary spells bytes, from its decoder: GPT-2's byte-level alphabet (char ->
        byte), "sentencepiece" (U+2581 for a space, <0xNN> for a byte), or {} (its text)."""
        from common.gguf_tokenizer import bytes_to_unicode

        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        kinds = {step.get("type") for step in steps}
        if "ByteLevel" in kinds:
            return {c: b for b, c in bytes_to_unicode().items()}
        if "Metaspace" in kinds or "ByteFallback" in kinds:
            return "sentencepiece"
        return {}
