"""Chaos: a cluster under a stream of requests while a driver SIGKILLs, SIGTERMs and SIGSTOPs
random workers (the launcher restarts the killed ones and those that left; stopped ones resume and
must rejoin). Every request's streamed tokens are checked against a fault-free reference run of
the monolithic engine: completed, token-exact, no duplicated or missing token, no KV block leaked.

Used at small scale by tests/test_chaos.py and at full scale by `pdserve bench chaos`.
"""

from __future__ import annotations

import asyncio
import gc
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.report import Progress, pct, print_json, print_table
from common.cli_options import engine_kwargs_from
from common.errors import InvalidArgument
from common.engine import Engine
from common.sampling_params import SamplingParams
from router.client import AsyncClient, Client, RequestError
from router.launcher import Cluster


def chaos_workload(n: int, seed: int, vocab: int = 256):
    """Mixed prompt lengths; greedy and seeded requests long enough to be mid-decode when hit."""
    rng = random.Random(f"chaos/{seed}")
    out = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([4, 16, 48, 120]))]
        s = dict(max_tokens=rng.randint(8, 48), ignore_eos=True)
        s.update(temperature=0.0) if i % 2 else s.update(temperature=0.9, top_p=0.95, seed=1000 + i)
        out.append((prompt, s))
    return out


@dataclass
class Outcome:
    tokens: list[int] | None = None
    streamed: list[int] = field(default_factory=list)
    duplicated: int = 0  # chunks re-sending a position already streamed
    gaps: int = 0  # chunks starting past the next position
    error: str | None = None
    latency_s: float = 0.0
    attempts: int = 1


@dataclass
class ChaosDriver:
    cluster: Cluster
    kills: int
    interval_s: float
    stop_s: float
    seed: int
    log: list[str] = field(default_factory=list)
    done: int = 0
    progress: Progress | None = None  # says each fault

    def _all_registered(self, client: Client) -> bool:
        try:
            return sum(w["alive"] for w in client.status(timeout=1).workers) == len(self.cluster.workers)
        except RequestError:
            return False

    def run(self, finished: threading.Event):
        rng = random.Random(f"driver/{self.seed}")
        stopped = []
        client = Client(self.cluster.address, timeout=5)
        while self.done < self.kills and not finished.wait(self.interval_s):
            self.cluster.supervise_once()
            if not self._all_registered(client):
                continue  # let the last victim come back first
            victim = rng.choice(self.cluster.workers)
            fault = rng.random()
            if fault < 0.6:
                victim.proc.send_signal(signal.SIGKILL)
                self.log.append(f"SIGKILL {victim.name}")
            elif fault < 0.8:  # it leaves gracefully (--drain-timeout), and the launcher starts it again
                victim.proc.send_signal(signal.SIGTERM)
                self.log.append(f"SIGTERM {victim.name}")
            else:
                victim.proc.send_signal(signal.SIGSTOP)
                stopped.append((victim, time.monotonic() + self.stop_s))
                self.log.append(f"SIGSTOP {victim.name} for {self.stop_s}s")
            self.done += 1
            if self.progress is not None:
                self.progress(f"fault {self.done} of {self.kills}: {self.log[-1]}")
            for c, until in list(stopped):
                if time.monotonic() >= until:
                    c.proc.send_signal(signal.SIGCONT)
                    stopped.remove((c, until))
            time.sleep(self.stop_s)
            for c, _ in stopped:
                c.proc.send_signal(signal.SIGCONT)
            stopped.clear()
        while not finished.wait(0.1):  # keep restarting until the load is done
            self.cluster.supervise_once()
        client.close()


async def _drive(address: str, work, concurrency: int, gap_s: float, faults_done) -> list[Outcome]:
    """Requests arrive every gap_s, at most `concurrency` at once; the last tenth waits until every
    fault was injected, so the faults always land under load."""
    sem = asyncio.Semaphore(concurrency)
    start = time.monotonic()
    tail = len(work) - max(1, len(work) // 10)
    async with AsyncClient(address, timeout=300) as client:
        async def one(i, prompt, sampling) -> Outcome:
            o = Outcome()
            await asyncio.sleep(max(0.0, start + i * gap_s - time.monotonic()))
            while i >= tail and not faults_done():
                await asyncio.sleep(0.1)
            async with sem:
                t0 = time.monotonic()
                try:
                    stream = client.stream(prompt, **sampling)
                    async for chunk in stream:
                        if chunk.index < len(o.streamed):
                            o.duplicated += 1
                        else:
                            o.gaps += chunk.index > len(o.streamed)
                            o.streamed.extend(chunk.token_ids)
                    o.tokens, o.attempts = stream.result.token_ids, stream.result.timings.get("attempts", 1)
                except RequestError as e:
                    o.error = e.code
                o.latency_s = time.monotonic() - t0
            return o
        return list(await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(work))))


def leaked_blocks(address: str, workers: int, timeout: float = 60.0) -> dict[str, int]:
    """Blocks still in use per worker once every worker is back and the cluster is idle (counts
    arrive with heartbeats, so this waits for them to settle)."""
    deadline = time.monotonic() + timeout
    with Client(address, timeout=10) as client:
        while True:
            live = [w for w in client.status().workers if w["alive"]]
            leaks = {w["worker_id"]: w["total_blocks"] - w["free_blocks"] for w in live}
            if (len(live) == workers and not any(leaks.values())) or time.monotonic() > deadline:
                return leaks
            time.sleep(0.2)


def run_chaos(model: str = "dummy:nanogpt", prefill: int = 2, decode: int = 2, requests: int = 500, kills: int = 10,
              concurrency: int = 24, seed: int = 0, interval_s: float = 1.5, stop_s: float = 1.5,
              heartbeat_timeout_s: float = 0.6, log_dir: Path | None = None, verbose: bool = True,
              devices: list[str] = ("cpu",), dtype: str | None = None, worker_args: list[str] = (),
              router_args: list[str] = ()) -> dict:
    """The reference runs on the first of `devices` in `dtype`, as the workers do (token-exact on a
    GPU needs a batch-invariant dtype there: float32)."""
    work = chaos_workload(requests, seed)
    given = engine_kwargs_from(worker_args)["dtype"]
    if dtype is not None and given is not None and given != dtype:
        raise InvalidArgument(f"--dtype {dtype} and --worker-arg=--dtype={given}: give the workers' dtype once")
    progress = Progress("chaos") if verbose else None
    if progress:
        progress(f"the reference: {len(work)} requests in one engine")
    engine = Engine(model=model, device=devices[0], dtype=dtype or given)
    reference = [o.token_ids for o in engine.generate([p for p, _ in work], [SamplingParams(**s) for _, s in work])]
    on_gpu, dtype = engine.config.torch_device.type == "cuda", engine.config.dtype
    del engine
    if on_gpu:  # the workers size their pools from their share of the device: give the reference's back
        gc.collect()
        torch.cuda.empty_cache()
    worker_args = ["--dtype", dtype, *worker_args]
    tmp = tempfile.TemporaryDirectory() if log_dir is None else None
    router_args = ["--heartbeat-timeout", str(heartbeat_timeout_s), "--max-attempts", "20",
                   "--decode-stall-timeout", "10", "--prefill-timeout", "20", "--queue-timeout", "60", *router_args]
    cluster = Cluster(model, prefill, decode, 0, list(devices), "127.0.0.1", 0, 0, Path(log_dir or tmp.name),
                      "least_loaded", worker_args, threads=None if on_gpu else 1, restart=True, router_args=router_args)
    try:
        cluster.start()
        driver = ChaosDriver(cluster, kills, interval_s, stop_s, seed, progress=progress)
        if progress:
            progress(f"{len(work)} requests over about {kills * (interval_s + stop_s + 4.0) + 2.0:.0f} s, {kills} "
                     "faults among them")
        finished = threading.Event()
        thread = threading.Thread(target=driver.run, args=(finished,), daemon=True)
        t0 = time.monotonic()
        thread.start()
        span = kills * (interval_s + stop_s + 4.0) + 2.0  # 4 s: a killed worker's restart
        outcomes = asyncio.run(_drive(cluster.address, work, concurrency, span / max(1, requests),
                                      lambda: driver.done >= kills))
        wall = time.monotonic() - t0
        leaks = leaked_blocks(cluster.address, len(cluster.workers))  # the driver still restarts workers
        finished.set()
        thread.join()
    finally:
        cluster.stop()
        if tmp is not None:
            tmp.cleanup()
    completed = [o for o in outcomes if o.tokens is not None]
    exact = sum(o.tokens == ref and o.streamed == ref for o, ref in zip(outcomes, reference))
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
    missing = sum(max(0, len(ref) - len(o.streamed)) for o, ref in zip(completed and outcomes, reference) if o.tokens)
    result = {"bench": "chaos", "model": model, "topology": f"{prefill}p{decode}d", "devices": list(devices),
              "dtype": dtype, "total": len(outcomes),
              "completed": len(completed), "token_exact": exact,
              "duplicated_tokens": sum(o.duplicated for o in outcomes),
              "missing_tokens": missing + sum(o.gaps for o in outcomes),
              "leaked_blocks": sum(leaks.values()), "leaked_by_worker": leaks, "kills": driver.done,
              "chaos_events": driver.log, "errors": errors,
              "retried_requests": sum(o.attempts > 1 for o in outcomes),
              "p99_latency_s": round(pct([o.latency_s for o in outcomes], 99), 3), "wall_s": round(wall, 1)}
    if verbose:
        print_table(f"pdserve bench chaos: {model} ({dtype} on {','.join(devices)}), {prefill}P{decode}D, "
                    f"{len(outcomes)} requests, {driver.done} faults ({', '.join(driver.log)})",
                    ["total", "completed", "token exact", "retried", "duplicated", "missing", "leaked blocks",
                     "errors", "p99 latency s"],
                    [[result["total"], result["completed"], result["token_exact"], result["retried_requests"],
                      result["duplicated_tokens"], result["missing_tokens"], result["leaked_blocks"], errors or "-",
                      result["p99_latency_s"]]])
        print_json(result)
    return result
