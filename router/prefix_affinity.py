"""The prefix_affine policy: send a prompt to the prefill worker whose prefix cache most likely
holds its beginning, unless that worker is busier than the cached part is worth.

Prefill workers cache the KV of the prompts they computed (common/kv_cache.py) and skip the
blocks a new prompt shares with one. Balanced by load alone, requests that share a prefix (a
system prompt, a conversation's earlier turns, a document asked about twice) land on every worker
in turn, so each worker computes and caches every prefix: with more prefixes than one worker's
cache holds, they evict each other and few hit. Sent to the worker that has it, each prefix is
computed once, and the workers' caches add up instead of repeating each other. This is SGLang's
cache-aware routing and NVIDIA Dynamo's KV-aware routing, in their simplest form.

The router cannot see the workers' caches, so it remembers what it sent each one: the hash chain
of every prompt's full blocks (common/prefix_hash.py, the hashes the workers' caches use), least
recently sent forgotten first, at most as many blocks as the worker's pool holds. Each candidate
scores the cached share of the prompt minus how far its load is above the mean, relative to the
mean (the vLLM production stack's load-aware score, weight 1): a worker holding the whole prompt
wins while its load is within one mean of the others'. Ties go to the worker with more of the
prompt cached (a hit saves work, a queue only waits), then the less loaded, then the first by id.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from common.prefix_hash import prefix_hashes

LOAD_WEIGHT = 1.0  # how much a load one mean above the others' outweighs: a wholly cached prompt


class PrefixIndex:
    """The block hashes a worker was sent, least recently sent first, at most `capacity`: what
    its prefix cache likely holds (it, too, reuses the least recently freed blocks first)."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def matched(self, hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt's chain it holds."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def pick_affine(candidates: list, token_ids: list[int], load: Callable[[object], float]):
    """The candidate (a registry Worker, sorted by id) to prefill token_ids; it remembers them."""
    chains: dict[int, list[bytes]] = {}  # by block size
    mean = sum(map(load, candidates)) / len(candidates)

    def chain(w) -> list[bytes]:
        if w.block_size not in chains:
            chains[w.block_size] = prefix_hashes(token_ids, w.block_size)
        return chains[w.block_size]

    def score(w) -> tuple[float, float, float]:
        hashes = chain(w)
        cached = index(w).matched(hashes) / len(hashes) if hashes else 0.0
        return cached - LOAD_WEIGHT * (load(w) - mean) / max(1.0, mean), cached, -load(w)

    best = max(candidates, key=score)  # the first of equals: the lowest id
    index(best).add(chain(best))
    return best


def index(w) -> PrefixIndex:
    if w.prefix_index is None:
        w.prefix_index = PrefixIndex(w.total_blocks)
    return w.prefix_index
