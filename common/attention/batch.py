"""What a step asks of attention: the packed batch's layout (AttentionMetadata, built by
common/engine.py), and how decodes of mixed lengths are cut into runs read at their own width
(decode_groups), which the simulator and the step trace count the same way (decode_kv_read)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    positions: torch.Tensor | None = None  # (T,) each token's position in its sequence
    host_positions: list[int] | None = None  # the same on the host (what scratch is sized by, with no sync)


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
