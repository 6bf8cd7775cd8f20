"""What `auto` measures at start on the device at hand, for the paged Triton attention
(triton_paged.py): choices that change no token, only speed, and that a given GPU, Triton and
driver answer differently.

- choose_prefill_tile: a prefill chunk's tile (rows, warps), among those whose rows come out the
  bits a decode's one-token tile gives them (on an H100 some do not);
- choose_decode_launch: a decode tile's launch options (a cap on a thread's registers), which
  change no arithmetic (checked all the same).

Each times its candidates (triton.testing.do_bench on CUDA; a given timer elsewhere; untimed, the
first that keeps the bits) and says in notes why one was passed over and how fast each was.
"""

from __future__ import annotations

import torch

from common.attention import triton_paged as tp
from common.errors import first_line
from common.triton_support import triton


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
    tile, its keys in a shuffled table), timed on that chunk beside a decode's own tile (on CUDA by
    triton.testing.do_bench; `timer(fn) -> seconds` elsewhere; with no timer, the first in the list
    that keeps the bits); else the decode's tile, (tp.MIN_ROWS, 0). And notes: why a candidate was
    passed over where it failed to run (a tile too big for the device's shared memory), and each
    timed one's µs."""
    gen = torch.Generator().manual_seed(0)
    T, H, K, D = tokens, num_heads, num_kv_heads, head_dim
    blocks = -(-T // page)
    k_cache, v_cache = _pool(blocks + 1, page, K, D, device, dtype, 0)
    tables = torch.randperm(blocks + 1, generator=gen)[:blocks][None, :].to(device)
    q = torch.randn(T, H, D, generator=gen).to(device, dtype)
    positions, host, scale = torch.arange(T, device=device), list(range(T)), D ** -0.5
    ones = torch.stack([torch.zeros_like(positions), positions, torch.ones_like(positions), positions])
    want = tp.paged_attention(q, k_cache, v_cache, tables, ones, positions, scale, host)
    timer = timer or device_timer(device)
    notes, kept = [], {}
    for tile in [*tp.PREFILL_CANDIDATES, (tp.MIN_ROWS, 0)]:
        block_q, _ = tp.tile_shape(H // K, tile[0])
        if block_q <= 1 and tile[0] != tp.MIN_ROWS:  # a decode's tile, of other rows
            continue
        chunk = torch.tensor([(0, j, min(block_q, T - j), j) for j in range(0, T, block_q)], device=device)
        run = (lambda c=chunk.T.contiguous(), t=tile: tp.paged_attention(  # noqa: E731
            q, k_cache, v_cache, tables, c, positions, scale, host, decode_tiles=0, prefill_tile=t))
        try:
            got = run()
        except Exception as e:  # Triton's out-of-resources errors are not RuntimeErrors
            notes.append(f"{tp.tile_name(tile)}: {first_line(e)}")
            continue
        if not torch.equal(got, want):
            continue
        if timer is None:
            return tile, notes
        kept[tile] = timer(run)
    best = min(kept, key=kept.get) if kept else (tp.MIN_ROWS, 0)
    notes += [f"{tp.tile_name(t)} {1e6 * sec:.0f} us" for t, sec in kept.items()]
    return best, notes


def choose_decode_launch(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                         dtype: torch.dtype, page: int, batch: int = 64, context: int = 2 * tp.SPLIT + 37,
                         timer=None) -> tuple[dict, list[str]]:
    """The fastest of DECODE_LAUNCHES for a decode's tiles, timed on a batch of `batch` decodes at
    `context` tokens over a shuffled pool, among those that give its bits (the first's: a launch
    option changes no arithmetic, and this checks it); with no timer, the first. And notes: why one
    was passed over (an option this Triton does not take), and each timed one's µs."""
    gen = torch.Generator().manual_seed(1)
    H, K, D = num_heads, num_kv_heads, head_dim
    width = -(-context // page)
    k_cache, v_cache = _pool(batch * width, page, K, D, device, dtype, 1)
    tables = torch.randperm(batch * width, generator=gen).view(batch, width).to(device)
    q = torch.randn(batch, H, D, generator=gen).to(device, dtype)
    lens = torch.full((batch,), context, device=device)
    tiles, scale = tp.decode_tiles(lens), D ** -0.5
    timer = timer or device_timer(device)
    notes, kept, want = [], {}, None
    for i, launch in enumerate(tp.DECODE_LAUNCHES):
        run = (lambda o=launch: tp.paged_attention(  # noqa: E731
            q, k_cache, v_cache, tables, tiles, lens - 1, scale, decode_launch=o))
        try:
            got = run()
        except Exception as e:  # an option this Triton does not know; out of resources
            notes.append(f"{launch_name(launch)}: {first_line(e)}")
            continue
        want = got if want is None else want
        if not torch.equal(got, want):
            notes.append(f"{launch_name(launch)}: other bits")
            continue
        if timer is None:
            return launch, notes
        kept[i] = timer(run)
    best = tp.DECODE_LAUNCHES[min(kept, key=kept.get)] if kept else {}
    notes += [f"{launch_name(tp.DECODE_LAUNCHES[i])} {1e6 * sec:.0f} us" for i, sec in kept.items()]
    return best, notes


def launch_name(launch: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in launch.items()) or "uncapped"
