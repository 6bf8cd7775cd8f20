"""KV transports: how one request's KV moves from the prefill worker's pool into the blocks a
decode worker reserved for it. Every transport has the same shape:

    decode worker (Receiver)                     prefill worker (Sender)
    KVGrant(blocks, transports={name: advert}) -> choose(): the fastest both ends can use
                                                  open(), then send(layers, blocks) as often as
                                               <- the bytes, by the transport's own means
                                               <- KVTransfer(header, transport, transport_info)
    receiver.begin(inbox, info); once receiver.settle(inbox): start decoding, KVAck

A transfer is sent in pieces, each some layers' K and V in some of the request's blocks: all of
it at once after the prefill, or layer by layer while the forward pass runs (layer-wise
streaming, prefill_worker/worker.py). The pieces may come in any order; each unit once.

    zmq       KVChunk messages, each with one frame of 64 KiB..4 MiB, on the same socket ahead of
              the header, sent from the pool in place where blocks are consecutive. Any hosts.
    shm       the decode worker's pool lives in a shared-memory segment (common/kv_cache.py);
              the prefill maps it once and copies its blocks straight into the granted ones,
              then only the header crosses ZeroMQ. Same host, CPU pools.
    gloo      a two-rank torch.distributed group per prefill/decode pair, made on first use
              from a store the decode worker hosts. Each chunk is announced by a KVChunk without
              a frame that names its tag; the decode worker posts the receive into a staging
              buffer then, and copies it into its blocks. Any hosts, any pool (staged on the CPU).
    cuda_ipc  shm's shape for CUDA pools (the pool shared by a CUDA IPC handle).  } not run in
    nccl      gloo's shape for CUDA pools (NCCL backend, staging on the GPU).    } CI: no GPU

Both ends see a request's KV as units: one block of one layer's K or V, (block_size, kv_heads,
head_dim), contiguous in the pool. A request's units are numbered in (layer, K/V, block) order,
and a chunk lists the runs of unit numbers it holds.

shm and cuda_ipc are one-sided: the decode worker cannot tell when a writer is done, so blocks
granted by a decode worker that offers them come back only on word from the writer (KVTransfer
or KVRelease) or at the end of the lease; the prefill never starts writing past its own view of
the lease (measured from its request, so earlier than the decode worker's), checked as each copy
starts, not when it is queued.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import ctypes
import datetime
import functools
import itertools
import logging
import math
import os
import queue
import socket
import threading
import time
import types
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import torch

from common import protocol as P
from common.config import DTYPES, KV_TRANSPORT_DEVICE
from common.errors import PdserveError
from common.kv_cache import SharedSegment

log = logging.getLogger("pdserve.kv")

PREFERENCE = ("cuda_ipc", "shm", "nccl", "zmq", "gloo")  # fastest first (`pdserve bench transfer`)
assert set(PREFERENCE) == set(P.KV_TRANSPORTS) - {"auto"}
CHUNK_BYTES = 4 << 20  # largest frame or point-to-point message: pipelines, stays on the heap
MIN_FRAME_BYTES = 64 << 10  # shorter stretches are gathered: below this a copy costs less than a frame
HOSTNAME = socket.gethostname()


class TransportError(PdserveError):
    code = "TRANSFER_FAILED"


def offered(kv_transport: str, device: torch.device) -> list[str]:
    """The transports an engine on this device uses under --kv-transport, fastest first."""
    if kv_transport != "auto":
        return [kv_transport]
    return [t for t in PREFERENCE if KV_TRANSPORT_DEVICE.get(t, device.type) == device.type]


def choose(senders: dict[str, "Sender"], offer: dict, peer: str, forced: str = "auto") -> str:
    """The first of our senders (fastest first) that the peer offers and we can reach."""
    unusable = []
    for name, sender in senders.items():
        if name in offer:
            why = sender.unusable(offer[name])
            if why is None:
                return name
            unusable.append(f"{name}: {why}")
    ours = f"kv_transport={forced!r} is forced on this prefill worker" if forced != "auto" else \
        f"this prefill worker uses {list(senders)}"
    raise TransportError(f"no KV transport in common with decode worker {peer!r}: {ours}, it offers "
                         f"{sorted(offer)}" + (f" ({'; '.join(unusable)})" if unusable else ""))


def tune_malloc() -> None:
    """Keep MiB-sized buffers (zmq's receive buffers, gathered chunks) on the heap instead of a
    fresh mmap each: a fresh mapping is page-faulted in again on every transfer, which costs more
    than copying the bytes (measured on a 64 MB zmq transfer: ~5,000 faults, twice the receiver's
    CPU time). Process-wide; glibc only, elsewhere nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: glibc's largest
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: keep freed heap for the next transfer
    except (OSError, AttributeError):
        pass


# ----------------------------------------------------------------------------- units and frames

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


def copy_blocks(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int],
                layers: slice = slice(None)) -> None:
    """dst's blocks = src's blocks in these layers: one strided copy per run of consecutive ids
    on both sides (a fresh pool's blocks mostly are), no staging."""
    i, n = 0, len(src_blocks)
    while i < n:
        j = i + 1
        while j < n and src_blocks[j] == src_blocks[j - 1] + 1 and dst_blocks[j] == dst_blocks[j - 1] + 1:
            j += 1
        s, d = src_blocks[i], dst_blocks[i]
        dst[layers, :, d:d + j - i].copy_(src[layers, :, s:s + j - i])
        i = j


def written(t: torch.Tensor):
    """For a CUDA tensor, an event after the work queued so far on this thread's stream (the
    forward that wrote it), for a transport's own stream to wait on; None elsewhere. Waiting on
    this and not on the whole stream lets a streamed layer go before the later layers are done."""
    if t.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event


def on_stream(stream) -> contextlib.AbstractContextManager:
    """Run on this CUDA stream, from any thread (None: as is). The thread's device is set first, so
    that leaving the context does not switch the thread to GPU 0."""
    if stream is None:
        return contextlib.nullcontext()
    torch.cuda.set_device(stream.device)
    return torch.cuda.stream(stream)


def tensor_frame(t: torch.Tensor) -> memoryview:
    """A tensor's bytes for a zero-copy frame (any dtype; bfloat16 has no numpy twin)."""
    return memoryview(t.detach().cpu().contiguous().view(torch.uint8).numpy()).cast("B")


def frame_tensor(buf, dtype: torch.dtype, shape) -> torch.Tensor:
    """A received frame's buffer as a tensor, without copying (read-only: copy out before it is freed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is read-only
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class Inbox:
    """Where one request's KV goes on the decode side (these blocks of the pool), and which of its
    units have arrived."""

    def __init__(self, pool: torch.Tensor, block_ids: list[int]):
        self.pool, self.block_ids = pool, list(block_ids)
        self.num_units = pool.shape[0] * 2 * len(block_ids)
        self.arrived = bytearray(self.num_units)
        self.error: str | None = None
        self.pending: list[tuple[list, concurrent.futures.Future]] = []  # gloo/nccl: (runs, staging's receipt)
        self.pair: str = ""
        self._stretches: list[list[int]] | None = None  # unit_stretches of the whole transfer
        self._starts: list[int] = []  # the unit number each of them begins with

    @property
    def complete(self) -> bool:
        return self.num_units > 0 and self.arrived.find(0) == -1

    def fail(self, why: str) -> None:
        self.error = self.error or why

    def check(self, unit_runs: list) -> int | None:
        """How many units these [first, count] runs hold, or None (and the inbox failed) if any
        is malformed, outside this transfer or already arrived."""
        total = 0
        for r in unit_runs:
            if not (isinstance(r, list) and len(r) == 2 and r[1] > 0 and 0 <= r[0] and r[0] + r[1] <= self.num_units):
                self.fail(f"KV unit run {repr(r)[:40]} is not [first, count] inside this transfer's "
                          f"[0, {self.num_units})")
                return None
            if self.arrived.find(1, r[0], r[0] + r[1]) != -1:
                self.fail(f"KV units [{r[0]}, {r[0] + r[1]}) arrived twice")
                return None
            total += r[1]
        if not total:
            self.fail("a KV chunk with no units")
            return None
        return total

    def put(self, unit_runs: list, units: torch.Tensor) -> None:
        """Write these runs of units, in order, from units (as many rows as the runs hold)."""
        if self.check(unit_runs) != units.shape[0]:
            return self.fail(self.error or f"KV unit runs of {sum(r[1] for r in unit_runs)} units with "
                                           f"{units.shape[0]} units of data")
        if self._stretches is None:
            self._stretches = unit_stretches(self.pool.shape[2], self.block_ids, range(self.pool.shape[0]))
            self._starts = list(itertools.accumulate((c for _, c in self._stretches), initial=0))
        pool, src, k = unit_view(self.pool), units.to(self.pool.device), 0
        for first, count in unit_runs:
            i, u = bisect.bisect_right(self._starts, first) - 1, first
            while u < first + count:  # one plain copy per stretch of consecutive rows
                row, held = self._stretches[i]
                skip = u - self._starts[i]
                take = min(held - skip, first + count - u)
                pool[row + skip:row + skip + take].copy_(src[k:k + take])
                i, u, k = i + 1, u + take, k + take
            self.arrived[first:first + count] = b"\x01" * count

    def put_all(self) -> None:
        """The bytes were written straight into the pool by the peer (one-sided transports)."""
        self.arrived[:] = b"\x01" * self.num_units


def _failure(f: concurrent.futures.Future | None) -> str | None:
    if f is None or not f.done():
        return None
    if f.cancelled():
        return "cancelled: its pair was closed"
    return None if f.exception() is None else f"{type(f.exception()).__name__}: {f.exception()}"


@dataclass
class Outgoing:
    """One request's KV to send, prefill side."""
    request_id: str
    attempt: int
    pool: torch.Tensor
    src_blocks: list[int]
    dst_blocks: list[int]
    advert: dict  # what the decode worker advertised for this transport
    send: Callable[[object, list], object]  # a message and frames to the decode worker: a Released, or None
    write_by: float = math.inf  # time.monotonic() after which no copy into the peer's blocks may start (its lease)


@dataclass(eq=False)
class Handle:
    """A transfer under way, prefill side."""
    info: dict = field(default_factory=dict)  # for KVTransfer.transport_info
    futures: list = field(default_factory=list)  # point-to-point sends, shm/cuda_ipc copies: done once delivered
    trackers: list = field(default_factory=list)  # zmq: one per frame sent in place from the pool
    failed: str | None = None  # a send that failed half way (some bytes may be under way)
    peer: object = None  # what the sends go into: the peer's pool (shm, cuda_ipc), the pair (gloo, nccl)

    def sent(self) -> bool:
        """Nothing reads our blocks for this transfer any more: they may be reused."""
        return all(f.done() for f in self.futures) and all(t.done for t in self.trackers)

    def error(self) -> str | None:
        if self.failed is None:
            self.failed = next((why for why in map(_failure, self.futures) if why is not None), None)
        return self.failed


# ----------------------------------------------------------------------------- interfaces

class Sender:
    """Prefill side of a transport: one per worker, for all its decode peers."""
    name = ""

    def unusable(self, advert: dict) -> str | None:
        """Why the peer that advertised this cannot be reached from here, or None."""
        return None

    def open(self, out: Outgoing) -> Handle:
        """Get ready to send this request's KV. Raises TransportError if it cannot be sent."""
        return Handle()

    def send(self, out: Outgoing, handle: Handle, layers: range, blocks: range) -> None:
        """Set moving the units of these layers in these of the request's blocks (indices into
        out.src_blocks and out.dst_blocks). A failure is the handle's error()."""
        raise NotImplementedError

    def finish(self, handle: Handle) -> None:
        """Return once the header may follow what was sent: for one-sided transports, once every
        byte is in place (the header says so); for the others at once (the bytes go ahead of it)."""

    def forget(self, advert: dict) -> None:
        """The peer is gone: drop what we hold for it."""

    def close(self) -> None:
        pass


class Receiver:
    """Decode side of a transport: one per worker, for all its prefill peers."""
    name = ""
    one_sided = False  # peers write our blocks themselves (see the module docstring)

    def advert(self) -> dict:
        return {}

    def chunk(self, inbox: Inbox, msg: P.KVChunk, frames: list) -> None:
        """A KVChunk: take its units in (or fail the inbox)."""
        inbox.fail(f"a KVChunk by {self.name}, which sends none")

    def drop(self, msg: P.KVChunk) -> None:
        """A chunk that no transfer takes (late, cancelled, failed): let it go."""

    def begin(self, inbox: Inbox, info: dict) -> None:
        """The header arrived: every chunk was sent ahead of it."""

    def settle(self, inbox: Inbox) -> bool:
        """True once the KV is in the pool, or the inbox failed."""
        return True

    def poll(self, now: float) -> None:
        pass

    def close(self) -> None:
        pass


def _check_complete(inbox: Inbox) -> None:
    if not inbox.complete:
        inbox.fail(f"only {inbox.num_units - inbox.arrived.count(0)} of {inbox.num_units} KV units arrived")


def _piece(out: Outgoing, layers: range, blocks: range) -> Iterator[tuple[Frame, list]]:
    """The frames of a piece and the runs of the request's unit numbers each holds."""
    stretches = unit_stretches(out.pool.shape[2], out.src_blocks[blocks.start:blocks.stop], layers)
    for f in frame_plan(stretches, unit_bytes(out.pool)):
        yield f, number_runs(len(out.dst_blocks), layers, blocks, f.first, f.end)


# ----------------------------------------------------------------------------- zmq

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
        for frame, unit_runs in _piece(out, layers, blocks):
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
        _check_complete(inbox)  # chunks travel ahead of the header on the same socket
        return True


# ----------------------------------------------------------------------------- shm, cuda_ipc

class MappedSender(Sender):
    """Writes straight into a peer's pool mapped into this process (shm, cuda_ipc), from a thread
    of its own, so that a streamed transfer's copies overlap the forward pass."""

    def __init__(self):
        self.maps: dict[str, object] = {}  # advert key -> mapping holding .tensor
        self.copier = JobThread(f"pdserve-kv-{self.name}")

    def _key(self, advert: dict) -> str:
        raise NotImplementedError

    def _map(self, advert: dict):
        raise NotImplementedError

    def _mapped(self, advert: dict):
        key = self._key(advert)
        if key not in self.maps:
            for gone in [k for k in self.maps if self._gone(k)]:  # a restarted peer's old pool
                self.forget_key(gone)
            self.maps[key] = self._map(advert)
        return self.maps[key]

    def _gone(self, key: str) -> bool:
        return False

    def unusable(self, advert: dict) -> str | None:
        if advert.get("host") != HOSTNAME:
            return f"its pool is on host {advert.get('host')!r}, this is {HOSTNAME!r}"
        try:
            self._mapped(advert)
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
            return f"cannot map its pool ({type(e).__name__}: {e})"
        return None

    def open(self, out: Outgoing) -> Handle:
        peer = self._mapped(out.advert).tensor
        if peer.shape[3:] != out.pool.shape[3:] or peer.shape[:2] != out.pool.shape[:2] or peer.dtype != out.pool.dtype:
            raise TransportError(f"peer pool {tuple(peer.shape)} {peer.dtype} does not match ours "
                                 f"{tuple(out.pool.shape)} {out.pool.dtype} but for the block count")
        if not 0 <= min(out.dst_blocks) <= max(out.dst_blocks) < peer.shape[2]:
            raise TransportError(f"granted blocks {out.dst_blocks} are outside the peer pool of {peer.shape[2]}")
        return Handle({"key": self._key(out.advert)}, peer=peer)

    def send(self, out: Outgoing, handle: Handle, layers: range, blocks: range) -> None:
        b, peer, after = slice(blocks.start, blocks.stop), handle.peer, written(out.pool)

        def copy():
            if time.monotonic() > out.write_by:  # queued too long: the blocks may be someone else's by now
                raise TransportError("the grant's lease ended before this copy could start")
            with torch.inference_mode(), self._copying(out.pool.device, peer.device, after):  # as the forward
                copy_blocks(out.pool, out.src_blocks[b], peer, out.dst_blocks[b], slice(layers.start, layers.stop))
        handle.futures.append(self.copier.submit(copy))

    def finish(self, handle: Handle) -> None:
        concurrent.futures.wait(handle.futures)

    def _copying(self, ours: torch.device, peers: torch.device, after) -> contextlib.AbstractContextManager:
        """Where the copies run, once `after` (written()) is reached; they are complete when it exits."""
        return contextlib.nullcontext()

    def forget(self, advert: dict) -> None:
        try:
            self.forget_key(self._key(advert))
        except (KeyError, TypeError, IndexError):
            pass

    def forget_key(self, key: str) -> None:
        mapping = self.maps.pop(key, None)
        if mapping is not None and hasattr(mapping, "close"):
            mapping.close()

    def close(self) -> None:
        self.copier.shutdown()
        for key in list(self.maps):
            self.forget_key(key)


class MappedReceiver(Receiver):
    one_sided = True

    def __init__(self, advert: dict):
        self._advert = dict(advert, host=HOSTNAME)

    def advert(self) -> dict:
        return self._advert

    def begin(self, inbox: Inbox, info: dict) -> None:
        if info.get("key") != self.key:
            return inbox.fail(f"{self.name} transfer into {info.get('key')!r}; this pool is {self.key!r}")
        inbox.put_all()


class ShmSender(MappedSender):
    name = "shm"

    def _key(self, advert: dict) -> str:
        return advert["segment"]

    def _map(self, advert: dict) -> SharedSegment:
        return SharedSegment.attach(advert["segment"], bytes.fromhex(advert["nonce"]), tuple(advert["shape"]),
                                    DTYPES[advert["dtype"]])

    def _gone(self, key: str) -> bool:
        return not os.path.exists(f"/proc/{SharedSegment.creator(key)}")


class ShmReceiver(MappedReceiver):
    name = "shm"

    def __init__(self, pool: torch.Tensor, segment: SharedSegment, dtype: str):
        self.key = segment.name
        super().__init__({"segment": segment.name, "nonce": segment.nonce.hex(), "shape": list(pool.shape),
                          "dtype": dtype})


class CudaIpcSender(MappedSender):
    """Not run in CI (no GPU): the pool opened from its CUDA IPC handle, as torch.multiprocessing does."""
    name = "cuda_ipc"

    def __init__(self):
        super().__init__()
        self.streams: dict[torch.device, torch.cuda.Stream] = {}  # used on the copier thread only

    def _key(self, advert: dict) -> str:
        return advert["ipc"][7].hex()  # the allocation's IPC handle

    def _map(self, advert: dict):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        a = advert["ipc"]
        return types.SimpleNamespace(tensor=rebuild_cuda_tensor(
            torch.Tensor, torch.Size(a[1]), tuple(a[2]), a[3], torch.storage.TypedStorage, DTYPES[a[5]], *a[6:10],
            False, *a[11:]))

    @contextlib.contextmanager
    def _copying(self, ours: torch.device, peers: torch.device, after):
        """On a stream of our own, so that a streamed layer's copy waits for that layer only and the
        forward's later layers do not wait for it. A copy to another GPU runs on the source's stream,
        but without peer access ends on the peer device's current stream (torch copies through a
        temporary there), which nothing else of ours uses: both streams' ends are the copies' end,
        also when one failed (the blocks are handed back after this)."""
        if ours not in self.streams:
            self.streams[ours] = torch.cuda.Stream(ours)
        stream = self.streams[ours]
        stream.wait_event(after)
        try:
            with on_stream(stream):
                yield
        finally:
            stream.synchronize()
            if peers != ours:
                torch.cuda.current_stream(peers).synchronize()


class CudaIpcReceiver(MappedReceiver):
    name = "cuda_ipc"

    def __init__(self, pool: torch.Tensor, dtype: str):
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(pool)
        ipc = [None, list(args[1]), list(args[2]), args[3], None, dtype, *args[6:10], False, *args[11:]]
        self.key = ipc[7].hex()
        super().__init__({"ipc": ipc})


# ----------------------------------------------------------------------------- gloo, nccl

class JobThread:
    """One daemon thread that runs jobs in order. Not a ThreadPoolExecutor: the interpreter joins
    those at exit, so a connect stuck on a peer that never came would hold up our exit."""

    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """A future of fn(*args); cancelled at once if the thread was shut down."""
        future = concurrent.futures.Future()
        if self.closed:
            future.cancel()
        else:
            self.jobs.put((future, fn, args))
        return future

    def _loop(self):
        while (job := self.jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:
                    future.set_exception(e)

    def shutdown(self):
        """Cancel the jobs not started; the thread ends after the one running, if any."""
        self.closed = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self.jobs.put(None)


class Pair:
    """One two-rank process group between a decode worker (rank 0) and a prefill worker (rank
    1), made from a TCPStore that the decode worker hosts, and two threads that use it: one
    connects, then posts chunks' sends (or receives) in order, each under a tag of its own,
    without waiting; the other waits for them in order, so that chunks are in flight together.
    The decode worker receives every well-formed chunk announced on a working pair, even for a
    transfer given up on either side, so the two stay in step; a chunk that fails (a peer died,
    the group's timeout, a chunk never received) breaks the pair, and the prefill worker makes a
    new one, which replaces it on the decode side too. Closed then, on a transfer timeout, or
    when either worker stops; a closed pair is never reopened."""

    def __init__(self, pair_id: str, backend: str, rank: int, host: str, timeout_s: float,
                 store: Callable[[], object], device: torch.device):
        self.id, self.backend, self.device = pair_id, backend, device
        self.pg = None
        self.closed = self.broken = False
        self.last_used = time.monotonic()
        self.poster, self.waiter = JobThread(f"pdserve-kv-{backend}-post"), JobThread(f"pdserve-kv-{backend}-wait")
        self._tags = itertools.count()
        # NCCL: posts on a stream of our own and waits on another (so a wait covers its chunk alone,
        # not the posts queued after it). On the default stream, work.wait() would make every later
        # decode step wait for this transfer, which a streamed one may take long.
        nccl = backend == "nccl"
        self.stream, self.wait_stream = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if nccl else (None, None)
        self.connected = self.poster.submit(self._connect, rank, host, timeout_s, store)

    def _connect(self, rank, host, timeout_s, store):
        from torch.distributed import PrefixStore

        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = PrefixStore(f"pdserve/kv/{self.id}", store())
        if self.backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            torch.cuda.set_device(self.device)
            opts = ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = ProcessGroupNCCL(prefixed, rank, 2, opts)
        else:
            from torch.distributed import ProcessGroupGloo

            opts = ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
            pg = ProcessGroupGloo(prefixed, rank, 2, opts)
        self.pg = pg
        if self.closed:
            self.close()

    def next_tag(self) -> int:
        return next(self._tags) % 2**31

    def transfer(self, make: Callable[[], torch.Tensor], tag: int, after=None) -> concurrent.futures.Future:
        """Post this rank's half of one chunk, the tensor make() gives (on the posting thread:
        staging or gathering overlaps the chunks before it), once `after` (written()) is reached;
        a future of that tensor, done once the chunk went through."""
        self.last_used = time.monotonic()

        def post():
            self.connected.result()
            if self.pg is None:
                raise TransportError(f"{self.backend} pair {self.id} is closed")
            if after is not None and self.stream is None:
                after.synchronize()  # gloo from a CUDA pool
            with on_stream(self.stream):
                if after is not None and self.stream is not None:
                    self.stream.wait_event(after)
                tensor = make()
                op = self.pg.send if self.pg.rank() == 1 else self.pg.recv
                return tensor, op([tensor], 1 - self.pg.rank(), tag)

        def wait():
            tensor, work = posted.result()
            with on_stream(self.wait_stream):
                work.wait()  # NCCL: our waiting stream waits for the transfer; gloo: we do
            if self.wait_stream is not None:
                self.wait_stream.synchronize()
            return tensor
        posted = self.poster.submit(post)
        future = self.waiter.submit(wait)
        future.add_done_callback(lambda f: f.cancelled() or f.exception() is None or setattr(self, "broken", True))
        return future

    def close(self) -> None:
        self.closed = True
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()  # a send or receive still waiting fails at once
            except Exception as e:  # the group may be half made or already broken
                log.debug("aborting %s pair %s: %s", self.backend, self.id, e)
        self.poster.shutdown()
        self.waiter.shutdown()


class GroupSender(Sender):
    name = "gloo"
    backend = "gloo"

    def __init__(self, worker_id: str, host: str, timeout_s: float, device: torch.device):
        self.worker_id, self.host, self.timeout_s, self.device = worker_id, host, timeout_s, device
        self.pairs: dict[tuple, Pair] = {}

    def unusable(self, advert: dict) -> str | None:
        if not (isinstance(advert.get("host"), str) and isinstance(advert.get("port"), int)):
            return f"advertisement {advert!r} has no host and port"
        return None

    def _pair(self, advert: dict) -> Pair:
        key = (advert["host"], advert["port"])
        pair = self.pairs.get(key)
        if pair is not None and pair.broken:
            pair.close()
            pair = None
        if pair is None:
            from torch.distributed import TCPStore

            timeout = datetime.timedelta(seconds=self.timeout_s)
            pair = Pair(f"{self.worker_id}/{uuid.uuid4().hex[:12]}", self.backend, 1, self.host, self.timeout_s,
                        lambda: TCPStore(key[0], key[1], None, False, timeout), self.device)
            self.pairs[key] = pair
        return pair

    def open(self, out: Outgoing) -> Handle:
        pair = self._pair(out.advert)
        return Handle({"pair": pair.id}, peer=pair)

    def send(self, out: Outgoing, handle: Handle, layers: range, blocks: range) -> None:
        pair, units = handle.peer, unit_view(out.pool)
        if pair.closed or pair.broken:  # by another transfer's failure: nothing more goes on it
            handle.failed = handle.failed or f"{self.name} pair {pair.id} broke during this transfer"
            return
        after = written(out.pool)
        for frame, unit_runs in _piece(out, layers, blocks):
            tag = pair.next_tag()
            announce = P.KVChunk(out.request_id, out.attempt, len(out.dst_blocks), unit_runs, self.name,
                                 {"pair": pair.id, "tag": tag})
            if out.send(announce, []) is None:
                handle.failed = "the decode worker's socket takes no more KV chunks (its queue is full)"
                return
            handle.futures.append(pair.transfer(functools.partial(self._take, frame, units), tag, after))

    def _take(self, frame: Frame, units: torch.Tensor) -> torch.Tensor:
        return self._stage(frame.take(units))

    def _stage(self, chunk: torch.Tensor) -> torch.Tensor:
        return chunk.cpu()  # in place on a CPU pool

    def forget(self, advert: dict) -> None:
        pair = self.pairs.pop((advert.get("host"), advert.get("port")), None)
        if pair is not None:
            pair.close()

    def close(self) -> None:
        for key in list(self.pairs):
            self.pairs.pop(key).close()


class GroupReceiver(Receiver):
    name = "gloo"
    backend = "gloo"
    IDLE_S = 600.0  # a pair unused this long is closed (its prefill worker may be gone)

    def __init__(self, host: str, timeout_s: float, pool: torch.Tensor, wake: Callable[[], None]):
        from torch.distributed import TCPStore

        self.host, self.timeout_s, self.device, self.wake = host, timeout_s, pool.device, wake
        self.unit_shape, self.dtype, self.max_units = pool.shape[3:], pool.dtype, pool.shape[0] * 2 * pool.shape[2]
        sock = socket.socket()
        sock.bind((host, 0))  # our own socket: TCPStore would listen on every interface
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self.store = TCPStore(host, self.port, None, True, datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=sock.detach())
        self.pairs: dict[str, Pair] = {}
        self.closed_pairs: collections.deque = collections.deque(maxlen=1024)  # ids never to reopen

    def advert(self) -> dict:
        return {"host": self.host, "port": self.port}

    def chunk(self, inbox: Inbox, msg: P.KVChunk, frames: list) -> None:
        pair_id = msg.transport_info.get("pair")
        if frames:
            inbox.fail(f"a {self.name} KVChunk with {len(frames)} frames; expected none")
        elif inbox.pair and inbox.pair != pair_id:
            inbox.fail(f"{self.name} chunks of one transfer over pairs {inbox.pair} and {pair_id}")
        count = inbox.check(msg.runs) if inbox.error is None else None
        if count is None:
            return self.drop(msg)
        future = self._receive(msg, count)
        if future is None:
            return inbox.fail(f"{self.name} KVChunk transport_info {repr(msg.transport_info)[:80]} is not "
                              f"{{pair: str, tag: int}} of a working pair")
        inbox.pair = pair_id
        inbox.pending.append((msg.runs, future))

    def drop(self, msg: P.KVChunk) -> None:
        """An announced chunk that no transfer takes (cancelled, failed): receive it anyway, into
        scratch, or its send would wait, and break the pair, when it times out."""
        count = sum(r[1] for r in msg.runs if isinstance(r, list) and len(r) == 2 and r[1] > 0)
        if 0 < count <= self.max_units:
            self._receive(msg, count)

    def _receive(self, msg: P.KVChunk, count: int) -> concurrent.futures.Future | None:
        pair_id, tag = msg.transport_info.get("pair"), msg.transport_info.get("tag")
        if not (isinstance(pair_id, str) and "/" in pair_id and isinstance(tag, int)):
            return None
        if pair_id in self.closed_pairs:  # a late chunk on a pair that broke: its sender fails too
            return None
        pair = self.pairs.get(pair_id) or self._open(pair_id)
        if pair.broken:  # its sender's side fails too, and makes a new pair
            return None
        shape, dtype, device = self.unit_shape, self.dtype, self._staging_device()
        future = pair.transfer(lambda: torch.empty((count, *shape), dtype=dtype, device=device), tag)
        future.add_done_callback(lambda _: self.wake())
        return future

    def _staging_device(self) -> torch.device:
        return torch.device("cpu")

    def _open(self, pair_id: str) -> Pair:
        worker = pair_id.rsplit("/", 1)[0]
        for old in [p for p in self.pairs if p.rsplit("/", 1)[0] == worker]:  # its earlier pair broke
            self._close(old)
        pair = self.pairs[pair_id] = Pair(pair_id, self.backend, 0, self.host, self.timeout_s, lambda: self.store,
                                          self.device)
        return pair

    def settle(self, inbox: Inbox) -> bool:
        while inbox.pending and inbox.pending[0][1].done():
            unit_runs, f = inbox.pending.pop(0)
            why = _failure(f)
            if why is not None:
                inbox.fail(f"{self.name} receive failed: {why}")
                inbox.pending.clear()  # the pair is closed: the rest fail too
                self._close(inbox.pair)
            elif inbox.error is None:
                staged = f.result()
                inbox.put(unit_runs, staged)
                if staged.is_cuda:  # made on the pair's stream, read on ours: not to be reused before
                    staged.record_stream(torch.cuda.current_stream(staged.device))
        if inbox.pending:
            return False
        _check_complete(inbox)
        return True

    def poll(self, now: float) -> None:
        for pair_id, pair in list(self.pairs.items()):
            if now - pair.last_used > self.IDLE_S:
                self._close(pair_id)

    def _close(self, pair_id: str) -> None:
        pair = self.pairs.pop(pair_id, None)
        if pair is not None:
            pair.close()
            self.closed_pairs.append(pair_id)

    def close(self) -> None:
        for pair_id in list(self.pairs):
            self._close(pair_id)
        self.store = None


class NcclSender(GroupSender):
    """Not run in CI (no GPU): gloo's shape with chunks staged on the GPU."""
    name = backend = "nccl"

    def _stage(self, chunk: torch.Tensor) -> torch.Tensor:
        return chunk


class NcclReceiver(GroupReceiver):
    name = backend = "nccl"

    def _staging_device(self) -> torch.device:
        return self.device


# ----------------------------------------------------------------------------- construction

def make_senders(names: list[str], worker_id: str, host: str, timeout_s: float,
                 device: torch.device) -> dict[str, Sender]:
    """Senders for these transports, in the order given (fastest first)."""
    make = {"zmq": ZmqSender, "shm": ShmSender, "cuda_ipc": CudaIpcSender,
            "gloo": lambda: GroupSender(worker_id, host, timeout_s, device),
            "nccl": lambda: NcclSender(worker_id, host, timeout_s, device)}
    return {name: make[name]() for name in names}


def make_receivers(names: list[str], pool: torch.Tensor, segment: SharedSegment | None, dtype: str, host: str,
                   timeout_s: float, required: bool, wake: Callable[[], None] = lambda: None) -> dict[str, Receiver]:
    """Receivers for these transports into this pool. One that cannot be set up here (shm without
    a shared pool, a store that cannot bind) is left out with a warning, or raises if required.
    wake() is called from another thread when a receive there finishes (gloo, nccl)."""
    receivers = {}
    for name in names:
        try:
            if name == "zmq":
                receivers[name] = ZmqReceiver()
            elif name == "shm":
                if segment is None:
                    raise TransportError("the KV pool is not in shared memory (kv_shared=False)")
                receivers[name] = ShmReceiver(pool, segment, dtype)
            elif name == "cuda_ipc":
                receivers[name] = CudaIpcReceiver(pool, dtype)
            else:
                cls = GroupReceiver if name == "gloo" else NcclReceiver
                receivers[name] = cls(host, timeout_s, pool, wake)
        except (TransportError, OSError, RuntimeError) as e:
            if required:
                raise TransportError(f"kv_transport={name!r} cannot receive here: {e}") from e
            log.warning("not offering the %s KV transport: %s", name, e)
    return receivers
