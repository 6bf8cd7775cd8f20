"""Where a request's next attempt goes: a prefill worker and the decode worker it sends the KV to,
or a decode worker that prefills the request itself (a local prefill).

Pairs are picked by the router's policy (router/registry.py) among those that can hand KV over:
the same KV dtype and block size, a transport in common, and not failed for this request before.

A local prefill is NVIDIA Dynamo's conditional disaggregation. A short prompt costs a decode worker
little to compute, while its handoff (a reservation's round trip, the transfer, a second worker's
queue) costs about as much as the prefill; and a decode worker's prefix cache holds the prompts
it was sent and the outputs it decoded, so a conversation's next turn is mostly cached on the
worker that decoded the last. Up to max_local_prefill_length tokens to compute (past what the
decode worker likely holds, as prefix_affine mirrors it) go to a decode worker, and so does
every request while each prefill worker holds max_prefill_queue or more (a burst starts on every
worker at once instead of queueing behind the prefill workers). Unless
disaggregation is enforced, a decode worker also prefills what no prefill worker can take: none
is alive (all restarting), or every one has failed the request. A live prefill worker that cannot
hand a decode worker KV (no transport in common: another dtype or block size is refused when it
registers) is still sent the request, and says why it fails: a misconfiguration to see, not to
serve around in silence.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from common.errors import InvalidArgument
from router.prefix_affinity import PromptChain, cached_tokens, remember, told
from router.registry import PREFILL_ROLES, Registry, Worker, load, missing_roles

if TYPE_CHECKING:
    from router.server import Request

log = logging.getLogger("pdserve.router")
# A pair whose handoff failed (the prefill worker could not reach the decode worker's KV ingress, or
# had no acknowledgement in time) is left out of new placements this long, while another can serve:
# otherwise each request placed there waited out the transfer timeout before its retry elsewhere.
FAILING_PAIR_S = 60.0


def check_flags(max_local_prefill_length: int, max_prefill_queue: int, enforce_disagg: bool) -> None:
    """InvalidArgument where the router's placement flags contradict each other."""
    local = [f"{flag} {n}" for flag, n in (("--max-local-prefill-length", max_local_prefill_length),
                                           ("--max-prefill-queue", max_prefill_queue)) if n]
    if enforce_disagg and local:
        raise InvalidArgument(f"{local[0]} with --enforce-disagg: the one has decode workers prefill, the other "
                              "never; allowed: one of them", param="--enforce-disagg")


class Placement:
    def __init__(self, registry: Registry, max_local_prefill_length: int = 0, enforce_disagg: bool = False,
                 max_prefill_queue: int = 0):
        check_flags(max_local_prefill_length, max_prefill_queue, enforce_disagg)
        self.registry = registry
        self.local_limit = max_local_prefill_length
        self.enforce_disagg = enforce_disagg
        self.queue_limit = max_prefill_queue
        self.failing: dict[tuple[str, str], float] = {}  # (prefill, decode) -> until when it is left out

    def handoff_failed(self, prefill: str, decode: str, why: str) -> None:
        """A handoff from prefill to decode failed: leave the pair out of new placements for a while."""
        if self.failing.get((prefill, decode), 0.0) < time.monotonic():
            log.warning("a handoff from %s to %s failed (%s): new requests avoid that pair for %.0f s where another "
                        "serves", prefill, decode, why, FAILING_PAIR_S)
        self.failing[(prefill, decode)] = time.monotonic() + FAILING_PAIR_S

    def forget(self, worker_id: str) -> None:
        """A worker (re)registered: its pairs' failures were its last incarnation's."""
        self.failing = {pair: until for pair, until in self.failing.items() if worker_id not in pair}

    def _avoided(self) -> set[tuple[str, str]]:
        if not self.failing:
            return set()
        now = time.monotonic()
        self.failing = {pair: until for pair, until in self.failing.items() if until > now}
        return set(self.failing)

    def missing(self, workers) -> list[str]:
        """The roles these workers lack to serve a request ("prefill", "decode"; none: they serve)."""
        return missing_roles((w.role for w in workers), decode_prefills=not self.enforce_disagg)

    def place(self, req: Request) -> tuple[Worker, Worker] | None:
        """(prefill worker, decode worker) for req's next attempt, the same worker twice where it
        runs the whole request (mono, or a local prefill); None while no live worker can."""
        decoders = self.registry.serving(("decode",))
        chain = self._chain(req)
        p = d = self._local(req, decoders, chain)
        if p is None:
            avoid = self._avoided()
            p, d = self._remote(req, decoders, chain, avoid)
            if (p is None or d is None) and avoid:  # none but a failing pair: it may work again
                p, d = self._remote(req, decoders, chain, set())
        if p is None or d is None:
            return None
        req.expected_cached = None
        if chain is not None:
            most = min(len(chain.hashes(p.block_size)) * p.block_size, len(req.prompt_ids))
            req.expected_cached = min(cached_tokens(p, chain), most), most
            remember(p, chain)
            if d is not p and self.local_limit:  # the KV it receives joins its prefix cache
                remember(d, chain)
        return p, d

    def _remote(self, req: Request, decoders: list[Worker], chain: PromptChain | None,
                avoid: set[tuple[str, str]]) -> tuple[Worker | None, Worker | None]:
        """A prefill worker and the decode worker it hands req's KV to, by the policy."""
        def ok(p: Worker, d: Worker) -> bool:
            return pairs(req, p, d) and (p.worker_id, d.worker_id) not in avoid
        p = self.registry.pick(PREFILL_ROLES, lambda p: any(ok(p, d) for d in ([p] if p.role == "mono" else decoders)),
                               prompt=chain)
        if p is None or p.role == "mono":
            return p, p
        return p, self.registry.pick(("decode",), lambda d: ok(p, d))

    def finished(self, req: Request) -> None:
        """req ended on its decode worker, whose prefix cache now holds its output too: the
        beginning of a conversation's next turn (guessed; a worker that sends KV events told it)."""
        d = self.registry.workers.get(req.decode_worker)
        if req.chain is not None and req.tokens and self.local_limit and d is not None and d.alive and not told(d):
            done = len(req.chain.token_ids) - len(req.prompt_ids)  # tokens its chain holds already
            remember(d, req.chain.extended(req.tokens[done:]))

    def _local(self, req: Request, decoders: list[Worker], chain: PromptChain | None) -> Worker | None:
        """The decode worker to prefill req itself, or None."""
        if self.enforce_disagg or not decoders:
            return None
        prefillers = self.registry.serving(PREFILL_ROLES)
        remote = any(untried(req, p, d) for p in prefillers for d in ([p] if p.role == "mono" else decoders))
        if remote and self.queue_limit and all(load(p) >= self.queue_limit for p in prefillers):
            remote = False  # every prefill worker has a queue: a decode worker starts it now instead
        length, limit = len(req.prompt_ids) + len(req.tokens), self.local_limit
        if remote and (not limit or (length > limit and chain is None)):
            return None
        d = self.registry.pick(("decode",), lambda d: untried(req, d, d), prompt=chain)
        if remote and length > limit and length - cached_tokens(d, chain) > limit:
            return None
        return d

    def _chain(self, req: Request) -> PromptChain | None:
        """What prefix_affine routes req by: the tokens its prefill computes, unless the prefix cache
        cannot serve it (prompt logprobs need every position's logits; a re-prefill asks for none)."""
        if self.registry.policy != "prefix_affine" or asks_prompt_logprobs(req):
            return None
        if req.chain is None:
            req.chain = PromptChain(req.prompt_ids + req.tokens)
        elif len(req.chain.token_ids) != len(req.prompt_ids) + len(req.tokens):  # migrating with more tokens
            req.chain = req.chain.extended(req.tokens[len(req.chain.token_ids) - len(req.prompt_ids):])
        return req.chain


def asks_prompt_logprobs(req: Request) -> bool:
    """Whether req's next prefill computes its prompt's logprobs: asked for, and not yet received
    (a re-prefill after a migration does not compute them again)."""
    return req.params.prompt_logprobs is not None and req.prompt_logprobs is None


def pairs(req: Request, p: Worker, d: Worker) -> bool:
    """Whether to send req's KV from p to d: they hold KV alike (dtype, block size), share a KV
    transport (by name: whether it works between their hosts only p can tell), and req has not
    failed between them already."""
    shared = not p.kv_transports or not d.kv_transports or set(p.kv_transports) & set(d.kv_transports)
    return bool(shared) and p.kv_fits(d) and untried(req, p, d)


def untried(req: Request, p: Worker, d: Worker) -> bool:
    """Whether req has not failed between p and d (and d has not refused it whoever prefilled, nor
    p's own pool whatever the decode worker)."""
    return not {(p.worker_id, d.worker_id), ("*", d.worker_id), (p.worker_id, "*")} & req.failed_pairs
