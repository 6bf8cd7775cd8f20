"""The prefix_affine policy: send a prompt to the prefill worker whose prefix cache most likely
holds its beginning, unless that worker is busier than the cached part is worth.

Prefill workers cache the KV of the prompts they computed (common/kv_cache.py) and skip the
blocks a new prompt shares with one. Balanced by load alone, requests that share a prefix (a
system prompt, a conversation's earlier turns, a document asked about twice) land on every worker
in turn, so each worker computes and caches every prefix: with more prefixes than one worker's
cache holds, they evict each other and few hit. Sent to the worker that has it, each prefix is
computed once, and the workers' caches add up instead of repeating each other. This is SGLang's
cache-aware routing and NVIDIA Dynamo's KV-aware routing, in their simplest form.

Each worker tells the router what its cache gains and loses (P.KVEvents, NVIDIA Dynamo's KV
events): the hash chain of each full block (common/prefix_hash.py). A chain names a block and every
token before it, so a set of them is the worker's cache, and a prompt's leading hashes found in it
are what the worker holds of the prompt (CacheMirror). Beside what was reported, the prompts sent
to a worker count as held for PREDICTED_S, until its events say so: two requests for one document
sent back to back go to the same worker. Until a worker's first events come (or with the router's
--no-kv-events), the router guesses (PrefixIndex) from what it sent each one: the hash chain of
every prompt's full blocks, in the order a worker's pool reuses them (a prompt's partial last
block first, then its full blocks from the last to the first, so its beginning stays longest), at
most as many blocks as the pool holds. The guess drifts where running requests hold blocks while
others come and go, and begins empty when the router restarts; the events do not.

Each candidate scores the cached share of the prompt minus how far its load is above the mean,
relative to the mean but to no less than LOAD_FLOOR requests (the vLLM production stack's
load-aware score, with a floor so that one request in flight does not outweigh a cached
document). Ties go to the worker with more of the prompt cached (a hit saves work, a queue only
waits), then the less loaded, then the one whose cache holds less (a new prefix goes where there
is room), then the first by id.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from typing import Callable

from common import protocol as P
from common.prefix_hash import prefix_hashes

LOAD_WEIGHT = 1.0  # a load this many (relative) means above the others' outweighs a wholly cached prompt
LOAD_FLOOR = 4.0  # below a mean load of this many requests, load differences count against it
MAX_BLOCKS = 256  # of a prompt's beginning, hashed and matched: enough to tell prefixes apart, bounded in cost
PREDICTED_S = 10.0  # a prompt sent counts as held this long, unless the worker's events say so sooner
RESYNC_S = 5.0  # a worker asked for its whole cache is asked again after this long without it
_placeholders = itertools.count()  # keys for blocks without a hash (ints: never equal to a hash's bytes)


class PromptChain:
    """A prompt's block hashes, per block size, computed once per prompt (a request waiting for a
    worker is dispatched again and again)."""

    def __init__(self, token_ids: list[int], known: dict[int, list[bytes]] | None = None):
        self.token_ids = token_ids
        self.by_size: dict[int, list[bytes]] = {}
        self.known = known or {}  # a prefix's chain per block size, continued rather than hashed again

    def hashes(self, block_size: int) -> list[bytes]:
        if block_size not in self.by_size:
            self.by_size[block_size] = prefix_hashes(self.token_ids[:MAX_BLOCKS * block_size + 1], block_size,
                                                     self.known.get(block_size, ()))
        return self.by_size[block_size]

    def extended(self, token_ids: list[int]) -> "PromptChain":
        """The chain of these tokens followed by token_ids (an output, a migrated request's tokens)."""
        return PromptChain(self.token_ids + token_ids, self.by_size)

    def blocks(self, block_size: int) -> int:
        """Blocks the prompt takes in a pool."""
        return -(-len(self.token_ids) // block_size)


class PrefixIndex:
    """What a worker's prefix cache likely holds: the blocks of what it was sent, in the order its
    pool would reuse them, at most `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.blocks: OrderedDict[bytes | int, None] = OrderedDict()  # next to be reused first

    def matched(self, hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt's chain it holds."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def add(self, hashes: list[bytes], blocks: int) -> None:
        """A prompt of `blocks` blocks, `hashes` its leading full ones, computed by the worker: when
        it is freed, its blocks are reused last first, so its beginning stays longest."""
        for _ in range(max(0, blocks - len(hashes))):  # partial or unhashed: reused first
            self.blocks[next(_placeholders)] = None
        for h in reversed(hashes):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class CacheMirror:
    """A worker's prefix cache as its KV events tell it, and the prompts sent to it since."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.held: set[bytes] = set()  # as reported
        self.predicted: OrderedDict[bytes, float] = OrderedDict()  # sent, not yet reported: hash -> when
        self.next_seq: int | None = None  # of the next KVEvents; None: none yet, or one went missing
        self.asked_at = -math.inf  # when a resync was last asked for

    @property
    def blocks(self):
        return self.held

    def matched(self, hashes: list[bytes]) -> int:
        self._expire()
        n = 0
        for h in hashes:
            if h not in self.held and h not in self.predicted:
                break
            n += 1
        return n

    def add(self, hashes: list[bytes], blocks: int) -> None:
        """A prompt sent to the worker: its blocks count as held until its events tell. (blocks:
        PrefixIndex.add's, the prompt's block count; the hashes alone name what a mirror holds.)"""
        now = self.clock()
        for h in hashes:
            if h not in self.held:
                self.predicted[h] = now
                self.predicted.move_to_end(h)

    def apply(self, msg: P.KVEvents) -> bool:
        """Take a KVEvents in. True: ask the worker for its whole cache, one having gone missing
        before this (asked again every RESYNC_S while no reset comes; deltas wait for it)."""
        if msg.reset:
            self.held = set()
        elif msg.seq != self.next_seq:
            now = self.clock()
            ask = self.next_seq is not None or now - self.asked_at >= RESYNC_S
            self.next_seq, self.asked_at = None, now if ask else self.asked_at
            return ask
        self.next_seq = msg.seq + 1
        self.held.difference_update(msg.removed)
        self.held.update(msg.stored)
        for h in msg.stored:  # a removal leaves a prediction be: the prompt sent may be computed again
            self.predicted.pop(h, None)
        return False

    def _expire(self) -> None:
        horizon = self.clock() - PREDICTED_S
        while self.predicted and next(iter(self.predicted.values())) < horizon:
            self.predicted.popitem(last=False)


def told(w) -> bool:
    """Whether w's KV events tell the router what its cache holds (else it is guessed)."""
    return isinstance(w.prefix_index, CacheMirror)


def take_events(w, msg: P.KVEvents) -> bool:
    """A KVEvents from w, whose cache is mirrored from now on. True: ask w for its whole cache."""
    if not told(w):
        w.prefix_index = CacheMirror()
    return w.prefix_index.apply(msg)


def pick_affine(candidates: list, chain: PromptChain, load: Callable[[object], float]):
    """The candidate (a registry Worker, sorted by id) to prefill the prompt."""
    mean = sum(map(load, candidates)) / len(candidates)

    def score(w) -> tuple:
        hashes, idx = chain.hashes(w.block_size), index(w)
        cached = idx.matched(hashes) / len(hashes) if hashes and w.prefix_caching else 0.0
        busier = (load(w) - mean) / max(LOAD_FLOOR, mean)
        return cached - LOAD_WEIGHT * busier, cached, -load(w), -len(idx.blocks)

    return max(candidates, key=score)  # the first of equals: the lowest id


def cached_tokens(w, chain: PromptChain | None) -> int:
    """How many of the prompt's leading tokens w's prefix cache likely holds."""
    if chain is None or not w.prefix_caching:
        return 0
    return index(w).matched(chain.hashes(w.block_size)) * w.block_size


def remember(w, chain: PromptChain) -> None:
    """The prompt went to w: its cache will hold it (if it keeps one)."""
    if w.prefix_caching:
        index(w).add(chain.hashes(w.block_size), chain.blocks(w.block_size))


def index(w) -> PrefixIndex | CacheMirror:
    if w.prefix_index is None:
        w.prefix_index = PrefixIndex(w.total_blocks)
    return w.prefix_index
