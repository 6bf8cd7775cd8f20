"""The tokenizer a GGUF file describes in its `tokenizer.*` metadata, built as a `tokenizers`
Tokenizer (no `transformers`, no tokenizer.json), with the chat template the file carries.

Two tokenizer models, by `tokenizer.ggml.model`:
- `gpt2`: byte-level BPE (tokens, merges). The text is split before BPE the way the vocabulary's
  merges were learned, which the file names in `tokenizer.ggml.pre`; PRE_TOKENIZERS maps those
  names to llama.cpp's split expressions (several run in turn, each splitting the pieces of the
  one before), and `tokenizer.ggml.pre` values outside it fail at load.
- `llama`: SentencePiece BPE (tokens, scores): merges are rebuilt from the scores, bytes fall
  back to <0xNN> tokens, and a space is prepended to the text unless `add_space_prefix` is false.

Tokens the file marks as control, unknown or user-defined are written as plain text (in a byte-level
vocabulary too) and are matched whole in the text as their own ids, as llama.cpp does; control and
unknown ones (<|im_start|>, <s>, <｜User｜>, <unk>) are special, left out when decoding. BOS/EOS are
added as `add_bos_token`/`add_eos_token` say (defaults: BOS for `llama`, nothing for `gpt2`), as
`transformers` does for the same file.
"""

from __future__ import annotations

import functools

from common.chat import ChatTemplate
from common.errors import ModelLoadError, first_line
from common.tokenizer import HFTokenizer

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_FAMILIES = {  # split expressions -> the `tokenizer.ggml.pre` names that use them (llama-vocab.cpp)
    (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"): ("default",),
    (_GPT2,): ("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"),
    (r"\p{N}", _GPT2): ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
    (_LLAMA3,): ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe",
                 "chatglm-bpe", "glm4"),
    (_QWEN2,): ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"),
    (_TEKKEN,): ("tekken",),
    (_GPT4O,): ("gpt-4o", "llama4"),
}
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {name: splits for splits, names in _FAMILIES.items() for name in names}
MODELS = ("gpt2", "llama")
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # llama.cpp token types
_ADDED = (_UNKNOWN, _CONTROL, _USER_DEFINED)


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet byte-level vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def gguf_tokenizer(g) -> HFTokenizer:
    """The tokenizer of an opened GGUFFile (common/gguf_file.py)."""
    model = g.get("tokenizer.ggml.model")
    if model not in MODELS:
        raise ModelLoadError(f"{g.path}: tokenizer.ggml.model={model!r} is not supported; allowed: " + ", ".join(MODELS))
    tokens = g.get("tokenizer.ggml.tokens")
    types = g.get("tokenizer.ggml.token_type", None) or [1] * len(tokens)
    if model == "gpt2":
        tok = _byte_level_bpe(g, tokens, types)
    else:
        tok = _sentencepiece_bpe(g, tokens)
    _add_special_tokens(tok, tokens, types)
    bos, eos = _special(g, tokens, "bos"), _special(g, tokens, "eos")
    add_bos = g.get("tokenizer.ggml.add_bos_token", model == "llama")
    add_eos = g.get("tokenizer.ggml.add_eos_token", False)
    _add_bos_eos(tok, bos if add_bos else None, eos if add_eos else None)
    source = g.get("tokenizer.chat_template", None)
    template = None
    if isinstance(source, str):
        # the other special tokens GGUF names (llama.cpp's keys, "seperator" as spelled there), as
        # transformers gives a template them
        others = {name: found[0] for name, key in (("unk_token", "unknown"), ("sep_token", "seperator"),
                                                   ("pad_token", "padding"))
                  if (found := _special(g, tokens, key)) is not None}
        template = ChatTemplate(source, bos[0] if bos else "", eos[0] if eos else "",
                                origin=f"{g.path}: tokenizer.chat_template", **others)
    return HFTokenizer(tok, template)


def _special(g, tokens: list[str], which: str) -> tuple[str, int] | None:
    i = g.get(f"tokenizer.ggml.{which}_token_id", None)
    return (tokens[i], i) if isinstance(i, int) and 0 <= i < len(tokens) else None


def _byte_level_bpe(g, tokens: list[str], types: list[int]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = g.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(f"{g.path}: tokenizer.ggml.pre={pre!r} is not supported; allowed: "
                             + ", ".join(sorted(PRE_TOKENIZERS)))
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    def byte_spelled(t: str) -> str:
        return t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))

    # A few converters store some normal tokens as plain text; BPE needs them in the byte alphabet.
    vocab = {byte_spelled(t): i for i, (t, kind) in enumerate(zip(tokens, types)) if kind not in _ADDED}
    # Control, unknown and user-defined tokens are plain text, found by it (_add_special_tokens); one
    # spelled like a normal token takes that spelling, as llama.cpp matches them before BPE. Their
    # byte spelling stays theirs where no other token has it: a merge may name it (else the library
    # panics), and only a merge can produce it.
    for i, (t, kind) in enumerate(zip(tokens, types)):
        if kind in _ADDED:
            vocab[t] = i
            vocab.setdefault(byte_spelled(t), i)
    merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges")]
    try:
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    except BaseException as e:  # the library panics (a BaseException) on a merge of tokens it lacks
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise
        raise ModelLoadError(f"{g.path}: its BPE vocabulary and merges do not fit ({type(e).__name__}: "
                             f"{first_line(e)})") from None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(g, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    scores = g.get("tokenizer.ggml.scores")
    unk = _special(g, tokens, "unknown")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, _merges_from_scores(vocab, dict(zip(tokens, scores))),
                               unk_token=unk[0] if unk else None, fuse_unk=True, byte_fallback=True))
    prefix = bool(g.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece keeps no merges: every split of a token into two tokens is one, ranked by the
    merged token's score (the order `transformers` rebuilds them in)."""
    merges = []
    for merged, score in scores.items():
        local = [(merged[:i], merged[i:], score) for i in range(1, len(merged))
                 if merged[:i] in vocab and merged[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _add_special_tokens(tok, tokens: list[str], types: list[int]):
    """Each token added here is a key of the vocabulary, so it gets the file's id for it (one
    missing there would get a new id, past the model's vocabulary)."""
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types)
                            if kind in (_UNKNOWN, _CONTROL)])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types)
                    if kind == _USER_DEFINED])


def _add_bos_eos(tok, bos: tuple[str, int] | None, eos: tuple[str, int] | None):
    from tokenizers import processors

    if bos is None and eos is None:
        return
    single = " ".join(([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else []))
    pair = single + " " + " ".join(([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else []))
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                       special_tokens=[t for t in (bos, eos) if t])
