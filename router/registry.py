"""The router's view of its workers: who is registered, how loaded, when last heard from, and
the balancing policies that pick among them."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from router.prefix_affinity import CacheMirror, PrefixIndex, PromptChain, pick_affine

PREFILL_ROLES = ("prefill", "mono")
DECODE_ROLES = ("decode", "mono")
POLICIES = ("least_loaded", "round_robin", "prefix_affine")  # prefix_affine: router/prefix_affinity.py


@dataclass
class Worker:
    worker_id: str
    role: str
    incarnation: str
    identity: bytes  # the worker's DEALER identity on the router's backend socket
    device: str
    total_blocks: int
    block_size: int
    kv_address: str
    kv_transports: list[str] = field(default_factory=list)  # what it sends (prefill) or receives (decode) KV by
    kv_dtype: str = ""  # its KV pool's dtype ("": not said, an older worker)
    batch_invariant: bool | None = None  # its kernels' rounding does not depend on the batch (None: not said)
    registered_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    queued: int = 0
    running: int = 0
    held: int = 0  # prefilled, their KV kept for a decode worker (P.Heartbeat)
    free_blocks: int = 0
    assigned: set[str] = field(default_factory=set)  # router request ids in this worker's hands
    alive: bool = True
    leaving: bool = False  # told to stop, it finishes what it holds and takes no new work (P.Leaving)
    left: bool = False  # stopped as it was told: not an outage (its gauges are left out of the metrics)
    counters: dict = field(default_factory=dict)  # its heartbeat's counters, last seen (router/metrics.py)
    prefix_caching: bool = True  # it keeps a prefix cache (started without --no-prefix-caching)
    prefix_index: PrefixIndex | CacheMirror | None = None  # prefix_affine: what its prefix cache holds
    max_model_len: int = 0  # the context it serves, prompt and output (0: not said)

    def lost(self) -> None:
        """Gone, dead or left: nothing of its last heartbeat stands (its requests move elsewhere, its
        pool is dropped), so its gauges and status read idle until it registers again."""
        self.alive = False
        self.queued = self.running = self.held = 0
        self.free_blocks = self.total_blocks

    def describe(self, now: float) -> dict:
        return {"worker_id": self.worker_id, "role": self.role, "incarnation": self.incarnation,
                "device": self.device, "alive": self.alive, "leaving": self.leaving, "queued": self.queued,
                "held": self.held, "running": self.running, "assigned": len(self.assigned),
                "free_blocks": self.free_blocks,
                "total_blocks": self.total_blocks, "kv_address": self.kv_address, "kv_transports": self.kv_transports,
                "kv_dtype": self.kv_dtype, "block_size": self.block_size, "batch_invariant": self.batch_invariant,
                "prefix_caching": self.prefix_caching, "max_model_len": self.max_model_len,
                "kv_sent": {key[1]: n for key, n in self.counters.items()  # KV bytes sent by transport
                            if isinstance(key, tuple) and key[0] == "kv_bytes"},
                "heartbeat_age_s": round(now - self.last_seen, 3)}

    def kv_fits(self, other: "Worker") -> bool:
        """Whether KV moves between the two as it is: the same block size and dtype (an older
        worker that does not say its dtype is taken at its word when the KV arrives)."""
        return self.block_size == other.block_size and (not self.kv_dtype or not other.kv_dtype
                                                         or self.kv_dtype == other.kv_dtype)

    def kv_name(self) -> str:
        return f"{self.kv_dtype or 'unsaid-dtype'} KV in {self.block_size}-token blocks"


def load(w: Worker) -> float:
    """How busy a worker is: the router's own count is current; the heartbeat's queue adds what it cannot see."""
    return len(w.assigned) + w.queued / 2


def missing_roles(alive_roles, decode_prefills: bool = False) -> list[str]:
    """What a cluster lacks to serve, by the roles of its live workers: "prefill", "decode", both or
    none. decode_prefills: a decode worker prefills what no prefill worker can take (the router
    runs without --enforce-disagg), so decode workers alone serve."""
    alive = set(alive_roles)
    prefill = PREFILL_ROLES + ("decode",) if decode_prefills else PREFILL_ROLES
    return [what for roles, what in ((prefill, "prefill"), (DECODE_ROLES, "decode")) if not alive & set(roles)]


def invariance_split(workers: list[Worker]) -> tuple[list[str], list[str]] | None:
    """(ids of workers running the batch-invariant kernels, ids of those that are not) where live
    workers disagree, else None. Where they do, a request's tokens depend on the workers it meets:
    the promise of the same tokens in any batch, topology and migration no longer holds."""
    on = sorted(w.worker_id for w in workers if w.alive and w.batch_invariant is True)
    off = sorted(w.worker_id for w in workers if w.alive and w.batch_invariant is False)
    return (on, off) if on and off else None


def layout_conflict(workers: list[Worker], joining: Worker) -> str | None:
    """Why worker `joining` cannot serve beside the live workers, else None: it computes in
    another dtype than theirs (a request's tokens would depend on the worker it meets), or it is a
    prefill or decode worker whose KV does not fit the other role's (kv_fits: it moves between
    them as it is, so every handoff would fail). The live workers set both; a launch starts its
    workers alike, so this catches a worker started by hand with other flags."""
    others = [w for w in workers if w.alive and w.worker_id != joining.worker_id]
    clash = next((w for w in others if joining.kv_dtype and w.kv_dtype and w.kv_dtype != joining.kv_dtype), None)
    if clash is not None:
        return (f"it computes in {joining.kv_dtype}, live worker {clash.worker_id} in {clash.kv_dtype}: a request's "
                f"tokens would depend on the worker it meets; allowed: --dtype {clash.kv_dtype}")
    peer = {"prefill": "decode", "decode": "prefill"}.get(joining.role)
    clash = next((w for w in others if w.role == peer and not joining.kv_fits(w)), None)
    if clash is not None:  # (the dtypes agree: the block sizes differ)
        return (f"its KV comes in {joining.block_size}-token blocks, {peer} worker {clash.worker_id}'s in "
                f"{clash.block_size}: KV cannot move between them; allowed: --block-size {clash.block_size}")
    return None


class Registry:
    def __init__(self, policy: str = "least_loaded"):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is not supported; allowed: {', '.join(POLICIES)}")
        self.policy = policy
        self.workers: dict[str, Worker] = {}
        self._turns: dict[tuple, itertools.count] = {}  # round_robin: one turn per role set

    def alive(self, roles) -> list[Worker]:
        return [w for w in self.workers.values() if w.alive and w.role in roles]

    def serving(self, roles) -> list[Worker]:
        """The live workers of these roles that take new work (not leaving)."""
        return [w for w in self.alive(roles) if not w.leaving]

    def pick(self, roles, fits: Callable[[Worker], bool] | None = None,
             prompt: PromptChain | None = None) -> Worker | None:
        """A live worker of these roles taking new work, by the policy among those that fit if any
        do (if none does, among all: the worker then says why it cannot, which the caller passes
        on). prompt: what the worker will prefill, for prefix_affine (without it, that policy is
        least_loaded); the caller tells prefix_affinity.remember where it went."""
        candidates = sorted(self.serving(roles), key=lambda w: w.worker_id)
        if fits is not None:
            candidates = [w for w in candidates if fits(w)] or candidates
        if not candidates:
            return None
        if self.policy == "round_robin":
            return candidates[next(self._turns.setdefault(tuple(roles), itertools.count())) % len(candidates)]
        if self.policy == "prefix_affine" and prompt is not None:
            return pick_affine(candidates, prompt, load)
        return min(candidates, key=lambda w: (load(w), w.worker_id))

    def by_identity(self, identity: bytes) -> Worker | None:
        for w in self.workers.values():
            if w.identity == identity:
                return w
        return None
