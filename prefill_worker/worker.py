"""The prefill worker: batches prompts into packed prefill steps, samples each request's first
token, reports it to the router at once (time to first token does not wait for the transfer),
and pushes the KV straight to the decode worker the router named:

    on accepting the work:  KVReserve -> (decode) KVGrant(blocks, transports)
                                       | KVRefuse(BUSY: queued there; the KVGrant comes when room frees)
    once prefilled and granted:  the KV by the fastest transport both ends support
                                 (common/kv_transport/), then KVTransfer(header) -> KVAck -> free our blocks

The reservation is asked for when the work arrives, so the grant's round trip overlaps the
prefill instead of following it; a request that ends at its first token sends KVRelease. A busy
decode worker queues the reservation and grants it when room frees; we ask again every REASK_S
(a lost message, a restarted peer), and each answer renews our deadline: waiting for room is
queueing, not a failure. Our Holding messages tell the router the same. Once granted, a lease
is renewed every third of it (the same KVReserve: the decode worker extends its lease and grants
the same blocks again, which renews our deadline too) until the KV is acknowledged, so a prefill
longer than one lease (a long prompt on a CPU) keeps its blocks; a grant of other blocks means
the lease had expired there, and the transfer gives up. A step may be longer than a third of the
lease: renewals go, and their grants are read, between layers too (with layer-wise streaming).
Prompts
still awaiting their grant are admitted only while they leave our pool room for the longest
request (common/scheduler.py): full of them, it could wait on a decode worker whose room is
promised to prompts we cannot admit.

Layer-wise streaming (on unless --no-kv-stream): once granted, a request's KV goes out while the
forward pass runs. After each layer, the blocks it has finished (every full block of the step's
chunk; all of them in its last chunk) are sent for the layers not sent yet, as soon as they make
STREAM_MIN_BYTES (so a short prompt goes at once after its last layer, in one piece). A grant that
arrives during the forward is read between layers, so even a one-step prefill streams from the
layer after it. The header follows the first token, with only the last group's bytes still to go.

Our blocks are held until the decode worker acknowledges, and given up (with a WorkerError that
makes the router retry) on refusal, cancellation or timeout, so none can leak; blocks that a
transport may still be reading (zmq frames sent in place, gloo sends) come back once it is done,
and a one-sided writer (shm, cuda_ipc) finishes its queued copies before it sends KVRelease.
A transfer that times out also drops what we hold for that decode worker (socket, shared-memory
mapping, process group): it is likely gone, and closing its socket ends what was queued for it.
So does a decode worker not sent to for PEER_IDLE_S: one that died or came back at another
address would otherwise keep its socket reconnecting and its process group open for good.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import zmq

from common import protocol as P
from common.channel import Channel, Envelope
from common.engine import RequestOutput
from common.errors import InvalidArgument, NoRoom
from common.kv_transport import Handle, Outgoing, TransportError, choose, make_senders, offered, tune_malloc
from common.kv_transport.mapped import HOSTNAME
from common.sampling_params import SamplingParams
from common.scheduler import ScheduledSeq
from common.sequence import PREFILLED
from common.worker import WorkerBase

log = logging.getLogger("pdserve.prefill")

REASK_S = 1.0  # a reservation the decode worker queued (BUSY) is asked for again this often
RESEND_S = 0.05  # a KVReserve our full socket to the decode worker did not take is sent again after this
LEASE_MARGIN_S = 1.0  # never start writing a peer's blocks closer than this to the end of their lease
STREAM_MIN_BYTES = 1 << 20  # layer-wise streaming sends groups of layers at least this big (but the last)
SWEEP_S = 1.0  # how often the senders look for peers whose process exited (Sender.sweep)
PEER_IDLE_S = 300.0  # what we hold for a decode worker not used this long is dropped (remade on demand)
# How long a decode worker may take nothing from our full socket to it (1,000 messages queued here,
# as many in its own): then it is stuck or gone, and what we send it fails, at once until it reads again.
PEER_SEND_WAIT_S = 1.0


@dataclass
class Draining:
    """Blocks of a given-up transfer that its transport may still be reading."""
    handle: Handle
    block_ids: list[int]
    address: str
    offer: dict
    deadline: float  # then the decode worker is taken for gone, and what we hold for it dropped


@dataclass
class Transfer:
    work: P.PrefillWork
    deadline: float
    first_token: int | None = None  # set once prefilled
    prefilled_at: float = 0.0  # wall clock, for the decode worker's handoff_s
    block_ids: list[int] | None = None  # set once granted
    offer: dict = field(default_factory=dict)  # the decode worker's transports, from its grant
    lease_end: float = 0.0  # the grant holds until at least then (its lease, counted from our request)
    lease_s: float = 0.0  # the grant's lease, renewed every third of it (_renew_if_due)
    renew_sent_at: float = 0.0  # when we last asked for the same blocks again
    renewing: bool = False  # and its grant has not come yet
    state: str = "reserving"  # reserving -> (granted) -> [streaming] -> sending -> (acked: removed)
    retry_at: float | None = None
    requested_at: float = 0.0
    transport: str = ""
    out: Outgoing | None = None  # once the transport is chosen
    handle: Handle | None = None  # the transport's transfer under way
    max_len: int = 0  # prompt + max_tokens: what the decode worker must be able to hold
    streamed: int = 0  # leading blocks whose every layer was sent
    next_layer: int = 0  # streaming, in a step: the first layer of its finished blocks not yet sent
    failure: tuple[str, str] | None = None  # (code, message) of a send that failed mid-step
    stream_s: float = 0.0  # host time its streamed layers took to send (in the forward's layer hooks)

    @property
    def write_by(self) -> float:
        """No byte of ours may start into the peer's blocks after this (time.monotonic())."""
        return min(self.lease_end, self.deadline) - LEASE_MARGIN_S

    def transport_failure(self) -> tuple[str, str] | None:
        why = self.handle.error() if self.handle is not None else None
        return None if why is None else ("TRANSFER_FAILED", f"{self.transport}: {why}")


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, cfg):
        tune_malloc()
        super().__init__(cfg)
        self.work: dict[str, tuple[P.PrefillWork, float]] = {}
        self.transfers: dict[str, Transfer] = {}
        self.peers: dict[str, Channel] = {}  # decode KV address -> our socket to it
        self.peer_used: dict[str, float] = {}  # ... -> when we last sent to it
        self.offers: dict[str, dict] = {}  # ... -> the transports it offered last (what senders hold for it)
        self.senders = make_senders(offered(cfg.engine.kv_transport, cfg.engine.torch_device), self.worker_id,
                                    cfg.host, cfg.transfer_timeout_s, cfg.engine.torch_device)
        self.chosen: dict[str, str] = {}  # decode KV address -> transport last used (for the log)
        self.draining: list[Draining] = []
        self._last_sweep = 0.0  # when the senders last let go of exited peers' pools
        self.stream = self._on_layer if cfg.kv_stream else None
        self.deferred: list[Envelope] = []  # decode workers' answers read mid-forward, but for grants
        kv = self.engine.kv_cache
        self.layer_bytes = 2 * kv[0, 0, 0].numel() * kv.element_size()  # one block of one layer's K and V

    def kv_transports(self) -> list[str]:
        return list(self.senders)

    def step(self) -> list[RequestOutput]:
        outputs = self.engine.step(self.stream)
        deferred, self.deferred = self.deferred, []
        for env in deferred:
            self.handle(self._on_peer, env)
        return outputs

    # ------------------------------------------------------------------ router

    def on_router(self, msg):
        if isinstance(msg, P.PrefillWork):
            self.accept(msg)
        elif isinstance(msg, P.CancelWork):
            t = self.transfers.get(msg.request_id)
            if t is not None and t.work.attempt == msg.attempt:
                self._drop(msg.request_id)

    def accept(self, work: P.PrefillWork):
        rid = work.request_id
        if rid in self.work or rid in self.transfers:  # a newer attempt replaces an older one
            self._drop(rid)
        try:
            params = SamplingParams.from_dict(work.sampling)
            self.engine.add_sequence(rid, work.token_ids, work.num_prompt_tokens, params, work.seed,
                                     prefill_only=True)
        except InvalidArgument as e:  # NO_ROOM relayed from a decode worker is its pool's: ours has its own code
            code = "PREFILL_NO_ROOM" if isinstance(e, NoRoom) else e.code
            self.to_router(P.WorkerError(rid, work.attempt, code, str(e)))
            return
        now = time.monotonic()
        self.work[rid] = (work, now)
        self.transfers[rid] = Transfer(work, now + self.cfg.transfer_timeout_s,
                                       max_len=work.num_prompt_tokens + params.max_tokens)
        self._reserve(rid)

    # ------------------------------------------------------------------ engine

    def on_outputs(self, outputs: list[RequestOutput]):
        now = time.monotonic()
        for out in outputs:
            work, received = self.work.pop(out.request_id, (None, None))
            if work is None:
                continue
            index = len(work.token_ids) - work.num_prompt_tokens
            first = out.new_token_ids[-1]
            timings = {"prefill_s": now - received, "cached_tokens": out.metrics.get("num_cached_tokens", 0)}
            if "queue_s" in out.metrics:  # waiting for the engine to take it
                timings["queue_s"] = out.metrics["queue_s"]
            t = self.transfers.get(out.request_id)
            if t is not None and t.stream_s:
                timings["kv_stream_host_s"] = t.stream_s
            done = out.finish_reason != PREFILLED  # finished at its first token: nothing to transfer
            self.to_router(P.WorkerTokens(out.request_id, work.attempt, index, [first],
                                          out.finish_reason if done else None, timings,
                                          out.new_logprobs, out.prompt_logprobs))
            if done:  # a one-sided writer may still be copying its streamed layers: as a cancel does
                self._drop(out.request_id)
                continue
            if t is not None:
                t.first_token, t.prefilled_at = first, time.time()
                if t.block_ids is not None:
                    self._send_kv(out.request_id, t)

    # ------------------------------------------------------------------ decode peers

    def _peer(self, address: str) -> Channel:
        self.peer_used[address] = time.monotonic()
        chan = self.peers.get(address)
        if chan is None:
            chan = Channel.connect(self.ctx, zmq.DEALER, address, end="kv_sender")
            chan.send_wait_s = PEER_SEND_WAIT_S
            self.peers[address] = chan
            self.watch(chan, self._on_peer)
        return chan

    def _forget_peer(self, address: str, offer: dict):
        """Drop what we hold for a decode worker that seems gone, unless a transfer still uses it."""
        if any(t.work.decode_kv_address == address for t in self.transfers.values()):
            return
        chan = self.peers.pop(address, None)
        if chan is not None:
            self.unwatch(chan)  # also frees KV chunks queued for it
        for name, sender in self.senders.items():
            if name in offer:
                sender.forget(offer[name])
        for held in (self.chosen, self.peer_used, self.offers):
            held.pop(address, None)

    def _reserve(self, rid: str):
        t = self.transfers[rid]
        now = time.monotonic()
        t.state, t.retry_at, t.requested_at = "reserving", None, now
        if not self._ask(rid, t):
            t.retry_at = now + RESEND_S  # until the transfer's deadline gives up, and says so

    def _renew_if_due(self, rid: str, t: Transfer, now: float):
        """Ask for the granted blocks again every third of their lease: the decode worker extends it."""
        if t.lease_s and t.state != "reserving" and now >= t.renew_sent_at + t.lease_s / 3:
            t.renew_sent_at, t.renewing = now, True
            self._ask(rid, t)  # one lost goes again a third of a lease later

    def _ask(self, rid: str, t: Transfer) -> bool:
        """False if our queue to the decode worker is full: unlogged (20 a second to a stuck peer)."""
        return self._peer(t.work.decode_kv_address).send_nowait(
            P.KVReserve(rid, t.work.attempt, len(t.work.token_ids), self.engine.kv_layout, t.max_len, HOSTNAME,
                        os.getpid()))

    def _release_reservation(self, rid: str):
        t = self.transfers.pop(rid, None)
        if t is not None:
            self._peer(t.work.decode_kv_address).try_send(P.KVRelease(rid, t.work.attempt))
        return t

    def _drop(self, rid: str) -> Transfer | None:
        """Forget rid: its reservation (KVRelease), its work, and its blocks once no transport reads them."""
        self.work.pop(rid, None)
        t = self.transfers.get(rid)
        if t is not None and t.handle is not None:  # a one-sided writer's KVRelease says it is done writing
            self.senders[t.transport].finish(t.handle, release=True)
        t = self._release_reservation(rid)
        if t is not None and t.handle is not None and not t.handle.sent():
            self.draining.append(Draining(t.handle, self.engine.detach(rid), t.work.decode_kv_address, t.offer,
                                          t.deadline))
        self.engine.abort_request(rid)
        return t

    def _give_up(self, rid: str, code: str, message: str):
        t = self._drop(rid)
        if t is not None:
            if code == "TIMEOUT" and t.state == "sending":
                self._forget_peer(t.work.decode_kv_address, t.offer)
            log.warning("transfer of %s to %s failed: %s %s", rid, t.work.decode_worker_id, code, message)
            self.to_router(P.WorkerError(rid, t.work.attempt, code, message))

    def _on_peer(self, env: Envelope):
        msg = env.msg
        if env.error is not None:
            log.warning("bad message from a decode worker: %s", env.error)
            return
        t = self.transfers.get(msg.request_id)
        if t is None or msg.attempt != t.work.attempt:
            return
        if isinstance(msg, P.KVGrant):
            if t.state != "reserving":  # granted already: a renewal, or a re-ask that crossed its queued grant
                t.renewing = False
                if msg.block_ids != t.block_ids:  # our lease had expired there (given up after the step, if in one)
                    t.failure = ("TIMEOUT", "the decode worker's lease on our blocks expired before the transfer")
                    return
                t.lease_end = max(t.lease_end, t.renew_sent_at + msg.lease_s)
                t.deadline = max(t.deadline, time.monotonic() + self.cfg.transfer_timeout_s)
                if t.out is not None:  # the transport's copies check it too
                    t.out.write_by = t.write_by
                return
            t.block_ids, t.state, t.retry_at = msg.block_ids, "granted", None
            self.engine.kv_granted(msg.request_id)
            t.offer, t.lease_end, t.lease_s = msg.transports, t.requested_at + msg.lease_s, msg.lease_s
            t.renew_sent_at = t.requested_at
            t.deadline = max(t.deadline, time.monotonic() + self.cfg.transfer_timeout_s)  # as long as the lease
            self.offers[t.work.decode_kv_address] = msg.transports
            if t.first_token is not None:
                self._send_kv(msg.request_id, t)
        elif isinstance(msg, P.KVRefuse):
            if msg.code == "BUSY" and t.state == "reserving":  # queued there, and it is alive: wait on
                now = time.monotonic()
                t.retry_at = now + REASK_S
                t.deadline = max(t.deadline, now + self.cfg.transfer_timeout_s)
            elif msg.code != "BUSY":
                self._give_up(msg.request_id, msg.code, msg.message)
        elif isinstance(msg, P.KVAck):
            if msg.ok:
                self.transfers.pop(msg.request_id)
                self.engine.release(msg.request_id)
                sent = len(t.out.dst_blocks) * self.engine.model_config.num_layers * self.layer_bytes
                self.kv_bytes[t.transport] = self.kv_bytes.get(t.transport, 0) + sent
            else:
                self._give_up(msg.request_id, "TRANSFER_FAILED", msg.message)

    # ------------------------------------------------------------------ sending KV

    def _on_layer(self, layer: int, batch: list[ScheduledSeq]):
        """Stream what layer `layer` finished of each granted request in this step (see the
        module docstring). Failures wait for the end of the step (t.failure): the engine is mid-forward."""
        last = layer == self.engine.model_config.num_layers - 1
        now = time.monotonic()
        ours = [(s.seq.request_id, t) for s in batch if (t := self.transfers.get(s.seq.request_id)) is not None]
        for rid, t in ours:  # a step may be longer than a third of the lease
            self._renew_if_due(rid, t, now)
        # a grant that came during the forward lets streaming start now, or renews a lease
        for address in {t.work.decode_kv_address for _, t in ours if t.state == "reserving" or t.renewing}:
            self._read_peer(address, grants_only=True)
        for s in batch:
            t = self.transfers.get(s.seq.request_id)
            if t is None or t.state not in ("granted", "streaming") or t.failure is not None:
                continue
            began = time.perf_counter()
            try:
                self._stream(layer, last, s, t)
            except Exception as e:
                log.exception("streaming the KV of %s failed", s.seq.request_id)
                t.failure = ("TRANSFER_FAILED", f"{type(e).__name__}: {e}")
            t.stream_s += time.perf_counter() - began

    def _read_peer(self, address: str, grants_only: bool = False):
        """Handle what the decode worker at address sent that waits unread; grants_only (mid-forward):
        keep the rest for after the step, as handling it might end a request the forward is running."""
        chan = self.peers.get(address)
        while chan is not None and (env := chan.recv(0)) is not None:
            if grants_only and not isinstance(env.msg, P.KVGrant):
                self.deferred.append(env)
            else:
                self.handle(self._on_peer, env)

    def _stream(self, layer: int, last: bool, s: ScheduledSeq, t: Transfer):
        if layer == 0:
            t.next_layer = 0
        table = s.seq.block_table
        upto = len(table) if s.samples else (s.start + s.num_tokens) // self.engine.config.block_size
        layers = range(t.next_layer, layer + 1)
        if upto <= t.streamed or (not last and len(layers) * (upto - t.streamed) * self.layer_bytes < STREAM_MIN_BYTES):
            return
        if self._push(s.seq.request_id, t, table, layers, range(t.streamed, upto)):
            t.next_layer = layer + 1
            if last:
                t.streamed = upto

    def _push(self, rid: str, t: Transfer, src_blocks: list[int], layers: range, blocks: range) -> bool:
        """Send these layers of these blocks, choosing the transport first if this is the first
        piece; False (and t.failure) if that failed."""
        if time.monotonic() > t.write_by:
            t.failure = ("TIMEOUT", "the grant's lease or our deadline ends before the transfer could")
            return False
        if t.handle is None:
            if len(t.block_ids) < len(src_blocks):
                t.failure = ("TRANSFER_FAILED", f"granted {len(t.block_ids)} blocks, need {len(src_blocks)}")
                return False
            w = t.work
            try:
                t.transport = choose(self.senders, t.offer, w.decode_worker_id, self.cfg.engine.kv_transport)
                t.out = Outgoing(rid, w.attempt, self.engine.kv_cache, list(src_blocks), t.block_ids[:len(src_blocks)],
                                 t.offer[t.transport], self._sender_to(w.decode_kv_address),
                                 t.write_by)
                t.handle = self.senders[t.transport].open(t.out)
            except TransportError as e:
                t.failure = (e.code, str(e))
                return False
            t.state = "streaming"
            if self.chosen.get(w.decode_kv_address) != t.transport:
                self.chosen[w.decode_kv_address] = t.transport
                log.info("KV to %s (%s) by %s", w.decode_worker_id, w.decode_kv_address, t.transport)
        self.senders[t.transport].send(t.out, t.handle, layers, blocks)
        t.failure = t.transport_failure()
        return t.failure is None

    def _sender_to(self, address: str):
        chan = self._peer(address)
        return lambda msg, frames: chan.try_send(msg, frames, track=True)  # None: not taken (logged)

    def _send_kv(self, rid: str, t: Transfer):
        """Prefilled and granted: send what streaming has not, then the header."""
        held = self.engine.held.get(rid)
        if held is None:
            return self._give_up(rid, "CANCELLED", "blocks no longer held")
        ours, layers = held.block_table, range(self.engine.model_config.num_layers)
        if t.failure is None and t.streamed < len(ours):
            self._push(rid, t, ours, layers, range(t.streamed, len(ours)))
        if t.failure is None:
            self.senders[t.transport].finish(t.handle)
            t.failure = t.transport_failure()
        if t.failure is not None:
            return self._give_up(rid, *t.failure)
        w = t.work
        header = P.KVTransfer(rid, w.attempt, w.token_ids + [t.first_token], w.num_prompt_tokens, t.first_token,
                              w.sampling, w.seed, self.engine.kv_layout, len(w.token_ids), t.out.dst_blocks,
                              t.transport, t.handle.info, t.prefilled_at)
        t.state = "sending"
        if not self._peer(w.decode_kv_address).try_send(header):
            self._give_up(rid, "TRANSFER_FAILED", "could not send KV")

    def on_tick(self, now: float):
        for rid, t in list(self.transfers.items()):
            if now > t.deadline:  # what the peer sent during our last step may say otherwise
                self._read_peer(t.work.decode_kv_address)
            if self.transfers.get(rid) is not t:  # ended by a message read here, for it or another
                continue
            if now > t.deadline:
                self._give_up(rid, "TIMEOUT", f"no acknowledgement within {self.cfg.transfer_timeout_s}s")
            elif t.failure is not None:
                self._give_up(rid, *t.failure)
            elif t.transport_failure() is not None:
                self._give_up(rid, *t.transport_failure())
            elif t.retry_at is not None and now >= t.retry_at:
                self._reserve(rid)
            else:
                self._renew_if_due(rid, t, now)
        draining, self.draining = self.draining, []
        for d in draining:
            if d.handle.sent():
                self.engine.free_blocks(d.block_ids)
                continue
            if now > d.deadline:  # closing what we hold for the peer ends the reads
                self._forget_peer(d.address, d.offer)
            self.draining.append(d)
        if now - self._last_sweep > SWEEP_S:
            self._last_sweep = now
            for sender in self.senders.values():
                sender.sweep()
        busy = {d.address for d in self.draining}
        for address, used in list(self.peer_used.items()):
            if now - used > PEER_IDLE_S and address not in busy:
                log.info("dropping what we hold for idle decode worker %s", address)
                self._forget_peer(address, self.offers.get(address, {}))

    def holding(self) -> list[list]:
        return [[rid, t.work.attempt] for rid, t in self.transfers.items()]

    def idle(self) -> bool:
        return super().idle() and not (self.work or self.draining)

    def drop_all_work(self):
        for rid in list(self.transfers):
            self._drop(rid)
        self.work.clear()
        super().drop_all_work()

    def close(self):
        try:
            super().close()
        finally:
            for sender in self.senders.values():
                sender.close()
