"""What `auto` measures at start on the device at hand, for the paged Triton attention
(triton_paged.py): choices that change no token, only speed, and that a given GPU, Triton and
driver answer differently.

- choose_prefill_tile: a prefill chunk's tile (rows, warps), among those whose rows come out the
  bits a decode's one-token tile gives them (on an H100 some do not);
- choose_decode_launch: a decode tile's launch options (a cap on a thread's registers), which
  change no arithmetic (checked all the same).

Each times its candidates (triton.testing.do_bench on CUDA; a given timer elsewhere; untimed, the
first that keeps the bits) and says in notes why one was passed over and how fast each was. A
timing wobbles from one start to the next, and on a small model every candidate times alike: so
the safe default (a decode's own tile, Triton's own launch) is kept unless another is more than
TIE times faster, and of candidates that near each other the first listed is taken. Two engines
on one machine then choose alike.
"""

from __future__ import annotations

import torch

from common.attention import triton_paged as tp
from common.errors import first_line
from common.triton_support import triton

TIE = 1.1  # timings within this factor of the fastest count as equal


def device_timer(device: torch.device):
    """`timer(fn) -> seconds` by triton.testing.do_bench's median on CUDA; None elsewhere (untimed)."""
    if device.type != "cuda":
        return None
    return lambda fn: triton.testing.do_bench(fn, warmup=2, rep=10, return_mode="median") / 1e3


def _pool(blocks: int, page: int, kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
          seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random K and V pool, drawn on the device (a decode batch's is tens of MB)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(blocks, page, kv_heads, head_dim, generator=gen, device=device).to(dtype)
                 for _ in range(2))


def choose_prefill_tile(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                        dtype: torch.dtype, page: int, tokens: int = 2 * tp.SPLIT + 37, timer=None
                        ) -> tuple[tuple[int, int], list[str]]:
    """The fastest of tp.PREFILL_CANDIDATES whose tiles give every row of a prefill chunk the bits
    one-token tiles give it, here, in this dtype (a chunk over several splits with a ragged last
    tile, its keys in a shuffled table, tiled from 0 and from past a split's start), timed on that
    chunk beside a decode's own tile (on CUDA by triton.testing.do_bench; `timer(fn) -> seconds`
    elsewhere; with no timer, the first in the list that keeps the bits); else the decode's tile,
    (tp.MIN_ROWS, 0). And _fastest's notes."""
    gen = torch.Generator().manual_seed(0)
    T, H, K, D = tokens, num_heads, num_kv_heads, head_dim
    blocks = -(-T // page)
    k_cache, v_cache = _pool(blocks + 1, page, K, D, device, dtype, 0)
    tables = torch.randperm(blocks + 1, generator=gen)[:blocks][None, :].to(device)
    q = torch.randn(T, H, D, generator=gen).to(device, dtype)
    positions, host, scale = torch.arange(T, device=device), list(range(T)), D ** -0.5
    ones = torch.stack([torch.zeros_like(positions), positions, torch.ones_like(positions), positions])
    want = tp.paged_attention(q, k_cache, v_cache, tables, ones, positions, scale, host)

    def run(tile):
        # the chunk's tiles from position 0 up to `cached`, then from there as a chunk after a cached
        # prefix of that many tokens tiles them (chunked prefill, a preempted request's recompute)
        block_q, _ = tp.tile_shape(H // K, tile[0])
        cached = min(T - 1, tp.SPLIT + 5)
        chunk = torch.tensor([(0, j, min(block_q, hi - j), j) for lo, hi in ((0, cached), (cached, T))
                              for j in range(lo, hi, block_q)], device=device).T
        return lambda: tp.paged_attention(q, k_cache, v_cache, tables, chunk.contiguous(), positions, scale, host,
                                          decode_tiles=0, prefill_tile=tile)
    # (a tile of other rows than a decode's that holds one token is a decode's tile)
    tiles = [t for t in [*tp.PREFILL_CANDIDATES, (tp.MIN_ROWS, 0)]
             if t[0] == tp.MIN_ROWS or tp.tile_shape(H // K, t[0])[0] > 1]
    return _fastest(tiles, run, tp.tile_name, want, timer or device_timer(device), (tp.MIN_ROWS, 0))


def choose_decode_launch(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                         dtype: torch.dtype, page: int, batch: int = 64, context: int = 2 * tp.SPLIT + 37,
                         timer=None) -> tuple[dict, list[str]]:
    """The fastest of DECODE_LAUNCHES for a decode's tiles, timed on a batch of `batch` decodes at
    `context` tokens over a shuffled pool, among those that give its bits (the first's: a launch
    option changes no arithmetic, and this checks it); with no timer, the first. And _fastest's
    notes."""
    gen = torch.Generator().manual_seed(1)
    H, K, D = num_heads, num_kv_heads, head_dim
    width = -(-context // page)
    k_cache, v_cache = _pool(batch * width, page, K, D, device, dtype, 1)
    tables = torch.randperm(batch * width, generator=gen).view(batch, width).to(device)
    q = torch.randn(batch, H, D, generator=gen).to(device, dtype)
    lens = torch.full((batch,), context, device=device)
    tiles, scale = tp.decode_tiles(lens), D ** -0.5

    def run(launch: dict):
        return lambda: tp.paged_attention(q, k_cache, v_cache, tables, tiles, lens - 1, scale, decode_launch=launch)
    return _fastest(tp.DECODE_LAUNCHES, run, launch_name, None, timer or device_timer(device), {})


def _fastest(candidates: list, run, name, want: torch.Tensor | None, timer, fallback):
    """(the fastest of candidates whose run(candidate)() gives want's bits (None: the first that
    runs), or with no timer the first of them; fallback where none does, notes): each passed over
    and why (it failed to run: a tile too big for the device's shared memory, an option this Triton
    does not take; it gave other bits), then each timed one's µs. Of those within TIE of the
    fastest, fallback if it is one, else the first listed."""
    notes, kept = [], {}
    for i, candidate in enumerate(candidates):
        fn = run(candidate)
        try:
            got = fn()
        except Exception as e:  # Triton's out-of-resources errors are not RuntimeErrors
            notes.append(f"{name(candidate)}: {first_line(e)}")
            continue
        want = got if want is None else want
        if not torch.equal(got, want):
            notes.append(f"{name(candidate)}: other bits")
            continue
        if timer is None:
            return candidate, notes
        kept[i] = timer(fn)
    tie = TIE * min(kept.values(), default=0.0)
    near = [i for i, sec in kept.items() if sec <= tie]
    best = fallback if not near or fallback in (candidates[i] for i in near) else candidates[near[0]]
    return best, notes + [f"{name(candidates[i])} {1e6 * sec:.0f} us" for i, sec in kept.items()]


def launch_name(launch: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in launch.items()) or "uncapped"
