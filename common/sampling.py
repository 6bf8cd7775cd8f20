"""Sampling parameters and the batched sampler.

Randomness never comes from a global RNG: the noise for a request's token at position p is a pure
function of (request seed, p, token id), computed by a counter-based hash in int64 tensor ops. A
request therefore samples the same tokens alone or in any batch, after a preemption, on another
worker, and on CPU or GPU alike. Sampling itself is the Gumbel-max trick over the filtered logits.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import torch

from common.errors import InvalidArgument, short_repr

MAX_SEED = 2**63 - 1
MAX_COUNT = 2**31 - 1  # max_tokens, top_k and token ids: far past any model, and safe on the wire
MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs
MAX_STOP_STRINGS = 16

# A token's logprob entry: [the token's logprob, ids of the top N tokens, their logprobs] (best
# first; lists, as msgpack carries them). Logprobs are log_softmax of the model's raw logits,
# before temperature and filters (vLLM's default, "raw_logprobs").
Logprob = list


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


def _bad(name: str, value, allowed: str) -> InvalidArgument:
    return InvalidArgument(f"{name}={short_repr(value)} is invalid; allowed: {allowed}", param=name)


@dataclass
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 (or -1) and top_p 1 disable those
    filters; seed None draws a fresh seed when the request is admitted (then it is fixed for the
    request's life, so preemption and migration still reproduce its tokens).

    stop: strings that end the text (the router, or an in-process Engine, finds them across tokens
    and cuts them off unless include_stop_str_in_output). logprobs: None, or N in [0, 20]: each generated token's
    logprob and the N most likely alternatives; prompt_logprobs the same for the prompt's tokens
    (computed by the prefill, which then skips the prefix cache)."""

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

    def __post_init__(self):
        if not _is_number(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature, "a number >= 0 (0 is greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "a number in (0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_COUNT:
            raise _bad("top_k", self.top_k, "an integer in [0, 2**31 - 1] (0 or -1 disables it)")
        if self.top_k == -1:
            self.top_k = 0
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_COUNT:
            raise _bad("max_tokens", self.max_tokens, "an integer in [1, 2**31 - 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise _bad("seed", self.seed, "an integer in [0, 2**63 - 1] or None")
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
        self.stop = list(self.stop)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise _bad("include_stop_str_in_output", self.include_stop_str_in_output, "true or false")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
                raise _bad(name, n, f"an integer in [0, {MAX_LOGPROBS}] or None")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        if not isinstance(d, dict):
            raise InvalidArgument(f"sampling={short_repr(d)} is invalid; allowed: a map of sampling fields")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidArgument(f"unknown sampling fields {sorted(unknown)}; allowed: "
                                  f"{sorted(cls.__dataclass_fields__)}", param=sorted(unknown)[0])
        return cls(**d)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request for n choices with this seed (vLLM's rule, seed +
    index): noise is keyed by (seed, position), so n copies under one seed would be identical."""
    return (seed + index) & MAX_SEED


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") & MAX_SEED


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


GOLDEN = _signed(0x9E3779B97F4A7C15)  # SplitMix64's increment, as int64
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def logical_shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 (wrapping alike on every device): the sampling noise and
    the dummy weights (common/checkpoint.py) are both drawn from it."""
    x = (x ^ logical_shr(x, 30)) * _MIX1
    x = (x ^ logical_shr(x, 27)) * _MIX2
    return x ^ logical_shr(x, 31)


def keyed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise in (0, 1), shape (S, V), a pure function of (seed, position, token id)."""
    key_S = splitmix64(seeds * GOLDEN + positions)
    ids_V = (torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64)) * GOLDEN
    bits_SV = logical_shr(splitmix64(key_S[:, None] ^ ids_V[None, :]), 40)  # top 24 bits
    return (bits_SV.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits_SV: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           positions: list[int]) -> torch.Tensor:
    """One token per row. Row i uses params[i], and its noise is keyed by (seeds[i], positions[i]).
    The rows' parameters reach the device in two copies, one of integers and one of floats."""
    logits_SV = logits_SV.float()
    greedy_S = logits_SV.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy_S
    dev = logits_SV.device
    S, V = logits_SV.shape
    ints = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params] + [int(p.greedy) for p in params]
                        + list(seeds) + list(positions), dtype=torch.int64).to(dev, non_blocking=True)
    k_S, is_greedy_S, seeds_S, positions_S = ints.view(4, S)
    floats = torch.tensor([p.temperature or 1.0 for p in params] + [p.top_p for p in params],
                          dtype=torch.float32).to(dev, non_blocking=True)
    temp_S, top_p_S = floats.view(2, S)
    scaled_SV = logits_SV / temp_S[:, None]
    if any(p.top_k or p.top_p < 1.0 for p in params):
        sorted_SV, order_SV = scaled_SV.sort(dim=-1, descending=True)
        rank_V = torch.arange(V, device=dev)
        drop_SV = rank_V[None, :] >= k_S[:, None]
        sorted_SV = sorted_SV.masked_fill(drop_SV, -math.inf)
        probs_SV = sorted_SV.softmax(dim=-1)
        mass_before_SV = probs_SV.cumsum(dim=-1) - probs_SV
        drop_SV |= mass_before_SV >= top_p_S[:, None]
        drop_SV[:, 0] = False
        sorted_SV = sorted_SV.masked_fill(drop_SV, -math.inf)
        scaled_SV = torch.empty_like(scaled_SV).scatter_(1, order_SV, sorted_SV)
    u_SV = keyed_uniform(seeds_S, positions_S, V)
    gumbel_SV = -torch.log(-torch.log(u_SV))
    sampled_S = (scaled_SV + gumbel_SV).argmax(dim=-1)
    return torch.where(is_greedy_S.bool(), greedy_S, sampled_S)


def token_logprobs(logits_SV: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[Logprob]:
    """Row i: [log_softmax(logits_SV[i])[token_ids[i]], the num_top[i] best ids, their logprobs]."""
    logprobs_SV = logits_SV.float().log_softmax(dim=-1)
    chosen_S = logprobs_SV.gather(1, torch.tensor(token_ids, device=logits_SV.device)[:, None])[:, 0].tolist()
    k = max(num_top, default=0)
    if k == 0:
        return [[lp, [], []] for lp in chosen_S]
    top_SK, ids_SK = logprobs_SV.topk(min(k, logprobs_SV.shape[-1]), dim=-1)
    top, ids = top_SK.tolist(), ids_SK.tolist()
    return [[lp, i[:n], t[:n]] for lp, i, t, n in zip(chosen_S, ids, top, num_top)]
