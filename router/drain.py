"""A router told to stop (SIGTERM, or Ctrl-C run alone) drains before it goes, as its workers do:
it admits no new request (UNAVAILABLE; over HTTP a 503 with Retry-After, and /health answers 503 so
that a load balancer sends its traffic elsewhere) and finishes those it holds, for up to its
--drain-timeout (vLLM's --shutdown-timeout). It stops waiting sooner once no worker is left to
serve what it holds (a worker that is leaving still finishes what it holds), and at once on a
second signal. What it still holds then ends UNAVAILABLE, each client told, and one line says how many.

Why: a router restarted to change a flag or to upgrade it cut every stream in flight, and its SDK
clients learned of it only when their connection was found lost."""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("pdserve.router")
STOPPING = "the router is stopping: it finishes the requests it holds and admits no new one"
POLL_S = 0.05  # how often the drain looks whether what the router holds has finished


class Drain:
    """A stopping router's drain: since when, until when, and what it refused meanwhile."""

    def __init__(self, held: int, timeout_s: float):
        self.started = time.monotonic()
        self.timeout_s = timeout_s
        self.deadline = self.started + timeout_s
        self.held = held  # requests held as it began
        self.refused = 0  # new requests refused meanwhile

    def refusal(self) -> str:
        return (f"{STOPPING} (it waits up to {self.timeout_s:g}s, its --drain-timeout); retry once it has "
                "restarted, or on another router")

    def why_not_waiting(self, held: int, with_workers: int, missing: list[str], now_too: bool,
                        workers_stopped: bool = False) -> str | None:
        """Why the drain ends now, or None while it waits: requests held, how many of them a worker
        holds (a worker that is leaving still finishes them), the roles no live worker serves,
        whether a second signal came, and whether the workers not alive all stopped as told."""
        if not held:
            return "done"
        if now_too:
            return "a second signal came"
        if missing and not with_workers:
            why = f"no live {' or '.join(missing)} worker was left to finish the request"
            return why + (" (the workers stopped as told, at their --drain-timeout)" if workers_stopped else "")
        if time.monotonic() >= self.deadline:
            return f"its --drain-timeout, {self.timeout_s:g}s, passed"
        return None

    def report(self, held: int, why: str) -> str:
        """The line that ends the drain; what is still held ends with `unfinished(why)`."""
        took = time.monotonic() - self.started
        refused = f"; it refused {self.refused} new ones meanwhile" if self.refused else ""
        if not held:
            return f"router stopping: the {self.held} requests it held ended in {took:.1f}s{refused}"
        return (f"router stopping: {held} of the {self.held} requests it held are unfinished after {took:.1f}s "
                f"({why}); they end UNAVAILABLE{refused}")


def unfinished(why: str) -> str:
    """What a client whose request the stopping router did not finish is told."""
    return f"the router stopped before this request finished: {why}"


async def drain(router, now_too: asyncio.Event) -> str:
    """Drain router (router/server.py's Router): returns why the drain ended ("done" if it holds
    nothing). now_too: set by a second signal."""
    d = router.stopping = Drain(len(router.requests), router.cfg.drain_timeout_s)
    if d.held:
        log.info("router stopping: finishing the %d requests it holds, for up to %gs (--drain-timeout); new ones "
                 "are refused; a second signal stops it at once", d.held, d.timeout_s)
    while True:
        with_workers = sum(req.state != "queued" for req in router.requests.values())
        gone = [w for w in router.registry.workers.values() if not w.alive]
        why = d.why_not_waiting(len(router.requests), with_workers, router.serving()[1], now_too.is_set(),
                                bool(gone) and all(w.left for w in gone))
        if why is not None:
            break
        try:
            await asyncio.wait_for(now_too.wait(), POLL_S)
        except asyncio.TimeoutError:
            pass
    if d.held:
        (log.info if why == "done" else log.warning)("%s", d.report(len(router.requests), why))
    return why
