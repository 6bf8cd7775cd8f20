"""FlexAttention backend: decode attention reads the KV pages in place.

The pool is viewed as one long KV sequence of N * block_size slots, and each sequence's block
table becomes the BlockMask's kv_indices, so the kernel visits exactly that sequence's pages and
nothing is gathered. The mask only trims the sequence's partly filled last page. Prefill chunks
go through the same path as the portable backend (SDPA's flash kernels already suit them).

Compiled once with dynamic shapes, so batch size and page counts do not recompile. On CUDA this
is what `auto` picks (after a start-up check against SDPA); on CPU it runs but is slower than
gather + SDPA, so it is opt-in there and tested equal to the portable backend.
"""

from __future__ import annotations

import torch

from common.attention.batch import AttentionMetadata
from common.attention.sdpa import SDPAAttention

_compiled = None


def _flex():
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled = torch.compile(flex_attention, dynamic=True)
    return _compiled


class FlexAttention(SDPAAttention):
    name = "flex"
    grouped_decodes = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(num_heads, num_kv_heads, head_dim)
        self._mask_meta = None  # the step the cached block mask was built for
        self._mask = None

    def _block_mask(self, meta: AttentionMetadata, num_pages: int, page: int):
        if self._mask_meta is meta:
            return self._mask
        from torch.nn.attention.flex_attention import BlockMask

        tables_BM = meta.decode_block_tables.to(torch.int32)
        B, M = tables_BM.shape
        lens_B = meta.decode_context_lens.to(torch.int32)
        pages_B = (lens_B + page - 1) // page
        last_page_B = tables_BM.gather(1, (pages_B - 1)[:, None].long())[:, 0]
        # Slots [cut_start, cut_end) are the unfilled tail of the last page. (Tensors, not a
        # captured int page size: dynamic compilation would make that int symbolic, and
        # inductor's CPU template fails to build with a symbolic divisor.)
        cut_start_B = last_page_B * page + lens_B - (pages_B - 1) * page
        cut_end_B = (last_page_B + 1) * page

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < cut_start_B[b]) | (kv_idx >= cut_end_B[b])

        # kv_indices must span the whole KV length; only the first pages_B entries are read.
        indices_BN = torch.zeros(B, num_pages, dtype=torch.int32, device=tables_BM.device)
        indices_BN[:, :M] = tables_BM
        self._mask = BlockMask.from_kv_blocks(pages_B[:, None, None], indices_BN[:, None, None, :],
                                              BLOCK_SIZE=(1, page), mask_mod=mask_mod,
                                              seq_lengths=(1, num_pages * page), compute_q_blocks=False)
        self._mask_meta = meta
        return self._mask

    def _decode(self, q_BHD, k_cache, v_cache, meta):
        N, P, K, D = k_cache.shape
        B = q_BHD.shape[0]
        k_BKSD = k_cache.view(1, N * P, K, D).transpose(1, 2).expand(B, K, N * P, D)
        v_BKSD = v_cache.view(1, N * P, K, D).transpose(1, 2).expand(B, K, N * P, D)
        o_BH1D = _flex()(q_BHD[:, :, None, :], k_BKSD, v_BKSD, block_mask=self._block_mask(meta, N, P),
                         enable_gqa=self.group > 1)  # default scale is head_dim ** -0.5, as ours
        return o_BH1D[:, :, 0, :]
