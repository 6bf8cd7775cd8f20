"""What the prefill and decode workers share: the engine, the link to the router (register,
heartbeat, re-register under a new incarnation when the router no longer knows us), and the main
loop, which is short on purpose:

    while running:
        poll sockets (no wait while the engine has work)  ->  handle messages
        engine.step()                                      ->  handle outputs
        heartbeat, leases, retries                          (on_tick)

One thread, and each socket is used by it alone; while one step runs longer than a heartbeat's
interval, a thread of its own beats for it (common/pulse.py).

Told to stop (SIGTERM, as Kubernetes does, or SIGINT), a worker leaves gracefully: it tells the
router (P.Leaving), which sends it no new work, finishes what it holds for up to --drain-timeout,
and says it is gone; what it still holds is then re-dispatched at once. A second signal, or a
router that does not answer, stops it at once.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from common import protocol as P
from common.channel import Channel, Envelope, Waker
from common.config import EngineConfig
from common.engine import Engine, RequestOutput, freeze_startup_objects
from common.pulse import Pulse
from common.security import HANDSHAKE_EVENTS, close_context, refusal
from common.signals import DRAIN_TIMEOUT_S, StopSignals, stop_signals
from common.step_trace import StepTrace

log = logging.getLogger("pdserve.worker")

IDLE_POLL_MS = 10  # no work: wait this long for a message before the next tick
# Work that cannot run yet (no blocks to admit a request to while others are held for transfers):
# what frees them comes as a message, a wake, or by on_tick's polls. Not 0: that spins a core.
STALLED_POLL_MS = 1
HOLDING_S = 1.0  # how often a worker tells the router which attempts it holds (P.Holding)
KV_EVENTS_MAX = 65536  # block hashes in one KVEvents (about 1.2 MB): a whole cache may take several
KV_EVENTS_S = 0.05  # a cache's changes wait up to this long to go together, unless a prefill just ended
LEAVING_ACK_S = 1.0  # a leaving worker the router has not answered by then stops at once
NO_ROUTER_S = 10.0  # a worker no router answers says so this often
# its last P.Leaving goes at once to a live router; to one that has gone too, it would wait for good
GOODBYE_LINGER_MS = 100


@dataclass
class WorkerConfig:
    router: str = "tcp://127.0.0.1:7101"  # the router's worker address
    engine: EngineConfig = field(default_factory=EngineConfig)
    worker_id: str | None = None
    host: str = "127.0.0.1"  # where a decode worker binds its KV ingress
    kv_port: int = 0  # its port (0: any free one, which it tells the router)
    heartbeat_interval_s: float = 0.2
    step_timeout_s: float = 120.0  # one step running longer is hung: its pulse stops (common/pulse.py)
    kv_lease_s: float = 30.0  # reserved blocks come back if no KV arrives by then
    transfer_timeout_s: float = 30.0  # a prefill gives up a transfer not acknowledged by then
    kv_stream: bool = True  # a prefill sends KV layer by layer during the forward pass
    drain_timeout_s: float = DRAIN_TIMEOUT_S  # told to stop, finish what it holds this long (0: stop at once)
    max_kv_frame_bytes: int = 2**31
    threads: int | None = None  # torch intra-op threads


class WorkerBase:
    role = "worker"

    def __init__(self, cfg: WorkerConfig):
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.engine = Engine(cfg.engine)
        self.engine.finds_stop_strings = False  # the router finds them for the whole cluster
        # the host's name too: in containers every worker may be PID 1
        self.worker_id = cfg.worker_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.waker = Waker()  # wake(): news from another thread ends the poll at once
        self.poller.register(self.waker.fd, zmq.POLLIN)
        self.handlers: dict[zmq.Socket, tuple[Channel, callable]] = {}
        self.router: Channel | None = None
        self.stopping = False
        self.stops = StopSignals()  # SIGTERM / SIGINT taken: the first leaves gracefully, a second at once
        self.leaving: tuple[float, float] | None = None  # (drain deadline, answer deadline): leaving
        self.refused: str | None = None  # why the router sent us away (run() then exits 1)
        self.kv_address = ""
        self.kv_bytes: dict[str, int] = {}  # KV bytes sent, by transport (prefill), for the router's metrics
        self.stalled = False  # the last step had work but ran nothing
        self.pulse = Pulse(self.ctx, cfg.router, cfg.heartbeat_interval_s, cfg.step_timeout_s, self.worker_id)
        self._connect_router()

    # ------------------------------------------------------------------ sockets

    def watch(self, chan: Channel, handler):
        self.poller.register(chan.sock, zmq.POLLIN)
        self.handlers[chan.sock] = (chan, handler)

    def unwatch(self, chan: Channel):
        self.poller.unregister(chan.sock)
        self.handlers.pop(chan.sock, None)
        chan.close()

    def _connect_router(self):
        if self.router is not None:
            self.unwatch(self.router)
        self.incarnation = uuid.uuid4().hex[:12]
        self.identity = f"{self.worker_id}/{self.incarnation}".encode()
        self.router = Channel.connect(self.ctx, zmq.DEALER, self.cfg.router, identity=self.identity, end="worker",
                                      monitor=HANDSHAKE_EVENTS)
        self._refused: str | None = None  # why the router refused our handshake, from the monitor
        self.watch(self.router, self._on_router)
        self.pulse.forget()
        self._beat = self._held = None  # the last Heartbeat and Holding sent: the pulse repeats them
        self._counted_before = self._counters()  # a heartbeat's counters count from this incarnation's start
        self.registered = False
        self.kv_events_seq: int | None = None  # the next KVEvents' seq; None: the router asked for none
        self._kv_events_at = 0.0  # when the last KVEvents went
        self.engine.block_manager.changes = None
        self._last_register = 0.0
        self._unanswered_since: float | None = None  # registering since then (None: not yet tried)
        self._said_unanswered = 0.0  # when the worker last said no router answers
        self._said_taken = -math.inf  # ... that the router refuses it, its id being a live worker's
        self._last_heartbeat = 0.0
        self._last_holding = 0.0

    def _on_router(self, env: Envelope):
        if env.error is not None:
            log.warning("bad message from the router: %s", env.error)
            return
        msg = env.msg
        if isinstance(msg, P.Registered):
            self.registered = msg.incarnation == self.incarnation
            if self.registered:
                log.info("%s registered (incarnation %s)", self.worker_id, self.incarnation)
                if msg.kv_events:
                    self._send_kv_events(reset=True)
        elif isinstance(msg, P.KVEventsResync):
            if self.kv_events_seq is not None:
                log.warning("the router missed KV events from %s; sending its whole prefix cache", self.worker_id)
                self._send_kv_events(reset=True)
        elif isinstance(msg, P.Shutdown):
            if msg.reason == "re-register":
                log.warning("the router does not know %s; dropping its work and registering anew", self.worker_id)
                self.drop_all_work()
                self._connect_router()
            else:
                log.error("router asked %s to stop: %s", self.worker_id, msg.reason)
                self.stopping, self.refused = True, msg.reason
        elif isinstance(msg, P.Leaving):
            if self.leaving is not None:
                self.leaving = (self.leaving[0], math.inf)  # answered: it sends us nothing new
        elif isinstance(msg, P.Error) and msg.code == "ALREADY_EXISTS":  # our id is a live worker's: wait it out
            self._unanswered_since = None  # answered: not the warning that no router answers
            now = time.monotonic()
            if now - self._said_taken >= NO_ROUTER_S:
                self._said_taken = now
                log.warning("%s: the router refuses to register it: %s", self.worker_id, msg.message)
        elif isinstance(msg, P.Error):  # no router's worker port answers so: --router names another port
            log.error("%s: %s answers %s: %s", self.worker_id, self.cfg.router, msg.code, msg.message)
            self.stopping, self.refused = True, msg.message
        else:
            self.on_router(msg)

    def to_router(self, msg):
        self.router.try_send(msg)

    def _send_kv_events(self, reset: bool = False, wait: bool = False):
        """Tell the router how the prefix cache changed (reset: all it holds), if it asked. wait:
        not within KV_EVENTS_S of the last (a decode step's output blocks need not go one by one)."""
        if self.kv_events_seq is None and not reset:
            return
        now = time.monotonic()
        if reset:
            self.kv_events_seq = self.kv_events_seq or 0
            stored, removed = self.engine.block_manager.watch(), []
        elif wait and now - self._kv_events_at < KV_EVENTS_S:
            return
        else:
            stored, removed = self.engine.block_manager.take_changes()
            if not stored and not removed:
                return
        for i in range(0, max(1, len(stored)), KV_EVENTS_MAX):
            self.to_router(P.KVEvents(self.worker_id, self.kv_events_seq, stored[i:i + KV_EVENTS_MAX],
                                      removed if i == 0 else [], reset and i == 0))
            self.kv_events_seq += 1
        self._kv_events_at = now

    def kv_transports(self) -> list[str]:
        """What this worker moves KV by, fastest first, for the router to pair workers that share one."""
        return []

    def _say_if_unanswered(self, now: float):
        """A worker whose registrations no router answers (a --router naming another port, or a
        router not started yet) says so every NO_ROUTER_S, rather than waiting in silence. A router
        that refuses its handshake (CURVE keys) is said at once: waiting cannot change that."""
        refused = self._refused
        while self.router.monitor.poll(0):
            event = recv_monitor_message(self.router.monitor)["event"]
            self._refused = refusal(event, "worker") if event != zmq.EVENT_HANDSHAKE_SUCCEEDED else None
        if self._unanswered_since is None:
            self._unanswered_since = self._said_unanswered = now
        newly_refused = self._refused is not None and self._refused != refused
        if not newly_refused and now - self._said_unanswered < NO_ROUTER_S:
            return
        self._said_unanswered = now
        if self._refused is not None:
            log.error("%s: the router at %s refuses to talk: %s; still trying", self.worker_id, self.cfg.router,
                      self._refused)
            return
        log.warning("%s: no router has answered at %s for %.0f s; still trying. Is that the router's worker "
                    "port (its --worker-port: by default its --port + 1; the launchers print 'workers join "
                    "at ...')?", self.worker_id, self.cfg.router, now - self._unanswered_since)

    def _register(self, now: float):
        self._last_register = now
        e = self.engine
        # never waits: one the socket cannot take now goes again in 0.5 s, and a router that is not
        # there, or refuses this worker, must not hold the loop (_say_if_unanswered says which)
        self.router.send_nowait(P.Register(self.role, self.worker_id, self.incarnation, str(e.config.torch_device),
                                           e.num_blocks, e.config.block_size, self.kv_address,
                                           e.model_config.fingerprint, self.kv_transports(), e.config.dtype,
                                           e.batch_invariant, e.config.enable_prefix_caching, e.max_model_len))

    # ------------------------------------------------------------------ the loop

    def run(self, stopped_before: Callable[[], bool] = lambda: False) -> int:
        """Serve until SIGTERM, SIGINT or the router refuses us; the process's exit status.
        stopped_before: whether a SIGTERM came before these handlers (the CLI's start-up handler
        notes one), asked once they are in place, so that none falls between."""
        for sig in stop_signals():
            signal.signal(sig, self._on_signal)
        if stopped_before():
            self.stops.take()
        log.info("%s %s on %s: %s, %d KV blocks%s", self.role, self.worker_id, self.engine.config.torch_device,
                 self.engine.config.model, self.engine.num_blocks,
                 ", async scheduling" if self.engine.config.async_scheduling else "")
        trace = StepTrace.from_env(self.worker_id, self.engine.config.block_size)
        self.engine.runner.timing = trace is not None
        freeze_startup_objects()
        try:
            while not self.stopping:
                for sock, _ in self.poller.poll(self.poll_timeout()):
                    if sock == self.waker.fd:
                        self.waker.drain()
                        continue
                    chan, handler = self.handlers.get(sock, (None, None))
                    for _ in range(1000):  # drain, but never starve the engine
                        env = chan.recv(0) if chan is not None and sock in self.handlers else None
                        if env is None:
                            break
                        self.handle(handler, env)
                if self.engine.has_unfinished():
                    start = self.pulse.step_started = time.monotonic()  # the pulse speaks for a long step
                    outputs = self.step()
                    stepped, self.pulse.step_started = time.monotonic(), None
                    self.stalled = not (outputs or self.engine.last_batch or self.engine.inflight)
                    if self.kv_events_seq is not None:  # before the tokens: a prefill's blocks, by its end
                        self._send_kv_events(wait=not self.prefill_ended(outputs))
                    self.on_outputs(outputs)
                    if trace is not None:
                        trace.record(start, stepped, time.monotonic(), self.engine.last_batch,
                                     self.engine.runner.last_gpu_ms)
                self._tick(time.monotonic())
        finally:
            if trace is not None:
                trace.close()
            self.close()
        return 1 if self.refused else 0

    def _on_signal(self, *_):
        self.stops.take()
        self.waker.wake_from_signal()

    def _leave(self, now: float):
        """Told to stop: leave the router's rotation, finish what it holds, then go (see above)."""
        if self.leaving is None:
            if self.stops.count > 1 or not self.registered or self.cfg.drain_timeout_s <= 0 or self.idle():
                self.stopping = True
            else:
                log.info("%s leaving: no new work; finishing what it holds, for up to %g s (--drain-timeout)",
                         self.worker_id, self.cfg.drain_timeout_s)
                self.to_router(P.Leaving(self.worker_id))
                self.leaving = (now + self.cfg.drain_timeout_s, now + LEAVING_ACK_S)
        elif self.stops.count > 1 or self.idle() or now > min(self.leaving):
            why = ("a second signal" if self.stops.count > 1 else "done" if self.idle() else
                   "no answer from the router" if now > self.leaving[1] else "--drain-timeout")
            log.info("%s leaving now (%s)", self.worker_id, why)
            self.stopping = True
        if self.stopping and self.registered:  # what it holds is re-dispatched at once
            self.to_router(P.Leaving(self.worker_id, gone=True, idle=self.idle()))

    def idle(self) -> bool:
        """Whether it holds no request (nothing a graceful stop waits for)."""
        return not self.engine.has_unfinished() and not self.holding()

    def poll_timeout(self) -> int:
        """Milliseconds the loop waits for a message: none while the engine has work to step."""
        if not self.engine.has_unfinished():
            return IDLE_POLL_MS
        return STALLED_POLL_MS if self.stalled else 0

    def _tick(self, now: float):
        said = False
        if self.stops.count:
            self._leave(now)
        self._send_kv_events(wait=True)  # what the last steps changed, and what changed outside a step
        if not self.registered and now - self._last_register > 0.5:
            self._register(now)
            self._say_if_unanswered(now)
        if self.registered and now - self._last_heartbeat > self.cfg.heartbeat_interval_s:
            self._last_heartbeat = now
            s, bm = self.engine.scheduler, self.engine.block_manager
            queries, hits, kv_bytes, spec_decode, preemptions = self._counters_since_registering()
            beat = P.Heartbeat(self.worker_id, self.incarnation, len(s.waiting), len(s.running), bm.num_free_blocks,
                               bm.num_blocks, queries, hits, kv_bytes, spec_decode, held=len(self.engine.held),
                               preemptions=preemptions)
            self.to_router(beat)
            self._beat, said = beat, True
        if self.registered and now - self._last_holding > HOLDING_S:
            self._last_holding = now
            held = self.holding()
            self._held, said = (P.Holding(self.worker_id, held) if held else None), True
            if held:
                self.to_router(self._held)
        if said:
            self.pulse.repeat(self.identity, *filter(None, (self._beat, self._held)))
        self.on_tick(now)

    def _counters(self) -> tuple[int, int, dict[str, int], list[int], int]:
        """The counters a heartbeat carries, as they stand since the process started."""
        bm, drafter = self.engine.block_manager, self.engine.drafter
        return (bm.prefix_queries, bm.prefix_hits, dict(self.kv_bytes), drafter.counters() if drafter else [],
                self.engine.scheduler.num_preemptions)

    def _counters_since_registering(self) -> tuple[int, int, dict[str, int], list[int], int]:
        """The counters since this incarnation began: the router adds what they grow by to its own
        and starts from zero for a new incarnation (one that registers anew after the router lost
        it or restarted), which would otherwise count the process's whole past again."""
        (queries, hits, kv_bytes, spec, preempted), (queries0, hits0, kv_bytes0, spec0, preempted0) = \
            self._counters(), self._counted_before
        return (queries - queries0, hits - hits0, {t: n - kv_bytes0.get(t, 0) for t, n in kv_bytes.items()},
                [n - (spec0[i] if i < len(spec0) else 0) for i, n in enumerate(spec)], preempted - preempted0)

    @staticmethod
    def handle(handler, env: Envelope) -> None:
        """Give one message to its handler: a message that breaks it never takes the worker down."""
        try:
            handler(env)
        except Exception:
            log.exception("handling %s failed", type(env.msg).__name__)

    def wake(self):
        """Thread-safe: run the loop now (a KV receive finished on another thread)."""
        self.waker.wake()

    def close(self):
        self.pulse.close()  # its socket first: the context's term() waits for every socket
        for chan, _ in list(self.handlers.values()):
            chan.close(GOODBYE_LINGER_MS if chan is self.router and self.stops.count else 0)
        close_context(self.ctx)
        self.waker.close()
        gc.unfreeze()  # (run's freeze: a worker in a test's process goes with its last reference)

    # ------------------------------------------------------------------ for the roles

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def on_router(self, msg):
        raise NotImplementedError

    def on_outputs(self, outputs: list[RequestOutput]):
        raise NotImplementedError

    def on_tick(self, now: float):
        pass

    def prefill_ended(self, outputs: list[RequestOutput]) -> bool:
        """Whether a step's outputs hold a prefill's first token (a prefill worker's all do)."""
        return bool(outputs)

    def holding(self) -> list[list]:
        """[request_id, attempt] of every attempt this worker holds, for P.Holding."""
        return []

    def drop_all_work(self):
        for rid in list(self.engine.requests) + list(self.engine.held):
            self.engine.abort_request(rid)
