"""A worker's pulse: its heartbeat, from a thread of its own, while one long step holds its loop.

The loop tells the router it is alive between steps (common/worker.py), and the router counts a
worker silent for --heartbeat-timeout (2 s) as dead. One healthy step can take longer than that: a
2,048-token prefill chunk of a CPU model takes seconds. Rather than bound every step by the
heartbeat timeout, this thread repeats the loop's last Heartbeat and Holding while a step runs, for
at most --step-timeout seconds. Past that the step counts as hung: the pulse stops, and the router
recovers the worker's requests as it does a silent worker's. A process that dies or is stopped
stops pulsing with it.

ZeroMQ sockets are not thread-safe, so the pulse sends on a DEALER socket of its own, identity
"<worker>/<incarnation>/pulse" (`identity`), from which the router takes only Heartbeat and Holding,
and to which it never answers.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from common.channel import Channel

log = logging.getLogger("pdserve.worker")

SUFFIX = b"/pulse"


def identity(worker_identity: bytes) -> bytes:
    """The pulse socket's identity for a worker's router socket identity."""
    return worker_identity + SUFFIX


def worker_identity(pulse_identity: bytes) -> bytes | None:
    """The worker's router socket identity of a pulse socket's, or None if it is none."""
    return pulse_identity[:-len(SUFFIX)] if pulse_identity.endswith(SUFFIX) else None


class Pulse:
    def __init__(self, ctx: zmq.Context, address: str, interval_s: float, step_timeout_s: float, worker_id: str):
        self.ctx, self.address, self.interval_s, self.step_timeout_s = ctx, address, interval_s, step_timeout_s
        self.worker_id = worker_id
        self._repeat: tuple[bytes, tuple] | None = None  # (router socket identity, messages): swapped whole
        self.step_started: float | None = None  # set by the loop around each step (time.monotonic())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{worker_id}-pulse", daemon=True)
        self._thread.start()

    def repeat(self, worker_identity: bytes, *messages) -> None:
        """What to send for the worker (registered under worker_identity) while a step runs."""
        self._repeat = (worker_identity, messages)

    def forget(self) -> None:
        """Send nothing until told again (the worker registers anew)."""
        self._repeat = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 1)

    def _run(self) -> None:
        chan, sent_as, hung = None, None, None
        try:
            while not self._stop.wait(self.interval_s):
                started, repeat = self.step_started, self._repeat
                running = 0.0 if started is None else time.monotonic() - started
                if running < self.interval_s or repeat is None:
                    continue  # the loop beats between steps itself
                if running > self.step_timeout_s:
                    if hung != started:
                        hung = started
                        log.error("%s: one step has run for %.0f s (--step-timeout): counted hung, its "
                                  "heartbeat stops and the router will recover its requests",
                                  self.worker_id, running)
                    continue
                who, messages = repeat
                if chan is None or sent_as != who:
                    if chan is not None:
                        chan.close()
                    chan, sent_as = Channel.connect(self.ctx, zmq.DEALER, self.address, identity=identity(who),
                                                    end="worker"), who
                    chan.send_wait_s = 0  # a router not reading: drop the beat, never block
                for msg in messages:
                    chan.try_send(msg)
        finally:
            if chan is not None:
                chan.close()
