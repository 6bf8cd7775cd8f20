"""One-sided transports (shm, cuda_ipc): the prefill worker maps the decode worker's pool into its
own process once per peer and copies its blocks straight into the granted ones, from a thread of
its own, so that a streamed transfer's copies overlap the forward pass. Only the KVTransfer
header then crosses ZeroMQ, and says that every byte is in place (or, from cuda_ipc to a peer on
the same GPU, carries the event that says when: cuda_ipc.py).

The decode worker cannot tell when a writer is done (see __init__.py): the writer checks its own
view of the lease as each copy starts, not when it is queued on this thread (cuda_ipc on one GPU:
as it is queued on the device), and counts the copies it is inside for the decode worker to see
(copy_count.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import socket
import time

import torch

from common.kv_transport.base import Handle, Inbox, Outgoing, Receiver, Sender, TransportError
from common.kv_transport.block_copy import copy_blocks
from common.kv_transport.copy_count import counted
from common.kv_transport.jobs import JobThread, run_now, written

HOSTNAME = socket.gethostname()


def process_gone(pid: int) -> bool:
    """Whether process pid of this host has exited (a zombie not yet reaped included): a one-sided
    writer that has writes nothing more. False where it cannot tell (no pid, no /proc)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return os.path.isdir("/proc/self")  # /proc is there and has no such process
    except OSError:
        return False


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
            self.sweep()  # a restarted peer's old pool first
            self.maps[key] = self._map(advert)
        return self.maps[key]

    def _gone(self, key: str) -> bool:
        return False

    def sweep(self) -> None:
        """Close the pools of peers whose process has exited: a CUDA pool opened here stays
        allocated on the device while it is open, and a restarted decode worker sizes its own
        pool by the memory it finds free, before any transfer would reopen (and so sweep) here."""
        for gone in [k for k in self.maps if self._gone(k)]:
            self.forget_key(gone)

    def unusable(self, advert: dict) -> str | None:
        if advert.get("host") != HOSTNAME:
            return f"its pool is on host {advert.get('host')!r}, this is {HOSTNAME!r}"
        try:
            if self._gone(self._key(advert)):
                return "its process has exited"
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
        key = handle.info["key"]
        mapping = self.maps.get(key)
        if mapping is None:
            raise TransportError("the peer's pool was closed here: its worker is gone")

        def copy():
            with counted():  # for the peer, which takes back blocks whose lease ended only while we copy nothing
                if time.monotonic() > out.write_by:  # queued too long: the blocks may be someone else's by now
                    raise TransportError("the grant's lease ended before this copy could start")
                if self.maps.get(key) is not mapping:  # forgotten since: its close runs on this thread, after us
                    raise TransportError("the peer's pool was closed here before this copy could start: "
                                         "its worker is gone")
                with torch.inference_mode(), self._copying(out.pool.device, peer.device, after, handle.queued_on):
                    copy_blocks(out.pool, out.src_blocks[b], peer, out.dst_blocks[b], slice(layers.start, layers.stop))
        handle.futures.append(run_now(copy) if handle.queued_on is not None else self.copier.submit(copy))

    def finish(self, handle: Handle, release: bool = False) -> None:
        concurrent.futures.wait(handle.futures)

    def _copying(self, ours: torch.device, peers: torch.device, after, queued_on) -> contextlib.AbstractContextManager:
        """Where the copies run, once `after` (written()) is reached; they are complete when it exits,
        or, on a queued_on stream, queued there."""
        return contextlib.nullcontext()

    def forget(self, advert: dict) -> None:
        try:
            self.forget_key(self._key(advert))
        except (KeyError, TypeError, IndexError):
            pass

    def forget_key(self, key: str) -> None:
        """Stop using a peer's pool. Its mapping is closed on the copier's thread, after the copies
        queued before: closing it under a running copy was a segfault (a tensor over an mmap does
        not keep it from being unmapped), and copies queued later see it gone. Once the copier is
        shut down the mapping goes with the last tensor that uses it."""
        mapping = self.maps.pop(key, None)
        if mapping is not None and hasattr(mapping, "close"):
            self.copier.submit(mapping.close)

    def close(self) -> None:
        for key in list(self.maps):
            self.forget_key(key)
        self.copier.shutdown()


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
