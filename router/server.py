"""The router process: admits requests from clients, picks a prefill and a decode worker, tracks
each request through its states, streams tokens back in order, and recovers from workers dying.

    client --Generate--> frontend   backend <--Register/Heartbeat/Holding/WorkerTokens(Batch)-- workers
           <--Token/Done--                  --PrefillWork/CancelWork-->

States: queued -> prefill (PrefillWork sent, waiting for the first token) -> decode (tokens
flowing) -> done. Each dispatch of a request is an attempt with its own number; messages from
any attempt but the current one are dropped, so a slow or dead worker's late output can never
duplicate or reorder tokens. Every state has a deadline, held off while a live worker of the
attempt says it holds the request (queued behind others is waiting, not lost); a missed one, or
the death of a worker holding the request, re-dispatches it as prompt + the tokens already
delivered (a migration).
The router never carries KV bytes. What it does with each worker message is router/worker_messages.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq
import zmq.asyncio

from common import protocol as P
from common.channel import Channel
from common.errors import InvalidArgument, port_free
from common.generation_config import sampling_defaults
from common.sampling_params import SamplingParams, fresh_seed
from common.security import close_context
from common.signals import DRAIN_TIMEOUT_S, StopSignals, stop_signals
from router.drain import Drain, drain, unfinished
from router.metrics import RouterMetrics
from router.openai_api import OutputParsers
from router.placement import Placement, asks_prompt_logprobs
from router.prefix_affinity import PromptChain
from router.prompts import Prompts
from router.registry import DECODE_ROLES, PREFILL_ROLES, Registry, Worker
from router.request_log import RequestLog
from router.worker_messages import DEAD_WORKER_MEMORY_S, WorkerMessages
from router.zmq_front import ZmqFront
from common.text import TextStream

log = logging.getLogger("pdserve.router")
TICK_S = 0.05  # how often the router checks deadlines and heartbeats
LOOP_LAG_S = 0.5  # a tick this late: the event loop was held up (a huge request), not the workers
STOP_LINGER_MS = 100  # a stopping router's cancels go at once to live workers; not to wait on gone ones


@dataclass
class RouterConfig:
    model: str = "dummy:nanogpt"
    host: str = "127.0.0.1"
    port: int = 7100  # clients
    worker_port: int = 7101  # workers
    policy: str = "least_loaded"
    max_queue: int = 1024  # requests in the router at once; more get OVERLOADED
    heartbeat_timeout_s: float = 2.0  # a worker silent this long is dead
    # what a request's attempt may wait with no worker of it saying it holds the request (P.Holding)
    prefill_timeout_s: float = 60.0  # dispatch -> first token
    decode_stall_timeout_s: float = 30.0  # longest gap between two tokens
    queue_timeout_s: float = 30.0  # longest wait for a live worker
    max_attempts: int = 3
    max_message_bytes: int = 4 * 2**20  # also the HTTP body limit
    http_port: int | None = None  # the OpenAI-compatible HTTP API and /metrics (router/http.py)
    api_key: str | None = None  # HTTP: required as "Authorization: Bearer <key>" on /v1/
    api_server_count: int = 1  # 1: HTTP served in the router process; N > 1: by N processes (router/api_server.py)
    max_model_len: int | None = None  # the served context, prompt and output (None: the model's)
    allowed_origins: str = "*"  # HTTP: web origins allowed to call it (CORS), comma-separated; "*" any
    served_model_names: tuple[str, ...] = ()  # HTTP: the model's names (the first shown); () is (model,)
    parsers: OutputParsers = OutputParsers()  # HTTP: how the model writes tool calls and reasoning
    # a prompt with at most this many tokens to compute (past what its decode worker's prefix cache
    # likely holds) is prefilled by the decode worker itself, with no KV handoff (0: none)
    max_local_prefill_length: int = 0
    enforce_disagg: bool = False  # never prefill on a decode worker, not even while no prefill worker can
    max_prefill_queue: int = 0  # while every prefill worker holds this many, decode workers prefill (0: never)
    kv_events: bool = True  # prefix_affine: workers tell what their prefix caches hold (else it is guessed)
    log_requests: bool = False  # a log line as each request is admitted, refused and finished; HTTP's access log
    drain_timeout_s: float = DRAIN_TIMEOUT_S  # told to stop, it finishes what it holds for up to this long
    # the sampling a request that leaves it out takes (common/generation_config.py)
    generation_config: str = "auto"  # the model's generation_config.json; "vllm": none; or a directory's
    override_generation_config: dict = field(default_factory=dict)  # fields set over it
    metrics_prefix: str = "pdserve"  # /metrics' names: pdserve:..., or vllm:... for tools made for vLLM's


@dataclass
class Request:
    rid: str
    client: object  # who asked: a ZeroMQ identity (bytes), or the HTTP front
    client_request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    stream: bool
    reply_to: Callable[[object], None] | None = None  # where its Token, Done and Error go (Router.submit sets it)
    arrival: float = field(default_factory=time.monotonic)
    state: str = "queued"
    attempt: int = 0
    moved_by_stops: int = 0  # attempts ended by a worker's planned stop: not counted against max_attempts
    prefill_worker: str | None = None
    decode_worker: str | None = None
    deadline: float = math.inf
    tokens: list[int] = field(default_factory=list)  # delivered to the client, in order
    logprobs: list | None = None  # of tokens, when params.logprobs asks for them
    prompt_logprobs: list | None = None  # when params.prompt_logprobs asks for them
    pending: dict[int, tuple] = field(default_factory=dict)  # (token, logprob) arrived ahead of a gap
    finish_at: int | None = None
    finish_reason: str | None = None
    text: TextStream | None = None  # streamed text and stop strings (None: decoded once, at the end)
    dispatched_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    worker_timings: dict = field(default_factory=dict)
    failed_pairs: set[tuple[str, str]] = field(default_factory=set)  # (prefill, decode) that failed it
    router_s: float = 0.0  # the router's own time on the first-token path: admit + forward
    chain: PromptChain | None = None  # prefix_affine: its prompt's block hashes, made once
    # prefix_affine: (prompt tokens the router took to be cached where it sent the attempt, the most
    # it could tell) until the worker says what it found
    expected_cached: tuple[int, int] | None = None


def check_ports(port: int, worker_port: int, http_port: int | None) -> None:
    """A router's ports, each its own (0: any free one)."""
    taken: dict[int, str] = {}
    for flag, number in (("--port", port), ("--worker-port", worker_port), ("--http-port", http_port)):
        if number and number in taken:
            raise InvalidArgument(f"{flag} {number} is also {taken[number]} (--worker-port defaults to --port + 1); "
                                  "allowed: a port of its own", param=flag)
        taken[number] = flag


class Router(WorkerMessages):
    def __init__(self, cfg: RouterConfig):
        if cfg.api_server_count < 1 or (cfg.api_server_count > 1 and cfg.http_port is None):
            raise InvalidArgument(f"api_server_count={cfg.api_server_count} is invalid; allowed: 1 (HTTP in the "
                                  f"router process) or more (that many API server processes) with an http_port")
        check_ports(cfg.port, cfg.worker_port, cfg.http_port)
        self.cfg = cfg
        defaults = sampling_defaults(cfg.model, cfg.generation_config, cfg.override_generation_config)
        if defaults:
            log.info("requests that leave them out sample with %s (the model's generation config; "
                     "--generation-config vllm for none)", ", ".join(f"{k}={v}" for k, v in defaults.items()))
        self.prompts = Prompts(cfg.model, cfg.max_model_len, defaults)  # its tokenizer and model_config: the router's
        self.configured_context = self.prompts.context  # prompts.context: the least of it and the workers' (_fit_context)
        self.registry = Registry(cfg.policy)
        self._said_taken: set[tuple[str, str]] = set()  # (worker id, incarnation) refused as a live worker's id
        self.placement = Placement(self.registry, cfg.max_local_prefill_length, cfg.enforce_disagg,
                                   cfg.max_prefill_queue)
        self.kv_events = cfg.kv_events and cfg.policy == "prefix_affine"  # workers tell their prefix caches
        self.requests: dict[str, Request] = {}
        self.by_client: dict[tuple[bytes, str], str] = {}
        # Request ids, with a tag of this router's: a worker that still holds a request of the router
        # before it (a step that outlasted the restart) must not take this router's for it.
        self._ids = map(f"{secrets.token_hex(3)}-{{}}".format, itertools.count())
        self.ctx = zmq.asyncio.Context()
        # Messages over max_message_bytes get an error naming the limit; ZeroMQ itself drops a peer
        # sending frames over 4x that, before they are buffered whole.
        hard_cap = 4 * cfg.max_message_bytes
        with port_free(cfg.host, cfg.port, "--port"):
            self.frontend = Channel.bind(self.ctx, zmq.ROUTER, f"tcp://{cfg.host}:{cfg.port}",
                                         max_frame_bytes=hard_cap, max_header_bytes=cfg.max_message_bytes,
                                         end="router_clients")
        self.clients = ZmqFront(self, self.frontend)  # what comes in at that port, and goes back
        with port_free(cfg.host, cfg.worker_port, "--worker-port"):
            self.backend = Channel.bind(self.ctx, zmq.ROUTER, f"tcp://{cfg.host}:{cfg.worker_port}",
                                        max_frame_bytes=hard_cap, max_header_bytes=cfg.max_message_bytes,
                                        end="router_workers")
        self.metrics = RouterMetrics(self)
        self.request_log = RequestLog(cfg.log_requests)
        # until then a role no worker has registered for may be one whose workers served an earlier
        # router and are registering anew (within ~50 ms of its start): requests wait for them
        self.rejoin_until = 0.0
        self._told_to_rejoin: set[bytes] = set()  # worker identities told so (said once each)
        self.stopping: Drain | None = None  # told to stop: it admits nothing new (router/drain.py)
        self.http = self.api_servers = None
        if cfg.http_port is not None and cfg.api_server_count > 1:
            from router.api_server import ApiServers

            address = self.frontend.address.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")  # they run here
            with port_free(cfg.host, cfg.http_port, "--http-port"):
                self.api_servers = ApiServers(cfg.api_server_count, address, cfg.model, cfg.host,
                                              cfg.http_port, cfg.max_queue, cfg.max_message_bytes, cfg.api_key,
                                              self.prompts.context, cfg.allowed_origins, cfg.served_model_names,
                                              cfg.parsers, on_exit=self.clients.gone, access_log=cfg.log_requests,
                                              sampling_defaults=self.prompts.defaults)
        elif cfg.http_port is not None:
            from router.http import HttpFront, LocalBackend  # aiohttp is imported only where HTTP is served

            self.http = HttpFront(LocalBackend(self), cfg.host, cfg.http_port, cfg.api_key, cfg.max_message_bytes,
                                  allowed_origins=cfg.allowed_origins, served_model_names=cfg.served_model_names,
                                  parsers=cfg.parsers, access_log=cfg.log_requests)

    # ------------------------------------------------------------------ plumbing

    def serving(self) -> tuple[list[Worker], list[str]]:
        """The workers that take work (alive, not leaving), and the roles they lack to serve: what
        /health, `pdserve status` and a request that waited for a worker in vain all report."""
        serving = self.registry.serving(PREFILL_ROLES + DECODE_ROLES)
        return serving, self.placement.missing(serving)

    def _send(self, chan: Channel, msg, to: bytes, quiet: bool = False) -> bool:
        """quiet: the caller says the peer is gone in a line of its own."""
        try:
            chan.post(msg, to=to)
            return True
        except zmq.ZMQError as e:  # the peer is gone (ROUTER_MANDATORY)
            if not quiet:
                log.warning("dropped %s to %r: %s", type(msg).__name__, to, e)
            return False

    def requests_of(self, client: bytes) -> list[Request]:
        return [self.requests[rid] for (c, _), rid in self.by_client.items() if c == client]

    def status(self, ask_id: str | None = None) -> P.StatusReply:
        """What `pdserve status` and the SDK's status() show."""
        now = time.monotonic()
        workers = [w.describe(now) for w in sorted(self.registry.workers.values(), key=lambda w: w.worker_id)]
        queued = sum(r.state == "queued" for r in self.requests.values())
        serving, missing = self.serving()
        return P.StatusReply(workers, queued, len(self.requests) - queued, self.prompts.context, missing,
                             self.cfg.model, ask_id, self.cfg.policy, self.cfg.kv_events, len(serving),
                             self.stopping is not None)

    def reply(self, req: Request, msg):
        req.reply_to(msg)

    def error(self, req: Request, code: str, message: str, logged: bool = True):
        """logged: False where the caller logs one line for many."""
        self.reply(req, P.Error(req.client_request_id, code, message))
        self.metrics.on_error(code)
        self.request_log.failed(req, code, message, logged)
        self._finish(req)

    def done(self, req: Request, reason: str):
        """Finish req with its tokens so far: Done to the client."""
        text = (req.text.final() if req.text is not None else
                self.prompts.output_text(req.tokens, req.params, req.prompt_ids))
        stop_reason = req.text.stop_reason if req.text is not None else None
        reason = req.text.finish_reason(reason) if req.text is not None else reason
        if stop_reason is None and reason == "stop" and req.tokens and req.tokens[-1] in req.params.stop_token_ids:
            stop_reason = req.tokens[-1]
        self.reply(req, P.Done(req.client_request_id, reason, req.tokens, text, req.prompt_ids, self._timings(req),
                               req.logprobs, req.prompt_logprobs, stop_reason))
        self.metrics.on_done(req, reason)
        self.request_log.finished(req, reason)
        self.placement.finished(req)
        self._finish(req)

    def _finish(self, req: Request):
        self.requests.pop(req.rid, None)
        self.by_client.pop((req.client, req.client_request_id), None)
        for w in self.registry.workers.values():
            w.assigned.discard(req.rid)
        req.state = "done"

    async def serve(self, stop: asyncio.Event | None = None, on_ready: Callable[[str], None] | None = None,
                    stop_now: asyncio.Event | None = None):
        """Serve until stop is set, then drain (router/drain.py) until stop_now is, or it is done."""
        stop, stop_now = stop or asyncio.Event(), stop_now or asyncio.Event()
        if self.http is not None:
            with port_free(self.cfg.host, self.cfg.http_port, "--http-port"):
                await self.http.start()
        if self.api_servers is not None:
            await self.api_servers.start()
        tasks = [asyncio.ensure_future(t) for t in (self.clients.serve(), self._backend_loop(), self._monitor_loop())]
        where = f"clients at {self.frontend.address}, workers at {self.backend.address}"
        if self.http is not None:
            where += f", HTTP at {self.http.url}"
        elif self.api_servers is not None:
            where += f", HTTP at {self.api_servers.url} ({self.cfg.api_server_count} API server processes)"
        self.rejoin_until = time.monotonic() + min(self.cfg.heartbeat_timeout_s, self.cfg.queue_timeout_s)
        log.info("router ready: %s", where)
        if on_ready is not None:
            on_ready(where)
        why = "the router was stopped"
        try:
            await stop.wait()
            why = await drain(self, stop_now)
        finally:
            for req in list(self.requests.values()):  # no one is left to take their tokens: workers free them
                self._cancel_work(req)
                self.error(req, "UNAVAILABLE", unfinished(why), logged=False)
            # then HTTP: what its handlers were just told still goes out, and their cancels reach no worker
            if self.http is not None:
                await self.http.close()
            if self.api_servers is not None:  # told after the errors above, which they so read first
                for server in self.api_servers.identities():
                    self._send(self.frontend, P.Shutdown("the router is stopping"), server, quiet=True)
                await self.api_servers.close()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.frontend.close(STOP_LINGER_MS)
            self.backend.close(STOP_LINGER_MS)
            close_context(self.ctx)

    # ------------------------------------------------------------------ requests

    def submit(self, client, client_request_id: str, ids: list[int], params: SamplingParams, stream: bool,
               reply_to: Callable[[object], None] | None = None, received: float | None = None) -> bool:
        """Admit a validated request and dispatch it. Its replies (Token if stream, then Done or
        Error) go to reply_to, in-process (the HTTP front), or else back to the ZeroMQ identity
        client. False if refused (the Error went to reply_to too)."""
        received = received or time.monotonic()
        reply_to = reply_to or self.clients.reply_to(client, False)

        def refuse(code, text):
            reply_to(P.Error(client_request_id, code, text))
            self.metrics.on_error(code)
            self.request_log.refused(client, client_request_id, code, text)
            return False

        if self.stopping is not None:
            self.stopping.refused += 1
            return refuse("UNAVAILABLE", self.stopping.refusal())
        if (client, client_request_id) in self.by_client:
            return refuse("INVALID_ARGUMENT", f"request_id={client_request_id!r} is already in flight")
        if (stalled := self.clients.stalled(client)) is not None:
            return refuse("UNAVAILABLE", stalled)
        if len(self.requests) >= self.cfg.max_queue:
            return refuse("OVERLOADED", f"the router holds {len(self.requests)} requests, its limit "
                                        f"(max_queue={self.cfg.max_queue}); retry later")
        # None ever registered: say so now, past the time an earlier router's workers take to
        # rejoin this one. Some did but are down: they may be restarting, so the request waits
        # (dispatch queues it) up to queue_timeout_s.
        never = self._never_registered()
        if never and time.monotonic() >= self.rejoin_until:
            return refuse("UNAVAILABLE", never)
        req = Request(next(self._ids), client, client_request_id, ids, params,
                      params.seed if params.seed is not None else fresh_seed(), stream, reply_to, arrival=received)
        if params.logprobs is not None:
            req.logprobs = []
        if self.prompts.tokenizer is not None and (stream or params.stop):
            req.text = TextStream.for_params(self.prompts.tokenizer, params, self.prompts.model_config.eos_token_ids,
                                             ids)
        self.requests[req.rid] = req
        self.by_client[(client, client_request_id)] = req.rid
        self.request_log.admitted(req)
        self.dispatch(req)
        if req.dispatched_at is not None:
            req.router_s += time.monotonic() - received
        return True

    def cancel(self, client, client_request_id: str):
        rid = self.by_client.get((client, client_request_id))
        if rid is None:
            return
        req = self.requests[rid]
        self._cancel_work(req)
        self.done(req, "cancelled")

    def _never_registered(self) -> str | None:
        """What is missing if no worker of a role the requests need has ever registered, else None."""
        never = self.placement.missing(self.registry.workers.values())
        if not never:
            return None
        return "no worker has registered" if len(never) == 2 else f"no {never[0]} worker has registered"

    def _cancel_work(self, req: Request):
        for wid in {req.prefill_worker, req.decode_worker} - {None}:
            w = self.registry.workers.get(wid)
            if w is not None and w.alive:
                self._send(self.backend, P.CancelWork(req.rid, req.attempt), w.identity)

    # ------------------------------------------------------------------ dispatch

    def _already_finished(self, req: Request) -> str | None:
        """A migrating request whose delivered tokens already end it (its Done was lost with its worker)."""
        if not req.tokens:
            return None
        if req.tokens[-1] in req.params.stop_ids(self.prompts.model_config.eos_token_ids):
            return "stop"
        if len(req.tokens) >= req.params.max_tokens or \
                len(req.prompt_ids) + len(req.tokens) >= self.prompts.context:
            return "length"
        return None

    def dispatch(self, req: Request):
        """Send req (prompt + tokens delivered so far) to a prefill worker, naming its decode worker,
        or to a decode worker to prefill itself (router/placement.py)."""
        reason = self._already_finished(req)
        if reason is not None:
            return self.done(req, reason)
        placed = self.placement.place(req)
        if placed is None:
            if req.state != "queued" or math.isinf(req.deadline):  # it waits --queue-timeout from now, not arrival
                req.state, req.deadline = "queued", time.monotonic() + self.cfg.queue_timeout_s
            return
        p, d = placed
        if p is d and p.role == "decode":
            self.metrics.local_prefills.inc()
        req.attempt += 1
        req.state = "prefill"
        req.prefill_worker, req.decode_worker = p.worker_id, d.worker_id
        req.deadline = time.monotonic() + self.cfg.prefill_timeout_s
        req.pending.clear()
        req.dispatched_at = req.dispatched_at or time.monotonic()
        p.assigned.add(req.rid)
        d.assigned.add(req.rid)
        sampling = req.params.to_dict()
        if not asks_prompt_logprobs(req):  # none asked, or a migration: they came with the first attempt
            sampling["prompt_logprobs"] = None
        self._send(self.backend, P.PrefillWork(req.rid, req.attempt, req.prompt_ids + req.tokens, len(req.prompt_ids),
                                               sampling, req.seed, d.worker_id, d.kv_address), p.identity)

    def retry(self, req: Request, why: str, planned: bool = False):
        """planned: a worker's planned stop ended the attempt (SIGTERM, a rolling restart), which is
        no failure of the request: it does not count against --max-attempts."""
        self._cancel_work(req)
        for w in self.registry.workers.values():
            w.assigned.discard(req.rid)
        req.moved_by_stops += planned
        if req.attempt - req.moved_by_stops >= self.cfg.max_attempts:
            return self.error(req, "UNAVAILABLE", f"gave up after {req.attempt - req.moved_by_stops} failed attempts "
                                                  f"(the router's --max-attempts); last: {why}")
        self.metrics.on_retry(req)
        failed_attempt = req.attempt
        self.dispatch(req)
        self.request_log.redispatched(req, failed_attempt, why)

    # ------------------------------------------------------------------ time

    async def _monitor_loop(self):
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            lag, last = now - last - TICK_S, now
            if lag > LOOP_LAG_S:
                # Heartbeats may wait unread in the socket: the router's own stall is no worker's silence.
                log.warning("the router's event loop was held up %.1f s; workers' silence counted from now", lag)
                for w in self.registry.alive(PREFILL_ROLES + DECODE_ROLES):
                    w.last_seen = max(w.last_seen, now - self.cfg.heartbeat_timeout_s / 2)
            try:
                self.tick(now)
            except Exception:
                log.exception("monitor tick failed")

    def tick(self, now: float):
        for w in list(self.registry.workers.values()):
            if w.alive and now - w.last_seen > self.cfg.heartbeat_timeout_s:
                self.worker_lost(w, f"silent for {now - w.last_seen:.1f}s")
            elif not w.alive and now - w.last_seen > DEAD_WORKER_MEMORY_S:
                del self.registry.workers[w.worker_id]  # long gone: forget it
                self._fit_context()
        never = self._never_registered() if now >= self.rejoin_until else None
        for req in list(self.requests.values()):
            if never and req.state == "queued":  # admitted while workers might have been rejoining
                self.error(req, "UNAVAILABLE", never)
                continue
            if now < req.deadline:
                continue
            if req.state == "queued":
                missing = self.serving()[1]
                self.error(req, "UNAVAILABLE", f"no live {' or '.join(missing) or 'worker'} worker "
                                               f"for {self.cfg.queue_timeout_s}s")
            else:
                self.retry(req, f"{req.state} deadline passed")
        for req in list(self.requests.values()):
            if req.state == "queued":
                self.dispatch(req)
        self.clients.probe(now)

    # ------------------------------------------------------------------ text and timings

    def _timings(self, req: Request) -> dict:
        now = time.monotonic()
        t = dict(req.worker_timings)
        t.update(attempts=req.attempt, e2e_s=now - req.arrival, router_s=req.router_s)
        if req.dispatched_at is not None:
            t["queue_s"] = req.dispatched_at - req.arrival
        if req.first_token_at is not None:
            t["ttft_s"] = req.first_token_at - req.arrival
            if len(req.tokens) > 1:
                t["tpot_s"] = (now - req.first_token_at) / (len(req.tokens) - 1)
        return t


def run_router(cfg: RouterConfig):
    import uvloop

    async def main():
        router = Router(cfg)
        stop, stop_now = asyncio.Event(), asyncio.Event()
        stops = StopSignals()

        def signalled():  # the first drains, a second stops at once
            (stop if stops.take() == 1 else stop_now).set()

        loop = asyncio.get_running_loop()
        for sig in stop_signals():
            loop.add_signal_handler(sig, signalled)
        await router.serve(stop, on_ready=lambda where: print(f"router: {where}", flush=True), stop_now=stop_now)

    uvloop.run(main())
