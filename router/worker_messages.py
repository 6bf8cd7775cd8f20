"""What the router does with each message from its workers: registration (a worker of another
model, dtype or KV layout is refused, a live worker's id is not taken twice), heartbeats and the
pulses that beat for a long step, the tokens of each attempt put in order and sent on, a worker
that holds a request, one that is leaving (a planned stop) or is lost, and the errors workers
report. Router (router/server.py) has these methods from WorkerMessages; the state they act on
is its own: its registry, placement, requests, backend socket (the worker port), clients (the
client port, router/zmq_front.py), prompts, metrics and cfg, and its request methods (reply,
done, error, retry, _cancel_work)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable

from common import protocol as P, pulse
from common.channel import Envelope
from router.prefix_affinity import take_events
from router.registry import PREFILL_ROLES, Worker, invariance_split, layout_conflict
from router.request_log import client_name

if TYPE_CHECKING:
    from router.server import Request

log = logging.getLogger("pdserve.router")
DEAD_WORKER_MEMORY_S = 300.0  # how long `pdserve status` still lists a dead worker
# What a client at the worker port is told: it would otherwise wait
WORKER_PORT = ("this is the router's worker port; clients connect to its client port (--port; the worker port is "
               "--worker-port, by default --port + 1)")
DECODE_FAULTS = ("NO_ROOM", "LAYOUT_MISMATCH")  # WorkerError codes that say the decode worker cannot take it
HANDOFF_FAULTS = ("TIMEOUT", "TRANSFER_FAILED")  # a prefill worker's: its KV did not reach the decode worker


class WorkerMessages:
    """Router's methods for its workers' messages."""

    async def _backend_loop(self):
        while True:
            env = await self.backend.arecv()
            try:
                self.on_worker(env)
            except Exception:
                log.exception("worker message handling failed")
            # arecv does not yield while messages wait: let the HTTP streams write what this one
            # gave them now, as ZeroMQ replies go at once, not after the whole backlog
            await asyncio.sleep(0)

    def on_worker(self, env: Envelope):
        if env.error is not None:
            log.warning("dropped a bad worker message: %s", env.error)
            return
        msg = env.msg
        if isinstance(msg, P.Register):
            self.register(env.sender, msg)
            return
        w = self.registry.by_identity(env.sender)
        beating_for = pulse.worker_identity(env.sender) if w is None else None
        if beating_for is not None:
            # a worker's pulse, beating for it during a long step (common/pulse.py): never answered
            w = self.registry.by_identity(beating_for)
            if w is None or not w.alive or not isinstance(msg, (P.Heartbeat, P.Holding)):
                return
        elif isinstance(msg, P.CLIENT_MESSAGES):  # a client given this port by mistake: it would wait forever
            self._send(self.backend, P.Error(P.reply_id(msg), "INVALID_ARGUMENT", WORKER_PORT),
                       env.sender)
            return
        elif w is None or not w.alive:
            # A worker we do not know (the router restarted, or it was declared dead): make it
            # register again, under a new incarnation. Said once: after a restart, each worker's
            # messages sent while no router was there arrive at once, hundreds of them.
            sent = self._send(self.backend, P.Shutdown("re-register"), env.sender, quiet=True)
            if env.sender not in self._told_to_rejoin:
                if len(self._told_to_rejoin) > 10_000:  # (one a worker incarnation: bounded)
                    self._told_to_rejoin.clear()
                self._told_to_rejoin.add(env.sender)
                log.info("told %s, which this router does not know, to register anew%s",
                         client_name(env.sender), "" if sent else " (it could not be reached)")
            return
        w.last_seen = time.monotonic()
        if isinstance(msg, P.Heartbeat):
            w.queued, w.held, w.running, w.free_blocks = msg.queued, msg.held, msg.running, msg.free_blocks
            self.metrics.on_heartbeat(w, msg)
        elif isinstance(msg, P.WorkerTokens):
            self.on_tokens(w, msg)
        elif isinstance(msg, P.WorkerTokenBatch):
            with self.clients.batched():
                for item in P.unbatch_tokens(msg):
                    if isinstance(item, P.ProtocolError):
                        log.warning("dropped a bad item of %s's tokens: %s", w.worker_id, item)
                    else:
                        self.on_tokens(w, item)
        elif isinstance(msg, P.WorkerError):
            self.on_worker_error(w, msg)
        elif isinstance(msg, P.Holding):
            self.on_holding(w, msg)
        elif isinstance(msg, P.Leaving):
            self.on_leaving(w, msg)
        elif isinstance(msg, P.KVEvents) and self.kv_events:
            if take_events(w, msg):
                self.metrics.kv_event_resyncs.inc()
                self._send(self.backend, P.KVEventsResync(), w.identity)

    def register(self, identity: bytes, msg: P.Register):
        problem = None
        if msg.role not in ("prefill", "decode", "mono"):
            problem = f"role={msg.role!r}; allowed: prefill, decode, mono"
        elif msg.role != "prefill" and not msg.kv_address.startswith(("tcp://", "ipc://")):
            problem = f"kv_address={msg.kv_address!r}; allowed: tcp://HOST:PORT or ipc://PATH"
        elif msg.total_blocks < 1 or msg.block_size < 1:
            problem = f"total_blocks={msg.total_blocks}, block_size={msg.block_size}; both must be >= 1"
        if problem:
            log.warning("refused a registration from %r: %s", identity, problem)
            return
        if msg.model and msg.model != self.prompts.model_config.fingerprint:
            log.error("refused worker %s: it serves model %r, the router %r", msg.worker_id, msg.model,
                      self.prompts.model_config.fingerprint)
            self._send(self.backend, P.Shutdown(f"model mismatch: router serves {self.cfg.model}"), identity)
            return
        joining = Worker(msg.worker_id, msg.role, msg.incarnation, identity, msg.device, msg.total_blocks,
                         msg.block_size, msg.kv_address, list(msg.kv_transports), kv_dtype=msg.kv_dtype,
                         batch_invariant=msg.batch_invariant, free_blocks=msg.total_blocks,
                         prefix_caching=msg.prefix_caching, max_model_len=msg.max_model_len)
        conflict = layout_conflict(list(self.registry.workers.values()), joining)
        if conflict is not None:
            log.error("refused worker %s: %s", msg.worker_id, conflict)
            self._send(self.backend, P.Shutdown(conflict), identity)
            return
        old = self.registry.workers.get(msg.worker_id)
        if old is not None and old.alive and old.incarnation == msg.incarnation:
            if old.identity == identity:
                # its Register again, sent before our Registered reached it (a worker asks every 0.5 s until
                # answered): its record stays, and with it the requests it holds, re-dispatched if it dies
                return self._registered(msg, identity)
            # a worker's socket is its id and incarnation, for its life: another peer that names them (they
            # are in `pdserve status`) would take its place, and its requests would wait out their deadlines
            log.warning("refused a registration from %r as worker %s: that worker is live, on another connection",
                        identity, msg.worker_id)
            return
        if old is not None and old.alive and old.incarnation != msg.incarnation:
            if not old.leaving:
                # Another process with a live worker's id: a second worker started with the same --worker-id
                # (before, each displaced the other every heartbeat and every request failed), or one that
                # restarted before its last incarnation timed out, which joins once it does.
                if (msg.worker_id, msg.incarnation) not in self._said_taken:
                    self._said_taken.add((msg.worker_id, msg.incarnation))
                    log.warning("worker %s (incarnation %s) waits: its id is a live worker's (incarnation %s)",
                                msg.worker_id, msg.incarnation, old.incarnation)
                self._send(self.backend, P.Error(None, "ALREADY_EXISTS", (
                    f"the worker id {msg.worker_id!r} is a live worker's (incarnation {old.incarnation}, heard from "
                    f"{time.monotonic() - old.last_seen:.1f} s ago); this worker joins once that one is gone (silent "
                    f"for the router's --heartbeat-timeout). To run both, give this one another --worker-id")),
                    identity)
                return
            self.worker_lost(old, "restarted under a new incarnation")
        self._said_taken.discard((msg.worker_id, msg.incarnation))
        self.registry.workers[msg.worker_id] = w = joining
        self.placement.forget(msg.worker_id)
        log.info("worker %s registered: role=%s device=%s blocks=%d (%s) kv=%s by %s", msg.worker_id, msg.role,
                 msg.device, msg.total_blocks, w.kv_name(), msg.kv_address or "-", ",".join(msg.kv_transports) or "-")
        self._fit_context()
        split = invariance_split(list(self.registry.workers.values()))
        if split is not None and msg.worker_id in split[0] + split[1]:
            log.warning("workers disagree on batch invariance (on: %s; off: %s): a request's tokens then depend on "
                        "the workers it meets. Start every worker with the same --batch-invariant or --no-batch-invariant",
                        ", ".join(split[0]), ", ".join(split[1]))
        self._registered(msg, identity)

    def _registered(self, msg: P.Register, identity: bytes):
        self._send(self.backend, P.Registered(msg.worker_id, msg.incarnation, self.kv_events and msg.prefix_caching),
                   identity)

    def _fit_context(self):
        """Admit the context every known worker serves. A worker may serve less than the router was
        told (started with another --max-model-len, or a GPU worker whose KV pool holds less: see
        Engine._auto_num_blocks); past it, that worker would refuse a prompt or end an output early,
        and a migrated request's output would depend on the workers it met. A dead worker counts
        until it is forgotten (DEAD_WORKER_MEMORY_S): it is likely to come back as it was. One that
        left when told to stop no longer counts: it was stopped, and comes back, if at all, with
        its own registration."""
        served = {w.worker_id: w.max_model_len for w in self.registry.workers.values()
                  if w.max_model_len and (w.alive or not w.leaving)}
        context = min([self.configured_context, *served.values()])
        if context < self.prompts.context:
            least = [name for name, n in sorted(served.items()) if n == context]
            log.warning("worker %s serves a context of %d tokens; the router admits %d from now on (was %d): longer "
                        "prompts are refused, outputs end there with finish_reason 'length'. Give every worker the "
                        "router's --max-model-len and a KV pool that holds it", ", ".join(least), context, context,
                        self.prompts.context)
        elif context > self.prompts.context:
            log.info("no worker known serves less than %d tokens now: the router admits %d again", context, context)
        self.prompts.context = context

    def worker_lost(self, w: Worker, why: str, died: bool = True):
        """w is gone (died: not by leaving gracefully): what it held is re-dispatched."""
        w.lost()
        if died:
            self.metrics.worker_deaths.inc()
        (log.warning if died else log.info)("worker %s %s (%s); %d requests to recover", w.worker_id,
                                             "lost" if died else "left", why, len(w.assigned))
        for rid in sorted(w.assigned):
            req = self.requests.get(rid)
            if req is not None:
                self.retry(req, f"worker {w.worker_id} {why}", planned=not died)
        w.assigned.clear()

    def on_tokens(self, w: Worker, msg: P.WorkerTokens):
        req = self.requests.get(msg.request_id)
        if req is None or msg.attempt != req.attempt:
            return  # a finished, cancelled or abandoned attempt
        now = time.monotonic()
        req.worker_timings.update(msg.timings)
        if req.expected_cached is not None and type(msg.timings.get("cached_tokens")) is int:
            (expected, most), req.expected_cached = req.expected_cached, None
            self.metrics.prefix_mispredicted.inc(abs(expected - min(msg.timings["cached_tokens"], most)))
        if req.state == "prefill":
            req.state = "decode"
        if w.worker_id == req.decode_worker and w.worker_id != req.prefill_worker:
            # Tokens from the decode worker: the KV arrived, the prefill worker is done with it.
            pw = self.registry.workers.get(req.prefill_worker)
            if pw is not None:
                pw.assigned.discard(req.rid)
        req.deadline = now + self.cfg.decode_stall_timeout_s
        if msg.prompt_logprobs is not None and req.prompt_logprobs is None and req.params.prompt_logprobs is not None:
            req.prompt_logprobs = msg.prompt_logprobs
        logprobs = msg.logprobs or ()
        for i, t in enumerate(msg.token_ids):
            if msg.index + i >= len(req.tokens):
                req.pending[msg.index + i] = (t, logprobs[i] if i < len(logprobs) else None)
        if msg.finish_reason is not None:
            req.finish_at, req.finish_reason = msg.index + len(msg.token_ids), msg.finish_reason
        start = len(req.tokens)
        while len(req.tokens) in req.pending:
            token, logprob = req.pending.pop(len(req.tokens))
            req.tokens.append(token)
            if req.logprobs is not None:
                req.logprobs.append(logprob)
            if req.text is not None and req.text.add(token):  # a stop string: the workers need not go on
                req.finish_at, req.finish_reason = len(req.tokens), "stop"
                req.pending.clear()
                self._cancel_work(req)
                break
        if len(req.tokens) > start:
            self.metrics.on_tokens(req, now, len(req.tokens) - start)
            if req.stream:
                self.reply(req, P.Token(req.client_request_id, start, req.tokens[start:],
                                        req.text.delta() if req.text is not None else "",
                                        None if req.logprobs is None else req.logprobs[start:],
                                        req.prompt_logprobs if start == 0 else None))
            if req.first_token_at is None:
                req.first_token_at = now
                req.router_s += time.monotonic() - now
            req.last_token_at = now
        if req.finish_at is not None and len(req.tokens) >= req.finish_at:
            del req.tokens[req.finish_at:]
            if req.logprobs is not None:
                del req.logprobs[req.finish_at:]
            self.done(req, req.finish_reason)

    def on_holding(self, w: Worker, msg: P.Holding):
        """A live worker of their attempt holds these requests: queued or progressing, not lost.
        Their deadlines wait (they catch a request no worker holds, not a busy cluster)."""
        now = time.monotonic()
        for item in msg.requests if isinstance(msg.requests, list) else ():
            if not (isinstance(item, list) and len(item) == 2):
                continue
            req = self.requests.get(item[0]) if isinstance(item[0], str) else None
            if req is None or req.attempt != item[1] or w.worker_id not in (req.prefill_worker, req.decode_worker):
                continue
            if req.state in ("prefill", "decode"):
                wait = self.cfg.prefill_timeout_s if req.state == "prefill" else self.cfg.decode_stall_timeout_s
                req.deadline = max(req.deadline, now + wait)

    def on_leaving(self, w: Worker, msg: P.Leaving):
        """w was told to stop: no new work for it; once gone, what it held is re-dispatched now."""
        if msg.gone:
            w.leaving = w.left = True  # (an idle worker leaves at once, without saying it is leaving first)
            if msg.idle:  # what it prefilled for another worker is that one's now
                w.assigned = {rid for rid in w.assigned if (req := self.requests.get(rid)) is not None
                              and req.decode_worker == w.worker_id}
            self.worker_lost(w, "told to stop", died=False)
            return self._fit_context()
        if not w.leaving:
            w.leaving = True
            log.info("worker %s is leaving: it finishes its %d requests and gets no new work", w.worker_id,
                     len(w.assigned))
        self._send(self.backend, P.Leaving(w.worker_id), w.identity)

    def on_worker_error(self, w: Worker, msg: P.WorkerError):
        req = self.requests.get(msg.request_id)
        if req is None or msg.attempt != req.attempt:
            return
        if msg.code == "INVALID_ARGUMENT":
            self.error(req, msg.code, msg.message)
        else:
            # the decode worker's own fault (its pool, its model) holds for every prefill worker, and the
            # prefill worker's own pool for every decode worker
            decode_fault, prefill_fault = msg.code in DECODE_FAULTS, msg.code == "PREFILL_NO_ROOM"
            if msg.code in HANDOFF_FAULTS and req.decode_worker not in (None, w.worker_id):
                self.placement.handoff_failed(w.worker_id, req.decode_worker, f"{msg.code}: {msg.message}")
            req.failed_pairs.add(("*" if decode_fault else req.prefill_worker,
                                  "*" if prefill_fault else req.decode_worker))
            why = f"{msg.code} from {req.decode_worker if decode_fault else w.worker_id}: {msg.message}"
            # every worker registered (a dead one may come back) that could take that side has failed it
            if decode_fault and not self._untried(req, ("decode", "mono"), lambda d: ("*", d)):
                return self.error(req, "UNAVAILABLE", f"no decode worker can take this request; {why}")
            prefilling = PREFILL_ROLES if self.cfg.enforce_disagg else PREFILL_ROLES + ("decode",)
            if prefill_fault and not self._untried(req, prefilling, lambda p: (p, "*")):
                return self.error(req, "UNAVAILABLE", f"no worker can prefill this request; {why}")
            self.retry(req, why)

    def _untried(self, req: Request, roles: tuple, failed: Callable[[str], tuple]) -> bool:
        """Whether a registered worker of these roles has not failed req (failed(id): its entry in
        req.failed_pairs)."""
        return any(w.role in roles and failed(w.worker_id) not in req.failed_pairs
                   for w in self.registry.workers.values())
