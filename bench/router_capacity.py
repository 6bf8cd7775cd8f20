"""`pdserve bench router`: how many tokens a second one router process carries, and what each
costs it in CPU.

Every token of a cluster crosses the router: in from a decode worker's step message, out to its
client, with incremental detokenization, metrics and ordering checks on the way. On a GPU a decode
step takes one or two milliseconds, so a decode worker at batch 64 hands the router 30,000 to
60,000 tokens a second, and one router serves every worker. This bench offers the router that
load without a GPU: synthetic workers (bench/synthetic_worker.py) that speak the worker protocol
and emit one token per running request every --step-ms, and a load generator that keeps
--concurrency streaming requests in flight and checks every token it gets back (each stream
echoes its prompt, so a lost, repeated or misplaced token is caught).

For each concurrency it reports the tokens offered (workers' pace) and delivered (to the client),
the client's inter-token latency, and the router process's CPU from /proc: its cores and its
microseconds per token. The last is the figure to plan with: one router core carries at most
1e6 / (us per token) tokens a second. On a 2-core machine the synthetic workers and the load
generator share the cores with the router, so delivery saturates before the router does; its CPU
per token is measured all the same.

--frontend picks the clients' way in: the SDK (its streams' tokens come a TokenBatch per worker
step), a ZeroMQ client that asks for a message per token, or OpenAI's streaming HTTP API, served
in the router process or, with --api-servers N > 1, by N API server processes beside it
(router/api_server.py), whose CPU is then shown apart from the router's.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

import zmq

from bench.hostload import CpuWatch, children
from bench.report import cluster_logs, pct, print_json, print_table
from common import protocol as P
from common.channel import Channel
from common.errors import InvalidArgument
from common.model_spec import load_tokenizer, model_config
from common.sampling_params import SamplingParams
from common.text import output_text
from router.launcher import Child, Cluster


class Load:
    """What both load generators share: prompts, and the tokens, gaps and errors they saw."""

    def __init__(self, vocab: int, prompt_len: int, max_tokens: int, seed: int):
        self.rng = random.Random(seed)
        self.vocab, self.prompt_len, self.max_tokens = vocab, prompt_len, max_tokens
        self.tokens = self.done = 0
        self.messages = 0  # the client's messages (or HTTP events) that carried them
        self.gaps: list[float] = []  # seconds between a stream's consecutive tokens
        self.errors: list[str] = []

    def prompt(self) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(self.prompt_len)]

    def expected(self, prompt: list[int]) -> list[int]:
        """What a synthetic worker answers: the prompt, echoed over and over."""
        return [prompt[i % len(prompt)] for i in range(self.max_tokens)]

    def take(self) -> tuple[int, int, list[float]]:
        """Tokens, the messages that carried them, and gaps since the last take."""
        tokens, messages, gaps = self.tokens, self.messages, self.gaps
        self.tokens, self.messages, self.gaps = 0, 0, []
        return tokens, messages, gaps


class LoadGenerator(Load):
    """`concurrency` streaming requests in flight on one ZeroMQ socket (the SDK's protocol), each
    replaced when it ends; every token checked against the prompt it echoes. token_batches: read
    the router's TokenBatch replies, as the SDK does, or take a message per token."""

    def __init__(self, address: str, vocab: int, prompt_len: int, max_tokens: int, seed: int,
                 token_batches: bool = True):
        super().__init__(vocab, prompt_len, max_tokens, seed)
        self.token_batches = token_batches
        self.ctx = zmq.Context()
        self.chan = Channel.connect(self.ctx, zmq.DEALER, address)
        self.chan.sock.setsockopt(zmq.RCVHWM, 0)
        self.open: dict[str, list] = {}  # request id -> [expected tokens, next index, last token's arrival]
        self.ids = 0

    def submit(self):
        rid = f"r{self.ids}"
        self.ids += 1
        prompt = self.prompt()
        self.open[rid] = [self.expected(prompt), 0, None]
        self.chan.send(P.Generate(rid, prompt, {"max_tokens": self.max_tokens, "temperature": 0,
                                                "ignore_eos": True}, True, token_batches=self.token_batches))

    def run(self, concurrency: int, seconds: float) -> None:
        """Top up to `concurrency` and serve replies for `seconds`."""
        end = time.monotonic() + seconds
        while (now := time.monotonic()) < end:
            while len(self.open) < concurrency:
                self.submit()
            env = self.chan.recv(max(1, int((end - now) * 1000)))
            if env is not None:
                self.on_reply(env.msg)

    def drain(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while self.open and (now := time.monotonic()) < end:
            env = self.chan.recv(max(1, int((end - now) * 1000)))
            if env is not None:
                self.on_reply(env.msg)
        if self.open:
            self.errors.append(f"{len(self.open)} requests still open {timeout}s after the load stopped")
            self.open.clear()

    def on_reply(self, msg):
        if isinstance(msg, P.Probe):  # the router checking that this client is there: nothing to read
            return
        self.messages += isinstance(msg, (P.Token, P.TokenBatch))
        if not isinstance(msg, P.TokenBatch):
            return self._check(msg)
        if not self.token_batches:
            self.errors.append(f"a TokenBatch for a client that did not ask for one: {msg!r:.200}")
        for item in P.unbatch_tokens(msg):
            self._check(item)

    def _check(self, msg):
        r = self.open.get(getattr(msg, "request_id", None))
        if r is None:
            self.errors.append(f"a reply for no open request: {msg!r:.200}")
            return
        if isinstance(msg, P.Token):
            want, index, last = r
            if msg.index != index or msg.token_ids != want[index:index + len(msg.token_ids)]:
                self.errors.append(f"{msg.request_id}: tokens {msg.token_ids} at {msg.index}; "
                                   f"expected {want[index:index + len(msg.token_ids)]} at {index}")
            now = time.monotonic()
            if last is not None:
                self.gaps.append(now - last)
            r[1], r[2] = index + len(msg.token_ids), now
            self.tokens += len(msg.token_ids)
        elif isinstance(msg, P.Done):
            del self.open[msg.request_id]
            self.done += 1
            if msg.token_ids != r[0] or r[1] != self.max_tokens:
                self.errors.append(f"{msg.request_id} ended with {len(msg.token_ids)} tokens, "
                                   f"{r[1]} streamed; expected {self.max_tokens}, the prompt echoed")
        else:
            del self.open[msg.request_id]
            self.errors.append(f"{msg.request_id}: {msg!r:.200}")

    def close(self):
        self.chan.close()
        self.ctx.term()


class HttpLoadGenerator(Load):
    """The same load over OpenAI's streaming POST /v1/completions (aiohttp, one connection per
    stream, as HTTP clients are): each stream's text checked against its prompt's echo, detokenized,
    and one event per token."""

    def __init__(self, base_url: str, model: str, vocab: int, prompt_len: int, max_tokens: int, seed: int):
        import aiohttp

        super().__init__(vocab, prompt_len, max_tokens, seed)
        self.url, self.model, self.tokenizer = f"{base_url}/v1/completions", model, load_tokenizer(model)
        self.loop = asyncio.new_event_loop()
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, loop=self.loop), loop=self.loop,
                                             timeout=aiohttp.ClientTimeout(total=600))
        self.target = 0
        self.slots: list[asyncio.Task] = []

    def run(self, concurrency: int, seconds: float) -> None:
        self.target = concurrency
        self.slots += [self.loop.create_task(self._slot(i)) for i in range(len(self.slots), concurrency)]
        self.loop.run_until_complete(asyncio.sleep(seconds))

    async def _slot(self, i: int):
        while i < self.target:
            await self._one()

    async def _one(self):
        from bench.openai_load import completion_chunks

        prompt = self.prompt()
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        texts, events, last = [], 0, None
        try:
            async for now, chunk in completion_chunks(self.session, self.url, body):
                if "error" in chunk:
                    raise RuntimeError(f"the stream ended in an error: {chunk['error']}")
                choice = chunk["choices"][0]
                texts.append(choice["text"])
                if choice["finish_reason"] is None:
                    if last is not None:
                        self.gaps.append(now - last)
                    last, events = now, events + 1
                    self.tokens += 1
                    self.messages += 1
        except Exception as e:  # aiohttp's errors are many; each is this stream's failure
            self.errors.append(f"a stream failed: {type(e).__name__}: {e}")
            return
        self.done += 1
        want = output_text(self.tokenizer, self.expected(prompt), SamplingParams(ignore_eos=True))
        if events != self.max_tokens or "".join(texts) != want:
            self.errors.append(f"a stream of {events} token events gave {''.join(texts)!r:.80}; "
                               f"expected {self.max_tokens}, {want!r:.80}")

    def drain(self, timeout: float) -> None:
        self.target = 0
        if self.slots:
            _, pending = self.loop.run_until_complete(asyncio.wait(self.slots, timeout=timeout))
            if pending:
                self.errors.append(f"{len(pending)} streams still open {timeout}s after the load stopped")

    def close(self):
        for t in self.slots:
            t.cancel()
        self.loop.run_until_complete(asyncio.gather(*self.slots, return_exceptions=True))
        self.loop.run_until_complete(self.session.close())
        self.loop.close()


FRONTENDS = ("zmq", "zmq-per-token", "http")  # the SDK; a raw client that takes no TokenBatch; OpenAI's API


def run_router_bench(model: str = "dummy:nanogpt", concurrencies: list[int] = (16, 64, 256), workers: int = 2,
                     step_ms: float = 1.0, seconds: float = 3.0, prompt_len: int = 16, max_tokens: int = 256,
                     seed: int = 0, frontend: str = "zmq", api_servers: int = 1) -> dict:
    for name, value, ok, allowed in (
            ("workers", workers, workers >= 1, ">= 1"), ("step_ms", step_ms, step_ms > 0, "> 0"),
            ("seconds", seconds, seconds > 0, "> 0"), ("prompt_len", prompt_len, prompt_len >= 1, ">= 1"),
            ("max_tokens", max_tokens, max_tokens >= 2, ">= 2"),
            ("concurrencies", list(concurrencies), bool(concurrencies) and min(concurrencies) >= 1, "integers >= 1"),
            ("frontend", frontend, frontend in FRONTENDS, ", ".join(FRONTENDS)),
            ("api_servers", api_servers, api_servers == 1 or (api_servers > 1 and frontend == "http"),
             "1, or more with frontend=http")):
        if not ok:
            raise InvalidArgument(f"{name}={value!r}; allowed: {allowed}")
    cfg = model_config(model)
    if prompt_len + max_tokens >= cfg.max_position_embeddings:
        raise InvalidArgument(f"prompt_len + max_tokens = {prompt_len + max_tokens}; allowed: under "
                              f"{cfg.max_position_embeddings} ({model}'s context)")
    with cluster_logs() as logs:
        # A Cluster with no worker of its own kind: its router and start-up check, our synthetic workers.
        cluster = Cluster(model, 0, 0, workers, ["cpu"], "127.0.0.1", 0, 0, Path(logs), "least_loaded", [],
                          threads=1, restart=False, router_args=["--max-queue", str(max(concurrencies) + 64)],
                          http_port=0 if frontend == "http" else None, api_server_count=api_servers)
        cluster.workers = [Child(f"synth-{i}", [sys.executable, "-m", "bench.synthetic_worker", "--router",
                                                f"tcp://127.0.0.1:{cluster.worker_port}", "--worker-id", f"synth-{i}",
                                                "--model", model, "--step-ms", str(step_ms)],
                                 Path(logs) / f"synth-{i}.log") for i in range(workers)]
        gen = None
        try:
            cluster.start()
            gen = (HttpLoadGenerator(cluster.http_url, model, cfg.vocab_size, prompt_len, max_tokens, seed)
                   if frontend == "http" else LoadGenerator(cluster.address, cfg.vocab_size, prompt_len, max_tokens,
                                                            seed, token_batches=frontend == "zmq"))
            groups = {"router": [cluster.router.proc.pid], "workers": [w.proc.pid for w in cluster.workers],
                      "api_servers": children(cluster.router.proc.pid)}
            rows, points = [], []
            for c in concurrencies:
                print(f"concurrency {c}: warming up, then {seconds:.0f} s measured", file=sys.stderr, flush=True)
                gen.run(c, min(1.0, seconds))  # reach the level's steady state
                gen.take()
                watch = CpuWatch(groups)
                gen.run(c, seconds)
                cores = watch.stop()
                wall, (tokens, messages, gaps) = watch.elapsed, gen.take()
                offered = c / (step_ms / 1000)  # every stream a token a step
                point = {"concurrency": c, "offered_tok_s": round(offered), "delivered_tok_s": round(tokens / wall),
                         "tokens_per_message": round(tokens / max(messages, 1), 2),
                         "itl_p50_ms": round(pct(gaps, 50) * 1e3, 3), "itl_p99_ms": round(pct(gaps, 99) * 1e3, 3),
                         **{f"{k}_cores": round(v, 3) for k, v in cores.items()},
                         "router_us_per_token": round(cores["router"] * wall / max(tokens, 1) * 1e6, 2),
                         "api_servers_us_per_token": round(cores["api_servers"] * wall / max(tokens, 1) * 1e6, 2)}
                points.append(point)
                rows.append([c, point["offered_tok_s"], point["delivered_tok_s"],
                             f"{tokens / wall / offered:.2f}", point["tokens_per_message"], point["itl_p50_ms"],
                             point["itl_p99_ms"],
                             point["router_cores"], point["router_us_per_token"], point["api_servers_cores"],
                             point["api_servers_us_per_token"], point["workers_cores"], point["client_cores"],
                             point["others_cores"]])
            gen.drain(30.0)
        finally:
            if gen is not None:
                gen.close()
            cluster.stop()
    busiest = max(points, key=lambda p: p["delivered_tok_s"])  # the most loaded level
    per_token = busiest["router_us_per_token"]
    result = {"bench": "router", "model": model, "frontend": frontend, "api_servers": api_servers,
              "workers": workers, "step_ms": step_ms,
              "seconds": seconds, "prompt_len": prompt_len, "max_tokens": max_tokens, "points": points,
              "requests_done": gen.done, "errors": len(gen.errors), "router_us_per_token": per_token,
              "router_tok_s_per_core": round(1e6 / per_token) if per_token else None}
    print_table(f"pdserve bench router: {workers} synthetic workers stepping every {step_ms} ms, streaming "
                f"requests of {prompt_len} + {max_tokens} tokens over {frontend}"
                f"{f' from {api_servers} API servers' if api_servers > 1 else ''}, {seconds:.0f} s per level "
                "(ITL: at the client)",
                ["concurrency", "offered tok/s", "delivered tok/s", "delivered/offered", "tokens/message",
                 "ITL p50 ms", "ITL p99 ms", "router cores", "router us/token", "API servers cores",
                 "API servers us/token", "workers cores", "client cores", "others cores"], rows)
    for e in gen.errors[:10]:
        print(f"error: {e}")
    print(f"one router core carries about {result['router_tok_s_per_core']:,} tokens/s "
          f"({busiest['router_us_per_token']} us each, at concurrency {busiest['concurrency']}); "
          f"{gen.done} requests done, {len(gen.errors)} errors")
    print_json(result)
    return result
