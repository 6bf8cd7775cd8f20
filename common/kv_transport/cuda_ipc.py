"""The cuda_ipc transport: shm's shape for CUDA pools (mapped.py). The decode worker's pool is
shared by its CUDA IPC handle, as torch.multiprocessing shares a tensor; the prefill worker opens
it once per peer and pool and copies its blocks into the granted ones on a stream of its own, in
one launch per piece (block_copy.py).
Same host, CUDA pools. Not run in CI (no GPU): its tests are marked gpu.

A pool opened in this process stays allocated on the device while it is open, even after its
decode worker died: the advert carries the worker's pid, and a restarted peer's old pool is closed
within a second by the prefill worker's tick (mapped.py: sweep), or the restarted worker would
find its memory still taken.
"""

from __future__ import annotations

import contextlib
import os
import types

import torch

from common.config import DTYPES
from common.kv_transport.block_copy import warm_up
from common.kv_transport.jobs import on_stream
from common.kv_transport.mapped import MappedReceiver, MappedSender


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
        pool = rebuild_cuda_tensor(torch.Tensor, torch.Size(a[1]), tuple(a[2]), a[3], torch.storage.TypedStorage,
                                   DTYPES[a[5]], *a[6:10], False, *a[11:])
        warm_up(pool)  # the copy kernel compiles at pairing, not in the first transfer
        return types.SimpleNamespace(tensor=pool, pid=advert.get("pid"))

    def _gone(self, key: str) -> bool:
        pid = getattr(self.maps.get(key), "pid", None)
        return pid is not None and not os.path.exists(f"/proc/{pid}")

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
        super().__init__({"ipc": ipc, "pid": os.getpid()})
