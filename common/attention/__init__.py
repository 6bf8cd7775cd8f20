"""Attention over the paged KV cache, behind one interface.

A batch is packed: all decode tokens first (one per sequence), then prefill chunks. Every
backend writes the batch's new K/V into the pool at `slot_mapping`, then attends each query to
its sequence's cached keys through the block table. The cache itself is never concatenated,
padded or copied whole; the portable backend reads a decode batch's blocks with one gather per
layer (the only way plain PyTorch can read scattered pages), which costs about what the attention
math itself costs. It pads each sequence to the longest it is read with, so the engine packs
decodes longest first and `decode_groups` cuts them into runs of similar length, each read at
its own width: one long sequence no longer makes every short one beside it read its length.

- `sdpa.py`: portable (CPU and GPU), torch's scaled_dot_product_attention.
- `triton_paged.py`: one paged split-KV kernel in Triton for decodes and prefill chunks alike,
  batch-invariant (the KV is split at fixed positions); picked by `auto` on CUDA, which then times
  its tiles' shapes and launch on the device (`triton_choice.py`).
- `flex.py`: FlexAttention with a paged block mask, compiled (it does not compile for 16-token pages
  on an H100, so only by name).
- `batch.py`: the batch's layout every backend reads, and the runs of decodes.
Every backend is tested equal to SDPA. This module picks one.
"""

from __future__ import annotations

import logging

import torch

from common.errors import InvalidArgument, first_line
from common.attention.batch import AttentionMetadata, PrefillChunk, decode_groups, decode_kv_read
from common.attention.sdpa import SDPAAttention

__all__ = ["AttentionMetadata", "PrefillChunk", "SDPAAttention", "decode_groups", "decode_kv_read", "make_attention"]

log = logging.getLogger(__name__)


def make_attention(name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype = torch.float32, block_size: int = 16):
    """'auto' is the Triton kernel on CUDA when Triton is installed, it tiles the block size, and it
    passes a start-up check against SDPA in the serving dtype and block size; else SDPA. Its prefill
    tiles are then the fastest that keep a decode tile's bits, and its decode tiles' launch the
    fastest (common/attention/triton_choice.py). A backend asked for by name is used as it is."""
    sdpa = SDPAAttention(num_heads, num_kv_heads, head_dim)
    if name == "sdpa" or (name == "auto" and device.type != "cuda"):
        return sdpa
    if name == "flex":
        from common.attention.flex import FlexAttention

        return FlexAttention(num_heads, num_kv_heads, head_dim)
    from common import triton_support
    from common.attention import triton_choice, triton_paged

    if name == "triton" and device.type != "cuda" and not triton_support.interpreted():  # (the tests interpret it)
        raise InvalidArgument(f"attention backend 'triton' runs on CUDA devices, not {device}; allowed there: "
                              "sdpa, flex or auto")
    if name == "triton" and not triton_support.available():
        raise RuntimeError("attention backend 'triton' needs the triton package (pip install triton); "
                           "or use --attention-backend sdpa")
    fast = triton_paged.TritonAttention(num_heads, num_kv_heads, head_dim)
    if name == "triton":
        return fast
    if not triton_support.available():
        log.warning("triton is not installed: decoding with SDPA over gathered blocks (slow on %s)", device)
        return sdpa
    if not triton_paged.tiles(block_size):
        log.warning("the Triton attention reads blocks of a divisor of %d tokens, not %d: using SDPA",
                    triton_paged.BLOCK_N, block_size)
        return sdpa
    try:
        err = _step_difference(fast, sdpa, device, dtype, block_size)
    except Exception as e:  # a compiler or kernel failure: the portable path still serves
        log.warning("Triton attention unavailable on %s (%s); using SDPA", device, first_line(e))
        return sdpa
    if err > (2e-2 if dtype == torch.float32 else 6e-2):
        log.warning("Triton attention differs from SDPA by %.3g on %s; using SDPA", err, device)
        return sdpa
    try:
        fast.prefill_tile, notes = triton_choice.choose_prefill_tile(num_heads, num_kv_heads, head_dim, device, dtype,
                                                                     block_size)
    except Exception as e:  # the check itself failed: the decode's tile still serves
        fast.prefill_tile, notes = (triton_paged.MIN_ROWS, 0), [first_line(e)]
    log.info("prefill attention in tiles of %s on %s: the fastest that keep a decode tile's bits (%s)",
             triton_paged.tile_name(fast.prefill_tile), device, "; ".join(notes) or "none timed")
    try:
        fast.decode_launch, notes = triton_choice.choose_decode_launch(num_heads, num_kv_heads, head_dim, device,
                                                                       dtype, block_size)
    except Exception as e:  # the check itself failed: Triton's defaults still serve
        fast.decode_launch, notes = None, [first_line(e)]
    log.info("decode attention launched %s on %s: the fastest (%s)",
             triton_choice.launch_name(fast.decode_launch or {}), device, "; ".join(notes) or "none timed")
    return fast


def _step_difference(a, b, device: torch.device, dtype: torch.dtype = torch.float32, page: int = 16) -> float:
    """Largest difference between two backends on a small random paged step: two decodes and a
    prefill chunk over a cached prefix (lengths for 16-token blocks, scaled to `page`), fragmented
    tables, each backend on its own copy of the pool, in `dtype`."""
    gen = torch.Generator().manual_seed(0)
    N, P, H, K, D = 8, page, a.num_heads, a.num_kv_heads, a.head_dim

    def scaled(n: int) -> int:
        return max(1, n * page // 16)

    k_cache = torch.randn(N, P, K, D, generator=gen).to(device, dtype)
    v_cache = torch.randn(N, P, K, D, generator=gen).to(device, dtype)
    tables = torch.tensor([[3, 1, 6], [0, 2, 0]], device=device)
    lens = [scaled(40), scaled(17)]
    chunk_table, first, count = [7, 5, 4], scaled(20), scaled(10)
    positions = [n - 1 for n in lens] + list(range(first, first + count))
    rows = [tables[0].tolist(), tables[1].tolist()] + [chunk_table] * count
    slots = torch.tensor([row[p // P] * P + p % P for row, p in zip(rows, positions)], device=device)
    T = len(positions)
    q, k, v = (torch.randn(T, n, D, generator=gen).to(device, dtype) for n in (H, K, K))
    lens_B = torch.tensor(lens, device=device)
    mask = (torch.arange(3 * P, device=device)[None, :] < lens_B[:, None])[:, None, None, :]
    chunk = PrefillChunk(2, T, first, torch.tensor(chunk_table, device=device))
    meta = AttentionMetadata(slots, 2, tables, lens_B, mask, [chunk], None, torch.tensor(positions, device=device),
                             positions)
    out_a = a(q, k, v, k_cache.clone(), v_cache.clone(), meta).float()
    out_b = b(q, k, v, k_cache.clone(), v_cache.clone(), meta).float()
    return (out_a - out_b).abs().max().item()
