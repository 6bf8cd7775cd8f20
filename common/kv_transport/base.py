"""The KV transports' interface: what a Sender and a Receiver do, and what they pass (Outgoing,
Handle, Inbox). The package's __init__ says how a transfer goes and chooses the transport; each
transport is a module of its own beside this one."""

from __future__ import annotations

import bisect
import concurrent.futures
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from common import protocol as P
from common.errors import PdserveError
from common.kv_transport.frames import unit_stretches, unit_view
from common.kv_transport.jobs import failure


class TransportError(PdserveError):
    code = "TRANSFER_FAILED"


# ----------------------------------------------------------------------------- what the interface passes

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
    queued_on: object = None  # cuda_ipc to a peer on our GPU: the stream its copies are queued on, unsynchronised
    copied: object = None  # and the event finish() recorded after them there
    checked: int = 0  # the leading futures error() found done (well: else it failed)

    def sent(self) -> bool:
        """Nothing reads our blocks for this transfer any more: they may be reused."""
        return (all(f.done() for f in self.futures) and all(t.done for t in self.trackers)
                and (self.copied is None or self.copied.query()))

    def error(self) -> str | None:
        """Why a send failed, or None: asked after every piece, so each future done well is looked
        at once (a rescan of them all cost a 16-layer stream some 170 us a prefill)."""
        futures = self.futures
        while self.failed is None and self.checked < len(futures) and futures[self.checked].done():
            self.failed = failure(futures[self.checked])
            self.checked += 1
        if self.failed is None:  # past one still running, a later one may have failed already
            self.failed = next((why for why in map(failure, futures[self.checked:]) if why is not None), None)
        return self.failed


class Inbox:
    """Where one request's KV goes on the decode side (these blocks of the pool), and which of its
    units have arrived."""

    def __init__(self, pool: torch.Tensor, block_ids: list[int]):
        self.pool, self.block_ids = pool, list(block_ids)
        self.num_units = pool.shape[0] * 2 * len(block_ids)
        self.arrived = bytearray(self.num_units)
        self.error: str | None = None
        self.pending: list[tuple[list, concurrent.futures.Future]] = []  # gloo/nccl: (runs, staging's receipt)
        self.fence = None  # cuda_ipc: the writer's event after its copies; the KV is in place once it completed
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

    def writing(self) -> bool:
        """Whether the writer's copies may still be under way (cuda_ipc: its event has not completed).
        An event that cannot be read any more fails the transfer: its writer died, its copies with it."""
        if self.fence is None:
            return False
        try:
            if not self.fence.query():
                return True
        except RuntimeError as e:
            self.fail(f"the writer's completion event failed ({e})")
        self.fence = None
        return False

    def put_all(self) -> None:
        """The bytes were written straight into the pool by the peer (one-sided transports)."""
        self.arrived[:] = b"\x01" * self.num_units

    def fail_unless_complete(self) -> None:
        """For a transport whose header follows every byte: what has not arrived never will."""
        if not self.complete:
            self.fail(f"only {self.num_units - self.arrived.count(0)} of {self.num_units} KV units arrived")


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

    def finish(self, handle: Handle, release: bool = False) -> None:
        """Return once the header may follow what was sent: for one-sided transports, once every
        byte is in place or the header carries what says when (cuda_ipc's event); for the others at
        once (the bytes go ahead of it). release: no header follows but KVRelease, which says that
        nothing writes the peer's blocks any more: return only once that is so."""

    def forget(self, advert: dict) -> None:
        """The peer is gone: drop what we hold for it."""

    def sweep(self) -> None:
        """Drop what we hold for peers found gone without being told (the worker's tick calls it)."""

    def close(self) -> None:
        pass


class Receiver:
    """Decode side of a transport: one per worker, for all its prefill peers."""
    name = ""
    one_sided = False  # peers write our blocks themselves (see common/kv_transport/__init__.py)
    polled = False  # settle() turns true with nothing to wake the worker (cuda_ipc's event): poll without sleeping

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

    def fence(self, info: dict):
        """What says when the writer of a header with this transport_info is done writing our blocks,
        if it may not be yet (cuda_ipc's event, polled by Inbox.writing), else None."""
        return None

    def poll(self, now: float) -> None:
        pass

    def close(self) -> None:
        pass

