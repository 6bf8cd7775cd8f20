"""Attention over the paged KV cache, behind one interface.

A batch is packed: all decode tokens first (one per sequence), then prefill chunks. Every
backend writes the batch's new K/V into the pool at `slot_mapping`, then attends each query to
its sequence's cached keys through the block table. The cache itself is never concatenated,
padded or copied whole; the portable backend reads a decode batch's blocks with one gather per
layer (the only way plain PyTorch can read scattered pages), which costs about what the attention
math itself costs. It pads each sequence to the longest it is read with, so the engine packs
decodes longest first and `decode_groups` cuts them into runs of similar length, each read at
its own width: one long sequence no longer makes every short one beside it read its length.

- `sdpa`: portable (CPU and GPU), torch's scaled_dot_product_attention.
- `flex`: FlexAttention with a paged block mask, compiled; picked by `auto` on CUDA.
Both are tested equal to each other.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass
class PrefillChunk:
    start: int  # first token of the chunk in the packed batch
    end: int
    context_start: int  # tokens of this sequence already in the cache before the chunk
    block_table: torch.Tensor  # (blocks,) covering context_start + (end - start) tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) pool slot (block * block_size + offset) of each new token
    num_decode: int  # tokens [0, num_decode) are single-token decodes
    decode_block_tables: torch.Tensor | None  # (Bd, max_blocks), padded with block 0
    decode_context_lens: torch.Tensor | None  # (Bd,) tokens in cache including this one
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, max_blocks * block_size) True where visible
    prefills: list[PrefillChunk]
    decode_groups: list[tuple[int, int, int]] | None = None  # (first row, end row, blocks) read together


GROUP_WIDTH = 0.7  # a decode joins its group while its blocks are at least this share of the group's ...
GROUP_SAVING = 512  # ... and a group stands alone only if it spares this many tokens of padded reads


def decode_groups(lengths: list[int], block_size: int) -> list[tuple[int, int, int]]:
    """Decode rows, sorted longest first by their KV lengths, cut into runs that the portable
    attention reads each at its own width: (first row, end row, blocks of the longest). A run starts
    where a length falls below GROUP_WIDTH of the run's width, and is merged back into the one
    before if reading it apart spares fewer than GROUP_SAVING tokens (each run costs a gather and
    an attention call per layer)."""
    runs: list[list[int]] = []
    for i, n in enumerate(lengths):
        blocks = -(-n // block_size)
        if runs and blocks >= GROUP_WIDTH * runs[-1][2]:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1, blocks])
    out: list[list[int]] = []
    for first, end, blocks in runs:
        if out and (out[-1][2] - blocks) * block_size * (end - first) < GROUP_SAVING:
            out[-1][1] = end
        else:
            out.append([first, end, blocks])
    return [tuple(g) for g in out]


def decode_kv_read(lengths: list[int], block_size: int) -> int:
    """KV tokens the portable attention reads for decodes of these lengths (grouped as the engine does)."""
    ordered = sorted(lengths, reverse=True)
    return sum((end - first) * blocks * block_size for first, end, blocks in decode_groups(ordered, block_size))


class _Scratch:
    """A grow-only buffer reused by every layer and step: a fresh multi-megabyte tensor per
    gather would go to the OS and back each time (page faults cost more than the copy)."""

    def __init__(self):
        self.buf: torch.Tensor | None = None

    def take(self, shape, like: torch.Tensor) -> torch.Tensor:
        n = math.prod(shape)
        if self.buf is None or self.buf.numel() < n or self.buf.dtype != like.dtype or self.buf.device != like.device:
            self.buf = torch.empty(n, dtype=like.dtype, device=like.device)
        return self.buf[:n].view(shape)


def gather_blocks(cache_NBKD: torch.Tensor, tables_SM: torch.Tensor, out: _Scratch) -> torch.Tensor:
    """(S, M) block tables -> (S, M * block_size, kv_heads, head_dim), one row copy per block
    (index_select on whole blocks, far faster than elementwise advanced indexing)."""
    S, M = tables_SM.shape
    _, B, K, D = cache_NBKD.shape
    dst = out.take((S * M, B, K, D), cache_NBKD)
    torch.index_select(cache_NBKD, 0, tables_SM.reshape(-1), out=dst)
    return dst.view(S, M * B, K, D)


class SDPAAttention:
    name = "sdpa"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5
        self.k_scratch, self.v_scratch = _Scratch(), _Scratch()

    def __call__(self, q_THD, k_TKD, v_TKD, k_cache_NBKD, v_cache_NBKD, meta: AttentionMetadata):
        N, B, K, D = k_cache_NBKD.shape
        k_cache_NBKD.view(N * B, K, D).index_copy_(0, meta.slot_mapping, k_TKD)
        v_cache_NBKD.view(N * B, K, D).index_copy_(0, meta.slot_mapping, v_TKD)
        out_THD = torch.empty_like(q_THD)
        nd = meta.num_decode
        if nd:
            out_THD[:nd] = self._decode(q_THD[:nd], k_cache_NBKD, v_cache_NBKD, meta)
        for c in meta.prefills:
            out_THD[c.start:c.end] = self._prefill(q_THD[c.start:c.end], k_TKD[c.start:c.end],
                                                   v_TKD[c.start:c.end], k_cache_NBKD, v_cache_NBKD, c)
        return out_THD

    def _decode(self, q_BHD, k_cache, v_cache, meta):
        Bd = q_BHD.shape[0]
        groups = meta.decode_groups or [(0, Bd, meta.decode_block_tables.shape[1])]
        if len(groups) == 1:
            return self._decode_rows(q_BHD, k_cache, v_cache, meta, *groups[0])
        out = torch.empty_like(q_BHD)
        for first, end, blocks in groups:
            out[first:end] = self._decode_rows(q_BHD[first:end], k_cache, v_cache, meta, first, end, blocks)
        return out

    def _decode_rows(self, q_BHD, k_cache, v_cache, meta, first: int, end: int, blocks: int):
        """Decode rows [first, end), reading `blocks` blocks of each."""
        Bd = q_BHD.shape[0]
        K, G, D = self.num_kv_heads, self.group, self.head_dim
        tables = meta.decode_block_tables[first:end, :blocks]
        mask = meta.decode_mask[first:end, :, :, :blocks * k_cache.shape[1]]
        # The G query heads sharing a KV head become G query rows: GQA without repeating K/V.
        q_BKGD = q_BHD.view(Bd, K, G, D)
        k_BKLD = gather_blocks(k_cache, tables, self.k_scratch).transpose(1, 2)
        v_BKLD = gather_blocks(v_cache, tables, self.v_scratch).transpose(1, 2)
        o_BKGD = F.scaled_dot_product_attention(q_BKGD, k_BKLD, v_BKLD, attn_mask=mask, scale=self.scale)
        return o_BKGD.reshape(Bd, K * G, D)

    def _prefill(self, q_QHD, k_QKD, v_QKD, k_cache, v_cache, c: PrefillChunk):
        Q = q_QHD.shape[0]
        q_HQD = q_QHD.transpose(0, 1).unsqueeze(0)
        if c.context_start == 0:  # the chunk is the whole context: no cache read needed
            o = F.scaled_dot_product_attention(q_HQD, k_QKD.transpose(0, 1).unsqueeze(0),
                                               v_QKD.transpose(0, 1).unsqueeze(0), is_causal=True,
                                               scale=self.scale, enable_gqa=self.group > 1)
        else:
            L = c.context_start + Q
            k_LKD = gather_blocks(k_cache, c.block_table[None], self.k_scratch)[0, :L]
            v_LKD = gather_blocks(v_cache, c.block_table[None], self.v_scratch)[0, :L]
            q_pos = torch.arange(c.context_start, L, device=q_QHD.device)
            mask_QL = torch.arange(L, device=q_QHD.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q_HQD, k_LKD.transpose(0, 1).unsqueeze(0),
                                               v_LKD.transpose(0, 1).unsqueeze(0), attn_mask=mask_QL,
                                               scale=self.scale, enable_gqa=self.group > 1)
        return o.squeeze(0).transpose(0, 1)


def make_attention(name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int):
    """'auto' is FlexAttention on CUDA when it passes a start-up check against SDPA, else SDPA."""
    sdpa = SDPAAttention(num_heads, num_kv_heads, head_dim)
    if name == "sdpa" or (name == "auto" and device.type != "cuda"):
        return sdpa
    from common.flex_attention import FlexAttention

    flex = FlexAttention(num_heads, num_kv_heads, head_dim)
    if name == "flex":
        return flex
    try:
        err = _decode_difference(flex, sdpa, device)
    except Exception as e:  # a compiler or kernel failure: the portable path still serves
        log.warning("FlexAttention unavailable on %s (%s: %s); using SDPA", device, type(e).__name__, e)
        return sdpa
    if err > 2e-2:
        log.warning("FlexAttention differs from SDPA by %.3g on %s; using SDPA", err, device)
        return sdpa
    return flex


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
