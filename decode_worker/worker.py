"""The decode worker: binds a KV ingress endpoint (advertised on registration), reserves blocks
for incoming KV before the bytes arrive, lets a KV transport (common/kv_transport/) put the
bytes into them, adds the request to its continuous decode batch and streams every new token to
the router:

    KVReserve -> KVGrant(blocks, the transports we offer) | KVRefuse(BUSY: queued; KVGrant later)
    [KVChunk...] KVTransfer(header) -> the transport settles -> start decoding -> KVAck

Reservations are leases: blocks granted to a transfer that never arrives (the prefill died, the
request was cancelled) come back when the lease expires. A live prefill worker renews its lease
by asking again for the same reservation while its prefill runs. A full pool or a full batch answers a
reservation with BUSY and queues it, in order of arrival, granting it as soon as room frees: that
is the backpressure, and a busy decode worker is a queue, not a failure. A queued reservation its
prefill worker stops asking about (it asks every REASK_S) is dropped after QUEUE_STALE_S. Where a peer
may write our blocks itself (shm, cuda_ipc), a cancelled reservation's blocks are fenced: they
come back only when that writer says it is done (for cuda_ipc on one GPU, once the event its header
carries completed), or at the end of the lease once every copy the writer was inside at that end
has ended (a writer stopped in one may resume: common/kv_transport/copy_count.py). Past its lease,
a reservation is fenced likewise, and a renewal of it refused.

A decode worker also takes PrefillWork that names it as its decode worker, and runs the whole
request itself: a local prefill, where the router judges the handoff not worth its cost (a short
prompt, or one its prefix cache mostly holds) or no prefill worker can take the request. Role
"mono" takes all its work that way: the monolithic engine behind the same router, the baseline the
disaggregated topologies must beat.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from common import protocol as P
from common.channel import WILDCARD_HOSTS, Channel, Envelope, reachable_host
from common.engine import RequestOutput
from common.errors import InvalidArgument
from common.kv_transport import Inbox, make_receivers, offered, tune_malloc
from common.kv_transport.copy_count import counts_of, ended_since, in_flight, sweep as sweep_copy_counts
from common.kv_transport.mapped import HOSTNAME, process_gone
from common.sampling_params import SamplingParams
from common.worker import STALLED_POLL_MS, WorkerBase

log = logging.getLogger("pdserve.decode")
SPIN_S = 0.005  # after a header whose copies we poll for (cuda_ipc's event), the loop does not sleep this long
KV_INGRESS = "this is a decode worker's KV ingress; clients connect to the router's client port (its --port)"
QUEUE_STALE_S = 5.0  # a queued reservation not asked about again this long is dropped (its prefill is gone)
WRITERS_CHECKED_S = 0.2  # fenced blocks' writers are looked up in /proc this often, not every step


@dataclass
class Queued:
    """A reservation refused BUSY, waiting for room."""
    sender: bytes
    msg: P.KVReserve
    asked: float  # when its prefill worker last asked

    @property
    def attempt(self) -> int:
        return self.msg.attempt


@dataclass
class Reservation:
    attempt: int
    block_ids: list[int]
    expires: float
    granted_at: float
    writer: tuple[str, int] = ("", 0)  # the asking prefill worker's (host, pid): KVReserve's
    inbox: Inbox | None = None  # made by the first KVChunk or the KVTransfer
    waited: dict | None = None  # fenced past its lease: its writer's copies then in flight (copy_count.in_flight)
    told: bool = False  # that its blocks wait on their writer long past the lease

    def writer_gone(self) -> bool:
        """Whether its writer was a process of this host that has exited: fenced blocks need not
        wait for the lease's end (a stopped writer may resume, and checks its lease; a dead one cannot)."""
        return self.writer[0] == HOSTNAME and process_gone(self.writer[1])

    def copies_ended(self, counts: Callable[[int], list]) -> bool:
        """Past the lease: whether every copy its writer, a process of this host, was inside when
        first asked has ended (copy_count.py; counts: its counts_of). A writer stopped inside a
        copy for longer than the lease's margin would write on into the blocks when it resumes."""
        if self.writer[0] != HOSTNAME:
            return True  # no one-sided writer: those are on this host
        now = counts(self.writer[1])
        if self.waited is None:
            self.waited = in_flight(now)
        return ended_since(now, self.waited)


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, cfg, mono: bool = False):
        if mono:
            self.role = "mono"
        tune_malloc()
        names = ["zmq"] if mono else offered(cfg.engine.kv_transport, cfg.engine.torch_device)  # mono: its own KV
        cfg.engine.kv_shared = "shm" in names
        super().__init__(cfg)
        e = self.engine
        self.receivers = make_receivers(names, e.kv_cache, e.kv_segment, e.config.dtype, cfg.host, cfg.kv_lease_s,
                                        required=not mono and cfg.engine.kv_transport != "auto", wake=self.wake)
        # what prefill workers connect to: bound at 0.0.0.0, this machine's address toward the router
        host = reachable_host(cfg.host, cfg.router)
        self.offer = {name: {**a, "host": host} if a.get("host") in WILDCARD_HOSTS else a  # (shm's: a hostname)
                      for name, a in ((name, r.advert()) for name, r in self.receivers.items())}
        self.one_sided = any(r.one_sided for r in self.receivers.values())
        sweep_copy_counts()  # killed writers' files, whichever transport this host's clusters use now
        self.ingress = Channel.bind(self.ctx, zmq.ROUTER, f"tcp://{cfg.host}:{cfg.kv_port}", max_frame_bytes=cfg.max_kv_frame_bytes,
                                    end="kv_ingress")
        self.kv_address = f"tcp://{host}:{self.ingress.address.rsplit(':', 1)[1]}"
        self.watch(self.ingress, self._on_ingress)
        self.reservations: dict[str, Reservation] = {}
        self.queued: dict[str, Queued] = {}  # request id -> reservation waiting for room, in arrival order
        self._room_seen: tuple | None = None  # the room the queue was last tried against
        self.fenced: dict[tuple[str, int], Reservation] = {}  # (request id, attempt): dropped, maybe being written
        self.writers_checked = 0.0  # when the fenced blocks' writers were last looked for (WRITERS_CHECKED_S)
        self.spin_until = 0.0  # (poll_timeout)
        self.arriving: dict[str, tuple[P.KVTransfer, bytes]] = {}  # header in, the transport still settling
        self.streams: dict[str, tuple[int, dict]] = {}  # request id -> (attempt, timings)
        self.prefilling: set[str] = set()  # request ids prefilled here, before their first token
        log.info("KV transports offered: %s", list(self.receivers))

    def kv_transports(self) -> list[str]:
        return list(self.receivers)

    def idle(self) -> bool:
        return super().idle() and not (self.reservations or self.queued or self.arriving)

    def prefill_ended(self, outputs) -> bool:
        """Only a local prefill ends here: the outputs are looked through while one runs, not per step."""
        return bool(self.prefilling) and any(out.request_id in self.prefilling for out in outputs)

    # ------------------------------------------------------------------ router

    def on_router(self, msg):
        if isinstance(msg, P.CancelWork):
            if self._attempt(msg.request_id) == msg.attempt:  # an older attempt's cancel: not this one
                self._drop(msg.request_id)
        elif isinstance(msg, P.PrefillWork) and (self.role == "mono" or msg.decode_worker_id == self.worker_id):
            self._prefill_here(msg)
        elif isinstance(msg, P.PrefillWork):
            log.warning("PrefillWork for %s names decode worker %r, not this one (%s): refused", msg.request_id,
                        msg.decode_worker_id, self.worker_id)
            self.to_router(P.WorkerError(msg.request_id, msg.attempt, "NO_ROOM",
                                         f"{self.worker_id} is a decode worker; it prefills only work naming it"))

    def _prefill_here(self, msg: P.PrefillWork):
        """Run the whole request here: prefill it, then decode it with the rest of the batch."""
        self._drop(msg.request_id)
        try:
            params = SamplingParams.from_dict(msg.sampling)
            problem = self.engine.scheduler.no_room(len(msg.token_ids), msg.num_prompt_tokens + params.max_tokens)
            if problem:  # as it refuses a reservation: the router tries another worker
                self.to_router(P.WorkerError(msg.request_id, msg.attempt, "NO_ROOM", problem))
                return
            self.engine.add_sequence(msg.request_id, msg.token_ids, msg.num_prompt_tokens, params, msg.seed)
        except InvalidArgument as e:
            self.to_router(P.WorkerError(msg.request_id, msg.attempt, e.code, str(e)))
            return
        self.streams[msg.request_id] = (msg.attempt, {})
        self.prefilling.add(msg.request_id)

    def _attempt(self, rid: str) -> int | None:
        """The attempt of rid this worker holds: queued for room, reserved for, or decoding."""
        held = self.reservations.get(rid) or self.queued.get(rid)
        return held.attempt if held is not None else self.streams.get(rid, (None,))[0]

    def _drop(self, rid: str):
        self.queued.pop(rid, None)
        r = self.reservations.pop(rid, None)
        if r is not None:
            arrived = self.arriving.pop(rid, None) is not None
            self._free(rid, r, writer_done=arrived and not r.inbox.writing())
        self.streams.pop(rid, None)
        self.prefilling.discard(rid)
        self.engine.abort_request(rid)

    def _free(self, rid: str, r: Reservation, writer_done: bool):
        """Unreserve r's blocks, or fence them while a peer may still be writing them."""
        if self.one_sided and not writer_done:  # (never twice under a key: _reserve grants none under a fenced one)
            self.fenced[(rid, r.attempt)] = r
        else:
            self.engine.unreserve(r.block_ids)

    def _writer_done(self, rid: str, attempt: int, fence=None) -> bool:
        """A KVRelease or KVTransfer from this attempt's writer: unreserve what it held, or fence it
        until the copies the header says are still under way end (fence: cuda_ipc's event)."""
        r = self.reservations.get(rid)
        if r is not None and r.attempt == attempt:
            del self.reservations[rid]
            self.arriving.pop(rid, None)
        else:
            r = self.fenced.pop((rid, attempt), None)
        if r is None:
            return False
        if fence is not None:
            r.inbox = r.inbox or Inbox(self.engine.kv_cache, r.block_ids)
            r.inbox.fence = fence
        self._free(rid, r, writer_done=r.inbox is None or not r.inbox.writing())
        return True

    def _fence(self, msg: P.KVTransfer):
        """What says when the writer of this (refused) header is done writing, if it may not be yet."""
        receiver = self.receivers.get(msg.transport)
        return receiver.fence(msg.transport_info) if receiver is not None else None

    # ------------------------------------------------------------------ KV ingress

    def _on_ingress(self, env: Envelope):
        if env.error is not None:
            log.warning("refused a KV ingress message: %s", env.error)
            return
        msg = env.msg
        if isinstance(msg, P.KVReserve):
            self._reserve(env.sender, msg)
        elif isinstance(msg, P.KVRelease):
            q = self.queued.get(msg.request_id)
            if q is not None and q.attempt == msg.attempt:  # it ended at its first token, still queued
                del self.queued[msg.request_id]
            self._writer_done(msg.request_id, msg.attempt)
        elif isinstance(msg, P.KVChunk):
            self._on_chunk(msg, env.frames)
        elif isinstance(msg, P.KVTransfer):
            self._on_transfer(msg, env.sender)
        elif isinstance(msg, P.CLIENT_MESSAGES):  # a client given this port by mistake: it would wait forever
            self.ingress.try_send(P.Error(P.reply_id(msg), "INVALID_ARGUMENT", KV_INGRESS),
                                  to=env.sender)
        else:
            log.warning("unexpected %s on the KV ingress", type(msg).__name__)

    def _layout_problem(self, layout: dict) -> str | None:
        ours = self.engine.kv_layout
        if layout != ours:
            diff = {k: (layout.get(k), ours.get(k)) for k in set(layout) | set(ours) if layout.get(k) != ours.get(k)}
            return "KV layouts differ (sender, receiver): " + ", ".join(f"{k}={a!r}/{b!r}" for k, (a, b) in sorted(diff.items()))
        return None

    def _reserve(self, sender: bytes, msg: P.KVReserve):
        def refuse(code, text):
            self.ingress.try_send(P.KVRefuse(msg.request_id, msg.attempt, code, text), to=sender)

        problem = self._layout_problem(msg.layout)
        if problem:
            return refuse("LAYOUT_MISMATCH", problem)
        if msg.num_tokens < 1:
            return refuse("INVALID_ARGUMENT", f"num_tokens={msg.num_tokens}; allowed: >= 1")
        problem = self.engine.scheduler.no_room(msg.num_tokens, msg.max_len)
        if problem:  # never, here (BUSY would wait in vain): the router tries another decode worker
            return refuse("NO_ROOM", problem)
        rid, now = msg.request_id, time.monotonic()
        held = self._attempt(rid)
        if held is not None and held > msg.attempt:  # a late ask of an attempt the router has replaced
            return refuse("CANCELLED", f"attempt {msg.attempt} was replaced by attempt {held}, held here")
        if (rid, msg.attempt) in self.fenced:  # too late: its blocks may still be written, and are not granted again
            return refuse("TIMEOUT", f"attempt {msg.attempt} was let go here (its lease ended, or it was cancelled) "
                                     "before this ask")
        old = self.reservations.get(rid)
        if old is not None and old.attempt == msg.attempt:  # asked again (a renewal): the same blocks, a new lease
            old.expires = max(old.expires, now + self.cfg.kv_lease_s)
            return self._grant(sender, msg, old.block_ids)
        queued = self.queued.get(rid)
        if queued is not None and queued.attempt == msg.attempt:  # asked again: it keeps its place
            queued.sender, queued.asked = sender, now
        else:
            self._drop(rid)  # an older attempt of this request, if any
            blocks = None if self.queued else self.engine.reserve(msg.num_tokens, rid)  # none ahead of it: now
            if blocks is not None:
                return self._reserved(sender, msg, blocks, now)
            self.queued[rid] = Queued(sender, msg, now)
        refuse("BUSY", f"queued, {len(self.queued)} waiting: no free KV blocks or batch slots now")

    def _reserved(self, sender: bytes, msg: P.KVReserve, blocks: list[int], now: float):
        """Hold these blocks for msg's request under a lease, and grant them."""
        self.reservations[msg.request_id] = Reservation(msg.attempt, blocks, now + self.cfg.kv_lease_s, now,
                                                        (msg.writer_host, msg.writer_pid))
        self._grant(sender, msg, blocks)

    def _grant(self, sender: bytes, msg: P.KVReserve, blocks: list[int]):
        self.ingress.try_send(P.KVGrant(msg.request_id, msg.attempt, blocks, self.cfg.kv_lease_s, self.offer),
                              to=sender)

    def _room(self) -> tuple:
        """What a queued reservation waits on, and the head of the queue (one that left it lets the next try)."""
        e = self.engine
        return (e.block_manager.num_free_blocks, e.num_reserved_seqs, len(e.scheduler.running),
                len(e.scheduler.waiting), next(iter(self.queued), None))

    def _grant_queued(self):
        """Grant queued reservations, in order, while there is room for them (Engine.reserve keeps
        the first one refused its room from the later ones); tried again when the room or the head
        of the queue changed."""
        if not self.queued or self._room() == self._room_seen:
            return
        now = time.monotonic()
        for rid, q in list(self.queued.items()):
            if now - q.asked > QUEUE_STALE_S:
                del self.queued[rid]
                continue
            blocks = self.engine.reserve(q.msg.num_tokens, rid)
            if blocks is not None:
                del self.queued[rid]
                self._reserved(q.sender, q.msg, blocks, now)
            elif self.engine.scheduler.refuses_all(self.engine.num_reserved_seqs):
                break
        self._room_seen = self._room()

    def _on_chunk(self, msg: P.KVChunk, frames):
        receiver = self.receivers.get(msg.transport)
        if receiver is None:
            log.warning("a KVChunk of %s by %r, which is not offered here; offered: %s", msg.request_id,
                        msg.transport, list(self.receivers))
            return  # the KVTransfer header will be refused for the same reason
        r = self.reservations.get(msg.request_id)
        if r is None or r.attempt != msg.attempt:
            return receiver.drop(msg)  # late, or for a cancelled attempt: its KVTransfer will be refused
        if r.inbox is None:
            r.inbox = Inbox(self.engine.kv_cache, r.block_ids[:msg.num_blocks])
            if not 0 < msg.num_blocks <= len(r.block_ids):
                r.inbox.fail(f"KVChunk.num_blocks={msg.num_blocks}; allowed: 1..{len(r.block_ids)} (granted)")
        if len(r.inbox.block_ids) != msg.num_blocks:
            r.inbox.fail(f"KVChunks for {msg.num_blocks} and {len(r.inbox.block_ids)} blocks")
        if r.inbox.error is None:
            receiver.chunk(r.inbox, msg, frames)
        else:
            receiver.drop(msg)

    def _on_transfer(self, msg: P.KVTransfer, sender: bytes):
        def refuse(why: str):
            self.ingress.try_send(P.KVAck(msg.request_id, msg.attempt, False, why), to=sender)

        r = self.reservations.get(msg.request_id)
        if r is None or r.attempt != msg.attempt:
            self._writer_done(msg.request_id, msg.attempt, self._fence(msg))  # fenced blocks, if any, come back
            return refuse("no reservation for this request and attempt (expired or cancelled)")
        problem = self._layout_problem(msg.layout)
        n = len(msg.block_ids)
        if problem is None and (not set(msg.block_ids) <= set(r.block_ids) or
                                self.engine.block_manager.blocks_needed(msg.num_tokens) != n):
            problem = f"block_ids {msg.block_ids} are not the {n} granted blocks needed for {msg.num_tokens} tokens"
        if problem is None and len(msg.token_ids) != msg.num_tokens + 1:
            problem = f"{len(msg.token_ids)} token ids for {msg.num_tokens} tokens of KV; expected one more"
        receiver = self.receivers.get(msg.transport)
        if problem is None and receiver is None:
            problem = f"KV transport {msg.transport!r} is not offered here; offered: {list(self.receivers)}"
        if problem is None:
            if r.inbox is None:
                r.inbox = Inbox(self.engine.kv_cache, msg.block_ids)
            elif r.inbox.block_ids != msg.block_ids:
                problem = f"KV chunks were for blocks {r.inbox.block_ids}, the header names {msg.block_ids}"
        if problem:
            self._writer_done(msg.request_id, msg.attempt, self._fence(msg))
            return refuse(problem)
        receiver.begin(r.inbox, msg.transport_info)
        self.arriving[msg.request_id] = (msg, sender)
        self.spin_until = time.monotonic() + SPIN_S if receiver.polled else self.spin_until
        self._settle()

    def poll_timeout(self) -> int:
        """As any worker's, but while KV settles: no sleep for SPIN_S after the header of a transport
        whose arrival nothing wakes us for (cuda_ipc's event: a copy ends within a millisecond),
        then at most STALLED_POLL_MS (a writer that died leaves its event pending)."""
        if self.arriving:
            return 0 if time.monotonic() < self.spin_until else min(STALLED_POLL_MS, super().poll_timeout())
        return super().poll_timeout()

    def _settle(self):
        """Start decoding every request whose KV the transport has put in place; acknowledge."""
        for rid, (msg, sender) in list(self.arriving.items()):
            r = self.reservations.get(rid)
            if r is None:  # dropping a reservation drops its arrival too; this is for safety
                del self.arriving[rid]
                continue
            if not self.receivers[msg.transport].settle(r.inbox):
                continue
            del self.arriving[rid], self.reservations[rid]
            ok, why = self._start(msg, r)
            self.ingress.try_send(P.KVAck(rid, msg.attempt, ok, why), to=sender)

    def _start(self, msg: P.KVTransfer, r: Reservation) -> tuple[bool, str]:
        if r.inbox.error is None and msg.transport_info.get("event") is not None and r.writer_gone():
            # (CUDA leaves an IPC event undefined once its process is gone: "complete" proves nothing)
            r.inbox.fail("the writer exited before its copies were seen to end: its event cannot say they did")
        if r.inbox.error is not None:
            self._free(msg.request_id, r, writer_done=not r.inbox.writing())
            return False, r.inbox.error
        try:
            self.engine.add_prefilled(msg.request_id, msg.token_ids, msg.num_prompt_tokens,
                                      SamplingParams.from_dict(msg.sampling), msg.seed, r.block_ids)
        except InvalidArgument as err:
            self.engine.unreserve(r.block_ids)
            return False, str(err)
        timings = {"transfer_s": time.monotonic() - r.granted_at}
        if msg.prefilled_at > 0:  # wall clocks: exact on one host, as good as their sync across hosts
            timings["handoff_s"] = max(0.0, time.time() - msg.prefilled_at)
        self.streams[msg.request_id] = (msg.attempt, timings)
        return True, ""

    # ------------------------------------------------------------------ engine

    def on_outputs(self, outputs: list[RequestOutput]):
        """The step's tokens to the router, in one message."""
        sends = []
        for out in outputs:
            attempt, timings = self.streams.get(out.request_id, (None, None))
            if attempt is None:
                continue
            index = out.num_tokens - len(out.new_token_ids)
            reason = out.finish_reason if out.finished else None
            prefilled = out.request_id in self.prefilling  # its first output here, even after a migration
            if prefilled:  # work received -> first token, the prefill time a prefill worker reports too
                self.prefilling.discard(out.request_id)
                timings.update(prefill_s=out.metrics["ttft_s"], cached_tokens=out.metrics["num_cached_tokens"])
            sends.append(P.WorkerTokens(out.request_id, attempt, index, out.new_token_ids, reason,
                                        timings if out.finished or prefilled else {},
                                        out.new_logprobs,
                                        out.prompt_logprobs if index == 0 else None))  # prefilled here: with the first
            if out.finished:  # (past its first output: no longer in prefilling)
                del self.streams[out.request_id]
        if sends:
            self.to_router(P.batch_tokens(sends))

    def holding(self) -> list[list]:
        return [[rid, attempt] for rid, (attempt, _) in self.streams.items()]

    def on_tick(self, now: float):
        self._settle()
        self._grant_queued()
        for rid, r in list(self.reservations.items()):
            if now > r.expires:
                log.warning("KV lease of %s expired; its %d blocks come back", rid, len(r.block_ids))
                del self.reservations[rid]
                self.arriving.pop(rid, None)
                self._free(rid, r, writer_done=False)
        if self.fenced:
            self._release_fenced(now)
        for receiver in self.receivers.values():
            receiver.poll(now)

    def _release_fenced(self, now: float):
        """Fenced blocks come back once no copy can write them: a cuda_ipc header's copies end with
        its event; no copy starts once the writer exited, nor past the lease, and past it, the
        copies the writer was inside at its end must have ended. Writers are looked up (in /proc,
        and their counts' files) every WRITERS_CHECKED_S, each once a check."""
        check_writers = now - self.writers_checked >= WRITERS_CHECKED_S
        if check_writers:
            self.writers_checked = now
            counts = functools.cache(counts_of)
        for key, r in list(self.fenced.items()):
            if (r.inbox is not None and r.inbox.fence is not None and not r.inbox.writing()) \
                    or (check_writers and (r.writer_gone() or (now > r.expires and r.copies_ended(counts)))):
                del self.fenced[key]
                self.engine.unreserve(r.block_ids)
            elif check_writers and now > r.expires + self.cfg.kv_lease_s and not r.told:
                r.told = True
                log.warning("the %d KV blocks of %s (attempt %d) still wait, a lease past its end, for writer %s "
                            "pid %d: it has been inside a copy into them since before that end (stopped?)",
                            len(r.block_ids), key[0], key[1], *r.writer)

    def drop_all_work(self):
        self.queued.clear()
        for rid in list(self.reservations):
            self._drop(rid)
        self.streams.clear()
        self.prefilling.clear()
        super().drop_all_work()

    def close(self):
        try:
            for receiver in self.receivers.values():  # first: their threads may still wake() us
                receiver.close()
            super().close()
        finally:
            self.engine.close()  # unlinks the shared KV segment
