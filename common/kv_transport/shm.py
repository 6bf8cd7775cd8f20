"""The shm transport: the decode worker's pool lives in a shared-memory segment
(common/kv_cache.py SharedSegment); the prefill worker maps it once per peer and copies its blocks
straight into the granted ones (mapped.py). Same host, CPU pools.
"""

from __future__ import annotations

import os

import torch

from common.config import dtype_of
from common.kv_cache import SharedSegment
from common.kv_transport.mapped import MappedReceiver, MappedSender


class ShmSender(MappedSender):
    name = "shm"

    def _key(self, advert: dict) -> str:
        return advert["segment"]

    def _map(self, advert: dict) -> SharedSegment:
        return SharedSegment.attach(advert["segment"], bytes.fromhex(advert["nonce"]), tuple(advert["shape"]),
                                    dtype_of(advert["dtype"]))

    def _gone(self, key: str) -> bool:
        return not os.path.exists(f"/proc/{SharedSegment.creator(key)}")


class ShmReceiver(MappedReceiver):
    name = "shm"

    def __init__(self, pool: torch.Tensor, segment: SharedSegment, dtype: str):
        self.key = segment.name
        super().__init__({"segment": segment.name, "nonce": segment.nonce.hex(), "shape": list(pool.shape),
                          "dtype": dtype})
