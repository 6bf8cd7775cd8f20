"""The portable backend (CPU and GPU): torch's scaled_dot_product_attention over blocks gathered
from the pool, one gather per layer (the only way plain PyTorch can read scattered pages). It pads
each sequence to the longest it is read with, so it reads a decode batch run by run
(batch.decode_groups). It is the reference every other backend is tested against."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from common.attention.batch import AttentionMetadata, PrefillChunk


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
    grouped_decodes = True  # reads AttentionMetadata.decode_mask and decode_groups (the others do not)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5
        self.k_scratch, self.v_scratch = _Scratch(), _Scratch()

    @staticmethod
    def store(k_TKD, v_TKD, k_cache_NBKD, v_cache_NBKD, meta: AttentionMetadata) -> None:
        """The step's new K/V into the pool at their slots."""
        N, B, K, D = k_cache_NBKD.shape
        k_cache_NBKD.view(N * B, K, D).index_copy_(0, meta.slot_mapping, k_TKD)
        v_cache_NBKD.view(N * B, K, D).index_copy_(0, meta.slot_mapping, v_TKD)

    def __call__(self, q_THD, k_TKD, v_TKD, k_cache_NBKD, v_cache_NBKD, meta: AttentionMetadata):
        self.store(k_TKD, v_TKD, k_cache_NBKD, v_cache_NBKD, meta)
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
