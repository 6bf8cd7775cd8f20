"""A request's sampling parameters, checked where they enter (the router, the engine), and its
seed. Torch-free: the router imports them."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from common import structured_output
from common.errors import InvalidArgument, short_repr
from common.text import utf8

MAX_SEED = 2**63 - 1
MAX_COUNT = 2**31 - 1  # max_tokens, top_k and token ids: far past any model, and safe on the wire
MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs
MAX_STOP_STRINGS = 16
# A request's stop strings travel with each of its n choices to the router and the workers: 16 of
# 200 kB at n=400 held the router's loop 11.7 s and grew a prefill worker by 1.3 GB.
MAX_STOP_BYTES = 4096
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias
MAX_AFTER_TOKENS = 16  # structured_outputs_after: an end-of-thinking tag, as one token or spelled out
# A temperature under this is greedy (vLLM's _SAMPLING_EPS): float32 logits over 1e-38 are infinities,
# whose argmax is the first of them, not the likeliest token.
GREEDY_BELOW = 1e-5


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A finite float, or an int a float holds exactly (a JSON integer of 400 digits is neither)."""
    return (_is_int(x) and abs(x) <= 2**53) or (isinstance(x, float) and math.isfinite(x))


def _bad(name: str, value, allowed: str) -> InvalidArgument:
    return InvalidArgument(f"{name}={short_repr(value)} is invalid; allowed: {allowed}", param=name)


@dataclass
class SamplingParams:
    """Per-request sampling. temperature 0 (or under GREEDY_BELOW) is greedy; top_k 0 (or -1) and top_p 1 disable those
    filters; seed None draws a fresh seed when the request is admitted (then it is fixed for the
    request's life, so preemption and migration still reproduce its tokens).

    stop: strings that end the text (the router, or an in-process Engine, finds them across tokens
    and cuts them off unless include_stop_str_in_output). logprobs: None, or N in [0, 20]: each generated token's
    logprob and the N most likely alternatives; prompt_logprobs the same for the prompt's tokens
    (computed by the prefill, which then skips the prefix cache).

    Logit adjustments, applied in vLLM's order before temperature (common/logits_processing.py):
    logit_bias ({token id: bias in [-100, 100]}, added to the logits); min_tokens (EOS and
    stop_token_ids cannot be sampled before that many tokens, and stop strings are not searched
    in their text: common/text.py); repetition_penalty (> 0; a logit
    of a token seen in the prompt or output is divided by it if positive, else multiplied);
    frequency_penalty and presence_penalty (in [-2, 2]; subtracted once per occurrence in the
    output, and once if it occurs at all); then, after temperature, min_p (in [0, 1]: tokens less
    likely than min_p times the likeliest are dropped). Each is off at its default. Logprobs stay
    those of the raw logits.

    structured_outputs: None, or {kind: value} holding the output to a JSON schema, any JSON
    object, a regex, a choice of strings or a grammar (common/structured_output.py); its mask
    comes before the adjustments above. structured_outputs_after: token ids (at most
    MAX_AFTER_TOKENS) after whose first run that ends in the output (it may begin in the prompt's
    last tokens) the structured output begins, the text before them free: a reasoning model's end
    of thinking (`</think>`), which the HTTP front sets under --reasoning-parser; empty: from the
    first token."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_outputs: dict | None = None
    structured_outputs_after: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not _is_number(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature, "a finite number >= 0 (0 is greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "a number in (0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_COUNT:
            raise _bad("top_k", self.top_k, "an integer in [0, 2**31 - 1] (0 or -1 disables it)")
        if self.top_k == -1:
            self.top_k = 0
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_COUNT:
            raise _bad("max_tokens", self.max_tokens, "an integer in [1, 2**31 - 1]")
        if self.seed is not None:
            if not _is_int(self.seed) or not -MAX_SEED - 1 <= self.seed <= MAX_SEED:
                raise _bad("seed", self.seed, "an integer in [-2**63, 2**63 - 1] or None")
            self.seed &= MAX_SEED  # a negative one (vLLM and OpenAI take any int64) as its low 63 bits
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and 0 <= t <= MAX_COUNT for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "a list of token ids in [0, 2**31 - 1]")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "true or false")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if (not isinstance(self.stop, (list, tuple)) or len(self.stop) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and s for s in self.stop)):
            raise _bad("stop", self.stop, f"a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
        try:
            size = sum(len(utf8(s)) for s in self.stop)
        except InvalidArgument:
            raise _bad("stop", self.stop, "text (a lone surrogate such as '\\ud800' is not)") from None
        if size > MAX_STOP_BYTES:
            raise _bad("stop", self.stop, f"at most {MAX_STOP_BYTES} bytes of text in all (UTF-8); these are {size}")
        self.stop = list(self.stop)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise _bad("include_stop_str_in_output", self.include_stop_str_in_output, "true or false")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
                raise _bad(name, n, f"an integer in [0, {MAX_LOGPROBS}] or None")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise _bad(name, v, "a number in [-2, 2] (0 is off)")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 1e4:
            raise _bad("repetition_penalty", self.repetition_penalty, "a number in (0, 10000] (1 is off)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad("min_p", self.min_p, "a number in [0, 1] (0 is off)")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            self.structured_outputs = structured_output.check(self.structured_outputs)
        after = self.structured_outputs_after
        if not isinstance(after, (list, tuple)) or len(after) > MAX_AFTER_TOKENS or not all(
                _is_int(t) and 0 <= t <= MAX_COUNT for t in after):
            raise _bad("structured_outputs_after", after, f"a list of at most {MAX_AFTER_TOKENS} token ids")
        if after and self.structured_outputs is None:
            raise _bad("structured_outputs_after", after, "[] without structured_outputs (it says where they begin)")
        self.structured_outputs_after = list(after)
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            setattr(self, name, float(getattr(self, name)))
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logit adjustment is on for every token (common/logits_processing.py applies
        them; min_tokens only until it is met, which its sequence knows)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or (self.min_p and not self.greedy) or self.logit_bias or self.structured_outputs)

    def stop_ids(self, eos_token_ids) -> set[int]:
        """The token ids that end the output: stop_token_ids, and the model's EOS unless ignore_eos."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))

    def check_model(self, vocab_size: int, has_tokenizer: bool) -> None:
        """The token ids logit_bias and stop_token_ids name must be the model's; checked where the
        model is known (a stop id past the vocabulary could never be sampled: a mistake). Stop
        strings need its tokenizer, to find them in the text: without one they never matched."""
        if self.stop and not has_tokenizer:
            raise InvalidArgument(f"stop={self.stop!r} needs the model's tokenizer to find text, and this model has "
                                  "none; allowed: stop_token_ids", param="stop")
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids),
                          ("structured_outputs_after", self.structured_outputs_after)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidArgument(f"{name} token ids {bad[:5]} are invalid; allowed: integers in "
                                      f"[0, {vocab_size})", param=name)

    def to_dict(self) -> dict:
        """The fields as plain data for the wire: logit_bias as [token, bias] pairs, since the
        protocol's maps take string keys only."""
        d = asdict(self)
        d["logit_bias"] = [[t, b] for t, b in self.logit_bias.items()]
        if not self.structured_outputs_after:  # (a worker from before it refuses the field: at its default, left out)
            del d["structured_outputs_after"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        if not isinstance(d, dict):
            raise InvalidArgument(f"sampling={short_repr(d)} is invalid; allowed: a map of sampling fields")
        d = {k: v for k, v in d.items() if v is not None}  # null: the field's default, as over HTTP
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidArgument(f"unknown sampling fields {sorted(unknown)}; allowed: "
                                  f"{sorted(cls.__dataclass_fields__)}", param=sorted(unknown)[0])
        return cls(**d)


def _logit_bias(value) -> dict[int, float]:
    """logit_bias as {token id: bias}, from a map (JSON's keys are strings of digits) or a list
    of [token, bias] pairs (the wire's form)."""
    allowed = (f"a map of at most {MAX_LOGIT_BIAS} distinct token ids (integers in [0, 2**31 - 1], or their "
               f"decimal strings) to biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise _bad("logit_bias", value, allowed)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", value, allowed)
    out = {}
    for token, bias in pairs:
        key = token
        if isinstance(token, str) and token.isascii() and token.isdigit() and len(token) <= 10:
            token = int(token)
        if (not _is_int(token) or not 0 <= token <= MAX_COUNT or token in out or not _is_number(bias)
                or abs(bias) > MAX_BIAS):
            raise InvalidArgument(f"logit_bias entry {short_repr(key)}: {short_repr(bias)} is invalid; "
                                  f"allowed: {allowed}", param="logit_bias")
        out[token] = float(bias)
    return out


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request for n choices with this seed (vLLM's rule, seed +
    index): noise is keyed by (seed, position), so n copies under one seed would be identical."""
    return (seed + index) & MAX_SEED


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") & MAX_SEED
