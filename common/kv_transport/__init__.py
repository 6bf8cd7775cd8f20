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
streaming, prefill_worker/worker.py). The pieces may come in any order; each unit once (units,
their numbering and the frame plan: frames.py).

base.py holds the interface (Sender, Receiver, what they pass: Outgoing, Handle, Inbox), this
module the choice of transport; each transport is a module of its own:

    zmq.py       KVChunk messages, each with one frame of 64 KiB..4 MiB, on the same socket
                 ahead of the header, sent from the pool in place where blocks are consecutive.
                 Any hosts.
    shm.py       the decode worker's pool lives in a shared-memory segment (common/kv_cache.py);
                 the prefill maps it once and copies its blocks straight into the granted ones,
                 then only the header crosses ZeroMQ. Same host, CPU pools.
    cuda_ipc.py  shm's shape for CUDA pools (the pool shared by a CUDA IPC handle). On one GPU
                 the copies are only queued, and the header carries an IPC event the decode
                 worker polls before it decodes.
                 (shm and cuda_ipc share mapped.py: writing into a peer's pool mapped here,
                 and copy_count.py: the copies a writer is inside, for its peers to see.)
    process_group.py
                 gloo: a two-rank torch.distributed group per prefill/decode pair, made on first
                 use from a store the decode worker hosts. Each chunk is announced by a KVChunk
                 without a frame that names its tag; the decode worker posts the receive into a
                 staging buffer then, and copies it into its blocks. Any hosts, any pool (staged
                 on the CPU). nccl: the same with the NCCL backend, staged on the GPU; NCCL
                 refuses two ranks on one GPU, so it needs two.
    jobs.py      the threads and CUDA streams the transports' work runs on.

shm and cuda_ipc are one-sided: the decode worker cannot tell when a writer is done, so blocks
granted by a decode worker that offers them come back only on word from the writer (KVTransfer
or KVRelease; a cuda_ipc header's event, once it completed) or at the end of the lease; the
prefill never starts writing past its own view of the lease (measured from its request, so
earlier than the decode worker's), checked as each copy starts, not when it is queued (cuda_ipc
on one GPU: as it is queued on the device, which runs a step or two behind). A copy begun in time
may outlast the lease if its writer is stopped inside it, so past the lease blocks come back only
once every copy their writer was inside at the lease's end has ended (copy_count.py).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Callable

import torch

from common import protocol as P
from common.config import KV_TRANSPORT_DEVICE
from common.kv_cache import SharedSegment
from common.kv_transport.base import Handle, Inbox, Outgoing, Receiver, Sender, TransportError
from common.kv_transport.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from common.kv_transport.frames import frame_plan, piece_frames, unit_bytes, unit_stretches, unit_view
from common.kv_transport.jobs import JobThread
from common.kv_transport.mapped import MappedSender
from common.kv_transport.process_group import GroupReceiver, GroupSender, NcclReceiver, NcclSender
from common.kv_transport.shm import ShmReceiver, ShmSender
from common.kv_transport.zmq import ZmqReceiver, ZmqSender

__all__ = ["Handle", "Inbox", "Outgoing", "Receiver", "Sender", "TransportError", "JobThread", "MappedSender",
           "frame_plan", "piece_frames", "unit_bytes", "unit_stretches", "unit_view", "PREFERENCE", "offered",
           "choose", "tune_malloc", "make_senders", "make_receivers"]
log = logging.getLogger("pdserve.kv")

PREFERENCE = ("cuda_ipc", "shm", "nccl", "zmq", "gloo")  # fastest first (`pdserve bench transfer`)
assert set(PREFERENCE) == set(P.KV_TRANSPORTS) - {"auto"}


def offered(kv_transport: str, device: torch.device) -> list[str]:
    """The transports an engine on this device uses under --kv-transport, fastest first."""
    if kv_transport != "auto":
        return [kv_transport]
    return [t for t in PREFERENCE if KV_TRANSPORT_DEVICE.get(t, device.type) == device.type]


def choose(senders: dict[str, Sender], offer: dict, peer: str, forced: str = "auto") -> str:
    """The first of our senders (fastest first) that the peer offers and we can reach."""
    unusable = []
    for name, sender in senders.items():
        if name in offer:
            why = sender.unusable(offer[name])
            if why is None:
                return name
            unusable.append(f"{name}: {why}")
    if unusable:  # one in common, but not reachable (a peer that has just exited, another host)
        raise TransportError(f"cannot reach decode worker {peer!r} by a KV transport both use: {'; '.join(unusable)}")
    ours = f"kv_transport={forced!r} is forced on this prefill worker" if forced != "auto" else \
        f"this prefill worker uses {list(senders)}"
    raise TransportError(f"no KV transport in common with decode worker {peer!r}: {ours}, it offers {sorted(offer)}")


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
