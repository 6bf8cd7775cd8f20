"""The frame plan: how a request's KV is cut up on its way out of the prefill worker's pool.

Both ends see a request's KV as units: one block of one layer's K or V, (block_size, kv_heads,
head_dim), contiguous in the pool. A request's units are numbered in (layer, K/V, block) order,
and a chunk lists the runs of unit numbers it holds (the receiver places them by those numbers:
Inbox in __init__.py).

A piece of a transfer (some layers in some of the request's blocks) lies in stretches of
consecutive pool rows; frame_plan cuts them into frames: stretches long enough go as the pool's
own memory, cut evenly to at most CHUNK_BYTES, shorter ones are gathered. Plain integers, no
tensors: this is on the way to a transfer's first byte, where caches are cold.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator, NamedTuple

import torch

if TYPE_CHECKING:
    from common.kv_transport.base import Outgoing

CHUNK_BYTES = 4 << 20  # largest frame or point-to-point message: pipelines, stays on the heap
MIN_FRAME_BYTES = 64 << 10  # shorter stretches are gathered: below this a copy costs less than a frame


def unit_view(pool: torch.Tensor) -> torch.Tensor:
    """(layers, 2, blocks, block_size, kv_heads, head_dim) -> (layers * 2 * blocks, block_size, ...)."""
    return pool.view(-1, *pool.shape[3:])


def unit_bytes(pool: torch.Tensor) -> int:
    return math.prod(pool.shape[3:]) * pool.element_size()


def _add_run(out: list[list[int]], first: int, count: int) -> None:
    """Append the run [first, count], joined to the last one if it carries it on."""
    if out and out[-1][0] + out[-1][1] == first:
        out[-1][1] += count
    else:
        out.append([first, count])


def unit_stretches(pool_blocks: int, block_ids: list[int], layers: range) -> list[list[int]]:
    """The rows of unit_view(pool) that hold these blocks' units in these layers, in (layer, K/V,
    block) order, as [first row, count] stretches of consecutive rows. Plain integers, no
    tensors: this is on the way to a transfer's first byte, where caches are cold."""
    blocks: list[list[int]] = []  # runs of consecutive block ids
    for b in block_ids:
        _add_run(blocks, b, 1)
    out: list[list[int]] = []
    for kv in range(2 * layers.start, 2 * layers.stop):
        for first, count in blocks:
            _add_run(out, kv * pool_blocks + first, count)
    return out


def number_runs(num_blocks: int, layers: range, blocks: range, first: int, end: int) -> list[list[int]]:
    """[first, count] runs of the request's unit numbers (numbered in (layer, K/V, block) order
    over its num_blocks blocks) of the units at [first, end) of the piece that holds these layers
    in these of its blocks."""
    out: list[list[int]] = []
    width, p = len(blocks), first
    while p < end:
        kv, i = divmod(p, width)
        take = min(width - i, end - p)
        _add_run(out, (2 * layers.start + kv) * num_blocks + blocks.start + i, take)
        p += take
    return out


class Frame(NamedTuple):
    """One frame's worth of a piece: its units at [first, end) of the piece, which lie in these
    [row, count] stretches of pool rows. In place: one stretch, sent as the pool's own memory."""
    first: int
    end: int
    parts: list
    in_place: bool

    def take(self, units: torch.Tensor) -> torch.Tensor:
        """Its units of unit_view(pool): a view if in place, else gathered into a new tensor (on
        the current stream, for a CUDA pool)."""
        if self.in_place:
            row, count = self.parts[0]
            return units[row:row + count]
        rows = torch.tensor([r + i for r, c in self.parts for i in range(c)], dtype=torch.int64)
        return units.index_select(0, rows.to(units.device))


def frame_plan(stretches: list[list[int]], unit_nbytes: int) -> Iterator[Frame]:
    """Frames of a piece whose units lie in these stretches of pool rows, each as soon as it is
    known (the first goes out before the rest are planned). Stretches of at least MIN_FRAME_BYTES
    go in place, cut evenly to at most CHUNK_BYTES; the units of the shorter ones are gathered
    into frames of up to CHUNK_BYTES."""
    least, most = -(-MIN_FRAME_BYTES // unit_nbytes), max(1, CHUNK_BYTES // unit_nbytes)
    loose: list[list[int]] = []  # short stretches waiting to be gathered
    p = 0  # position in the piece
    for row, count in [*stretches, [-1, 0]]:  # the sentinel flushes the last loose ones
        if loose and (count >= least or count == 0):
            yield from _cut(loose, p, most, False)
            p += sum(c for _, c in loose)
            loose = []
        if count >= least:
            yield from _cut([[row, count]], p, most, True)
            p += count
        elif count:
            loose.append([row, count])


def _cut(parts: list[list[int]], p: int, most: int, in_place: bool) -> Iterator[Frame]:
    """These stretches, starting at position p of the piece, in even frames of at most `most` units."""
    total = sum(c for _, c in parts)
    pieces = -(-total // most)
    bounds = [total * i // pieces for i in range(pieces + 1)]
    for a, b in zip(bounds, bounds[1:]):
        yield Frame(p + a, p + b, _within(parts, a, b), in_place)


def _within(parts: list[list[int]], a: int, b: int) -> list[list[int]]:
    """The stretches that hold units [a, b) of these, in order."""
    out, p = [], 0
    for row, count in parts:
        lo, hi = max(a, p), min(b, p + count)
        if lo < hi:
            out.append([row + lo - p, hi - lo])
        p += count
    return out


def piece_frames(out: Outgoing, layers: range, blocks: range) -> Iterator[tuple[Frame, list]]:
    """The frames of a piece (these layers in these of the request's blocks) and the runs of the
    request's unit numbers each holds."""
    stretches = unit_stretches(out.pool.shape[2], out.src_blocks[blocks.start:blocks.stop], layers)
    for f in frame_plan(stretches, unit_bytes(out.pool)):
        yield f, number_runs(len(out.dst_blocks), layers, blocks, f.first, f.end)
