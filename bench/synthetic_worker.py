"""A worker with no model, for measuring the router alone (`pdserve bench router`): it registers as
a mono worker, speaks the worker protocol as a real one does (Register, Heartbeat, PrefillWork,
CancelWork, one WorkerTokenBatch a step), and emits one token per running request every
--step-ms, as a decode worker whose step takes that long would. A GPU decode step is about a
millisecond; no CPU-run model steps that fast, so this is how a 2-core machine can offer the
router the token rate a GPU cluster will.

The token at output position i is the prompt's token at i mod its length, so a client can check
that every stream arrived whole, in order and unmixed. The worker stops with its parent.

    python -m bench.synthetic_worker --router tcp://127.0.0.1:7101 --worker-id synth-0 \
        --model dummy:nanogpt --step-ms 1
"""

from __future__ import annotations

import argparse
import ctypes
import math
import signal
import time
import uuid

import zmq

from common import protocol as P
from common.channel import Channel
from common.model_spec import model_config
from common.signals import stop_signals

HEARTBEAT_S = 0.2


class SyntheticWorker:
    def __init__(self, router: str, worker_id: str, model: str, step_s: float):
        self.worker_id, self.step_s = worker_id, step_s
        self.fingerprint = model_config(model).fingerprint
        self.incarnation = uuid.uuid4().hex[:12]
        self.ctx = zmq.Context()
        self.chan = Channel.connect(self.ctx, zmq.DEALER, router,
                                    identity=f"{worker_id}/{self.incarnation}".encode(), end="worker")
        # request id -> [attempt, prompt, tokens sent, max_tokens]
        self.running: dict[str, list] = {}
        self.registered = False
        self.stopping = False

    def run(self):
        for sig in stop_signals():
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        next_step = next_beat = next_register = time.monotonic()
        try:
            while not self.stopping:
                now = time.monotonic()
                if not self.registered and now >= next_register:
                    self.chan.send(P.Register("mono", self.worker_id, self.incarnation, "cpu", 1 << 20, 16,
                                              "tcp://127.0.0.1:1", self.fingerprint, [], "float32"))
                    next_register = now + 0.5
                if self.registered and now >= next_beat:
                    self.chan.send(P.Heartbeat(self.worker_id, self.incarnation, 0, len(self.running),
                                               1 << 20, 1 << 20))
                    next_beat = now + HEARTBEAT_S
                if now >= next_step:
                    self.step()
                    # on pace on average: a late step is made up by the next, a long stall is not
                    next_step = max(next_step + self.step_s, now - 4 * self.step_s)
                # whole milliseconds (all zmq polls take): rounded up, so that a wait never spins
                wait_ms = max(0, math.ceil((min(next_step, next_beat) - time.monotonic()) * 1000))
                while (env := self.chan.recv(wait_ms)) is not None:
                    self.on_message(env.msg)
                    wait_ms = 0
        finally:
            self.chan.close()
            self.ctx.term()

    def on_message(self, msg):
        if isinstance(msg, P.Registered):
            self.registered = msg.incarnation == self.incarnation
        elif isinstance(msg, P.Shutdown):
            if msg.reason != "re-register":
                self.stopping = True
            self.running.clear()
            self.registered = False
        elif isinstance(msg, P.PrefillWork):
            prompt = msg.token_ids[:msg.num_prompt_tokens]
            self.running[msg.request_id] = [msg.attempt, prompt, len(msg.token_ids) - msg.num_prompt_tokens,
                                            int(msg.sampling.get("max_tokens", 16))]
        elif isinstance(msg, P.CancelWork):
            self.running.pop(msg.request_id, None)

    def step(self):
        items = []
        for rid, r in list(self.running.items()):
            attempt, prompt, sent, limit = r
            r[2] = sent + 1
            done = r[2] >= limit
            items.append([rid, attempt, sent, [prompt[sent % len(prompt)]], "length" if done else None, {}, None, None])
            if done:
                del self.running[rid]
        if items:
            self.chan.send(P.WorkerTokenBatch(items))


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", required=True, help="the router's worker address")
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--model", default="dummy:nanogpt", help="only its fingerprint is used, to register")
    ap.add_argument("--step-ms", type=float, default=1.0, help="one token per running request this often")
    a = ap.parse_args(argv)
    if not a.step_ms > 0:
        ap.error(f"--step-ms={a.step_ms}; allowed: > 0")
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: go with the bench
    SyntheticWorker(a.router, a.worker_id, a.model, a.step_ms / 1000).run()


if __name__ == "__main__":
    main()
