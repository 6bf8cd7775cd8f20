"""How much of a GPU one worker may take, and how many KV blocks that leaves: the arithmetic alone,
on plain numbers, so that it is the same in every process and testable without a GPU (the engine
asks the device for the numbers; the launchers split devices with it).

--gpu-memory-utilization F has vLLM's meaning: the fraction of the device's TOTAL memory this
worker may hold, weights, activations and KV pool together. The pool gets what is left of that
cap once the weights are loaded:

    pool = F * total - held (weights, the CUDA context) - activations of one full step

Workers that share a device start at the same time, so none may size from what is free when it
starts (the first would take what the others need): each sizes from the total and its share, and
the shares of one device add up to DEFAULT_UTILIZATION. What is free is only checked: a worker
that finds less free than it is about to take fails at start, as does one whose share cannot hold
its weights and a minimal pool. Both errors name the device, the memory found and the flag.

No torch here: the CLI and the launchers import this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from common.errors import InvalidArgument

DEFAULT_UTILIZATION = 0.9  # vLLM's default; the rest is for other processes and fragmentation
CONTEXT_BYTES = 1 << 30  # a process's CUDA context, cuBLAS and NCCL buffers: outside torch's allocator
SHARE_WEIGHTS = {"prefill": 1, "decode": 2, "mono": 2}  # decode holds KV while it decodes, prefill only until sent
MEMORY_FLAGS = ("--gpu-memory-utilization", "--kv-cache-gb", "--num-blocks")  # any of them: the user sized it


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def cuda_device_key(name: str) -> str | None:
    """'cuda:N' for a CUDA device name as --device takes it ('cuda', 'cuda:N', 'N'), None for others."""
    name = name.strip()
    if name.isdigit():
        return f"cuda:{int(name)}"
    if name == "cuda":
        return "cuda:0"
    if name.startswith("cuda:") and name[5:].isdigit():
        return f"cuda:{int(name[5:])}"
    return None


def device_shares(roles: list[str], devices: list[str], utilization: float = DEFAULT_UTILIZATION) -> list[float | None]:
    """Each worker's --gpu-memory-utilization when these workers (roles[i] on devices[i]) share
    their GPUs: `utilization` of each device split in proportion to SHARE_WEIGHTS, rounded down
    so that a device's shares never add up to more. None for a worker not on a GPU."""
    if len(roles) != len(devices):
        raise ValueError(f"{len(roles)} roles for {len(devices)} devices")
    keys = [cuda_device_key(d) for d in devices]
    weight = {k: sum(SHARE_WEIGHTS[r] for r, kk in zip(roles, keys) if kk == k) for k in set(keys) if k}
    return [None if k is None else math.floor(utilization * SHARE_WEIGHTS[r] / weight[k] * 1e4) / 1e4
            for r, k in zip(roles, keys)]


def has_flag(args: list[str], flags) -> bool:
    """Whether these worker args give one of flags (as 'FLAG VALUE' or 'FLAG=VALUE')."""
    return any(a.split("=", 1)[0] in flags for a in args)


def launch_plan(prefill: int, decode: int, mono: int, devices: list[str], worker_args: list[str],
                utilization: float = DEFAULT_UTILIZATION) -> list[tuple[str, str, float | None]]:
    """(role, device, --gpu-memory-utilization or None) of each worker a launcher starts, in order:
    devices assigned in turn, each GPU split between its workers unless worker_args size the pool.
    pdserve launch and deploy/launch.sh (through `pdserve gpu-shares`) both place workers by it."""
    roles = ["prefill"] * prefill + ["decode"] * decode + ["mono"] * mono
    placed = [devices[i % len(devices)] for i in range(len(roles))]
    if len({d.split(":")[0] == "cpu" for d in placed}) > 1 and not has_flag(worker_args, ("--dtype",)):
        raise InvalidArgument(f"--devices {','.join(devices)} puts workers on a CPU (float32 by default) and on GPUs "
                              "(bfloat16): a request's tokens would depend on the worker it meets, and the router "
                              "refuses a worker of a second dtype; give every worker one --dtype (float32 or "
                              "bfloat16)", param="--dtype")
    shares = [None] * len(roles) if has_flag(worker_args, MEMORY_FLAGS) else device_shares(roles, placed, utilization)
    return list(zip(roles, placed, shares))


def step_activation_bytes(mc, max_num_batched_tokens: int, sampled_rows: int, max_model_len: int,
                          dtype_bytes: int) -> int:
    """An upper estimate of what one step's forward and sampling hold at their peak, beside the
    weights and the pool: one layer's activations for a full token budget (residual, norms in
    float32, q/k/v and their rotated copies, attention output, the MLP's up and gated halves), the
    logits of every sampled row (a request's, or each of a speculative decode's) in float32 with
    the sampler's copies, and a prefill chunk's attention over a full context (its gathered K and
    V, and the query-by-context mask)."""
    T, C, I = max_num_batched_tokens, mc.hidden_size, mc.intermediate_size
    H, K, D = mc.num_heads, mc.num_kv_heads, mc.head_dim
    per_token = 8 * C + 4 * (H + 2 * K) * D + 4 * I
    layer = T * per_token * dtype_bytes
    logits = sampled_rows * mc.vocab_size * (dtype_bytes + 3 * 4)
    context = 2 * max_model_len * K * D * dtype_bytes + T * max_model_len * (1 + dtype_bytes)
    return layer + logits + context


def split_partial_bytes(mc, tokens: int, splits: int) -> int:
    """The Triton attention's float32 partial results (an output and its log-sum-exp per head) for
    `tokens` queries of `splits` 256-key splits each (common/attention/triton_paged.py)."""
    return tokens * splits * mc.num_heads * (mc.head_dim + 1) * 4


def triton_prefill_bytes(mc, max_num_batched_tokens: int, max_model_len: int, split: int = 256) -> int:
    """A step's partial results at worst: a full token budget of chunk tokens, each at the end of
    a full context (an eager step packs a row per split each token has)."""
    return split_partial_bytes(mc, max_num_batched_tokens, -(-max_model_len // split))


# The filtered sampler's peak per logit: float copies, sorted values, int64 order, the noise's
# int64 hash. torch's profiler measured 38.5 bytes (bfloat16 logits, CPU); the rest is room for
# the caching allocator's rounding.
SAMPLER_BYTES_PER_LOGIT = 64


def decode_graph_bytes(mc, max_num_seqs: int, max_model_len: int, dtype_bytes: int, split: int = 256) -> int:
    """What the CUDA graphs of the decode step keep in their pools (common/cuda_graphs.py): one
    step's activations for max_num_seqs rows, the Triton attention's partial results for a full
    context (a CUDA graph's static layout: the tables' width in splits), and the
    captured samplers' own pool, which the filtered sampler's peak sizes."""
    splits = -(-max_model_len // split)
    return (step_activation_bytes(mc, max_num_seqs, max_num_seqs, 0, dtype_bytes)
            + split_partial_bytes(mc, max_num_seqs, splits)
            + max_num_seqs * mc.vocab_size * SAMPLER_BYTES_PER_LOGIT)


def block_cost(block_bytes: int, num_layers: int) -> int:
    """Device memory one KV block costs: itself, and its share of what attention may gather of one
    layer of the pool at once (the SDPA backend copies a layer's blocks of the batch into scratch)."""
    return block_bytes + -(-block_bytes // num_layers)


@dataclass(frozen=True)
class DeviceMemory:
    """What a worker found on its device once its weights were loaded, in bytes."""
    device: str
    total: int
    free: int
    held: int  # by this process: torch's allocations (weights) and CONTEXT_BYTES


def kv_pool_blocks(mem: DeviceMemory, block_bytes: int, num_layers: int, activations: int, min_blocks: int,
                   max_blocks: int, utilization: float | None = None, kv_cache_bytes: float | None = None) -> int:
    """KV blocks of block_bytes for a worker on this device, at most max_blocks (what max_num_seqs
    full-length requests use): kv_cache_bytes of them if given (--kv-cache-gb), else what its
    share of the device leaves. With no share given, DEFAULT_UTILIZATION, and no more than that
    fraction of what is free: so a second engine in one process, or one beside another program,
    still gets a pool (a launcher always gives shares). Raises InvalidArgument if the share cannot
    hold min_blocks, or if the device has less free than the pool and one step's activations need."""
    cost = block_cost(block_bytes, num_layers)
    found = (f"{mem.device} has {gib(mem.total)}, {gib(mem.free)} of it free; this worker holds {gib(mem.held)} "
             f"(weights, CUDA context) and needs {gib(activations)} for one step's activations")
    if kv_cache_bytes is not None:
        blocks = max(1, min(max_blocks, int(kv_cache_bytes // block_bytes)))
        flag = f"lower --kv-cache-gb (it asks for {gib(kv_cache_bytes)})"
    else:
        util = DEFAULT_UTILIZATION if utilization is None else utilization
        share = util * mem.total - mem.held - activations
        free_budget = DEFAULT_UTILIZATION * mem.free - activations
        by_free = utilization is None and free_budget < share  # what is free limits it, not the share
        budget = free_budget if by_free else share
        if budget < min_blocks * cost:
            left, advice = ((f"{DEFAULT_UTILIZATION} of what is free leaves", "free the device, or size the pool with "
                             "--kv-cache-gb or --num-blocks") if by_free else
                            (f"--gpu-memory-utilization={util} ({gib(util * mem.total)}) leaves",
                             "raise --gpu-memory-utilization"))
            raise InvalidArgument(
                f"{found}: {left} {gib(max(0.0, budget))} for the KV pool, less than the {gib(min_blocks * cost)} of "
                f"the smallest useful one ({min_blocks} blocks: one step's tokens); {advice} (or lower "
                f"--max-num-batched-tokens, --max-num-seqs or --max-model-len, or pick a smaller --dtype)")
        blocks = min(max_blocks, int(budget // cost))
        flag = f"lower --gpu-memory-utilization (it is {util}: {gib(util * mem.total)})"
    need = blocks * cost + activations
    if need > mem.free:
        raise InvalidArgument(f"{found}: a KV pool of {blocks} blocks and the activations need {gib(need)} more, "
                              f"more than is free: {flag}, or free the device")
    return blocks


def pool_and_context(mem: DeviceMemory, block_bytes: int, block_size: int, num_layers: int,
                     activations_at: Callable[[int], int], max_model_len: int, min_blocks: int, max_blocks: int,
                     utilization: float | None = None, kv_cache_bytes: float | None = None) -> tuple[int, int]:
    """(KV blocks, the longest context a step attends over) of a worker whose step activations
    grow with that context (activations_at(tokens)). No sequence outgrows its pool, so a pool that
    holds less than max_model_len bounds the context too, and the activations are sized for that
    bound: sized for llama-1b's whole 131,072-token context, the Triton attention's partial
    results alone ask 8.7 GB, more than a prefill worker's share of an H100 beside three others.
    The context is the shortest c with c >= min(max_model_len, what the pool left at c holds),
    the largest pool that is safe; raises as kv_pool_blocks does if no useful pool is left."""
    def blocks_at(context: int) -> int:
        return kv_pool_blocks(mem, block_bytes, num_layers, activations_at(context), min_blocks, max_blocks,
                              utilization, kv_cache_bytes)

    def safe(context: int) -> bool:
        try:
            held = blocks_at(context) * block_size
        except InvalidArgument:
            held = 0
        return context >= min(max_model_len, held)

    lo, hi = min(max_model_len, min_blocks * block_size), max_model_len  # safe(hi) always holds
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if safe(mid) else (mid + 1, hi)
    blocks = blocks_at(lo)
    return blocks, min(max_model_len, blocks * block_size)
