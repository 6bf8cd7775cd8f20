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
  batch-invariant (the KV is split at fixed positions); picked by `auto` on CUDA.
- `flex.py`: FlexAttention with a paged block mask, compiled (it does not compile for 16-token pages
  on an H100, so only by name).
- `batch.py`: the batch's layout every backend reads, and the runs of decodes.
Every backend is tested equal to SDPA. This module picks one.
"""

from __future__ import annotations

import logging

import torch

from common.attention.batch import AttentionMetadata, PrefillChunk, decode_groups, decode_kv_read
from common.attention.sdpa import SDPAAttention

__all__ = ["AttentionMetadata", "PrefillChunk", "SDPAAttention", "decode_groups", "decode_kv_read", "make_attention"]

log = logging.getLogger(__name__)


def make_attention(name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int):
    """'auto' is the Triton kernel on CUDA when Triton is installed and the kernel passes a start-up
    check against SDPA, else SDPA. A backend asked for by name is used as it is."""
    sdpa = SDPAAttention(num_heads, num_kv_heads, head_dim)
    if name == "sdpa" or (name == "auto" and device.type != "cuda"):
        return sdpa
    if name == "flex":
        from common.attention.flex import FlexAttention

        return FlexAttention(num_heads, num_kv_heads, head_dim)
    from common.attention import triton_paged

    if name == "triton" and not triton_paged.available():
        raise RuntimeError("attention backend 'triton' needs the triton package (pip install triton); "
                           "or use --attention-backend sdpa")
    fast = triton_paged.TritonAttention(num_heads, num_kv_heads, head_dim)
    if name == "triton":
        return fast
    if not triton_paged.available():
        log.warning("triton is not installed: decoding with SDPA over gathered blocks (slow on %s)", device)
        return sdpa
    try:
        err = _decode_difference(fast, sdpa, device)
    except Exception as e:  # a compiler or kernel failure: the portable path still serves
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        log.warning("Triton attention unavailable on %s (%s: %s); using SDPA", device, type(e).__name__,
                    first_line)
        return sdpa
    if err > 2e-2:
        log.warning("Triton attention differs from SDPA by %.3g on %s; using SDPA", err, device)
        return sdpa
    return fast


def _decode_difference(a, b, device: torch.device) -> float:
    """Largest difference between two backends on a small random paged decode batch."""
    gen = torch.Generator().manual_seed(0)
    N, P, B = 8, 16, 3
    k_cache = torch.randn(N, P, a.num_kv_heads, a.head_dim, generator=gen).to(device)
    v_cache = torch.randn(N, P, a.num_kv_heads, a.head_dim, generator=gen).to(device)
    q = torch.randn(B, a.num_heads, a.head_dim, generator=gen).to(device)
    tables = torch.tensor([[3, 1, 6], [0, 2, 0], [7, 5, 4]], device=device)
    lens = torch.tensor([40, 17, 33], device=device)
    mask = (torch.arange(3 * P, device=device)[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64, device=device), B, tables, lens, mask, [])
    return (a._decode(q, k_cache, v_cache, meta).float() - b._decode(q, k_cache, v_cache, meta).float()).abs().max().item()
