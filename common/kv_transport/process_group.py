"""The gloo and nccl transports: a two-rank torch.distributed process group per prefill/decode
pair (Pair), made on first use from a TCPStore the decode worker hosts. Each chunk is announced
by a KVChunk without a frame that names its tag; the decode worker posts the receive into a
staging buffer then, and copies it into its blocks once it arrived. Any hosts.

gloo stages on the CPU (any pool); nccl is the same with the NCCL backend and staging on the GPU.
NCCL refuses two ranks on one GPU: nccl needs two GPUs (its test is for a machine with two).
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime
import functools
import itertools
import logging
import socket
import time
import uuid
from typing import Callable

import torch

from common import protocol as P
from common.kv_transport.base import Handle, Inbox, Outgoing, Receiver, Sender, TransportError
from common.kv_transport.frames import Frame, piece_frames, unit_view
from common.kv_transport.jobs import JobThread, failure, on_stream, written

log = logging.getLogger("pdserve.kv")


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
        for frame, unit_runs in piece_frames(out, layers, blocks):
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
            why = failure(f)
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
        inbox.fail_unless_complete()
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
