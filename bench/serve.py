"""`pdserve bench serve`: a load generator through the client SDK against clusters it launches
(or an existing router), reporting per topology and scenario: output tok/s, TTFT, inter-token
latency and end-to-end latency (p50/p99), and the router's own share of TTFT.

Topologies: `mono` (one monolithic worker behind the router: the baseline), `XpYd` (X prefill
and Y decode workers, e.g. 1p1d, 2p2d), and XpYd with `+localN` (prompts up to N tokens prefilled by
their decode workers: the router's --max-local-prefill-length) and/or `+queueN` (decode workers
prefill while every prefill worker holds N requests: --max-prefill-queue). Each topology gets the whole machine: the launcher
splits the cores between its workers, assigns them --devices in turn, and splits each GPU
between the workers on it.

Frontends: `zmq` (the SDK) and `http` (OpenAI's API, bench/openai_load.py). With both, each
launched cluster serves both and every scenario runs through each in turn, `--repeats` times,
so the two are compared on one cluster in one run. `--base-url` drives any OpenAI-compatible
server instead (vLLM, SGLang, or a pdserve router's HTTP port).
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import zmq

from bench.goodput import Latency, percentiles
from bench.report import Progress, cluster_logs, pct, print_json, print_table
from common.model_spec import model_config
from router.client import AsyncClient, Client, RequestError
from router.launcher import Cluster, check_worker_count


@dataclass
class Scenario:
    name: str
    requests: int
    prompt: tuple[int, int]  # prompt tokens, uniform in [lo, hi]
    new: tuple[int, int]  # new tokens, uniform in [lo, hi]
    arrival: str = "burst"  # burst (all at once), rate (fixed interval), poisson
    rate: float = 0.0  # requests per second for rate / poisson
    worker_args: list[str] = field(default_factory=list)
    concurrency: int = 0  # at most this many requests in flight (0: no limit)
    background: tuple[int, int] = (0, 0)  # (streams, tokens each) decoding throughout, not measured
    prefixes: tuple[int, int] = (0, 0)  # (count, tokens each): every prompt is one of them + its own `prompt` tokens
    # (turns, (lo, hi) new tokens a turn): each request a conversation, whose next turn's prompt is the
    # last one, its output and new tokens, sent once the output is in (the SDK only: it gets the ids)
    turns: tuple[int, tuple[int, int]] = (1, (0, 0))


SCENARIOS = {s.name: s for s in [
    Scenario("smoke_test", 4, (16, 16), (8, 8)),
    Scenario("staggered_arrivals", 8, (24, 24), (10, 10), "rate", 20.0),
    Scenario("batch_pressure", 12, (16, 16), (10, 10), worker_args=["--max-num-seqs", "2"]),
    Scenario("long_prompts", 6, (40, 40), (8, 8)),
    Scenario("long_decode", 6, (16, 16), (32, 32)),
    Scenario("stress_test", 16, (16, 16), (10, 10)),
    Scenario("realistic", 48, (256, 2048), (32, 128), "poisson", 3.0),
    Scenario("concurrent_64", 256, (64, 192), (32, 96), concurrency=64),  # 64 streams in flight throughout
    Scenario("sequential", 48, (32, 32), (8, 8), concurrency=1),  # no queueing: TTFT is the path itself
    # one request at a time beside 63 others (64 streams, a decode batch's default): TTFT without a queue
    Scenario("ttft_64_streams", 64, (32, 32), (4, 4), concurrency=1, background=(63, 320)),
    # 16 documents of 768 tokens asked about at random (a 16-48-token question each, a short answer),
    # 8 in flight, every worker's pool 512 blocks: the documents fill one and a half (prefix_affine)
    Scenario("shared_prefixes", 512, (16, 48), (4, 4), concurrency=8, prefixes=(16, 768),
             worker_args=["--num-blocks", "512"]),
    # 32 conversations of 4 turns, 8 at a time: a 128-384-token first prompt, then 16-48 new tokens a
    # turn, 16-48 answered each time (up to 720 tokens in all)
    Scenario("multi_turn", 32, (128, 384), (16, 48), concurrency=8, turns=(4, (16, 48))),
]}


def parse_topology(name: str) -> tuple[int, int, int, int, int]:
    """-> (prefill, decode, mono workers, the router's --max-local-prefill-length and
    --max-prefill-queue): "mono" or "Nmono" (N monolithic replicas), "XpYd", with "+localN"
    (prompts up to N tokens prefilled by their decode workers) and/or "+queueN" (decode workers
    prefill while every prefill worker holds N); 0 where not given."""
    mono = re.fullmatch(r"(\d*)mono", name)
    if mono and int(mono[1] or 1) >= 1:
        return 0, 0, int(mono[1] or 1), 0, 0
    m = re.fullmatch(r"(\d+)p(\d+)d((?:\+(?:local|queue)[1-9]\d*)*)", name)
    given = re.findall(r"\+(local|queue)(\d+)", m[3]) if m else []
    placing = dict(given)
    if not m or int(m[1]) < 1 or int(m[2]) < 1 or len(placing) < len(given):
        raise ValueError(f"topology {name!r} is not supported; allowed: mono, Nmono (N monolithic replicas), "
                         "XpYd with X, Y >= 1, each optionally with +localN (prompts up to N tokens prefilled by "
                         "decode workers) and +queueN (decode workers prefill while every prefill worker holds N), "
                         "N >= 1 (e.g. 2mono, 1p1d, 1p1d+local256, 1p2d+local64+queue2)")
    return int(m[1]), int(m[2]), 0, int(placing.get("local", 0)), int(placing.get("queue", 0))


def placement_argv(local: int, queue: int) -> list[str]:
    """The router's flags for a topology's +localN and +queueN (0: not given)."""
    return ((["--max-local-prefill-length", str(local)] if local else [])
            + (["--max-prefill-queue", str(queue)] if queue else []))


def make_requests(s: Scenario, vocab: int, context: int, seed: int, run: str = ""):
    """(arrival offset s, prompt ids, max_tokens[, the next turns' (new ids, max_tokens)]) per
    request, from a fixed seed: each `run` (the warm-up, each repeat and frontend) its own prompts,
    so that none finds another's in the prefix caches, and run k the same in every topology."""
    rng = random.Random(f"{s.name}/{seed}/{run}" if run else f"{s.name}/{seed}")
    prefixes = [random_prompt(rng, s.prefixes[1], vocab) for _ in range(s.prefixes[0])]
    turns, more = s.turns
    out, t = [], 0.0
    for i in range(s.requests):
        new = rng.randint(*s.new)
        later = [(random_prompt(rng, rng.randint(*more), vocab), rng.randint(*s.new)) for _ in range(turns - 1)]
        prefix = rng.choice(prefixes) if prefixes else []
        grows = sum(len(ids) + n for ids, n in later)
        plen = min(rng.randint(*s.prompt), context - new - 1 - len(prefix) - grows)  # fit the model's context
        if s.arrival == "rate":
            t = i / s.rate
        elif s.arrival == "poisson" and i:
            t += rng.expovariate(s.rate)
        out.append((t, prefix + random_prompt(rng, plen, vocab), new, *([later] if later else [])))
    return out


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    """n token ids of the first 256 (or the vocabulary): no prefix-cache hits between prompts."""
    return [rng.randrange(min(vocab, 256)) for _ in range(n)]


@dataclass
class Sample:
    sent: float
    prompt_tokens: int = 0
    first: float | None = None
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    tokens: int = 0
    router_s: float | None = None  # the router's own time, which it tells SDK clients (not HTTP ones)
    error: str | None = None  # the router's code, for a request that failed
    timings: dict = field(default_factory=dict)  # the workers' and the router's, from Done


async def drive(address: str, requests, concurrency: int = 0) -> tuple[list[Sample], float]:
    async with AsyncClient(address, timeout=600) as client:
        start = time.perf_counter()
        gate = asyncio.Semaphore(concurrency or len(requests) or 1)

        async def one(prompt, max_tokens) -> tuple[Sample, list[int]]:
            await gate.acquire()  # at most `concurrency` in flight
            s, output = Sample(time.perf_counter(), len(prompt)), []
            try:
                stream = client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
                async for chunk in stream:
                    now = time.perf_counter()
                    s.first = s.first or now
                    s.token_times += [now] * len(chunk.token_ids)
                s.end, s.tokens, s.timings = time.perf_counter(), len(stream.result.token_ids), stream.result.timings
                s.router_s = stream.result.timings.get("router_s", 0.0)
                output = stream.result.token_ids
            except RequestError as e:  # counted as failed, not fatal to the run
                s.error, s.end = e.code, None
            finally:
                gate.release()
            return s, output

        async def conversation(offset, prompt, max_tokens, later=()) -> list[Sample]:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            samples = []
            for new, n in [([], max_tokens), *later]:  # a turn that failed ends its conversation
                s, output = await one(prompt + new, n)
                samples.append(s)
                if s.error is not None:
                    break
                prompt = prompt + new + output
            return samples

        conversations = await asyncio.gather(*(conversation(*r) for r in requests))
        return [s for samples in conversations for s in samples], time.perf_counter() - start


def summarize(samples: list[Sample], wall: float) -> dict:
    """Latencies and throughput of the requests that completed; the failed ones are counted apart."""
    ok = [s for s in samples if s.error is None]
    done = [r for r in map(Latency.of, ok) if r.ttft is not None]
    router = [s.router_s * 1e3 for s in ok if s.router_s is not None]  # the SDK's: HTTP does not say
    told = [s for s in ok if "cached_tokens" in s.timings]  # the SDK gets the workers' timings; HTTP does not
    cached = (round(100 * sum(s.timings["cached_tokens"] for s in told) / max(1, sum(s.prompt_tokens for s in told)), 1)
              if told else None)
    return {"requests": len(samples), "failed": len(samples) - len(ok), "output_tokens": sum(s.tokens for s in ok),
            "output_tok_s": round(sum(s.tokens for s in ok) / wall, 1),
            **percentiles(done, (50, 99), ("ttft", "itl", "e2e")),
            "router_p50_ms": round(pct(router, 50), 3) if router else None,
            "router_p99_ms": round(pct(router, 99), 3) if router else None,
            "prompt_cached_pct": cached}


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
                    worker_args: list[str], frontends: tuple[str, ...] = ("zmq",), base_url: str | None = None,
                    repeats: int = 1, api_key: str | None = None, devices: list[str] = ("cpu",),
                    policies: list[str] = ("least_loaded",), kv_events: list[str] = ("on",),
                    num_requests: int | None = None) -> dict:
    """num_requests: each scenario's requests (conversations, for multi_turn) instead of its own count."""
    from bench.openai_load import drive_http, served_model_at  # it imports Sample from here

    progress = Progress("serve")
    from router.registry import POLICIES

    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is unknown; allowed: {', '.join(POLICIES)}")

    if set(kv_events) - {"on", "off"} or len(set(kv_events)) != len(kv_events) or not kv_events:
        raise ValueError(f"kv events {','.join(kv_events)!r} are not supported; allowed: on, off, on,off or off,on")
    kv_events = [e == "on" for e in kv_events]
    for name in scenarios:
        if name not in SCENARIOS:
            raise ValueError(f"scenario {name!r} is unknown; allowed: {', '.join(SCENARIOS)}")
    if set(frontends) - {"zmq", "http"} or not frontends:
        raise ValueError(f"frontends {','.join(frontends)!r} are not supported; allowed: zmq, http or both")
    if router and base_url:
        raise ValueError("give --router (a ZeroMQ address) or --base-url (an HTTP server), not both")
    frontends = ("http",) if base_url else ("zmq",) if router else tuple(frontends)
    talks = [name for name in scenarios if SCENARIOS[name].turns[0] > 1]
    if talks and "http" in frontends:
        raise ValueError(f"scenario {talks[0]!r} sends each turn's output back as token ids, which only the SDK "
                         "gets; allowed with it: --frontends zmq (and --router, not --base-url)")
    served, external_policy = model, ("-", True)
    if router:  # no router there: UNAVAILABLE now, before any run, as served_model_at says it of --base-url
        with Client(router) as client:
            status = client.status()
        served, external_policy = status.model or model, (status.policy or "-", status.kv_events)
    elif base_url:
        served = served_model_at(base_url, api_key)
    cfg = model_config(model)
    rows = []
    groups: dict[tuple, list[str]] = {}
    for name in scenarios:
        groups.setdefault(tuple(SCENARIOS[name].worker_args), []).append(name)
    external = router or base_url
    shapes = {} if external else {t: parse_topology(t) for t in topologies}  # every one, before any launch
    for shape in shapes.values():
        check_worker_count(sum(shape[:3]))
    # KV events matter to prefix_affine alone: another policy runs once
    launches = [(f"external {external}", *external_policy)] if external else [
        (t, p, e) for t in topologies for p in policies for e in (kv_events if p == "prefix_affine" else (True,))]
    for topo, policy, events in launches:
        for extra, names in groups.items():
            with cluster_logs() as logs:
                cluster = None
                if not external:
                    p, d, m, local, queue = shapes[topo]
                    cluster = Cluster(model, p, d, m, list(devices), "127.0.0.1", 0, 0, Path(logs), policy,
                                      worker_args + list(extra), threads=None, restart=False,
                                      router_args=placement_argv(local, queue) + ([] if events else ["--no-kv-events"]),
                                      http_port=0 if "http" in frontends else None, api_key=api_key)
                    cluster.start()
                try:
                    drivers = {"zmq": lambda reqs, n: drive(router or cluster.address, reqs, n),
                               "http": lambda reqs, n: drive_http(base_url or cluster.http_url, reqs, n, api_key)}
                    for name in names:
                        s = SCENARIOS[name] if num_requests is None else replace(SCENARIOS[name], requests=num_requests)
                        def requests(run: str):
                            return make_requests(s, cfg.vocab_size, cfg.max_position_embeddings, seed, run)
                        for frontend in frontends:
                            asyncio.run(drivers[frontend](requests(f"warm-up {frontend}")[:2], 0))
                        shown = f"{topo}{'' if external else ' ' + policy}"
                        for rep in range(repeats):  # in turn, first one then the other first: drift hits both alike
                            for frontend in (frontends if rep % 2 == 0 else frontends[::-1]):
                                before = router_counters(router or cluster.address) if not base_url else None
                                reqs = requests(f"{rep} {frontend}")
                                progress(f"{shown}: {name} x {len(reqs)} by {frontend}" +
                                         (f", run {rep + 1} of {repeats}" if repeats > 1 else ""))
                                samples, wall = asyncio.run(beside_background(drivers[frontend], reqs, s))
                                after = router_counters(router or cluster.address) if before is not None else None
                                rows.append({"topology": topo, "policy": policy, "kv_events": events, "scenario": name,
                                             "frontend": frontend, **summarize(samples, wall),
                                             **counted(before, after, samples, s, policy)})
                finally:
                    if cluster is not None:
                        cluster.stop()
    rtt = loopback_rtt_ms()
    order = {n: i for i, n in enumerate(scenarios)}
    rows.sort(key=lambda r: (order[r["scenario"]], r["topology"]))  # stable: policies in the order given
    shown = model if served == model else f"{served!r} at {router or base_url} (prompts from {model}'s vocabulary)"
    print_table(f"pdserve bench serve: {shown}, greedy, ignore_eos (latencies in ms; cached: the share of prompt "
                "tokens found in the workers' prefix caches; local: of requests prefilled by their decode worker; "
                "(approx): prefix_affine guessing the caches, --no-kv-events; mispredicted: of prompt tokens, "
                "taken for cached by prefix_affine and not found, or the other way round)",
                ["scenario", "topology", "policy", "frontend", "reqs", "failed", "out tok/s", "TTFT p50", "TTFT p99",
                 "ITL p50", "ITL p99", "E2E p50", "E2E p99", "router p99", "cached %", "mispredicted %", "local %"],
                [[r["scenario"], r["topology"], r["policy"] + ("" if r["kv_events"] else " (approx)"), r["frontend"],
                  r["requests"], r["failed"],
                  r["output_tok_s"], r["ttft_p50_ms"], r["ttft_p99_ms"], r["itl_p50_ms"], r["itl_p99_ms"],
                  r["e2e_p50_ms"], r["e2e_p99_ms"],
                  r["router_p99_ms"] if r["frontend"] == "zmq" else "-",
                  r["prompt_cached_pct"], r["prefix_mispredicted_pct"], r["local_prefill_pct"]] for r in rows])
    result = {"bench": "serve", "model": model, "served_model": served, "results": rows, "loopback_rtt_ms": round(rtt, 4)}
    zmq_rows = [r for r in rows if r["frontend"] == "zmq" and r["router_p50_ms"] is not None]  # none: all failed
    if zmq_rows:
        router_p50 = statistics.median([r["router_p50_ms"] for r in zmq_rows])
        print(f"router overhead on TTFT: {router_p50:.3f} ms processing (median over scenarios) + one loopback "
              f"round trip of {rtt:.3f} ms = {router_p50 + rtt:.3f} ms\n")
        result["router_overhead_ms"] = round(router_p50 + rtt, 4)
    if len(frontends) == 2:
        result["http_vs_zmq"] = compare_frontends(rows)
    print_json(result)
    return result


COUNTERS = ("local_prefills", "prefix_cache_mispredicted_tokens")


def router_counters(address: str) -> dict[str, float] | None:
    """The router at address's COUNTERS (its metrics); None where it does not answer."""
    try:
        with Client(address, timeout=10) as client:
            text = client.metrics().decode()
    except RequestError:
        return None
    return {name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(f"pdserve:{name}_total{{")) for name in COUNTERS}


def counted(before: dict | None, after: dict | None, samples: list[Sample], s: Scenario, policy: str) -> dict:
    """What the router counted over a run: the share of requests its decode workers prefilled, and
    (prefix_affine) of prompt tokens it took for cached where it sent them and the worker did not
    find, or the other way round."""
    if before is None or after is None:
        return {"local_prefill_pct": None, "prefix_mispredicted_pct": None}
    grew = {name: after[name] - before[name] for name in COUNTERS}
    prompts = sum(x.prompt_tokens for x in samples)
    return {"local_prefill_pct": round(100 * grew["local_prefills"] / (len(samples) + s.background[0]), 1),
            "prefix_mispredicted_pct": round(100 * grew["prefix_cache_mispredicted_tokens"] / max(1, prompts), 1)
            if policy == "prefix_affine" else None}


async def beside_background(driver, reqs, s: Scenario) -> tuple[list, float]:
    """Drive reqs while s.background's streams decode (through the same frontend); those are not
    measured, and run to their end so that the next run starts on an idle cluster."""
    streams, tokens = s.background
    if not streams:
        return await driver(reqs, s.concurrency)
    background = asyncio.ensure_future(driver([(0.0, [i % 200 + 1] * 64, tokens) for i in range(streams)], 0))
    await asyncio.sleep(1.0)  # they are decoding by then
    measured = await driver(reqs, s.concurrency)
    await background
    return measured


def compare_frontends(rows: list[dict]) -> list[dict]:
    """Per topology and scenario: HTTP's TTFT p50 minus the SDK's, and HTTP's output tok/s over
    the SDK's, run by run (the two ran back to back, so each pair saw the same machine), and the
    median over the runs; a pair in which either run served nothing (all its requests failed) is
    left out."""
    out = []
    for topo, policy, name in dict.fromkeys((r["topology"], r["policy"], r["scenario"]) for r in rows):
        zmq_runs, http_runs = ([r for r in rows if (r["topology"], r["policy"], r["scenario"], r["frontend"])
                                == (topo, policy, name, fe)] for fe in ("zmq", "http"))
        pairs = [(z, h) for z, h in zip(zmq_runs, http_runs) if z["output_tok_s"] > 0 and h["output_tok_s"] > 0]
        if not pairs:
            print(f"HTTP vs ZeroMQ SDK, {name} on {topo} ({policy}): no pair of runs in which both served a request")
            continue
        deltas = [h["ttft_p50_ms"] - z["ttft_p50_ms"] for z, h in pairs]
        ratios = [h["output_tok_s"] / z["output_tok_s"] for z, h in pairs]
        delta, ratio = statistics.median(deltas), statistics.median(ratios)
        out.append({"topology": topo, "policy": policy, "scenario": name, "runs": len(deltas),
                    "ttft_p50_delta_ms": round(delta, 2),
                    "output_tok_s_ratio": round(ratio, 3), "ttft_p50_delta_ms_per_run": [round(d, 2) for d in deltas],
                    "output_tok_s_ratio_per_run": [round(r, 3) for r in ratios]})
        print(f"HTTP vs ZeroMQ SDK, {name} on {topo} ({policy}), median of {len(deltas)} back-to-back pairs: TTFT p50 "
              f"{delta:+.2f} ms (runs: {', '.join(f'{d:+.2f}' for d in deltas)}), output tok/s {ratio:.3f}x "
              f"(runs: {', '.join(f'{r:.3f}' for r in ratios)})")
    print()
    return out
