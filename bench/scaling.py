"""`pdserve bench scaling`: goodput per topology, through the real router and workers.

For each topology (N monolithic replicas `Nmono`, and every `XpYd` with X + Y = N, for N = 1 up
to the workers the devices allow, or the list given), the cluster is launched once and driven
through the SDK (`bench/serve.py`'s load generator) at rising request rates until SLO attainment
falls clearly below the target (`bench/goodput.py`). Reported per topology: goodput, goodput per
device, throughput at saturation, and TTFT / ITL / end-to-end percentiles at the goodput rate; the
best topology for each N; the table, one JSON line, the JSON in a file and the PNG plots
(`bench/plots.py`). Progress goes to stderr, so that the JSON stays stdout's last line.

Devices: `cpu` with --workers N (each topology gets the machine's cores split between its
workers, as `pdserve launch` does), or a list of CUDA devices, one worker each (more workers than
devices share them in turn).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.goodput import BACKLOG_LIMIT, SLO, Latency, Point, Search, find_goodput, point_from
from bench.hostload import CpuWatch
from bench.report import Progress, finite, print_json, print_table
from bench.serve import drive, parse_topology, placement_argv, random_prompt
from bench.workloads import Workload, fit, get_workload
from common.model_spec import model_config
from common.errors import InvalidArgument, made_dir
from router.launcher import Cluster, check_worker_count, ended


@dataclass(frozen=True)
class Topology:
    prefill: int
    decode: int
    mono: int
    local: int = 0  # the router's --max-local-prefill-length (XpYd+localN)
    queue: int = 0  # ... and --max-prefill-queue (XpYd+queueN)

    @property
    def name(self) -> str:
        if self.mono:
            return f"{self.mono}mono"
        return (f"{self.prefill}p{self.decode}d" + (f"+local{self.local}" if self.local else "")
                + (f"+queue{self.queue}" if self.queue else ""))

    @property
    def router_args(self) -> list[str]:
        return placement_argv(self.local, self.queue)

    @property
    def devices(self) -> int:
        return self.prefill + self.decode + self.mono

    @classmethod
    def parse(cls, name: str) -> "Topology":
        try:
            return cls(*parse_topology(name))
        except ValueError as e:
            raise InvalidArgument(str(e)) from None


def all_topologies(n: int) -> list[Topology]:
    """N monolithic replicas and every XpYd with X + Y = N, for N = 1..n."""
    out = []
    for total in range(1, n + 1):
        out.append(Topology(0, 0, total))
        out += [Topology(x, total - x, 0) for x in range(1, total)]
    return out


def resolve_devices(devices: str, workers: int | None) -> tuple[list[str], int]:
    """(device list, most workers a topology may have); errors name what the devices allow."""
    names = [d.strip() for d in devices.split(",") if d.strip()]
    if not names:
        raise InvalidArgument(f"devices={devices!r}; allowed: cpu, or cuda:0,cuda:1,...")
    if names == ["cpu"]:
        cores = os.cpu_count() or 1
        n = workers if workers is not None else 1
        if not 1 <= n <= cores:
            raise InvalidArgument(f"--workers {n} on cpu; allowed: 1..{cores} (this machine's cores: "
                                  "each worker needs one)")
        return names, n
    if set(names) == {"cpu"}:
        raise InvalidArgument(f"devices={devices!r}: cpu is one device, its cores shared by the workers; allowed: "
                              "cpu, with --workers N")
    if "cpu" in names:
        raise InvalidArgument(f"devices={devices!r} mixes cpu with other devices; allowed: cpu, or cuda:N,...")
    n = workers if workers is not None else len(names)
    if n < 1:
        raise InvalidArgument(f"--workers {n}; allowed: >= 1")
    return names, n


def check_topologies(topologies: list[Topology], max_workers: int, devices: list[str]) -> None:
    names = [t.name for t in topologies]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # the second sweep's figures replaced the first's
        raise InvalidArgument(f"--topologies names {', '.join(twice)} twice; allowed: each topology once")
    for t in topologies:
        check_worker_count(t.devices)
        if t.devices > max_workers:
            more = ("this machine's cores allow no more" if devices == ["cpu"] and max_workers >= (os.cpu_count() or 1)
                    else "raise --workers or give more devices")
            raise InvalidArgument(f"topology {t.name} needs {t.devices} workers; the devices allow {max_workers} "
                                  f"(devices={','.join(devices)}; {more})")


class SweepProgress:
    """One line per point on stderr: which topology, which rate, how many topologies remain."""

    def __init__(self, total: int):
        self.total, self.index, self.progress = total, 0, Progress("scaling")

    def topology(self, t: Topology):
        self.index += 1
        self.say(f"{t.name}: launching ({self.index}/{self.total} topologies, {self.total - self.index} after it)")

    def point(self, t: Topology, p: Point, n: int, slo: SLO):
        mark = "meets" if p.attainment >= slo.attainment else "misses"
        backlog = f" (a backlog: {p.backlog:.0%} short, fails)" if p.backlog_over(BACKLOG_LIMIT) else ""
        self.say(f"{t.name} ({self.index}/{self.total}): {p.rate:.3g} req/s x {n} requests -> attainment "
                 f"{p.attainment:.0%} ({mark} {slo.attainment:.0%}), delivered {p.requests_s:.3g} of {p.offered_rps:.3g} "
                 f"req/s offered in its steady part{backlog}, {p.output_tok_s:.0f} tok/s; other "
                 f"processes on the machine kept {p.cpu.get('others', 0):.2f} cores busy")

    def say(self, text: str):
        self.progress(text)


MAX_POINT_REQUESTS = 1_000_000  # one rate's requests: past this a point would run (or simulate) for hours
MAX_POINT_S = 3600.0  # one rate's arrivals: a point at 0.001 req/s took 8 hours for its 30 requests
MIN_START_RATE = 0.05  # req/s: the lowest a sweep starts from when it measures its own start
LIFETIMES = 4  # a point's arrivals span at least this many request lifetimes (Sweep.requests_at)


@dataclass
class Sweep:
    """How many requests each rate gets and how the search moves."""

    duration_s: float = 15.0  # of arrivals per rate: requests = rate x duration, within the bounds below
    min_requests: int = 30
    max_requests: int = 400
    start_rate: float | None = None  # None: from one request's latency on the idle cluster
    growth: float = 2.0
    refine: int = 4  # the knee to 2 ** (1 / 16): 4.4%, finer than the 15% the planner is held to
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.duration_s < math.inf:
            raise InvalidArgument(f"--duration {self.duration_s}; allowed: a number of seconds > 0")
        if not 1 <= self.min_requests <= self.max_requests:
            raise InvalidArgument(f"--min-requests {self.min_requests}, --max-requests {self.max_requests}; "
                                  "allowed: 1 <= min <= max")
        if self.start_rate is not None and not self.start_rate > 0:
            raise InvalidArgument(f"--start-rate {self.start_rate}; allowed: > 0 requests per second")
        if self.refine < 0:
            raise InvalidArgument(f"--refine {self.refine}; allowed: >= 0")

    @property
    def resolution(self) -> float:
        """How near a goodput the search gets: within this fraction of it (bench/goodput.py)."""
        return self.growth ** (1 / 2 ** self.refine) - 1

    def requests_at(self, rate: float, slo: SLO, mean_output_tokens: float) -> int:
        """rate x duration requests, within [min, max]; but never so few that they arrive in less than
        the longest of: a quarter of the duration; 10 TTFT targets; LIFETIMES request lifetimes at the
        targets (TTFT + mean output x TPOT). A shorter burst is absorbed, by the queues or by a
        running batch that grows, and passes at any rate (bench/goodput.py)."""
        life = (slo.ttft_ms + mean_output_tokens * slo.itl_ms) / 1e3
        windows = [(self.duration_s / 4, f"--duration {self.duration_s:g}", "a quarter of the duration"),
                   (10 * slo.ttft_ms / 1e3, f"--ttft-slo-ms {slo.ttft_ms:g}", "10 TTFT targets"),
                   (LIFETIMES * life, f"--ttft-slo-ms {slo.ttft_ms:g} and --itl-slo-ms {slo.itl_ms:g}",
                    f"{LIFETIMES} request lifetimes at the targets: TTFT + {mean_output_tokens:.0f} mean output "
                    "tokens x TPOT")]
        window, flags, why = max(windows, key=lambda w: w[0])
        n = max(self.min_requests, min(self.max_requests, round(rate * self.duration_s)), math.ceil(rate * window))
        if n > MAX_POINT_REQUESTS:
            raise InvalidArgument(f"{flags}: a point at {rate:.3g} req/s would take {n:.3g} requests (arrivals "
                                  f"over {why}, {window:.3g} s, so that the system cannot absorb the burst); "
                                  f"allowed: at most {MAX_POINT_REQUESTS:,}, from a window of at most "
                                  f"{MAX_POINT_REQUESTS / rate:.3g} s at this rate")
        return n

    def check_start(self, slo: SLO, mean_output_tokens: float) -> None:
        """Before any cluster launches: the first point's size, at --start-rate or at the lowest rate
        a sweep starts from (an SLO of 1e300 ms asks for more requests than any rate can take)."""
        rate = self.start_rate or MIN_START_RATE
        n = self.requests_at(rate, slo, mean_output_tokens)
        if self.start_rate is not None and n / rate > MAX_POINT_S:
            raise InvalidArgument(f"--start-rate {rate:g}: its point would take {n / rate:.3g} s for its {n} "
                                  f"requests (--min-requests {self.min_requests}); allowed: a rate whose point takes "
                                  f"at most {MAX_POINT_S:g} s, here >= {n / MAX_POINT_S:.3g} req/s")


def measure_cluster(cluster: Cluster, workload: Workload, rate: float, n: int, slo: SLO, context: int, vocab: int,
                    seed: int, salt: str) -> Point:
    reqs = [fit(r, context) for r in workload.requests(rate, n, seed)]  # same lengths at every rate
    rng = random.Random(salt)  # fresh prompt ids at every point: no prefix-cache hit from an earlier one
    load = [(r.arrival, random_prompt(rng, r.prompt_tokens, vocab), r.output_tokens)
            for r in reqs]
    watch = CpuWatch({"router": [cluster.router.proc.pid], "workers": [w.proc.pid for w in cluster.workers]})
    samples, _ = asyncio.run(drive(cluster.address, load))
    served = [s for s in samples if s.error is None and s.end is not None]
    p = point_from(rate, [Latency.of(s) for s in samples], slo, [s.sent for s in samples], [s.end for s in served],
                   [t for s in served for t in s.token_times])
    p.cpu = watch.stop()
    return p


def check_alive(cluster: Cluster, during: str) -> None:
    """A process of the cluster that exited fails the sweep: its failed requests would be taken
    for the topology's own (a Ctrl-C that reached the workers measured a cluster that was gone,
    and its figures were written as a finished result)."""
    from router.client import RequestError

    for c in cluster.children:
        if c.proc.poll() is not None:
            raise RequestError("UNAVAILABLE", f"{c.name} {ended(c.proc.returncode)} during {during}; nothing "
                                              f"of this run is saved. Its log, {c.log_path}, ends:\n{c.run_log()}")


def start_rate_for(address: str, workload: Workload, t: Topology, context: int, vocab: int) -> float:
    """Half of what the workers could serve one request at a time each: a rate that should pass."""
    r = fit(workload.requests(1.0, 1)[0], context)
    rng = random.Random("start")
    samples, _ = asyncio.run(drive(address, [(0.0, random_prompt(rng, r.prompt_tokens, vocab),
                                              r.output_tokens)]))
    e2e = samples[0].end - samples[0].sent if samples[0].end else 1.0
    return max(MIN_START_RATE, 0.5 * max(t.mono, t.decode, 1) / e2e)


def sweep_topology(model: str, t: Topology, devices: list[str], workload: Workload, slo: SLO, sweep: Sweep,
                   worker_args: list[str], progress: SweepProgress, log_dir: Path) -> Search:
    cfg = model_config(model)
    context, vocab = cfg.max_position_embeddings, cfg.vocab_size
    cluster = Cluster(model, t.prefill, t.decode, t.mono, devices, "127.0.0.1", 0, 0, log_dir / t.name,
                      "least_loaded", worker_args, threads=None, restart=False, router_args=t.router_args)
    try:
        cluster.start()
        warm = [fit(r, context) for r in workload.requests(1.0, 2 * t.devices, sweep.seed + 1)]
        asyncio.run(drive(cluster.address, [(0.0, [1] * r.prompt_tokens, min(r.output_tokens, 4)) for r in warm]))
        start = sweep.start_rate or start_rate_for(cluster.address, workload, t, context, vocab)
        points, mean_output = [0], workload.mean_output_tokens(context)

        def measure(rate: float) -> Point:
            n = sweep.requests_at(rate, slo, mean_output)
            points[0] += 1
            p = measure_cluster(cluster, workload, rate, n, slo, context, vocab, sweep.seed,
                                f"{sweep.seed}/{t.name}/{points[0]}")
            check_alive(cluster, f"the point at {rate:.3g} req/s of {t.name}")
            progress.point(t, p, n, slo)
            return p

        return find_goodput(measure, slo.attainment, start, sweep.growth, sweep.refine)
    finally:
        cluster.stop()


def topology_row(t: Topology, s: Search) -> dict:
    at, sat = s.at_goodput, s.saturation
    row = {"topology": t.name, "devices": t.devices, "prefill": t.prefill, "decode": t.decode, "mono": t.mono,
           "goodput_rps": round(s.goodput, 4), "goodput_per_device_rps": round(s.goodput / t.devices, 4),
           # the most requests any point completed a second (the most-tokens point's may be fewer:
           # each rate draws its own requests, of other lengths)
           "saturation_rps": round(max(p.requests_s for p in s.points), 3) if sat else 0.0,
           "saturation_tok_s": round(sat.output_tok_s, 1) if sat else 0.0,
           "start_rate": s.points[0].rate if s.points else 0.0,
           "others_cores": round(statistics.mean(p.cpu.get("others", 0.0) for p in s.points), 3) if s.points else 0.0,
           "at_goodput": at.latency_summary() if at else {},
           "points": [p.to_json() for p in sorted(s.points, key=lambda p: p.rate)]}
    return row


def best_per_n(rows: list[dict]) -> dict[str, str]:
    """The topology of the most goodput for each device count; none where no topology met the SLO."""
    best: dict[int, dict] = {}
    for r in rows:
        if r["goodput_rps"] > 0 and (r["devices"] not in best or r["goodput_rps"] > best[r["devices"]]["goodput_rps"]):
            best[r["devices"]] = r
    return {str(n): r["topology"] for n, r in sorted(best.items())}


def print_results(title: str, rows: list[dict], best: dict[str, str]) -> None:
    def lat(r, key) -> str:  # p50/p90/p99, or "-" where no rate met the SLO
        values = [r["at_goodput"].get(f"{key}_p{q}_ms", math.nan) for q in (50, 90, 99)]
        return "/".join(f"{v:.0f}" for v in values) if all(math.isfinite(v) for v in values) else "-"

    winners = set(best.values())
    print_table(title, ["topology", "devs", "goodput req/s", "per device", "sat. req/s", "sat. tok/s",
                        "TTFT p50/p90/p99", "ITL p50/p90/p99", "E2E p50/p90/p99", "others' cores", "best"],
                [[r["topology"], r["devices"], r["goodput_rps"], r["goodput_per_device_rps"], r["saturation_rps"],
                  r["saturation_tok_s"]]
                 + [lat(r, k) for k in ("ttft", "itl", "e2e")]
                 + [f"{r['others_cores']:.2f}", "*" if r["topology"] in winners else ""] for r in rows])


def run_scaling_bench(model: str, devices: str, workers: int | None, topologies: list[str] | None,
                      workload_spec: str, slo: SLO, sweep: Sweep, out_dir: Path, worker_args: list[str] = ()) -> dict:
    workload = get_workload(workload_spec)
    names, max_workers = resolve_devices(devices, workers)
    topos = [Topology.parse(n) for n in topologies] if topologies else all_topologies(max_workers)
    check_topologies(topos, max_workers, names)
    sweep.check_start(slo, workload.mean_output_tokens(model_config(model).max_position_embeddings))
    out_dir = made_dir(Path(out_dir), "--out-dir")
    progress = SweepProgress(len(topos))
    searches: dict[Topology, Search] = {}
    finished: dict[Topology, float] = {}  # when each topology's sweep ended (a later profile is compared with it)
    for t in topos:  # each cluster's logs under --out-dir/logs, where an error can point to them
        progress.topology(t)
        searches[t] = sweep_topology(model, t, names, workload, slo, sweep, list(worker_args), progress,
                                     out_dir / "logs")
        finished[t] = time.time()
    rows = [{**topology_row(t, s), "finished_unix": round(finished[t])} for t, s in searches.items()]
    best = best_per_n(rows)
    workers = f"{max_workers} worker{'s' * (max_workers != 1)}"
    title = (f"pdserve bench scaling: {model} on {','.join(names)} (up to {workers}), "
             f"{workload.describe()}; SLO TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.itl_ms:g} ms for "
             f"{slo.attainment:.0%} of requests (latencies in ms at the goodput rate)")
    print_results(title, rows, best)
    result = {"bench": "scaling", "model": model, "devices": names, "workers": max_workers,
              "workload": workload_spec, "workload_shape": workload.describe(), "slo": asdict(slo),
              "sweep": asdict(sweep), "worker_args": list(worker_args), "results": rows, "best": best}
    from bench.plots import plot_scaling

    result["plots"] = plot_scaling(searches, rows, slo, out_dir)
    (out_dir / "scaling.json").write_text(json.dumps(finite(result), indent=1, allow_nan=False))  # as print_json
    print(f"JSON in {out_dir / 'scaling.json'}; plots: {', '.join(result['plots']) or 'none'}\n", flush=True)
    print_json(result)
    return result
