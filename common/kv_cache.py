"""The paged KV pool and the block manager.

One pool per engine, allocated once: (layers, 2, blocks, block_size, kv_heads, head_dim), in
private memory or (for the shm KV transport) in a named shared-memory segment. A sequence owns
a block table (list of block ids); blocks are reference counted so that prefix caching can
share them. A full block whose KV is computed gets a hash chained from the previous
block's hash and a fixed seed, so the same tokens hash the same in every process; a hit is
confirmed by comparing tokens. Freed blocks keep their hash and stay findable until reused
(least recently freed first).
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
from collections import OrderedDict
from multiprocessing import shared_memory

import torch

from common.model_spec import ModelConfig
from common.errors import InvalidArgument
from common.memory import gib
from common.sequence import Sequence


def available_bytes(device: torch.device) -> int:
    """What new tensors may take on device: a GPU's free memory and what torch holds there unused,
    else what the host has available (MemAvailable: what is free and the caches it would give back;
    all of it where that is unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
            torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def allocate_kv_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                     device: torch.device, shared: bool = False) -> tuple[torch.Tensor, SharedSegment | None]:
    """The pool, and its shared-memory segment when shared (CPU only; close it when done). A pool
    larger than the device has available is refused by name, not left to the allocator's error."""
    shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    nbytes, available = math.prod(shape) * dtype.itemsize, available_bytes(device)
    if nbytes > available:
        fits = available // (nbytes // num_blocks)
        raise InvalidArgument(f"num_blocks={num_blocks}: a KV pool of {gib(nbytes)} does not fit the {gib(available)} "
                              f"available on {device}; allowed: at most {fits} blocks (--num-blocks, --kv-cache-gb)")
    if shared:
        segment = SharedSegment.create(shape, dtype)
        return segment.tensor, segment
    # Zeroed, not empty: masked-out slots still pass through the attention matmul, and stale NaNs
    # there would poison a softmax even with zero weight.
    return torch.zeros(shape, dtype=dtype, device=device), None


SHM_PREFIX = "pdserve-kv"
SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux
_SHM_HEADER = 4096  # the first page holds the nonce; the pool starts page-aligned after it
_NONCE_BYTES = 16


class SharedSegment:
    """A tensor in a named POSIX shared-memory segment (/dev/shm/pdserve-kv-PID-XXXXXXXX) that
    another process on this host maps, to write KV straight into the blocks (the shm transport).

    The creator unlinks it on close(); if the creator is killed, multiprocessing's resource
    tracker (a process of its own) unlinks it. A mapper maps the file itself, outside the
    tracker (which would otherwise unlink the creator's segment when the mapper exits), and never
    unlinks. The first page holds a random nonce that a mapper checks, so that a segment of the
    same name elsewhere (another host, an earlier run) is never taken for this one."""

    def __init__(self, name: str, buffer, tensor: torch.Tensor, nonce: bytes,
                 owned: shared_memory.SharedMemory | None):
        self.name, self.buffer, self.tensor, self.nonce, self.owned = name, buffer, tensor, nonce, owned

    @classmethod
    def create(cls, shape, dtype: torch.dtype) -> "SharedSegment":
        nbytes = math.prod(shape) * dtype.itemsize
        st = os.statvfs(SHM_DIR)
        if nbytes > st.f_bavail * st.f_frsize:
            raise InvalidArgument(f"a shared KV pool of {gib(nbytes)} does not fit in {SHM_DIR} "
                                  f"({gib(st.f_bavail * st.f_frsize)} free); lower kv_cache_gb or "
                                  "num_blocks, enlarge /dev/shm, or use kv_transport='zmq'")
        name = f"{SHM_PREFIX}-{os.getpid()}-{secrets.token_hex(4)}"
        segment = shared_memory.SharedMemory(name, create=True, size=_SHM_HEADER + nbytes)
        nonce = secrets.token_bytes(_NONCE_BYTES)
        segment.buf[:_NONCE_BYTES] = nonce
        tensor = _tensor(segment.buf, shape, dtype)
        # Fresh tmpfs pages read as zeros but exist only once written: write them all now, so that
        # no transfer pays for allocating them (measured: ~0.5 ms per MiB first written).
        tensor.zero_()
        return cls(name, segment.buf, tensor, nonce, segment)

    @classmethod
    def attach(cls, name: str, nonce: bytes, shape, dtype: torch.dtype) -> "SharedSegment":
        """Map another process's segment; raises ValueError if it is not there or not that one."""
        if not name.startswith(SHM_PREFIX + "-") or "/" in name:
            raise ValueError(f"segment name {name!r} is not one of ours ({SHM_PREFIX}-...)")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except OSError as e:
            raise ValueError(f"shared-memory segment {name!r} cannot be opened here ({e})") from None
        try:
            mapping = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))  # map every page now
        finally:
            os.close(fd)
        nbytes = math.prod(shape) * dtype.itemsize
        if mapping[:_NONCE_BYTES] != nonce or len(mapping) < _SHM_HEADER + nbytes:
            mapping.close()
            raise ValueError(f"shared-memory segment {name!r} here is not the advertised one "
                             f"(nonce or size differs; expected {_SHM_HEADER + nbytes} bytes)")
        return cls(name, mapping, _tensor(mapping, shape, dtype), nonce, None)

    @staticmethod
    def creator(name: str) -> int:
        """The pid that created a segment of this name (-1 if the name is not one of ours)."""
        parts = name.split("-")
        return int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else -1

    def close(self) -> None:
        self.tensor = None
        try:
            (self.owned or self.buffer).close()
        except BufferError:  # views of the tensor still alive: the mapping goes when they do
            pass
        if self.owned is not None:
            try:
                self.owned.unlink()
            except FileNotFoundError:
                pass
            self.owned = None


def _tensor(buffer, shape, dtype: torch.dtype) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=_SHM_HEADER)
    return raw.view(dtype).view(shape)


class Block:
    __slots__ = ("id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.prefix_queries = self.prefix_hits = 0  # tokens looked up in the prefix cache, and found
        self.changes: dict[bytes, bool] | None = None  # watched: hash -> whether `cached` holds it now

    def watch(self) -> list[bytes]:
        """The hashes the prefix cache holds now; from here on take_changes() says how they change
        (the KV events a worker tells the router, router/prefix_affinity.py)."""
        self.changes = {}
        return list(self.cached)

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes stored, hashes removed) since watch() or the last call, each by its last change."""
        if not self.changes:
            return [], []
        changes, self.changes = self.changes, {}
        return [h for h, held in changes.items() if held], [h for h, held in changes.items() if not held]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _prefix_hits(self, seq: Sequence) -> list[tuple[bytes, int]]:
        """(hash, block id) for the leading full blocks already cached. The last token is never
        taken from the cache: its logits are needed to sample. Nor is any of a prompt whose
        logprobs are asked for: they need every position's logits."""
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return []
        hits, bs = [], self.block_size
        for i in range((len(seq) - 1) // bs):
            h = seq.hash_chain(i + 1, bs)[i]  # a block at a time: the first miss ends the walk
            block_id = self.cached.get(h)
            if block_id is None or list(self.blocks[block_id].token_ids) != seq.token_ids[i * bs:(i + 1) * bs]:
                break
            hits.append((h, block_id))
        return hits

    def _take_free(self, block_id: int | None = None) -> Block:
        if block_id is None:
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                if self.changes is not None:
                    self.changes[block.hash] = False
            block.hash, block.token_ids = None, ()
        else:
            del self.free[block_id]
            block = self.blocks[block_id]
        block.ref_count = 1
        return block

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        hits = self._prefix_hits(seq)
        shared = sum(1 for _, b in hits if self.blocks[b].ref_count > 0)
        return self.blocks_needed(len(seq)) - shared + reserve <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of seq's current tokens, reusing cached prefix blocks."""
        assert not seq.block_table
        hits = self._prefix_hits(seq)
        for h, block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._take_free(block_id)
            else:
                block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_published_blocks = len(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self.prefix_queries += len(seq)
        self.prefix_hits += seq.num_cached_tokens
        seq.block_table += [self._take_free().id for _ in range(self.blocks_needed(len(seq)) - len(seq.block_table))]

    def needs_block(self, seq: Sequence) -> bool:
        """Whether its tokens outgrew its blocks (blocks_needed, asked for every decode every step)."""
        return len(seq.token_ids) > len(seq.block_table) * self.block_size

    def append_block(self, seq: Sequence) -> None:
        seq.block_table.append(self._take_free().id)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of seq's blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        start, end = seq.num_published_blocks, seq.num_computed_tokens // bs
        if end <= start:
            return
        chain = seq.hash_chain(end, bs)
        seq.num_published_blocks = end
        for i in range(start, end):
            h = chain[i]
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, tuple(seq.token_ids[i * bs:(i + 1) * bs])
                if h not in self.cached:
                    self.cached[h] = block.id
                    if self.changes is not None:
                        self.changes[h] = True

    def take_blocks(self, n: int) -> list[int]:
        """n blocks outside any sequence (a reservation for KV arriving from another worker)."""
        assert n <= self.num_free_blocks
        return [self._take_free().id for _ in range(n)]

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; the last ones listed become reusable first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None

    def free_seq(self, seq: Sequence) -> None:
        # Last blocks first, so a sequence's tail is reused before its (more shareable) head.
        self.release_blocks(seq.block_table)
        seq.block_table = []
        seq.num_published_blocks = 0
        seq.num_computed_tokens = 0
