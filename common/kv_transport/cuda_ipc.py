"""The cuda_ipc transport: shm's shape for CUDA pools (mapped.py). The decode worker's pool is
shared by its CUDA IPC handle, as torch.multiprocessing shares a tensor; the prefill worker opens
it once per peer and pool and copies its blocks into the granted ones on a stream of its own, in
one launch per piece (block_copy.py).
Same host, CUDA pools. Not run in CI (no GPU): its tests are marked gpu.

To a peer on the same GPU (the common case: workers sharing one), nothing waits on the host. Each
piece's copy is queued from the caller's thread on our stream, behind the forward pass that wrote
its layer (an event, not a synchronisation); the header carries an IPC event recorded after the
last copy, and the decode worker polls it (Inbox.writing) before it decodes from those blocks or
gives them back. It polls, and does not make its stream wait on the event: a wait on the event of
a writer that died before its copies ended may never end, a poll ends with the lease. Nor does it
trust an event whose writer has exited (CUDA leaves it undefined): decode_worker/worker.py refuses
such a transfer (Reservation.writer_gone) however the event reads. Our source
blocks are reused once the peer acknowledged (it saw the event complete), or, for a transfer
given up, once finish(release=True) waited for the event on the host before KVRelease. Events come
from a ring per device (RING); one recorded again before a peer polled it only makes that peer
wait for later copies as well. The first header to a pool also lists the whole ring, which the
decode worker opens on its next tick, after that transfer's own: no later transfer waits for its
event to be opened (a ring's worth of transfers would otherwise each open one). A copy queued
before the lease's end may run on the GPU after it: the GPU runs behind the host by a step or
two, well inside the lease's margin (prefill_worker/worker.py: LEASE_MARGIN_S).
A peer on another GPU, in this process (an IPC event cannot be opened where it was made), or that
does not say in its advert that it polls events, is copied to from the transport's thread, which
synchronises before the header goes.

A pool opened in this process stays allocated on the device while it is open, even after its
decode worker died: the advert carries the worker's pid, and a restarted peer's old pool is closed
within a second by the prefill worker's tick (mapped.py: sweep), or the restarted worker would
find its memory still taken.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import types

import torch

from common.config import dtype_of
from common.errors import first_line
from common.kv_transport.base import Handle, Inbox, Outgoing
from common.kv_transport.block_copy import warm_up
from common.kv_transport.jobs import on_stream
from common.kv_transport.mapped import MappedReceiver, MappedSender, process_gone

log = logging.getLogger(__name__)

RING = 64  # completion events per device, recorded in turn
OPENED = 1024  # a decode worker keeps this many of its writers' events open (a few rings)


class CudaIpcSender(MappedSender):
    """Not run in CI (no GPU): the pool opened from its CUDA IPC handle, as torch.multiprocessing does."""
    name = "cuda_ipc"

    def __init__(self):
        super().__init__()
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.rings: dict[torch.device, itertools.cycle] = {}  # device -> (event, its IPC handle), in turn
        self.ring_handles: dict[torch.device, list[bytes]] = {}  # each ring's handles, in order
        self.ringed: set[str] = set()  # pools whose worker was sent our ring's handles

    def _key(self, advert: dict) -> str:
        return advert["ipc"][7].hex()  # the allocation's IPC handle

    def _map(self, advert: dict):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        a = advert["ipc"]
        pool = rebuild_cuda_tensor(torch.Tensor, torch.Size(a[1]), tuple(a[2]), a[3], torch.storage.TypedStorage,
                                   dtype_of(a[5]), *a[6:10], False, *a[11:])
        warm_up(pool)  # the copy kernel compiles at pairing, not in the first transfer
        return types.SimpleNamespace(tensor=pool, pid=advert.get("pid"))

    def forget_key(self, key: str) -> None:
        super().forget_key(key)
        self.ringed.discard(key)

    def _gone(self, key: str) -> bool:
        pid = getattr(self.maps.get(key), "pid", None)
        return pid is not None and process_gone(pid)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        return self.streams.get(device) or self.streams.setdefault(device, torch.cuda.Stream(device))

    def _ring(self, device: torch.device):
        """This device's completion events, made at the first transfer queued on it; None (and the
        host waits, as to another GPU) where interprocess events cannot be made."""
        if device not in self.rings:
            try:
                with torch.cuda.device(device):
                    events = [torch.cuda.Event(interprocess=True) for _ in range(RING)]
                    self.ring_handles[device] = [e.ipc_handle() for e in events]
                    self.rings[device] = itertools.cycle(zip(events, self.ring_handles[device]))
            except RuntimeError as e:
                log.warning("cuda_ipc on %s waits for its copies on the host: no interprocess events (%s)",
                            device, first_line(e))
                self.rings[device] = None
        return self.rings[device]

    def open(self, out: Outgoing) -> Handle:
        handle = super().open(out)
        ours = out.pool.device
        if (handle.peer.device == ours and self.maps[handle.info["key"]].pid not in (None, os.getpid())
                and out.advert.get("events") and self._ring(ours) is not None):
            handle.queued_on = self._stream(ours)
        return handle

    def finish(self, handle: Handle, release: bool = False) -> None:
        super().finish(handle)
        stream = handle.queued_on
        if stream is None:
            return
        event, ipc = next(self.rings[stream.device])
        event.record(stream)
        handle.copied, handle.info["event"] = event, ipc
        if handle.info["key"] not in self.ringed:  # (a header refused unread: its peer opens them one by one)
            self.ringed.add(handle.info["key"])
            handle.info["ring"] = self.ring_handles[stream.device]
        if release:
            event.synchronize()

    @contextlib.contextmanager
    def _copying(self, ours: torch.device, peers: torch.device, after, queued_on):
        """On a stream of our own, so that a streamed layer's copy waits for that layer only and the
        forward's later layers do not wait for it. Queued there (queued_on), or complete when this
        exits: a copy to another GPU runs on the source's stream, but without peer access ends on
        the peer device's current stream (torch copies through a temporary there), which nothing
        else of ours uses: both streams' ends are the copies' end, also when one failed (the blocks
        are handed back after this)."""
        stream = queued_on or self._stream(ours)
        stream.wait_event(after)
        try:
            with on_stream(stream):
                yield
        finally:
            if queued_on is None:
                stream.synchronize()
                if peers != ours:
                    torch.cuda.current_stream(peers).synchronize()


class Unopened:
    """Stands for a writer's event that could not be opened: as far as we can tell, its copies end
    with the lease."""

    def __init__(self, why: str):
        self.why = why

    def query(self) -> bool:
        return False


class CudaIpcReceiver(MappedReceiver):
    name = "cuda_ipc"
    polled = True

    def __init__(self, pool: torch.Tensor, dtype: str):
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(pool)
        ipc = [None, list(args[1]), list(args[2]), args[3], None, dtype, *args[6:10], False, *args[11:]]
        self.key = ipc[7].hex()
        self.device = pool.device
        self.events: dict[bytes, torch.cuda.Event] = {}  # our writers' completion events, opened once each
        self.unopened: list[bytes] = []  # writers' ring events to open on the next tick (poll)
        # events: we poll a writer's event (a writer queues its copies only for a decode worker that does)
        super().__init__({"ipc": ipc, "pid": os.getpid(), "events": True})

    def fence(self, info: dict):
        ipc = info.get("event")
        if ipc is None:
            return None
        if not isinstance(ipc, bytes):
            return Unopened(f"the writer's completion event {ipc!r:.40} is not an IPC event handle (bytes)")
        ring = info.get("ring")
        if isinstance(ring, list) and len(ring) <= RING:  # opened by poll(), beside the transfers
            self.unopened += [h for h in ring if isinstance(h, bytes) and h not in self.events]
        if ipc not in self.events:
            try:
                self._open(ipc)
            except (RuntimeError, TypeError, ValueError) as e:
                return Unopened(f"cannot open the writer's completion event ({type(e).__name__}: {e})")
        return self.events[ipc]

    def _open(self, ipc: bytes) -> None:
        if len(self.events) >= OPENED:
            del self.events[next(iter(self.events))]
        self.events[ipc] = torch.cuda.Event.from_ipc_handle(self.device, ipc)

    def poll(self, now: float) -> None:
        """Open the ring events writers listed (a transfer's own is opened when it comes)."""
        while self.unopened:
            ipc = self.unopened.pop()
            if ipc not in self.events:
                try:
                    self._open(ipc)
                except (RuntimeError, TypeError, ValueError) as e:  # its transfer opens it, or says why
                    log.info("cuda_ipc: a writer's ring event did not open (%s)", first_line(e))

    def begin(self, inbox: Inbox, info: dict) -> None:
        super().begin(inbox, info)
        if inbox.error is None:
            inbox.fence = self.fence(info)
            if isinstance(inbox.fence, Unopened):
                inbox.fail(inbox.fence.why)

    def settle(self, inbox: Inbox) -> bool:
        return inbox.error is not None or not inbox.writing()
