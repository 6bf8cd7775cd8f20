"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regular
expression, a choice of strings or a grammar (vLLM's `structured_outputs`; OpenAI's
`response_format` maps onto the first two in router/openai_api.py).

Each step, the tokens that would take the text out of the language are masked from the request's
logits before sampling. llguidance (the library vLLM and SGLang offer for this) computes that
mask from the grammar and the tokens so far, in about a millisecond for a 49k vocabulary.

A request's matcher state is a function of its output tokens alone, so it is rebuilt anywhere by
replaying them: on the decode worker from the token the prefill sampled, after a migration, on
another topology. The mask depends on nothing else in the batch, so a request's tokens stay the
same alone or batched, as every other logit adjustment keeps them (common/logits_processing.py).

The grammar decides where the output ends: once it can go no further the request finishes with
"stop" (EOS is allowed wherever the text is complete), and min_tokens does not hold it open.

Torch-free: the router checks a request's spec where it enters.
"""

from __future__ import annotations

import array
import importlib.util
import json
import threading
from collections import OrderedDict

from common.errors import InvalidArgument, short_repr
from common.protocol import check_maps

KINDS = ("json", "json_object", "regex", "choice", "grammar")
ALLOWED = ("a map with exactly one of: json (a JSON schema, as an object or its text), json_object (true: any "
           "JSON object), regex (a regular expression), choice (a non-empty list of strings), grammar (a Lark "
           "or GBNF grammar)")
# Python's separators (", " and ": ") rather than any whitespace: a small model given free rein
# over whitespace may emit it until max_tokens, and the JSON means the same either way (vLLM's
# disable_any_whitespace, on by default here).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A spec's compiling runs on the router's loop and each worker's: 50,000 choices (1 MB) took 1.5 s
# and 2.4 s there, while every other request waited. 64 KiB compiles in about 0.1 s.
MAX_SPEC_BYTES = 64 * 1024
# Specs compiled lately, by their JSON: a request's n choices, or the same schema sent again, compile
# once. Each choice compiled anew held a worker's loop 0.1 s (a 64 KiB spec): n=20 took 2 s, and the
# router counted the worker dead.
RECENT_SPECS = 32


def _llguidance():
    try:
        import llguidance
    except ImportError:  # a declared dependency; only a hand-made environment lacks it
        raise InvalidArgument("structured outputs need the llguidance package on this server "
                              "(pip install llguidance)", param="structured_outputs") from None
    return llguidance


class _Recent:
    """The last RECENT_SPECS things made from specs, by the spec's JSON text; thread-safe (API
    servers check in threads)."""

    def __init__(self):
        self._items: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, make):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = make()  # what raises is not kept
        with self._lock:
            self._items[key] = value
            if len(self._items) > RECENT_SPECS:
                self._items.popitem(last=False)
        return value


_checked_specs = _Recent()


def _key(spec: dict) -> str:
    return json.dumps(spec, ensure_ascii=False, sort_keys=True)


class Checked(dict):
    """A spec `check` passed: checked again (a copy of its SamplingParams, one per choice of n),
    it is passed through at once. What comes over the wire is plain data, checked again, though not
    compiled again while it is among the recent specs (_checked_specs)."""


def check(spec, name: str = "structured_outputs", field: str | None = None) -> dict:
    """The spec as plain data ({kind: value}, a JSON schema given as text parsed), its grammar
    compiled once to find any error: InvalidArgument naming the parameter `name`, the value's
    `field` (by default name.kind) and what is allowed."""
    if isinstance(spec, Checked):
        return spec
    if not isinstance(spec, dict):
        raise InvalidArgument(f"{name}={short_repr(spec)} is invalid; allowed: {ALLOWED}", param=name)
    given = {k: v for k, v in spec.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(KINDS))
    if unknown or len(given) != 1:
        what = f"unknown key {unknown[0]!r}" if unknown else f"{len(given)} kinds given"
        raise InvalidArgument(f"{name}={short_repr(spec)} is invalid ({what}); allowed: {ALLOWED}", param=name)
    (kind, value), = given.items()
    field = field or f"{name}.{kind}"
    try:
        return _checked_specs.get(_key({kind: value}), lambda: _checked(kind, value, name, field))
    except InvalidArgument:
        raise
    except (RecursionError, ValueError) as e:  # deep nesting, a lone surrogate, a number past 64 bits
        allowed = ("nesting at most a few hundred levels deep" if isinstance(e, RecursionError) else
                   "text without lone surrogates" if isinstance(e, UnicodeError) else "numbers that fit 64 bits")
        raise InvalidArgument(f"{field} cannot be compiled ({type(e).__name__}: {first_lines(str(e), limit=120)}); "
                              f"allowed: {allowed}", param=name) from None


def _checked(kind: str, value, name: str, field: str) -> Checked:
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidArgument(f"{field} is not JSON ({e}); allowed: a JSON schema", param=name) from None
    rules = {"json": (lambda v: isinstance(v, dict), "a JSON schema (an object, or its text)"),
             "json_object": (lambda v: v is True, "true"),
             "regex": (lambda v: isinstance(v, str) and v, "a non-empty regular expression"),
             "choice": (lambda v: isinstance(v, list) and v and all(isinstance(c, str) and c for c in v),
                        "a non-empty list of non-empty strings"),
             "grammar": (lambda v: isinstance(v, str) and v.strip(), "a Lark or GBNF grammar")}
    ok, allowed = rules[kind]
    if not ok(value):
        raise InvalidArgument(f"{field}={short_repr(value)} is invalid; allowed: {allowed}", param=name)
    size = len(json.dumps(value, ensure_ascii=False).encode())
    if size > MAX_SPEC_BYTES:
        raise InvalidArgument(f"{field} is {size} bytes as JSON; allowed: at most {MAX_SPEC_BYTES}", param=name)
    check_maps(value, field, name)  # (its workers would refuse the message that carries it)
    spec = Checked({kind: value})
    error = _llguidance().LLMatcher.validate_grammar(grammar(spec, name, field))
    if error:
        raise InvalidArgument(f"{field} does not compile: {first_lines(error)}; allowed: {allowed}", param=name)
    return spec


def grammar(spec: dict, name: str = "structured_outputs", field: str = "structured_outputs.grammar") -> str:
    """llguidance's grammar for a spec `check` passed."""
    llg = _llguidance()
    (kind, value), = spec.items()
    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(closed(value), overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    try:
        return llg.grammar_from("grammar", value)  # Lark, or GBNF converted to it
    except ValueError as e:
        raise InvalidArgument(f"{field} does not compile: {first_lines(str(e))}; allowed: a Lark or GBNF grammar",
                              param=name) from None


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMAS = ("items", "additionalProperties", "unevaluatedProperties", "not", "if", "then", "else", "contains",
            "propertyNames", "additionalItems", "unevaluatedItems")


def closed(schema, close: bool = True):
    """The schema with each object that lists its properties, and says nothing of others, closed to
    them ("additionalProperties": false), as vLLM's default backend (xgrammar) reads a schema and
    OpenAI's strict mode requires: left open, a small model adds keys until max_tokens. Not an
    allOf or its parts, which would then refuse each other's keys."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: closed(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [closed(sub, key != "allOf") for sub in value]
        elif key in _SCHEMAS:
            value = closed(value)
        out[key] = value
    if close and isinstance(out.get("properties"), dict) and not {
            "additionalProperties", "patternProperties", "unevaluatedProperties", "allOf"} & set(out):
        out["additionalProperties"] = False
    return out


def first_lines(error: str, n: int = 3, limit: int = 300) -> str:
    """The compiler's first lines, cut to `limit` characters: they may quote the whole spec."""
    text = " ".join(line.strip() for line in error.strip().splitlines()[:n])
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Grammars:
    """A model's side of structured outputs: its vocabulary as llguidance sees it (built once, in a
    thread from the start) and a matcher per request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self._lltokenizer = None
        self._lock = threading.Lock()
        self._fresh = _Recent()  # a matcher per spec, that has consumed nothing: a request's is a copy

    def warm_up(self) -> None:
        """Build the vocabulary in a thread now, so that the first structured request does not stall
        the steps of every request running beside it (0.3 s for 49k tokens). Not a daemon: a process
        that exits while llguidance is still building (a bad flag found just after) must wait for it,
        since native code running on through the interpreter's teardown crashed it (SIGSEGV)."""
        if self.tokenizer is not None and importlib.util.find_spec("llguidance") is not None:
            threading.Thread(target=self._build, name="grammar-vocabulary").start()

    def _vocabulary(self):
        """llguidance's view of the vocabulary, or InvalidArgument saying why it has none (every
        structured request is refused with it, and the rest serve on)."""
        if isinstance(self._build(), InvalidArgument):
            raise self._lltokenizer
        return self._lltokenizer

    def _build(self):
        with self._lock:
            if self._lltokenizer is None:
                llg = _llguidance()
                backend = getattr(self.tokenizer, "backend", None)
                try:
                    if backend is not None:  # a tokenizers.Tokenizer: llguidance reads its JSON
                        wrapped = backend.to_str()
                    else:
                        wrapped = llg.TokenizerWrapper(_Spelled(self.tokenizer, self.vocab_size))
                    self._lltokenizer = llg.LLTokenizer(wrapped, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                except Exception as e:  # llguidance's own errors, from a tokenizer it cannot read
                    why = first_lines(str(e), 1)
                    self._lltokenizer = InvalidArgument("structured outputs are not available for this model: "
                                                        f"llguidance cannot read its tokenizer ({why})",
                                                        param="structured_outputs")
            return self._lltokenizer

    def matcher(self, spec: dict, output_ids=()):
        """A matcher for the spec that has consumed output_ids (a resumed request's tokens): those
        must be a prefix of its language, or InvalidArgument."""
        if self.tokenizer is None:
            raise InvalidArgument("structured outputs need the model's tokenizer, and this model has none",
                                  param="structured_outputs")
        m = self._fresh.get(_key(spec), lambda: self._compiled(spec)).deep_copy()
        if output_ids and not m.consume_tokens(list(output_ids)):
            raise InvalidArgument(f"the request's output so far does not match its structured_outputs "
                                  f"({first_lines(m.get_error(), 1)})", param="structured_outputs")
        return m

    def _compiled(self, spec: dict):
        """A fresh matcher for spec, its first mask computed: a grammar llguidance compiles but cannot
        follow (one that refers only to itself) is refused here, not answered with empty output."""
        m = _llguidance().LLMatcher(self._vocabulary(), grammar(spec), log_level=0)
        if m.is_error():
            raise InvalidArgument(f"structured_outputs does not compile: {first_lines(m.get_error())}",
                                  param="structured_outputs")
        mask = array.array("i", bytes(4 * -(-self.vocab_size // 32)))
        m.unsafe_compute_mask_ptr(mask.buffer_info()[0], len(mask) * mask.itemsize)
        if m.is_error():
            raise InvalidArgument(f"structured_outputs cannot be followed from its start (llguidance: "
                                  f"{first_lines(m.get_error(), 1)})",
                                  param="structured_outputs")
        return m


def free_until(prompt_ids, output_ids, after: list[int]) -> int | None:
    """Where a structured output begins in output_ids: after the first run of `after` (a reasoning
    model's end of thinking) that ends in the output (it may begin in the prompt's last tokens, as
    Sequence.append_token sees it), at 0 if `after` is empty, or None: not yet."""
    if not after:
        return 0
    n = len(after)
    ids = list(prompt_ids[len(prompt_ids) - n + 1:] if n > 1 else ()) + list(output_ids)
    given = len(ids) - len(output_ids)  # of ids, the prompt's
    for i in range(max(0, given - n + 1), len(ids) - n + 1):
        if ids[i:i + n] == after:
            return i + n - given
    return None


def fill_masks(matchers: list, masks_CW) -> None:
    """Row c of masks_CW (an int32 CPU tensor of C rows of ceil(vocabulary / 32) words) gets the
    tokens matchers[c] allows next, a bit each (token t: bit t % 32 of word t // 32)."""
    row_bytes = 4 * masks_CW.shape[1]
    base = masks_CW.data_ptr()
    for c, m in enumerate(matchers):
        m.unsafe_compute_mask_ptr(base + c * row_bytes, row_bytes)


class _Spelled:
    """A tokenizer without a tokenizers.Tokenizer (the dummy models' bytes) as llguidance's
    TokenizerWrapper reads one: each token's bytes, special ones marked by a leading 0xFF."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        specials = getattr(tokenizer, "SPECIALS", {})
        self.special_token_ids = sorted(specials)
        self.tokens = [b"\xff" + specials[t] if t in specials else tokenizer.token_bytes(t) for t in range(vocab_size)]

    def __call__(self, text: bytes) -> list[int]:
        return self._tok.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False)
