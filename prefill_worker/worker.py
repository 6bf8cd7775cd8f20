"""The prefill worker: batches prompts into packed prefill steps, samples each request's first
token, reports it to the router at once (time to first token does not wait for the transfer),
and pushes the KV straight to the decode worker the router named:

    on accepting the work:  KVReserve -> (decode) KVGrant(blocks) | KVRefuse(BUSY: retry later)
    once prefilled and granted:  KVTransfer(header + one frame per layer) -> KVAck -> free our blocks

The reservation is asked for when the work arrives, so the grant's round trip overlaps the
prefill instead of following it; a request that ends at its first token sends KVRelease.

Our blocks are held until the decode worker acknowledges, and given up (with a WorkerError that
makes the router retry) on refusal, cancellation or timeout, so none can leak.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import zmq

from common import protocol as P
from common.channel import Channel, Envelope
from common.engine import RequestOutput
from common.errors import InvalidArgument
from common.sampling import SamplingParams
from common.worker import WorkerBase, tensor_frame

log = logging.getLogger("pdserve.prefill")

RETRY_BACKOFF_S = (0.002, 0.005, 0.01, 0.02)


@dataclass
class Transfer:
    work: P.PrefillWork
    deadline: float
    first_token: int | None = None  # set once prefilled
    block_ids: list[int] | None = None  # set once granted
    state: str = "reserving"  # reserving -> (granted) -> sending -> (acked: removed)
    retries: int = 0
    retry_at: float | None = None
    buffers: list = field(default_factory=list)  # KV tensors kept alive until acknowledged


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.work: dict[str, tuple[P.PrefillWork, float]] = {}
        self.transfers: dict[str, Transfer] = {}
        self.peers: dict[str, Channel] = {}

    # ------------------------------------------------------------------ router

    def on_router(self, msg):
        if isinstance(msg, P.PrefillWork):
            self.accept(msg)
        elif isinstance(msg, P.CancelWork):
            self.work.pop(msg.request_id, None)
            self._release_reservation(msg.request_id)
            self.engine.abort_request(msg.request_id)

    def accept(self, work: P.PrefillWork):
        rid = work.request_id
        if rid in self.work or rid in self.transfers:  # a newer attempt replaces an older one
            self.work.pop(rid, None)
            self._release_reservation(rid)
            self.engine.abort_request(rid)
        try:
            params = SamplingParams.from_dict(work.sampling)
            self.engine.add_sequence(rid, work.token_ids, work.num_prompt_tokens, params, work.seed,
                                     prefill_only=True)
        except InvalidArgument as e:
            self.to_router(P.WorkerError(rid, work.attempt, e.code, str(e)))
            return
        now = time.monotonic()
        self.work[rid] = (work, now)
        self.transfers[rid] = Transfer(work, now + self.cfg.transfer_timeout_s)
        self._reserve(rid)

    # ------------------------------------------------------------------ engine

    def on_outputs(self, outputs: list[RequestOutput]):
        now = time.monotonic()
        for out in outputs:
            work, received = self.work.pop(out.request_id, (None, None))
            if work is None:
                continue
            index = len(work.token_ids) - work.num_prompt_tokens
            first = out.token_ids[-1]
            timings = {"prefill_s": now - received}
            if out.finish_reason != "prefilled":  # finished at its first token: nothing to transfer
                self.to_router(P.WorkerTokens(out.request_id, work.attempt, index, [first], out.finish_reason, timings))
                self._release_reservation(out.request_id)
                continue
            self.to_router(P.WorkerTokens(out.request_id, work.attempt, index, [first], None, timings))
            t = self.transfers.get(out.request_id)
            if t is not None:
                t.first_token = first
                if t.block_ids is not None:
                    self._send_kv(out.request_id, t)

    # ------------------------------------------------------------------ decode peers

    def _peer(self, address: str) -> Channel:
        chan = self.peers.get(address)
        if chan is None:
            chan = Channel.connect(self.ctx, zmq.DEALER, address)
            self.peers[address] = chan
            self.watch(chan, self._on_peer)
        return chan

    def _reserve(self, rid: str):
        t = self.transfers[rid]
        t.state, t.retry_at = "reserving", None
        self._peer(t.work.decode_kv_address).try_send(
            P.KVReserve(rid, t.work.attempt, len(t.work.token_ids), self.engine.kv_layout))

    def _release_reservation(self, rid: str):
        t = self.transfers.pop(rid, None)
        if t is not None:
            self._peer(t.work.decode_kv_address).try_send(P.KVRelease(rid, t.work.attempt))
        return t

    def _give_up(self, rid: str, code: str, message: str):
        t = self._release_reservation(rid)
        self.engine.release(rid)
        self.work.pop(rid, None)
        self.engine.abort_request(rid)
        if t is not None:
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
            t.block_ids, t.state = msg.block_ids, "granted"
            if t.first_token is not None:
                self._send_kv(msg.request_id, t)
        elif isinstance(msg, P.KVRefuse):
            if msg.code == "BUSY" and time.monotonic() < t.deadline:
                t.retry_at = time.monotonic() + RETRY_BACKOFF_S[min(t.retries, len(RETRY_BACKOFF_S) - 1)]
                t.retries += 1
            else:
                self._give_up(msg.request_id, msg.code, msg.message)
        elif isinstance(msg, P.KVAck):
            if msg.ok:
                self.transfers.pop(msg.request_id)
                self.engine.release(msg.request_id)
            else:
                self._give_up(msg.request_id, "TRANSFER_FAILED", msg.message)

    def _send_kv(self, rid: str, t: Transfer):
        block_ids = t.block_ids
        held = self.engine.held.get(rid)
        if held is None:
            return self._give_up(rid, "CANCELLED", "blocks no longer held")
        ours = held.block_table
        if len(block_ids) < len(ours):
            return self._give_up(rid, "TRANSFER_FAILED", f"granted {len(block_ids)} blocks, need {len(ours)}")
        t.buffers = [self.engine.read_kv(ours, layer) for layer in range(self.engine.model_config.num_layers)]
        w = t.work
        header = P.KVTransfer(rid, w.attempt, w.token_ids + [t.first_token], w.num_prompt_tokens, t.first_token,
                              w.sampling, w.seed, self.engine.kv_layout, len(w.token_ids), block_ids[:len(ours)])
        t.state = "sending"
        if not self._peer(w.decode_kv_address).try_send(header, [tensor_frame(b) for b in t.buffers]):
            self._give_up(rid, "TRANSFER_FAILED", "could not send KV")

    def on_tick(self, now: float):
        for rid, t in list(self.transfers.items()):
            if now > t.deadline:
                self._give_up(rid, "TIMEOUT", f"no acknowledgement within {self.cfg.transfer_timeout_s}s")
            elif t.retry_at is not None and now >= t.retry_at:
                self._reserve(rid)

    def drop_all_work(self):
        self.work.clear()
        self.transfers.clear()
        super().drop_all_work()
