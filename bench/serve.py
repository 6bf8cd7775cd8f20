"""`pdserve bench serve`: a load generator through the client SDK against clusters it launches
(or an existing router), reporting per topology and scenario: output tok/s, TTFT, inter-token
latency and end-to-end latency (p50/p99), and the router's own share of TTFT.

Topologies: `mono` (one monolithic worker behind the router: the baseline), `XpYd` (X prefill
and Y decode workers, e.g. 1p1d, 2p2d). Each topology gets the whole machine: the launcher
splits the cores between its workers, assigns them --devices in turn, and splits each GPU
between the workers on it.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from bench.report import print_json, print_table
from common.checkpoint import model_config
from router.client import AsyncClient
from router.launcher import Cluster


@dataclass
class Scenario:
    name: str
    requests: int
    prompt: tuple[int, int]  # prompt tokens, uniform in [lo, hi]
    new: tuple[int, int]  # new tokens, uniform in [lo, hi]
    arrival: str = "burst"  # burst (all at once), rate (fixed interval), poisson
    rate: float = 0.0  # requests per second for rate / poisson
    worker_args: list[str] = field(default_factory=list)


SCENARIOS = {s.name: s for s in [
    Scenario("smoke_test", 4, (16, 16), (8, 8)),
    Scenario("staggered_arrivals", 8, (24, 24), (10, 10), "rate", 20.0),
    Scenario("batch_pressure", 12, (16, 16), (10, 10), worker_args=["--max-num-seqs", "2"]),
    Scenario("long_prompts", 6, (40, 40), (8, 8)),
    Scenario("long_decode", 6, (16, 16), (32, 32)),
    Scenario("stress_test", 16, (16, 16), (10, 10)),
    Scenario("realistic", 48, (256, 2048), (32, 128), "poisson", 3.0),
]}


def parse_topology(name: str) -> tuple[int, int, int]:
    """-> (prefill, decode, mono) workers."""
    if name == "mono":
        return 0, 0, 1
    m = re.fullmatch(r"(\d+)p(\d+)d", name)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"topology {name!r} is not supported; allowed: mono or XpYd with X, Y >= 1 (e.g. 1p1d)")
    return int(m[1]), int(m[2]), 0


def make_requests(s: Scenario, vocab: int, context: int, seed: int):
    """(arrival offset s, prompt ids, max_tokens) per request, from a fixed seed."""
    rng = random.Random(f"{s.name}/{seed}")
    out, t = [], 0.0
    for i in range(s.requests):
        new = rng.randint(*s.new)
        plen = min(rng.randint(*s.prompt), context - new - 1)  # fit the model's context
        if s.arrival == "rate":
            t = i / s.rate
        elif s.arrival == "poisson" and i:
            t += rng.expovariate(s.rate)
        out.append((t, [rng.randrange(min(vocab, 256)) for _ in range(plen)], new))
    return out


@dataclass
class Sample:
    sent: float
    first: float | None = None
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    tokens: int = 0
    router_s: float = 0.0


async def drive(address: str, requests) -> tuple[list[Sample], float]:
    async with AsyncClient(address, timeout=600) as client:
        start = time.perf_counter()

        async def one(offset, prompt, max_tokens) -> Sample:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            s = Sample(time.perf_counter())
            async for item in client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
                now = time.perf_counter()
                if hasattr(item, "finish_reason"):
                    s.end, s.tokens, s.router_s = now, len(item.token_ids), item.timings.get("router_s", 0.0)
                else:
                    s.first = s.first or now
                    s.token_times += [now] * len(item.token_ids)
            return s

        samples = await asyncio.gather(*(one(*r) for r in requests))
        return list(samples), time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(samples: list[Sample], wall: float) -> dict:
    ttft = [(s.first - s.sent) * 1e3 for s in samples if s.first]
    itl = [(b - a) * 1e3 for s in samples for a, b in zip(s.token_times, s.token_times[1:])]
    e2e = [(s.end - s.sent) * 1e3 for s in samples if s.end]
    router = [s.router_s * 1e3 for s in samples]
    return {"requests": len(samples), "output_tokens": sum(s.tokens for s in samples),
            "output_tok_s": round(sum(s.tokens for s in samples) / wall, 1),
            "ttft_p50_ms": round(pct(ttft, 50), 2), "ttft_p99_ms": round(pct(ttft, 99), 2),
            "itl_p50_ms": round(pct(itl, 50), 2), "itl_p99_ms": round(pct(itl, 99), 2),
            "e2e_p50_ms": round(pct(e2e, 50), 2), "e2e_p99_ms": round(pct(e2e, 99), 2),
            "router_p50_ms": round(pct(router, 50), 3), "router_p99_ms": round(pct(router, 99), 3)}


def loopback_rtt_ms(n: int = 2000) -> float:
    """Median round trip of a small message over ZeroMQ on loopback: the hop the router adds."""
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = ctx.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{port}")

    def echo():
        for _ in range(n):
            server.send_multipart(server.recv_multipart())

    t = threading.Thread(target=echo)
    t.start()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.send(b"x" * 64)
        client.recv()
        times.append((time.perf_counter() - t0) * 1e3)
    t.join()
    client.close(0)
    server.close(0)
    ctx.term()
    return statistics.median(times)


def run_serve_bench(model: str, topologies: list[str], scenarios: list[str], router: str | None, seed: int,
                    worker_args: list[str], devices: list[str] = ("cpu",)) -> dict:
    for name in scenarios:
        if name not in SCENARIOS:
            raise ValueError(f"scenario {name!r} is unknown; allowed: {', '.join(SCENARIOS)}")
    cfg = model_config(model)
    rows = []
    groups: dict[tuple, list[str]] = {}
    for name in scenarios:
        groups.setdefault(tuple(SCENARIOS[name].worker_args), []).append(name)
    for topo in ([f"external {router}"] if router else topologies):
        for extra, names in groups.items():
            with tempfile.TemporaryDirectory() as logs:
                cluster = None
                if router is None:
                    p, d, m = parse_topology(topo)
                    cluster = Cluster(model, p, d, m, list(devices), "127.0.0.1", 0, 0, Path(logs), "least_loaded",
                                      worker_args + list(extra), threads=None, restart=False)
                    cluster.start()
                try:
                    address = router or cluster.address
                    for name in names:
                        s = SCENARIOS[name]
                        reqs = make_requests(s, cfg.vocab_size, cfg.max_position_embeddings, seed)
                        asyncio.run(drive(address, reqs[:2]))  # warm-up
                        samples, wall = asyncio.run(drive(address, reqs))
                        rows.append({"topology": topo, "scenario": name, **summarize(samples, wall)})
                finally:
                    if cluster is not None:
                        cluster.stop()
    rtt = loopback_rtt_ms()
    order = {n: i for i, n in enumerate(scenarios)}
    rows.sort(key=lambda r: (order[r["scenario"]], r["topology"]))
    print_table(f"pdserve bench serve: {model}, greedy, ignore_eos (latencies in ms)",
                ["scenario", "topology", "reqs", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                 "E2E p50", "E2E p99", "router p99"],
                [[r["scenario"], r["topology"], r["requests"], r["output_tok_s"], r["ttft_p50_ms"], r["ttft_p99_ms"],
                  r["itl_p50_ms"], r["itl_p99_ms"], r["e2e_p50_ms"], r["e2e_p99_ms"], r["router_p99_ms"]]
                 for r in rows])
    router_p50 = statistics.median([r["router_p50_ms"] for r in rows]) if rows else float("nan")
    print(f"router overhead on TTFT: {router_p50:.3f} ms processing (median over scenarios) + one loopback "
          f"round trip of {rtt:.3f} ms = {router_p50 + rtt:.3f} ms\n")
    result = {"bench": "serve", "model": model, "results": rows, "loopback_rtt_ms": round(rtt, 4),
              "router_overhead_ms": round(router_p50 + rtt, 4)}
    print_json(result)
    return result
