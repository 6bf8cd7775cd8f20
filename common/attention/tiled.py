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
        N, B, K, D = k_cache_NBKD.shape
        k_cache_NBKD.view(N * B, K, D).index_copy_(0, meta.slot_mapping, k_TKD)
        v_cache_NBKD.view(N * B, K, D).index_copy_(0, meta.slot_mapping, v_TKD)
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

    def _decodes(self, q_nHD, k_cache, v_cache, tables_nM, positions: list[int], splits: int):
        """n decodes of `splits` splits each: a product per (decode, KV head)."""
        n, H, D = q_nHD.shape
        K, G, B = self.num_kv_heads, self.group, k_cache.shape[1]
        S, width = splits * SPLIT, -(-splits * SPLIT // B)
        tables = tables_nM.new_zeros(n, width)  # block 0 past a table's end: read, weighted zero
        tables[:, :min(width, tables_nM.shape[1])] = tables_nM[:, :width]
        keys = gather_blocks(k_cache, tables, self.k_scratch)[:, :S].permute(0, 2, 3, 1)  # (n, K, D, S)
        values = _with_ones(gather_blocks(v_cache, tables, self.v_scratch)[:, :S].transpose(1, 2))  # (n, K, S, D+1)
        row_pos = torch.tensor(positions, device=q_nHD.device).repeat_interleave(K).view(n * K, 1, 1)
        out = self._fold(_padded(q_nHD.reshape(n * K, G, D)), row_pos, splits,
                         lambda part: keys[..., part].reshape(n * K, D, SPLIT),
                         lambda part: values[:, :, part].reshape(n * K, SPLIT, D + 1))
        return out[:, :G].reshape(n, H, D)

    def _chunk(self, q_QHD, k_cache, v_cache, table_M, positions: list[int]):
        """A prefill chunk's tokens, a product per (token, KV head), against the chunk's keys (one
        copy of them, broadcast to every token)."""
        Q, H, D = q_QHD.shape
        K, G, B = self.num_kv_heads, self.group, k_cache.shape[1]
        splits = positions[-1] // SPLIT + 1
        S, width = splits * SPLIT, -(-splits * SPLIT // B)
        table = table_M.new_zeros(1, width)
        table[0, :min(width, table_M.shape[0])] = table_M[:width]
        keys = gather_blocks(k_cache, table, self.k_scratch)[0, :S].permute(1, 2, 0)  # (K, D, S)
        values = _with_ones(gather_blocks(v_cache, table, self.v_scratch)[0, :S].transpose(0, 1))  # (K, S, D + 1)
        q_KQGD = q_QHD.view(Q, K, G, D).transpose(0, 1)
        row_pos = torch.tensor(positions, device=q_QHD.device).view(Q, 1, 1)
        out_KQGD = torch.stack([
            self._fold(_padded(q_KQGD[k]), row_pos, splits, lambda part, k=k: keys[k, :, part].expand(Q, D, SPLIT),
                       lambda part, k=k: values[k, part].expand(Q, SPLIT, D + 1))
            for k in range(K)])[:, :, :G]
        return out_KQGD.transpose(0, 1).reshape(Q, H, D)

    def _fold(self, q_UGD, row_pos_U11, splits: int, keys_of, values_of):
        """Each unit's query rows against its keys, split by split: scores, a max over all the
        splits, then each split's weighted values and weights' sum (one product: the values carry
        a column of ones, so the sum is rounded as the products are), added in split order."""
        scores = []
        for s in range(splits):
            part = slice(s * SPLIT, (s + 1) * SPLIT)
            key_pos = torch.arange(part.start, part.stop, device=q_UGD.device)
            x = torch.bmm(q_UGD, keys_of(part)) * self.scale
            scores.append(x.masked_fill(key_pos > row_pos_U11, -math.inf))
        top = scores[0].amax(-1, keepdim=True)
        for x in scores[1:]:
            top = torch.maximum(top, x.amax(-1, keepdim=True))
        acc = None
        for s, x in enumerate(scores):
            part = torch.bmm(torch.exp(x - top), values_of(slice(s * SPLIT, (s + 1) * SPLIT)))
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
