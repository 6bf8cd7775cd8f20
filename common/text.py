"""A request's output text, built token by token, and its stop strings: the router streams it,
and an engine with stop strings to find (in-process generate, chat, a decode worker) stops on it,
so a request stops at the same token wherever it runs. Each token is detokenized
incrementally, as vLLM does: decode a short window of recent ids twice (with and without the newest
ones) and keep the difference, waiting while the window ends inside a multi-byte character. That
costs O(1) per token, where decoding the whole output each time would cost O(n).

Stop strings are searched in the text as it grows, so one found across token boundaries ("a" "bc"
for "ab") stops the request at the token that completed it; the text is cut before the string
(or after it, with include_stop_str_in_output). While a request has stop strings, the last
len(longest) - 1 characters are held back from streaming: they might be the start of a stop
string, which must never reach the client. Nor are they searched in the text of a request's
first min_tokens tokens (vLLM's rule: the text after them may still complete one begun there).

As in vLLM, a stop token that ends the output (stop_token_ids, or EOS) adds no text unless
include_stop_str_in_output, and an output that ends inside a multi-byte character ends its text
before that character: a client never sees a trailing U+FFFD.

utf8() is the other way: the one check of text a request brings (its prompt, through every
tokenizer, and its stop strings).
"""

from __future__ import annotations

from common.errors import InvalidArgument

LONE_SURROGATE = "a lone surrogate such as '\\ud800'; allowed: text that UTF-8 can encode"


def utf8(text: str) -> bytes:
    """text in UTF-8, or InvalidArgument: a Python string (and JSON) may hold a lone surrogate
    ('\\ud800'), which neither UTF-8 nor any tokenizer takes (`tokenizers` raises a TypeError)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"the text holds {LONE_SURROGATE}") from None


class TextStream:
    def __init__(self, tokenizer, stop: list[str] = (), include_stop: bool = False, min_tokens: int = 0,
                 stop_ids: set[int] = frozenset(), skip_special_tokens: bool = True, prompt: list[int] = ()):
        """prompt: the ids the output follows; its last few are decoded before the output's first
        token (context_of)."""
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens  # an output's text leaves them out; an echoed prompt's keeps them
        self.stop, self.include_stop, self.min_tokens = list(stop), include_stop, min_tokens
        self.stop_ids = stop_ids  # tokens that end the output without text of theirs
        self.holdback = max(map(len, self.stop), default=1) - 1
        self.ids: list[int] = context_of(tokenizer, prompt)  # the prompt's tail, then the output's
        self.primed = len(self.ids)
        self.prefix, self.read = 0, len(self.ids)  # the window: ids[prefix:read] is decoded already
        self.text = ""
        self.sent = 0  # characters of text handed out by delta()
        self.stop_reason: str | None = None  # the stop string that ended the text

    @classmethod
    def for_params(cls, tokenizer, params, eos_token_ids=(), prompt: list[int] = ()) -> "TextStream":
        """The text of a request with these SamplingParams, of a model with these EOS ids."""
        return cls(tokenizer, params.stop, params.include_stop_str_in_output, params.min_tokens,
                   textless_ids(params, eos_token_ids), prompt=prompt)

    def add(self, token: int) -> bool:
        """Take the next token; True if the text now reaches a stop string (then add no more)."""
        if token in self.stop_ids:
            return False  # it ends the output, which its caller sees
        self.ids.append(token)
        before, after = self._window()
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False  # nothing new yet, or inside a multi-byte character
        old = len(self.text)
        self.text += after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return self._stopped_after(old)

    def _window(self) -> tuple[str, str]:
        """The window's text without and with the tokens not yet in self.text."""
        return self._decode(self.ids[self.prefix:self.read]), self._decode(self.ids[self.prefix:])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.skip_special else self.tokenizer.decode(ids, False)

    def whole_chars(self) -> int:
        """len(text), and the whole characters the tokens held back (inside a character) begin
        with: ' \xf0\x9f' holds its space until the character is whole, yet the space is there."""
        if self.read == len(self.ids):
            return len(self.text)
        before, after = self._window()
        return len(self.text) + max(0, len(after.rstrip("\ufffd")) - len(before))

    def _stopped_after(self, old: int) -> bool:
        """Whether text grown from old characters now holds a stop string; if so, cut it there."""
        if not self.stop or len(self.ids) - self.primed <= self.min_tokens:
            return False
        # each string where it would take a new character (vLLM's rule): one within the text of the
        # first min_tokens tokens, never searched, is not found later either
        found = [(at, s) for s in self.stop if (at := self.text.find(s, max(0, old - len(s) + 1))) >= 0]
        if not found:
            return False
        at, self.stop_reason = min(found, key=lambda f: (f[0], -len(f[1])))
        self.text = self.text[:at + (len(self.stop_reason) if self.include_stop else 0)]
        return True

    def finish_reason(self, reason: str) -> str:
        """The request's finish reason once final() ran: "stop" where it found a stop string in the
        trailing partial character's token of an output that ended at its length."""
        return "stop" if reason == "length" and self.stop_reason is not None else reason

    def delta(self) -> str:
        """Text not handed out yet, less what may still turn out to begin a stop string."""
        end = len(self.text) if self.stop_reason is not None else max(self.sent, len(self.text) - self.holdback)
        out, self.sent = self.text[self.sent:end], end
        return out

    def final(self) -> str:
        """The whole text once the output is complete: what its last tokens hold before a trailing
        partial character, searched for stop strings like the rest (a token "a\\xc3" completes
        "xa" before its partial character; then stop_reason is set)."""
        if self.stop_reason is None and self.read < len(self.ids):
            old = len(self.text)
            before, after = self._window()
            self.text += after[len(before):].rstrip("\ufffd")
            self.prefix = self.read = len(self.ids)
            self._stopped_after(old)
        return self.text


def partial_tag_at(text: str, tag: str) -> int:
    """Where text's longest suffix that could begin tag starts (len(text) if none): what a stream
    holds back while it cannot yet tell whether tag follows (router/tool_parsers.py, router/reasoning.py)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def textless_ids(params, eos_token_ids) -> frozenset[int]:
    """The stop tokens whose text an output leaves out: all, unless include_stop_str_in_output."""
    return frozenset() if params.include_stop_str_in_output else frozenset(params.stop_ids(eos_token_ids))


CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET


def context_of(tokenizer, prompt: list[int]) -> list[int]:
    """The prompt's last tokens that an output's text is decoded after, as vLLM's detokenizer does:
    a SentencePiece decoder drops the space that begins the first piece it decodes ("▁Paris" alone
    is "Paris", after "The capital is" it is " Paris"). None where their text ends inside a
    character (a prompt of token ids), which the output's first token would then complete."""
    context = list(prompt[-CONTEXT_TOKENS:])
    if context and tokenizer.decode(context).endswith("\ufffd"):
        return []
    return context


def output_text(tokenizer, ids: list[int], params, eos_token_ids=(), prompt: list[int] = ()) -> str:
    """A whole output's text, the text TextStream builds token by token: without the text of a stop
    token that ended it, nor of a character it ends inside of. Decoded at once where that is the
    same text, which holds no U+FFFD; else streamed: a byte-fallback decoder (SentencePiece's
    <0xNN> tokens) turns a whole run of bytes to U+FFFD when it ends inside a character, the
    complete characters before that one included."""
    if ids and ids[-1] in textless_ids(params, eos_token_ids):
        ids = ids[:-1]
    context = context_of(tokenizer, prompt)
    head = tokenizer.decode(context) if context else ""
    text = tokenizer.decode(context + ids)
    if "\ufffd" not in text and text.startswith(head):
        return text[len(head):]
    stream = TextStream(tokenizer, prompt=context)
    for token in ids:
        stream.add(token)
    return stream.final()
