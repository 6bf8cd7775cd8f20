"""The zmq transport: the KV as KVChunk messages on the same ZeroMQ socket as the header, ahead of
it, each with one frame of 64 KiB..4 MiB (frames.py). Any hosts, any pool.

A frame whose units are consecutive in the pool is the pool's own memory (zero-copy on a CPU
pool), so the prefill worker keeps those blocks until zmq lets go of every such frame
(Handle.trackers); the rest is gathered into a new buffer first. The decode worker copies each
frame out of libzmq's receive buffer into its blocks as it arrives (libzmq cannot receive into a
buffer we choose).
"""

from __future__ import annotations

import warnings

import torch

from common import protocol as P
from common.kv_transport.base import Handle, Inbox, Outgoing, Receiver, Sender
from common.kv_transport.frames import piece_frames, unit_bytes, unit_view


def tensor_frame(t: torch.Tensor) -> memoryview:
    """A tensor's bytes for a zero-copy frame (any dtype; bfloat16 has no numpy twin)."""
    return memoryview(t.detach().cpu().contiguous().view(torch.uint8).numpy()).cast("B")


def frame_tensor(buf, dtype: torch.dtype, shape) -> torch.Tensor:
    """A received frame's buffer as a tensor, without copying (read-only: copy out before it is freed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is read-only
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class ZmqSender(Sender):
    """KVChunks, each frame straight from the pool where the request's blocks are consecutive
    (a fresh pool's mostly are): those frames are our blocks' own memory, so the prefill worker
    keeps the blocks until zmq is done with them (Handle.sent); the rest is gathered first."""
    name = "zmq"

    def __init__(self):
        self._pool: tuple = (None, None, None)  # the pool last sent from, its units, and its bytes on a CPU

    def _views(self, pool: torch.Tensor) -> tuple[torch.Tensor, memoryview | None]:
        """unit_view(pool) and, for a CPU pool, its bytes: in-place frames are slices of them. Kept
        for the next transfer (a worker has one pool): made on the way to the first byte, where
        caches are cold, they cost more than all the rest of the planning."""
        if self._pool[0] is not pool:
            units = unit_view(pool)
            aliased = units.device.type == "cpu" and units.is_contiguous()  # else tensor_frame would copy it
            self._pool = (pool, units, tensor_frame(units) if aliased else None)
        return self._pool[1], self._pool[2]

    def send(self, out: Outgoing, handle: Handle, layers: range, blocks: range) -> None:
        (units, pool_bytes), ub = self._views(out.pool), unit_bytes(out.pool)
        for frame, unit_runs in piece_frames(out, layers, blocks):
            if frame.in_place and pool_bytes is not None:
                row, count = frame.parts[0]
                buf = pool_bytes[row * ub:(row + count) * ub]
            else:
                buf = tensor_frame(frame.take(units))
            tracker = out.send(P.KVChunk(out.request_id, out.attempt, len(out.dst_blocks), unit_runs), [buf])
            if tracker is None:
                handle.failed = "the decode worker's socket takes no more KV chunks (its queue is full)"
                return
            if frame.in_place:
                handle.trackers.append(tracker)


class ZmqReceiver(Receiver):
    name = "zmq"

    def chunk(self, inbox: Inbox, msg: P.KVChunk, frames: list) -> None:
        if len(frames) != 1:
            return inbox.fail(f"a zmq KVChunk with {len(frames)} frames; expected 1")
        buf, ub = frames[0].buffer, unit_bytes(inbox.pool)
        if len(buf) == 0 or len(buf) % ub:
            return inbox.fail(f"a KV frame of {len(buf)} bytes; expected a positive multiple of {ub} "
                              "(one block of one layer's K or V)")
        inbox.put(msg.runs, frame_tensor(buf, inbox.pool.dtype, (len(buf) // ub, *inbox.pool.shape[3:])))

    def settle(self, inbox: Inbox) -> bool:
        inbox.fail_unless_complete()  # chunks travel ahead of the header on the same socket
        return True
