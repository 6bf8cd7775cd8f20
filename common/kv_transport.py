"""KV transports: how one request's KV moves from the prefill worker's pool into the blocks a
decode worker reserved for it. Every transport has the same shape:

    decode worker (Receiver)                     prefill worker (Sender)
    KVGrant(blocks, transports={name: advert}) -> choose(): the fastest both ends can use
                                               <- the bytes, by the transport's own means
                                               <- KVTransfer(header, transport, transport_info)
    receiver.begin(inbox, info); once receiver.settle(inbox): start decoding, KVAck

    zmq       KVChunk messages, one frame of 64 KiB..4 MiB each, on the same socket before the
              header, sent from the pool in place where blocks are consecutive. Works across hosts.
    shm       the decode worker's pool lives in a shared-memory segment (common/kv_cache.py);
              the prefill maps it once and copies its blocks straight into the granted ones,
              then only the header crosses ZeroMQ. Same host, CPU pools.
    gloo      a two-rank torch.distributed group per prefill/decode pair, made on first use
              from a store the decode worker hosts; the decode receives into staging chunks
              and copies them into its blocks. Any host, any pool (bytes staged on the CPU).
    cuda_ipc  shm's shape for CUDA pools (the pool shared by a CUDA IPC handle).  } not run in
    nccl      gloo's shape for CUDA pools (NCCL backend, staging on the GPU).    } CI: no GPU

Both ends see a request's KV as units: one block of one layer's K or V, (block_size, kv_heads,
head_dim), contiguous in the pool. A request's units are numbered in (layer, K/V, block) order,
so a chunk of them says where it goes by its first unit alone.

shm and cuda_ipc are one-sided: the decode worker cannot tell when a writer is done, so blocks
granted by a decode worker that offers them come back only on word from the writer (KVTransfer
or KVRelease) or at the end of the lease; the prefill never starts writing past its own view of
the lease (measured from its request, so earlier than the decode worker's).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import datetime
import logging
import math
import os
import socket
import time
import types
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from common import protocol as P
from common.config import DTYPES, KV_TRANSPORT_DEVICE
from common.errors import PdserveError
from common.kv_cache import SharedSegment

log = logging.getLogger("pdserve.kv")

PREFERENCE = ("cuda_ipc", "shm", "nccl", "zmq", "gloo")  # fastest first (`pdserve bench transfer`)
assert set(PREFERENCE) == set(P.KV_TRANSPORTS) - {"auto"}
CHUNK_BYTES = 4 << 20  # largest frame or point-to-point message: pipelines, stays on the heap
MIN_FRAME_BYTES = 64 << 10  # pyzmq copies smaller frames
MAX_CHUNKS = 1024  # per transfer: each gloo/nccl chunk has a tag of its own
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


def unit_ids(pool: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """Row of unit_view(pool) of each unit of these blocks, in (layer, K/V, block) order."""
    rows = torch.arange(pool.shape[0] * 2, device=pool.device)[:, None] * pool.shape[2]
    return (rows + torch.tensor(block_ids, dtype=torch.int64, device=pool.device)[None, :]).flatten()


def chunk_ranges(num_units: int, unit_nbytes: int) -> list[tuple[int, int]]:
    """[first, end) unit ranges of about CHUNK_BYTES, none under MIN_FRAME_BYTES unless all is."""
    per = max(1, CHUNK_BYTES // unit_nbytes, -(-num_units // MAX_CHUNKS))
    ranges = [(u, min(u + per, num_units)) for u in range(0, num_units, per)]
    if len(ranges) > 1 and (ranges[-1][1] - ranges[-1][0]) * unit_nbytes < MIN_FRAME_BYTES:
        ranges[-2:] = [(ranges[-2][0], num_units)]
    return ranges


def frame_plan(ids: torch.Tensor, unit_nbytes: int) -> list[tuple[int, int, bool]]:
    """[first, end) unit ranges covering a request, and whether each is one stretch of the pool
    (send it in place) or must be gathered. Stretches of at least MIN_FRAME_BYTES go in place, cut
    evenly to at most CHUNK_BYTES; the rest is gathered into chunks of up to CHUNK_BYTES."""
    rows = ids.tolist()
    least, most = -(-MIN_FRAME_BYTES // unit_nbytes), max(1, CHUNK_BYTES // unit_nbytes)
    plan, loose = [], None  # loose: where the units to gather began

    def cut(first, end, in_place):
        pieces = -(-(end - first) // most)
        bounds = [first + (end - first) * i // pieces for i in range(pieces + 1)]
        plan.extend((a, b, in_place) for a, b in zip(bounds, bounds[1:]))

    u = 0
    while u < len(rows):
        v = u + 1
        while v < len(rows) and rows[v] == rows[v - 1] + 1:
            v += 1
        if v - u >= least:
            if loose is not None:
                cut(loose, u, False)
                loose = None
            cut(u, v, True)
        elif loose is None:
            loose = u
        u = v
    if loose is not None:
        cut(loose, len(rows), False)
    return plan


def copy_blocks(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int]) -> None:
    """dst's blocks = src's blocks, all layers: one strided copy per run of consecutive ids on
    both sides (a fresh pool's blocks mostly are), no staging."""
    i, n = 0, len(src_blocks)
    while i < n:
        j = i + 1
        while j < n and src_blocks[j] == src_blocks[j - 1] + 1 and dst_blocks[j] == dst_blocks[j - 1] + 1:
            j += 1
        s, d = src_blocks[i], dst_blocks[i]
        dst[:, :, d:d + j - i].copy_(src[:, :, s:s + j - i])
        i = j


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
        self.future: concurrent.futures.Future | None = None  # gloo/nccl: the staging chunks' receipt
        self.pair: str = ""
        self._ids: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        return self.num_units > 0 and self.arrived.find(0) == -1

    def fail(self, why: str) -> None:
        self.error = self.error or why

    def put(self, first_unit: int, units: torch.Tensor) -> None:
        """Write units [first_unit, first_unit + len(units)) into the pool."""
        k = units.shape[0]
        if not 0 <= first_unit < first_unit + k <= self.num_units:
            return self.fail(f"KV units [{first_unit}, {first_unit + k}) are outside this transfer's "
                             f"[0, {self.num_units})")
        if self.arrived.find(1, first_unit, first_unit + k) != -1:
            return self.fail(f"KV units [{first_unit}, {first_unit + k}) arrived twice")
        if self._ids is None:
            self._ids = unit_ids(self.pool, self.block_ids)
        unit_view(self.pool).index_copy_(0, self._ids[first_unit:first_unit + k], units.to(self.pool.device))
        self.arrived[first_unit:first_unit + k] = b"\x01" * k

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
    send: Callable[[object, list], object]  # a message and frames to the decode worker: zmq's tracker, or None


@dataclass(eq=False)
class Handle:
    """A transfer under way, prefill side."""
    info: dict = field(default_factory=dict)  # for KVTransfer.transport_info
    future: concurrent.futures.Future | None = None  # point-to-point sends; done once all delivered
    trackers: list = field(default_factory=list)  # zmq: one per frame sent in place from the pool
    failed: str | None = None  # a start that failed half way (some bytes may be under way)

    def sent(self) -> bool:
        """Nothing reads our blocks for this transfer any more: they may be reused."""
        return (self.future is None or self.future.done()) and all(t.done for t in self.trackers)

    def error(self) -> str | None:
        if self.failed is not None:
            return self.failed
        return _failure(self.future)


# ----------------------------------------------------------------------------- interfaces

class Sender:
    """Prefill side of a transport: one per worker, for all its decode peers."""
    name = ""

    def unusable(self, advert: dict) -> str | None:
        """Why the peer that advertised this cannot be reached from here, or None."""
        return None

    def start(self, out: Outgoing) -> Handle:
        """Set the bytes moving. Raises TransportError if none could be; a failure after some
        were is the handle's error()."""
        raise NotImplementedError

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

    def begin(self, inbox: Inbox, info: dict) -> None:
        """The header arrived: take the rest in (or fail the inbox)."""

    def settle(self, inbox: Inbox) -> bool:
        """True once the KV is in the pool, or the inbox failed."""
        return True

    def poll(self, now: float) -> None:
        pass

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- zmq

class ZmqSender(Sender):
    """KVChunks, each frame straight from the pool where the request's blocks are consecutive
    (a fresh pool's mostly are): those frames are our blocks' own memory, so the prefill worker
    keeps the blocks until zmq is done with them (Handle.sent); the rest is gathered first."""
    name = "zmq"

    def start(self, out: Outgoing) -> Handle:
        units, ids = unit_view(out.pool), unit_ids(out.pool, out.src_blocks)
        handle = Handle()
        for first, end, in_place in frame_plan(ids, unit_bytes(out.pool)):
            row = int(ids[first])
            chunk = units[row:row + end - first] if in_place else units.index_select(0, ids[first:end])
            header = P.KVChunk(out.request_id, out.attempt, len(out.dst_blocks), first)
            tracker = out.send(header, [tensor_frame(chunk)])
            if tracker is None:
                handle.failed = "the decode worker's socket takes no more KV chunks (its queue is full)"
                break
            if in_place:
                handle.trackers.append(tracker)
        return handle


class ZmqReceiver(Receiver):
    name = "zmq"

    def chunk(self, inbox: Inbox, msg: P.KVChunk, frames: list) -> None:
        if len(frames) != 1:
            return inbox.fail(f"a KVChunk with {len(frames)} frames; expected 1")
        buf, ub = frames[0].buffer, unit_bytes(inbox.pool)
        if len(buf) == 0 or len(buf) % ub:
            return inbox.fail(f"a KV frame of {len(buf)} bytes; expected a positive multiple of {ub} "
                              "(one block of one layer's K or V)")
        inbox.put(msg.first_unit, frame_tensor(buf, inbox.pool.dtype, (len(buf) // ub, *inbox.pool.shape[3:])))

    def settle(self, inbox: Inbox) -> bool:
        if not inbox.complete:  # chunks travel ahead of the header on the same socket
            inbox.fail(f"only {inbox.num_units - inbox.arrived.count(0)} of {inbox.num_units} KV units arrived")
        return True


# ----------------------------------------------------------------------------- shm, cuda_ipc

class MappedSender(Sender):
    """Writes straight into a peer's pool mapped into this process (shm, cuda_ipc)."""

    def __init__(self):
        self.maps: dict[str, object] = {}  # advert key -> mapping holding .tensor

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
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            return f"cannot map its pool ({type(e).__name__}: {e})"
        return None

    def start(self, out: Outgoing) -> Handle:
        peer = self._mapped(out.advert).tensor
        if peer.shape[3:] != out.pool.shape[3:] or peer.shape[:2] != out.pool.shape[:2] or peer.dtype != out.pool.dtype:
            raise TransportError(f"peer pool {tuple(peer.shape)} {peer.dtype} does not match ours "
                                 f"{tuple(out.pool.shape)} {out.pool.dtype} but for the block count")
        if not 0 <= min(out.dst_blocks) <= max(out.dst_blocks) < peer.shape[2]:
            raise TransportError(f"granted blocks {out.dst_blocks} are outside the peer pool of {peer.shape[2]}")
        copy_blocks(out.pool, out.src_blocks, peer, out.dst_blocks)
        self._sync(out.pool, peer)
        return Handle({"key": self._key(out.advert)})

    def _sync(self, ours: torch.Tensor, peer: torch.Tensor) -> None:
        """Make the copies complete before the header says they are."""

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

    def _key(self, advert: dict) -> str:
        return advert["ipc"][7].hex()  # the allocation's IPC handle

    def _map(self, advert: dict):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        a = advert["ipc"]
        return types.SimpleNamespace(tensor=rebuild_cuda_tensor(
            torch.Tensor, torch.Size(a[1]), tuple(a[2]), a[3], torch.storage.TypedStorage, DTYPES[a[5]], *a[6:10],
            False, *a[11:]))

    def _sync(self, ours: torch.Tensor, peer: torch.Tensor) -> None:
        torch.cuda.synchronize(ours.device)
        torch.cuda.synchronize(peer.device)


class CudaIpcReceiver(MappedReceiver):
    name = "cuda_ipc"

    def __init__(self, pool: torch.Tensor, dtype: str):
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(pool)
        ipc = [None, list(args[1]), list(args[2]), args[3], None, dtype, *args[6:10], False, *args[11:]]
        self.key = ipc[7].hex()
        super().__init__({"ipc": ipc})


# ----------------------------------------------------------------------------- gloo, nccl

class Pair:
    """One two-rank process group between a decode worker (rank 0) and a prefill worker (rank
    1), made from a TCPStore that the decode worker hosts, and the one thread that uses it: it
    connects, then runs transfers in order. A transfer given up on either side still runs to its
    end (its peer is past the header, so it finishes too); one that fails (a peer died, the
    group's timeout) breaks the pair, and the prefill worker makes a new one, which replaces it
    on the decode side too. Closed then, on a transfer timeout, or when either worker stops."""

    def __init__(self, pair_id: str, backend: str, rank: int, host: str, timeout_s: float,
                 store: Callable[[], object], device: torch.device):
        self.id, self.backend, self.device = pair_id, backend, device
        self.pg = None
        self.closed = self.broken = False
        self.last_used = time.monotonic()
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"pdserve-kv-{backend}")
        self.connected = self.thread.submit(self._connect, rank, host, timeout_s, store)

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

    def run(self, job: Callable) -> concurrent.futures.Future:
        """job(send_or_recv) on the pair's thread, after it connected; send_or_recv(tensors, tag)
        posts this rank's half of a transfer and returns the works to wait on."""
        self.last_used = time.monotonic()

        def call():
            self.connected.result()
            if self.pg is None:
                raise TransportError(f"{self.backend} pair {self.id} is closed")
            return job(self._post)
        future = self.thread.submit(call)
        future.add_done_callback(lambda f: f.cancelled() or f.exception() is None or setattr(self, "broken", True))
        return future

    def _post(self, tensors: list[torch.Tensor], tag: int):
        peer = 1 - self.pg.rank()
        op = self.pg.send if self.pg.rank() == 1 else self.pg.recv
        works = [op([t], peer, tag + i) for i, t in enumerate(tensors)]
        for w in works:
            w.wait()
        if self.backend == "nccl":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self.closed = True
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()  # a send or receive still waiting fails at once
            except Exception as e:  # the group may be half made or already broken
                log.debug("aborting %s pair %s: %s", self.backend, self.id, e)
        self.thread.shutdown(wait=False, cancel_futures=True)


class GroupSender(Sender):
    name = "gloo"
    backend = "gloo"

    def __init__(self, worker_id: str, host: str, timeout_s: float, device: torch.device):
        self.worker_id, self.host, self.timeout_s, self.device = worker_id, host, timeout_s, device
        self.pairs: dict[tuple, Pair] = {}
        self.seq = 0

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

    def start(self, out: Outgoing) -> Handle:
        pair = self._pair(out.advert)
        units, ids = unit_view(out.pool), unit_ids(out.pool, out.src_blocks)
        plan = frame_plan(ids, unit_bytes(out.pool))
        if len(plan) > MAX_CHUNKS:  # scattered blocks: gather all, in at most MAX_CHUNKS chunks
            plan = [(a, b, False) for a, b in chunk_ranges(len(ids), unit_bytes(out.pool))]
        tag = (self.seq % (2**31 // MAX_CHUNKS)) * MAX_CHUNKS
        self.seq += 1

        def job(post):  # on the pair's thread, so gathering overlaps sending
            post([self._stage(units[int(ids[a]):int(ids[a]) + b - a] if in_place else units.index_select(0, ids[a:b]))
                  for a, b, in_place in plan], tag)
        return Handle({"pair": pair.id, "tag": tag, "sizes": [b - a for a, b, _ in plan]}, pair.run(job))

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

    def __init__(self, host: str, timeout_s: float, device: torch.device):
        from torch.distributed import TCPStore

        self.host, self.timeout_s, self.device = host, timeout_s, device
        sock = socket.socket()
        sock.bind((host, 0))  # our own socket: TCPStore would listen on every interface
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self.store = TCPStore(host, self.port, None, True, datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=sock.detach())
        self.pairs: dict[str, Pair] = {}

    def advert(self) -> dict:
        return {"host": self.host, "port": self.port}

    def begin(self, inbox: Inbox, info: dict) -> None:
        pair_id, tag, sizes = info.get("pair"), info.get("tag"), info.get("sizes")
        if not (isinstance(pair_id, str) and "/" in pair_id and isinstance(tag, int) and isinstance(sizes, list)
                and all(isinstance(k, int) and k > 0 for k in sizes) and len(sizes) <= MAX_CHUNKS):
            return inbox.fail(f"{self.name} transport_info {repr(info)[:80]} is not {{pair: str, tag: int, "
                              f"sizes: [int, ...]}}")
        if sum(sizes) != inbox.num_units:
            return inbox.fail(f"{self.name} chunks of {sum(sizes)} KV units for a transfer of {inbox.num_units}")
        pair = self.pairs.get(pair_id) or self._open(pair_id)
        if pair.broken:  # its sender's side fails too, and makes a new pair
            return inbox.fail(f"{self.name} pair {pair_id} broke on an earlier transfer")
        shape, dtype, device = inbox.pool.shape[3:], inbox.pool.dtype, self._staging_device()

        def job(post):
            staging = [torch.empty((k, *shape), dtype=dtype, device=device) for k in sizes]
            post(staging, tag)
            return staging
        inbox.pair, inbox.future = pair_id, pair.run(job)

    def _staging_device(self) -> torch.device:
        return torch.device("cpu")

    def _open(self, pair_id: str) -> Pair:
        worker = pair_id.rsplit("/", 1)[0]
        for old in [p for p in self.pairs if p.rsplit("/", 1)[0] == worker]:  # its earlier pair broke
            self.pairs.pop(old).close()
        pair = self.pairs[pair_id] = Pair(pair_id, self.backend, 0, self.host, self.timeout_s, lambda: self.store,
                                          self.device)
        return pair

    def settle(self, inbox: Inbox) -> bool:
        f = inbox.future
        if f is None:
            return True
        if not f.done():
            return False
        inbox.future = None
        if _failure(f) is not None:
            inbox.fail(f"{self.name} receive failed: {_failure(f)}")
            pair = self.pairs.pop(inbox.pair, None)
            if pair is not None:
                pair.close()
            return True
        first = 0
        for chunk in f.result():
            inbox.put(first, chunk)
            first += chunk.shape[0]
        return True

    def poll(self, now: float) -> None:
        for pair_id, pair in list(self.pairs.items()):
            if now - pair.last_used > self.IDLE_S:
                self.pairs.pop(pair_id).close()

    def close(self) -> None:
        for pair_id in list(self.pairs):
            self.pairs.pop(pair_id).close()
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
                   timeout_s: float, required: bool) -> dict[str, Receiver]:
    """Receivers for these transports into this pool. One that cannot be set up here (shm without
    a shared pool, a store that cannot bind) is left out with a warning, or raises if required."""
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
                receivers[name] = cls(host, timeout_s, pool.device)
        except (TransportError, OSError, RuntimeError) as e:
            if required:
                raise TransportError(f"kv_transport={name!r} cannot receive here: {e}") from e
            log.warning("not offering the %s KV transport: %s", name, e)
    return receivers
