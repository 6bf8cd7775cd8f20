"""Batch-invariant attention for the CPU, in torch's own ops: a query's result is the same bits
whatever else is in its batch, however its prompt was chunked, and whether it was computed as a
decode or in a prefill (a preemption's recompute, a migration's re-prefill).

SDPA and torch's matmuls round a row differently by how many rows share the call: MKL picks
its kernel and blocking by the matrix sizes. Here every product has one shape, whatever the batch:

- a product is one token's query heads that share a KV head (GROUP rows, at least MIN_ROWS with
  zero rows), decode or prefill;
- keys go in splits of SPLIT positions at fixed offsets (0, SPLIT, 2 * SPLIT, ...), as the
  Triton kernel's (triton_paged.py); positions past a query's own get an exact zero weight;
- each split is a batched product of (GROUP x head_dim) by (head_dim x SPLIT) for the scores and
  (GROUP x SPLIT) by (SPLIT x head_dim + 1) for the weighted values and their weights' sum (a
  column of ones); after a max over every split, the splits are added in split order.

A row's arithmetic then depends on its position and its sequence's keys alone (the pool is
zeroed, so a masked slot's value is finite and its zero weight gives an exact zero). It costs a
loop over splits (and over KV heads in a prefill chunk) per layer: the price of the promise on a
CPU (`--batch-invariant`; common/batch_invariant.py installs it).
"""

from __future__ import annotations

import math

import torch

from common.attention.batch import AttentionMetadata
from common.attention.sdpa import SDPAAttention, gather_blocks

SPLIT = 256  # key positions per split, at fixed offsets
MIN_ROWS = 4  # a product's rows, padded with zeros: a one-row product rounds by the batch's size (2 threads)


class TiledAttention(SDPAAttention):
    name = "tiled"
    grouped_decodes = False  # groups decodes by their split count itself

    def __call__(self, q_THD, k_TKD, v_TKD, k_cache_NBKD, v_cache_NBKD, meta: AttentionMetadata):
        self.store(k_TKD, v_TKD, k_cache_NBKD, v_cache_NBKD, meta)
        out_THD = torch.empty_like(q_THD)
        positions = meta.host_positions or meta.positions.tolist()
        by_splits: dict[int, list[int]] = {}  # decodes read together: those of one split count
        for row in range(meta.num_decode):
            by_splits.setdefault(positions[row] // SPLIT + 1, []).append(row)
        for splits, rows in by_splits.items():
            index = torch.tensor(rows, device=q_THD.device)
            tables = meta.decode_block_tables.index_select(0, index)
            out_THD[index] = self._decodes(q_THD.index_select(0, index), k_cache_NBKD, v_cache_NBKD, tables,
                                           [positions[r] for r in rows], splits)
        for c in meta.prefills:
            out_THD[c.start:c.end] = self._chunk(q_THD[c.start:c.end], k_cache_NBKD, v_cache_NBKD, c.block_table,
                                                 positions[c.start:c.end])
        return out_THD

    def _splits_of(self, k_cache, v_cache, tables_nM, splits: int):
        """Keys (n, K, splits, D, SPLIT), each split's (D x SPLIT) matrix row-major (MKL rounds a
        transposed layout differently), and values with their ones column (n, K, S, D + 1), of
        `splits` splits of each table's sequence; block 0 stands past a table's end (read, and
        weighted zero)."""
        n, B = tables_nM.shape[0], k_cache.shape[1]
        S, width = splits * SPLIT, -(-splits * SPLIT // B)
        tables = tables_nM.new_zeros(n, width)
        tables[:, :min(width, tables_nM.shape[1])] = tables_nM[:, :width]
        k_nSKD = gather_blocks(k_cache, tables, self.k_scratch)[:, :S]
        n, _, K, D = k_nSKD.shape
        keys = k_nSKD.view(n, splits, SPLIT, K, D).permute(0, 3, 1, 4, 2).contiguous()
        values = _with_ones(gather_blocks(v_cache, tables, self.v_scratch)[:, :S].transpose(1, 2))
        return keys, values

    def _decodes(self, q_nHD, k_cache, v_cache, tables_nM, positions: list[int], splits: int):
        """n decodes of `splits` splits each: a product per (decode, KV head)."""
        n, H, D = q_nHD.shape
        K, G = self.num_kv_heads, self.group
        keys, values = self._splits_of(k_cache, v_cache, tables_nM, splits)
        row_pos = torch.tensor(positions, device=q_nHD.device).repeat_interleave(K).view(n * K, 1, 1)
        out = self._fold(_padded(q_nHD.reshape(n * K, G, D)), row_pos, splits,
                         lambda s: keys[:, :, s].reshape(n * K, D, SPLIT),
                         lambda s: values[:, :, s * SPLIT:(s + 1) * SPLIT].reshape(n * K, SPLIT, D + 1))
        return out[:, :G].reshape(n, H, D)

    def _chunk(self, q_QHD, k_cache, v_cache, table_M, positions: list[int]):
        """A prefill chunk's tokens, a product per (token, KV head), against the chunk's keys (one
        copy of them, broadcast to every token)."""
        Q, H, D = q_QHD.shape
        K, G = self.num_kv_heads, self.group
        splits = positions[-1] // SPLIT + 1
        keys, values = self._splits_of(k_cache, v_cache, table_M[None], splits)
        q_KQGD = q_QHD.view(Q, K, G, D).transpose(0, 1)
        row_pos = torch.tensor(positions, device=q_QHD.device).view(Q, 1, 1)
        out_KQGD = torch.stack([
            self._fold(_padded(q_KQGD[k]), row_pos, splits, lambda s, k=k: keys[0, k, s].expand(Q, D, SPLIT),
                       lambda s, k=k: values[0, k, s * SPLIT:(s + 1) * SPLIT].expand(Q, SPLIT, D + 1))
            for k in range(K)])[:, :, :G]
        return out_KQGD.transpose(0, 1).reshape(Q, H, D)

    def _fold(self, q_UGD, row_pos_U11, splits: int, keys_of, values_of):
        """Each unit's query rows against its keys, split by split (keys_of(s), values_of(s)):
        scores, a max over all the splits, then each split's weighted values and weights' sum (one
        product: the values carry a column of ones, so the sum is rounded as the products are),
        added in split order."""
        scores = []
        for s in range(splits):
            key_pos = torch.arange(s * SPLIT, (s + 1) * SPLIT, device=q_UGD.device)
            x = torch.bmm(q_UGD, keys_of(s)) * self.scale
            scores.append(x.masked_fill(key_pos > row_pos_U11, -math.inf))
        top = scores[0].amax(-1, keepdim=True)
        for x in scores[1:]:
            top = torch.maximum(top, x.amax(-1, keepdim=True))
        acc = None
        for s, x in enumerate(scores):
            part = torch.bmm(torch.exp(x - top), values_of(s))
            acc = part if acc is None else acc + part
        return acc[..., :-1] / acc[..., -1:]


def _padded(q_UGD: torch.Tensor) -> torch.Tensor:
    """(U, G, D) -> (U, max(G, MIN_ROWS), D), the added rows zeros (their results are dropped)."""
    U, G, D = q_UGD.shape
    return q_UGD if G >= MIN_ROWS else torch.cat([q_UGD, q_UGD.new_zeros(U, MIN_ROWS - G, D)], 1)


def _with_ones(values: torch.Tensor) -> torch.Tensor:
    """(..., S, D) -> (..., S, D + 1), the last column ones: the softmax's sum comes out of the
    same product as the weighted values."""
    return torch.cat([values, values.new_ones(*values.shape[:-1], 1)], -1)
