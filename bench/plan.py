"""`pdserve plan`: predicted goodput per topology from a measured profile, by simulation.

From a profile (`bench/profile.py`, taken once and saved as JSON), a workload, an SLO and device
counts, each topology is simulated (`bench/simulate.py`) at the rates the goodput search
(`bench/goodput.py`) asks for, with the same request counts and seeds `bench scaling` uses, so a
prediction and a measurement see the very same requests. It reports per device count:

- the predicted goodput of N monolithic replicas and of the xPyD splits (all of them up to 16
  devices; past that a search over X that assumes goodput rises then falls with X), the best;
- what breaks first just past each topology's goodput (TTFT: prefill-bound, TPOT: decode-bound);
- a ladder for growing load: from 1P1D, the rate at which to add a prefill or a decode worker
  (whichever raises goodput more), up to the largest device count asked for (at most 16);
- with `--compare scaling.json`, the prediction for every topology `bench scaling` measured, its
  error, and the same search replayed (its start rate, requests and seeds).

On the profiling machine (up to --workers workers) the workers share its host as they did when
measured: on a CPU the cores are split between them and contend with the router and the client.
Beyond it, devices sit --devices-per-host to a host, one worker each, as fast as the profiled
worker; KV between hosts costs network latency + bytes / bandwidth (no overlap with the
prefill assumed); the router and the clients run elsewhere and cost no device time.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.goodput import SLO, Point, Search, find_goodput
from bench.profile import model_from_json
from bench.report import print_json, print_table
from bench.scaling import Sweep, Topology
from bench.simulate import Placement, WorkerModel, simulate
from bench.workloads import Workload, fit, get_workload
from common.errors import InvalidArgument

FULL_SEARCH_UP_TO = 16  # devices: every split is simulated; past it a search over X


@dataclass(frozen=True)
class Profile:
    """A saved profile: worker models by threads per worker, and the host they were measured on."""

    model: str
    device: str
    host_cores: int | None
    models: dict[int, WorkerModel]
    worker_args: tuple[str, ...] = ()

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            d = json.loads(Path(path).read_text())
            models = {p["threads"]: model_from_json(p["worker_model"]) for p in d["profiles"]}
            return cls(d["model"], d["device"], d.get("host_cores"), models, tuple(d.get("worker_args", ())))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"profile {str(path)!r} cannot be read ({type(e).__name__}: {e}); make one with "
                                  "pdserve plan --profile PATH (it profiles when PATH does not exist)") from e

    def local(self, t: Topology, background_cores: float = 0.0) -> tuple[WorkerModel, Placement]:
        """A topology on the profiling machine: its workers share the host as the launcher splits
        it, with the router, the clients and background_cores of other work."""
        if self.host_cores is None:  # GPUs: one device per worker, the host's CPU is no limit
            return next(iter(self.models.values())), Placement()
        threads = max(1, self.host_cores // t.devices)
        have = min(self.models, key=lambda k: (abs(k - threads), k))
        return self.models[have], Placement(host_cores=self.host_cores, front_on_host0=True,
                                            background_cores=background_cores)

    def remote(self, network_gbps: float, network_latency_ms: float, devices_per_host: int
               ) -> tuple[WorkerModel, Placement]:
        """Devices past this machine: each as fast as the profiled worker with the fewest threads."""
        m = self.models[min(self.models)]
        cores = self.host_cores
        per_host = devices_per_host if cores is None else max(1, cores // m.threads)
        return m, Placement(per_host, cores, False, network_gbps, network_latency_ms / 1e3)


def start_rate(m: WorkerModel, workload: Workload, t: Topology) -> float:
    """Half of what the topology serves one request at a time per worker: a rate that should pass."""
    reqs = [fit(r, m.engine.max_model_len) for r in workload.requests(1.0, 64)]
    prompt = sum(r.prompt_tokens for r in reqs) / len(reqs)
    out = sum(r.output_tokens for r in reqs) / len(reqs)
    one = m.step([(round(prompt), 0)], 0, 0) + m.handoff_s(round(prompt)) + out * m.step([], 1, round(prompt + out))
    return max(1e-3, 0.5 * max(t.mono, t.decode, 1) / one)


def predict(m: WorkerModel, placement: Placement, t: Topology, workload: Workload, slo: SLO, sweep: Sweep,
            start: float | None = None) -> Search:
    def measure(rate: float) -> Point:
        reqs = [fit(r, m.engine.max_model_len) for r in workload.requests(rate, sweep.requests_at(rate), sweep.seed)]
        return simulate(m, t.prefill, t.decode, t.mono, placement, rate, reqs, slo)

    return find_goodput(measure, slo.attainment, start or sweep.start_rate or start_rate(m, workload, t),
                        sweep.growth, sweep.refine)


def bound(s: Search, slo: SLO) -> str:
    """What fails first just past goodput: 'prefill' (TTFT), 'decode' (TPOT), or '-' (nothing failed)."""
    fails = [p for p in s.points if p.rate > s.goodput and p.attainment < slo.attainment]
    if not fails:
        return "-"
    p = min(fails, key=lambda p: p.rate)
    ttft = sum(r.ttft is None or r.ttft > slo.ttft_ms for r in p.records)
    tpot = sum(r.tpot is not None and r.tpot > slo.itl_ms for r in p.records)
    return "prefill" if ttft >= tpot else "decode"


class Planner:
    """Predictions for one profile, workload and SLO, each topology simulated once."""

    def __init__(self, profile: Profile, workload: Workload, slo: SLO, sweep: Sweep, local_workers: int,
                 network_gbps: float, network_latency_ms: float, devices_per_host: int, say=print):
        self.profile, self.workload, self.slo, self.sweep = profile, workload, slo, sweep
        self.local_workers = local_workers
        self.remote = profile.remote(network_gbps, network_latency_ms, devices_per_host)
        self.say = say
        self.searches: dict[tuple[Topology, float], Search] = {}

    def search(self, t: Topology, start: float | None = None, background_cores: float = 0.0) -> Search:
        key = (t, background_cores)
        if key not in self.searches:
            local = t.devices <= self.local_workers
            m, placement = self.profile.local(t, background_cores) if local else self.remote
            sweep = self.sweep
            if not local:  # as many requests per worker as a local run has
                sweep = replace(sweep, max_requests=sweep.max_requests * max(1, t.devices // 2))
            s = self.searches[key] = predict(m, placement, t, self.workload, self.slo, sweep, start)
            under = f" under {background_cores:.2f} cores of other work" if background_cores else ""
            self.say(f"{t.name}: predicted goodput {s.goodput:.3g} req/s{under} ({len(s.points)} rates simulated)")
        return self.searches[key]

    def goodput(self, t: Topology) -> float:
        return self.search(t).goodput

    def splits(self, n: int) -> list[Topology]:
        """The xPyD splits of n devices worth simulating: all of them, or a search over X."""
        if n < 2:
            return []
        xpyd = [Topology(f"{x}p{n - x}d", x, n - x, 0) for x in range(1, n)]
        if n <= FULL_SEARCH_UP_TO:
            for t in xpyd:
                self.goodput(t)
            return xpyd
        lo, hi = 0, len(xpyd) - 1  # ternary search over X on integers, assuming one peak
        while hi - lo > 2:
            a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
            if self.goodput(xpyd[a]) < self.goodput(xpyd[b]):
                lo = a + 1
            else:
                hi = b - 1 if self.goodput(xpyd[a]) > self.goodput(xpyd[b]) else b
        for t in xpyd[lo:hi + 1]:
            self.goodput(t)
        return [t for t in xpyd if (t, 0.0) in self.searches]

    def plan(self, n: int) -> dict:
        mono = Topology(f"{n}mono", 0, 0, n)
        tried = [mono] + self.splits(n)
        rows = [self.row(t) for t in tried]
        best = max(rows, key=lambda r: r["goodput_rps"])
        best_split = max((r for r in rows if r["mono"] == 0), key=lambda r: r["goodput_rps"], default=None)
        mono_g = rows[0]["goodput_rps"]
        return {"devices": n, "local": n <= self.local_workers, "best": best["topology"],
                "best_xpyd": best_split["topology"] if best_split else None,
                "xpyd_over_mono": round(best_split["goodput_rps"] / mono_g, 3) if best_split and mono_g else None,
                "topologies": rows}

    def row(self, t: Topology) -> dict:
        s = self.search(t)
        return {"topology": t.name, "devices": t.devices, "prefill": t.prefill, "decode": t.decode, "mono": t.mono,
                "goodput_rps": round(s.goodput, 4), "goodput_per_device_rps": round(s.goodput / t.devices, 4),
                "bound": bound(s, self.slo)}

    def ladder(self, most: int) -> list[dict]:
        """From 1P1D, add whichever worker raises goodput more, up to `most` devices."""
        x, y, steps = 1, 1, []
        while True:
            t = Topology(f"{x}p{y}d", x, y, 0)
            step = {"topology": t.name, "goodput_rps": round(self.goodput(t), 4), "add": None}
            steps.append(step)
            if x + y >= most:
                return steps
            more_p, more_d = Topology(f"{x + 1}p{y}d", x + 1, y, 0), Topology(f"{x}p{y + 1}d", x, y + 1, 0)
            if self.goodput(more_p) > self.goodput(more_d):
                step["add"], x = "prefill", x + 1
            else:
                step["add"], y = "decode", y + 1


def compare(planner: Planner, scaling: dict) -> list[dict]:
    """Predicted against measured goodput for every topology of a bench scaling result: on a quiet
    machine, and under the other work the measurement itself saw (its mean over the sweep)."""
    rows = []
    for r in scaling["results"]:
        t = Topology.parse(r["topology"])
        measured, others = r["goodput_rps"], r.get("others_cores", 0.0)
        quiet = planner.search(t, start=r.get("start_rate") or None).goodput
        loaded = planner.search(t, start=r.get("start_rate") or None, background_cores=others).goodput
        rows.append({"topology": t.name, "measured_rps": measured, "others_cores": others,
                     "predicted_rps": round(quiet, 4), "error": round(relative(quiet, measured), 4),
                     "predicted_under_others_rps": round(loaded, 4),
                     "error_under_others": round(relative(loaded, measured), 4)})
    return rows


def relative(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.nan


def run_plan(profile: Profile, workload_spec: str, slo: SLO, sweep: Sweep, device_counts: list[int],
             local_workers: int, network_gbps: float, network_latency_ms: float, devices_per_host: int,
             compare_with: dict | None = None) -> dict:
    if compare_with is not None:  # replay the measured sweep: its workload, SLO and search
        workload_spec = compare_with["workload"]
        slo = SLO(**compare_with["slo"])
        sweep = Sweep(**compare_with["sweep"])
        local_workers = max(local_workers, compare_with["workers"])
    workload = get_workload(workload_spec)
    if network_gbps <= 0 or network_latency_ms < 0 or devices_per_host < 1:
        raise InvalidArgument(f"--network-gbps {network_gbps}, --network-latency-ms {network_latency_ms}, "
                              f"--devices-per-host {devices_per_host}; allowed: > 0, >= 0, >= 1")
    bad = [n for n in device_counts if n < 1]
    if bad:
        raise InvalidArgument(f"--plan-devices {bad[0]}; allowed: device counts >= 1")

    def say(text):
        print(f"[plan] {text}", file=sys.stderr, flush=True)

    planner = Planner(profile, workload, slo, sweep, local_workers, network_gbps, network_latency_ms,
                      devices_per_host, say)
    result = {"bench": "plan", "model": profile.model, "profiled_on": profile.device, "workload": workload_spec,
              "workload_shape": workload.describe(), "slo": asdict(slo),
              "network": {"gbps": network_gbps, "latency_ms": network_latency_ms,
                          "devices_per_host": devices_per_host}}
    if compare_with is not None:
        rows = compare(planner, compare_with)
        result["validation"] = rows
        print_table(f"predicted vs measured goodput ({compare_with['model']}, {workload_spec}; the measured sweep "
                    "replayed in simulation; 'others': cores other processes kept busy during the measurement)",
                    ["topology", "measured req/s", "others", "predicted (quiet)", "error", "predicted (others)",
                     "error"],
                    [[r["topology"], r["measured_rps"], f"{r['others_cores']:.2f}", r["predicted_rps"],
                      f"{r['error']:+.1%}", r["predicted_under_others_rps"], f"{r['error_under_others']:+.1%}"]
                     for r in rows])
    plans = [planner.plan(n) for n in device_counts]
    result["plans"] = plans
    for p in plans:
        where = "this machine" if p["local"] else f"{devices_per_host} devices per host" \
            if profile.host_cores is None else "hosts like this one"
        print_table(f"plan for {p['devices']} devices ({where}): best {p['best']}"
                    + (f", best xPyD {p['best_xpyd']} = {p['xpyd_over_mono']}x {p['devices']}mono"
                       if p["xpyd_over_mono"] else ""),
                    ["topology", "goodput req/s", "per device", "bound past goodput"],
                    [[r["topology"], r["goodput_rps"], r["goodput_per_device_rps"], r["bound"]]
                     for r in p["topologies"]])
    most = min(max(device_counts), FULL_SEARCH_UP_TO)
    if most >= 2:
        result["ladder"] = planner.ladder(most)
        print_table("growing load from 1P1D: past each goodput, add the worker that raises it more",
                    ["topology", "goodput req/s", "past it, add"],
                    [[s["topology"], s["goodput_rps"], s["add"] or "-"] for s in result["ladder"]])
    result["assumptions"] = assumptions(profile, network_gbps, network_latency_ms, devices_per_host, local_workers)
    print("assumptions:\n" + "\n".join(f"- {a}" for a in result["assumptions"]) + "\n")
    print_json(result)
    return result


def assumptions(profile: Profile, gbps: float, latency_ms: float, per_host: int, local: int) -> list[str]:
    out = [f"each device runs one worker as fast as the profiled {profile.model} worker on {profile.device}",
           f"up to {local} workers: this machine, shared as measured"
           + (f" ({profile.host_cores} cores split between workers, router and clients)" if profile.host_cores else ""),
           (f"past it: {per_host} devices per host" if profile.host_cores is None
            else "past it: hosts like this one, each full of workers"),
           f"KV between hosts: {latency_ms:g} ms + bytes / {gbps:g} GB/s, not overlapped with the prefill; "
           "on one host: the profiled handoff",
           "the router pairs any prefill with any decode worker by load (it does not know hosts)",
           "router and clients on their own machines past this one; no failures, no prefix-cache hits, "
           "outputs run to their length"]
    return out
