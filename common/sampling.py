"""The batched sampler (its parameters: common/sampling_params.py).

Randomness never comes from a global RNG: the noise for a request's token at position p is a pure
function of (request seed, p, token id), computed by a counter-based hash in int64 tensor ops. A
request therefore samples the same tokens alone or in any batch, after a preemption, on another
worker, and on CPU or GPU alike. Sampling itself is the Gumbel-max trick over the filtered logits.
"""

from __future__ import annotations

import math

import torch

from common.config import upload
from common.sampling_params import SamplingParams

# A token's logprob entry: [the token's logprob, ids of the top N tokens, their logprobs] (best
# first; lists, as msgpack carries them). Logprobs are log_softmax of the model's raw logits,
# before temperature and filters (vLLM's default, "raw_logprobs"), but for a grammar's mask
# (common/logits_processing.py).
Logprob = list


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
    """Uniform noise in (0, 1), shape (S, V), a pure function of (seed, position, token id).
    23 bits, so that bits + 0.5 is exact in float32: with 24, the largest rounded up to 1.0, its
    Gumbel noise was +inf, and that token won whatever its logit, even a masked or filtered one."""
    key_S = splitmix64(seeds * GOLDEN + positions)
    ids_V = (torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64)) * GOLDEN
    bits_SV = logical_shr(splitmix64(key_S[:, None] ^ ids_V[None, :]), 41)  # top 23 bits
    return (bits_SV.to(torch.float32) + 0.5) * (1.0 / (1 << 23))


GREEDY, PLAIN, FILTERED = "greedy", "plain", "filtered"  # what a batch's sampling must do (sampling_mode)


def sampling_mode(params: list[SamplingParams]) -> str:
    """greedy: argmax alone; plain: temperature and noise; filtered: top-k or top-p too, which
    sorts every row. The decode graphs capture one sampler per mode (common/cuda_graphs.py)."""
    if all(p.greedy for p in params):
        return GREEDY
    return FILTERED if any(p.top_k or p.top_p < 1.0 for p in params) else PLAIN


def sampling_inputs(params: list[SamplingParams], seeds: list[int], positions: list[int],
                    vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' parameters on the host, a row per field: int64 (4, S) of top-k, greedy, seed,
    position, and float32 (2, S) of temperature, top-p."""
    V, S = vocab_size, len(params)
    ints = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params] + [int(p.greedy) for p in params]
                        + list(seeds) + list(positions), dtype=torch.int64)
    floats = torch.tensor([p.temperature or 1.0 for p in params] + [p.top_p for p in params], dtype=torch.float32)
    return ints.view(4, S), floats.view(2, S)


def top_k_top_p(scaled_SV: torch.Tensor, k_S: torch.Tensor, top_p_S: torch.Tensor) -> torch.Tensor:
    """Each row's logits past its top k, or past the smallest set whose probability reaches its top
    p, set to -inf. A row asking for neither (k = V, p = 1) comes out as it went in, bit for bit,
    whatever else is in its batch: a cumulative sum that rounds up to 1 before its end must not
    cut its tail."""
    V = scaled_SV.shape[1]
    # stable: tied logits keep their ids' order. An unstable sort orders ties as its algorithm
    # goes, on CUDA by the batch's shape: a tie at the top-k boundary kept another token alone.
    sorted_SV, order_SV = scaled_SV.sort(dim=-1, descending=True, stable=True)
    rank_V = torch.arange(V, device=scaled_SV.device)
    drop_SV = rank_V[None, :] >= k_S[:, None]
    sorted_SV = sorted_SV.masked_fill(drop_SV, -math.inf)
    probs_SV = sorted_SV.softmax(dim=-1)
    # On CUDA torch scans a lone row with CUB (another order of additions, and not deterministic)
    # and several rows a row per thread group: a single row is scanned as two, as in any batch.
    S = probs_SV.shape[0]
    mass_before_SV = (probs_SV if S > 1 else probs_SV.expand(2, V)).cumsum(dim=-1)[:S] - probs_SV
    drop_SV |= (mass_before_SV >= top_p_S[:, None]) & (top_p_S[:, None] < 1.0)
    drop_SV[:, 0] = False
    sorted_SV = sorted_SV.masked_fill(drop_SV, -math.inf)
    return torch.empty_like(scaled_SV).scatter_(1, order_SV, sorted_SV)


def sample_rows(logits_SV: torch.Tensor, mode: str, ints_4S: torch.Tensor | None = None,
                floats_2S: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row, from device tensors alone (no host sync: a graph can hold it). Row i's
    noise is keyed by its (seed, position)."""
    logits_SV = logits_SV.float()
    greedy_S = logits_SV.argmax(dim=-1)
    if mode == GREEDY:
        return greedy_S
    k_S, is_greedy_S, seeds_S, positions_S = ints_4S
    temp_S, top_p_S = floats_2S
    scaled_SV = logits_SV / temp_S[:, None]
    if mode == FILTERED:
        scaled_SV = top_k_top_p(scaled_SV, k_S, top_p_S)
    u_SV = keyed_uniform(seeds_S, positions_S, logits_SV.shape[1])
    gumbel_SV = -torch.log(-torch.log(u_SV))
    sampled_S = (scaled_SV + gumbel_SV).argmax(dim=-1)
    return torch.where(is_greedy_S.bool(), greedy_S, sampled_S)


def sample(logits_SV: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           positions: list[int]) -> torch.Tensor:
    """One token per row. Row i uses params[i], and its noise is keyed by (seeds[i], positions[i]).
    The rows' parameters reach the device in two copies, one of integers and one of floats."""
    mode = sampling_mode(params)
    if mode == GREEDY:
        return sample_rows(logits_SV, mode)
    ints, floats = sampling_inputs(params, seeds, positions, logits_SV.shape[1])
    dev = logits_SV.device
    return sample_rows(logits_SV, mode, upload(ints, dev), upload(floats, dev))


def logprobs_on_device(logits_SV: torch.Tensor, token_ids_S: torch.Tensor, k: int) -> tuple:
    """Row i's logprob of token_ids_S[i] and its top k (ids and logprobs), as device tensors: the
    host reads them later (logprob_entries), so the step that asks for them need not wait."""
    logprobs_SV = logits_SV.float().log_softmax(dim=-1)
    chosen_S = logprobs_SV.gather(1, token_ids_S[:, None])[:, 0]
    if k == 0:
        return chosen_S, None, None
    # topk over keys no two tokens share: the logprob's bits, ordered as the floats are, then the
    # lower id. Tied logprobs (a grammar's masked -infs) then list their lowest ids, whatever k the
    # other rows ask for (topk of the logprobs themselves listed ties by k), for the cost of a topk,
    # not of sorting the vocabulary
    V = logprobs_SV.shape[-1]
    bits = logprobs_SV.view(torch.int32)
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # a negative float's bits count down
    keys <<= 32  # in place: at 8 bytes a logit, a batch of 256 rows of 128k is 256 MiB a copy
    keys += V - 1 - torch.arange(V, device=bits.device)  # the lower id first
    best_SK = keys.topk(min(k, V), dim=-1).values
    ids_SK = V - 1 - (best_SK & 0xFFFFFFFF)
    return chosen_S, logprobs_SV.gather(1, ids_SK), ids_SK


def logprob_entries(parts: tuple, num_top: list[int]) -> list[Logprob]:
    """logprobs_on_device's tensors read into entries, row i with its num_top[i] best."""
    chosen_S, top_SK, ids_SK = parts
    chosen = chosen_S.tolist()
    if top_SK is None:
        return [[lp, [], []] for lp in chosen]
    top, ids = top_SK.tolist(), ids_SK.tolist()
    return [[lp, i[:n], t[:n]] for lp, i, t, n in zip(chosen, ids, top, num_top)]
