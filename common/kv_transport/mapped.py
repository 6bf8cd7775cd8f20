"""One-sided transports (shm, cuda_ipc): the prefill worker maps the decode worker's pool into its
own process once per peer and copies its blocks straight into the granted ones, from a thread of
its own, so that a streamed transfer's copies overlap the forward pass. Only the KVTransfer
header then crosses ZeroMQ, and says that every byte is in place.

The decode worker cannot tell when a writer is done (see __init__.py): the writer checks its own
view of the lease as each copy starts, not when it is queued.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import time

import torch

from common.kv_transport.base import Handle, Inbox, Outgoing, Receiver, Sender, TransportError
from common.kv_transport.jobs import JobThread, written

HOSTNAME = socket.gethostname()


GATHER_RUNS = 4  # on a GPU, blocks in more runs than this move by one gather and one scatter


def block_runs(src_blocks: list[int], dst_blocks: list[int]) -> list[tuple[int, int, int]]:
    """(source block, destination block, count) of each run of ids consecutive on both sides."""
    runs, i, n = [], 0, len(src_blocks)
    while i < n:
        j = i + 1
        while j < n and src_blocks[j] == src_blocks[j - 1] + 1 and dst_blocks[j] == dst_blocks[j - 1] + 1:
            j += 1
        runs.append((src_blocks[i], dst_blocks[i], j - i))
        i = j
    return runs


def words(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """src and dst viewed as the widest integers their rows divide into, alike: a block copy is a
    strided copy, which torch runs an element at a time, so 8-byte words move four times the bytes
    of bfloat16 elements per step. (On an H100 the cuda_ipc transport, whose copies these are, moved
    117 GB/s against 1,059 GB/s for a plain copy of the same bytes; how much of that these copies
    are waits for a GPU run.)"""
    row = src.shape[-1] * src.element_size()
    for dtype in (torch.int64, torch.int32):
        if dtype.itemsize > src.element_size() and row % dtype.itemsize == 0:
            try:
                return src.view(dtype), dst.view(dtype)
            except RuntimeError:  # an offset or stride the wider words do not divide
                continue
    return src, dst


def copy_blocks(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int],
                layers: slice = slice(None)) -> None:
    """dst's blocks = src's blocks in these layers, no staging: one strided copy per run of
    consecutive ids on both sides (a fresh pool's blocks mostly are). On a GPU, a fragmented grant
    (a launch per run) goes by gather_scatter instead; on a CPU torch's index ops are several times
    slower than the runs' memcpys, fragmented or not."""
    runs = block_runs(src_blocks, dst_blocks)
    if src.is_cuda and len(runs) > GATHER_RUNS:
        return gather_scatter(src, src_blocks, dst, dst_blocks, layers)
    src, dst = words(src, dst)
    for s, d, n in runs:
        dst[layers, :, d:d + n].copy_(src[layers, :, s:s + n])


def gather_scatter(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int],
                   layers: slice = slice(None)) -> None:
    """copy_blocks in two kernels over all its layers, whatever the runs: a gather on the source's
    device into one buffer of the blocks, and a scatter into the destination's."""
    src, dst = words(src, dst)
    picked = src[layers].index_select(2, torch.tensor(src_blocks, device=src.device))
    dst[layers].index_copy_(2, torch.tensor(dst_blocks, device=dst.device), picked.to(dst.device))


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
