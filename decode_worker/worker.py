"""The decode worker: binds a KV ingress endpoint (advertised on registration), reserves blocks
for incoming KV before the bytes arrive, writes the bytes into them, adds the request to its
continuous decode batch and streams every new token to the router.

Reservations are leases: blocks granted to a transfer that never arrives (the prefill died, the
request was cancelled) come back when the lease expires. A full pool or a full batch refuses a
reservation with BUSY, and the prefill worker retries: that is the backpressure.

Role "mono" also takes PrefillWork from the router and runs the whole request itself: the
monolithic engine behind the same router, the baseline the disaggregated topologies must beat.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import zmq

from common import protocol as P
from common.channel import Channel, Envelope
from common.config import DTYPES
from common.engine import RequestOutput
from common.errors import InvalidArgument
from common.sampling import SamplingParams
from common.worker import WorkerBase, frame_tensor

log = logging.getLogger("pdserve.decode")


@dataclass
class Reservation:
    attempt: int
    block_ids: list[int]
    expires: float
    granted_at: float


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, cfg, mono: bool = False):
        if mono:
            self.role = "mono"
        super().__init__(cfg)
        self.ingress = Channel.bind(self.ctx, zmq.ROUTER, f"tcp://{cfg.host}:0", max_frame_bytes=cfg.max_kv_frame_bytes)
        self.kv_address = self.ingress.address
        self.watch(self.ingress, self._on_ingress)
        self.reservations: dict[str, Reservation] = {}
        self.streams: dict[str, tuple[int, dict]] = {}  # request id -> (attempt, timings)

    # ------------------------------------------------------------------ router

    def on_router(self, msg):
        if isinstance(msg, P.CancelWork):
            self._drop(msg.request_id)
        elif isinstance(msg, P.PrefillWork) and self.role == "mono":
            self._drop(msg.request_id)
            try:
                self.engine.add_sequence(msg.request_id, msg.token_ids, msg.num_prompt_tokens,
                                         SamplingParams.from_dict(msg.sampling), msg.seed)
            except InvalidArgument as e:
                self.to_router(P.WorkerError(msg.request_id, msg.attempt, e.code, str(e)))
                return
            self.streams[msg.request_id] = (msg.attempt, {})

    def _drop(self, rid: str):
        r = self.reservations.pop(rid, None)
        if r is not None:
            self.engine.unreserve(r.block_ids)
        self.streams.pop(rid, None)
        self.engine.abort_request(rid)

    # ------------------------------------------------------------------ KV ingress

    def _on_ingress(self, env: Envelope):
        if env.error is not None:
            log.warning("refused a KV ingress message: %s", env.error)
            return
        msg = env.msg
        if isinstance(msg, P.KVReserve):
            self._reserve(env.sender, msg)
        elif isinstance(msg, P.KVRelease):
            r = self.reservations.get(msg.request_id)
            if r is not None and r.attempt == msg.attempt:
                del self.reservations[msg.request_id]
                self.engine.unreserve(r.block_ids)
        elif isinstance(msg, P.KVTransfer):
            ok, why = self._receive(msg, env.frames)
            self.ingress.try_send(P.KVAck(msg.request_id, msg.attempt, ok, why), to=env.sender)
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
        if not 0 < msg.num_tokens < self.engine.max_model_len:
            return refuse("INVALID_ARGUMENT", f"num_tokens={msg.num_tokens}; allowed: 1..{self.engine.max_model_len - 1}")
        old = self.reservations.get(msg.request_id)
        if old is not None and old.attempt == msg.attempt:
            blocks = old.block_ids  # a repeated request: grant the same blocks again
        else:
            self._drop(msg.request_id)  # an older attempt of this request, if any
            blocks = self.engine.reserve(msg.num_tokens)
            if blocks is None:
                return refuse("BUSY", "no free KV blocks or batch slots now")
            now = time.monotonic()
            self.reservations[msg.request_id] = Reservation(msg.attempt, blocks, now + self.cfg.kv_lease_s, now)
        self.ingress.try_send(P.KVGrant(msg.request_id, msg.attempt, blocks, self.cfg.kv_lease_s), to=sender)

    def _receive(self, msg: P.KVTransfer, frames) -> tuple[bool, str]:
        r = self.reservations.get(msg.request_id)
        if r is None or r.attempt != msg.attempt:
            return False, "no reservation for this request and attempt (expired or cancelled)"
        problem = self._layout_problem(msg.layout)
        e = self.engine
        n = len(msg.block_ids)
        shape = (2, n, e.config.block_size, e.model_config.num_kv_heads, e.model_config.head_dim)
        dtype = DTYPES[e.config.dtype]
        size = math.prod(shape) * torch.finfo(dtype).bits // 8
        if problem is None and len(frames) != e.model_config.num_layers:
            problem = f"{len(frames)} KV frames; expected one per layer ({e.model_config.num_layers})"
        if problem is None and (not set(msg.block_ids) <= set(r.block_ids) or
                                e.block_manager.blocks_needed(msg.num_tokens) != n):
            problem = f"block_ids {msg.block_ids} are not the {n} granted blocks needed for {msg.num_tokens} tokens"
        if problem is None and any(len(f.buffer) != size for f in frames):
            problem = f"KV frame sizes {[len(f.buffer) for f in frames]}; expected {size} bytes each"
        if problem is None and len(msg.token_ids) != msg.num_tokens + 1:
            problem = f"{len(msg.token_ids)} token ids for {msg.num_tokens} tokens of KV; expected one more"
        if problem:
            self._drop(msg.request_id)
            return False, problem
        for layer, frame in enumerate(frames):
            e.write_kv(msg.block_ids, layer, frame_tensor(frame, dtype, shape))
        del self.reservations[msg.request_id]
        try:
            e.add_prefilled(msg.request_id, msg.token_ids, msg.num_prompt_tokens,
                            SamplingParams.from_dict(msg.sampling), msg.seed, r.block_ids)
        except InvalidArgument as err:
            e.unreserve(r.block_ids)
            return False, str(err)
        self.streams[msg.request_id] = (msg.attempt, {"transfer_s": time.monotonic() - r.granted_at})
        return True, ""

    # ------------------------------------------------------------------ engine

    def on_outputs(self, outputs: list[RequestOutput]):
        for out in outputs:
            attempt, timings = self.streams.get(out.request_id, (None, None))
            if attempt is None:
                continue
            index = len(out.token_ids) - len(out.new_token_ids)
            reason = out.finish_reason if out.finished else None
            self.to_router(P.WorkerTokens(out.request_id, attempt, index, out.new_token_ids, reason,
                                          timings if out.finished else {}))
            if out.finished:
                del self.streams[out.request_id]

    def on_tick(self, now: float):
        for rid, r in list(self.reservations.items()):
            if now > r.expires:
                log.warning("KV lease of %s expired; freeing %d blocks", rid, len(r.block_ids))
                del self.reservations[rid]
                self.engine.unreserve(r.block_ids)

    def drop_all_work(self):
        for rid in list(self.reservations):
            self._drop(rid)
        self.streams.clear()
        super().drop_all_work()
