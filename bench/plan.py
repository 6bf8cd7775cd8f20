"""`pdserve plan`: predicted goodput per topology from a measured profile, by simulation.

From a profile (`bench/profile.py`, taken once and saved as JSON), a workload, an SLO and device
counts, each topology is simulated (`bench/simulate.py`) at the rates the goodput search
(`bench/goodput.py`) asks for, with the same request counts and seeds `bench scaling` uses, so a
prediction and a measurement see the very same requests. It reports per device count:

- the predicted goodput of N monolithic replicas and of every xPyD split (with `--placements`,
  each split also with decode workers that prefill: +localN, +queueN), and the best;
- what breaks first just past each topology's goodput (TTFT: prefill-bound, TPOT: decode-bound);
- a ladder for growing load: from 1P1D, the rate at which to add a prefill or a decode worker
  (whichever raises goodput more), up to one host (or this machine) full;
- with `--compare scaling.json`, the prediction for every topology `bench scaling` measured, its
  error, and the same search replayed (its start rate, requests and seeds).

On the profiling machine (up to --workers workers) the workers share its host as they did when
measured: on a CPU the cores are split between them and contend with the router and the client.
Beyond it, devices sit --devices-per-host to a host, one worker each, as fast as the profiled
worker, and every host runs the same split (N devices: hosts x aPbD). One host is simulated, at
1 / hosts of the rate: the router, which does not know hosts, pairs a prefill worker with a decode
worker elsewhere (hosts - 1) / hosts of the time, and such KV costs network latency + bytes /
bandwidth (not overlapped with the prefill); the router and clients run elsewhere. Balancing
over one host's workers instead of all of them makes this slightly pessimistic.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.goodput import CLEAR_MARGIN, SLO, Point, Search, find_goodput
from bench.profile import PROFILE_VERSION, model_from_json
from bench.report import print_json, print_table
from bench.scaling import Sweep, Topology
from bench.simulate import Hosting, WorkerModel, simulate
from bench.workloads import Workload, fit, get_workload
from common.errors import InvalidArgument
from router.launcher import threads_per_worker



@dataclass(frozen=True)
class Profile:
    """A saved profile: worker models by threads per worker, and the host they were measured on."""

    model: str
    device: str
    host_cores: int | None
    models: dict[int, WorkerModel]
    worker_args: tuple[str, ...] = ()
    measured_unix: float | None = None  # when it was profiled (a machine's speed drifts: compare like with like)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            d = json.loads(Path(path).read_text())
            version = d.get("profile_version")
            if version == PROFILE_VERSION:
                models = {p["threads"]: model_from_json(p["worker_model"]) for p in d["profiles"]}
                if not models:
                    raise InvalidArgument(f"profile {str(path)!r} holds no worker profile (its \"profiles\" is "
                                          "empty); allowed: a profile pdserve plan saved (make one anew: pdserve plan "
                                          "--profile PATH --reprofile)")
                return cls(d["model"], d["device"], d.get("host_cores"), models, tuple(d.get("worker_args", ())),
                           d.get("measured_unix"))
        except InvalidArgument:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidArgument(f"profile {str(path)!r} cannot be read ({type(e).__name__}: {e}); make one with "
                                  "pdserve plan --profile PATH (it profiles when PATH does not exist)") from e
        raise InvalidArgument(f"profile {str(path)!r} is version {version!r}; allowed: {PROFILE_VERSION}, what this "
                              "pdserve measures and simulates (profile anew: pdserve plan --profile PATH --reprofile)")

    def check_reuse(self, path: str | Path, given: dict[str, object]) -> None:
        """A saved profile planned with: the --model, --device and --threads given (given: the
        flags given and their values) must be the ones it measured, or InvalidArgument naming both."""
        have = {"--model": self.model, "--device": self.device}
        for flag, value in given.items():
            if flag in have and value != have[flag]:
                raise InvalidArgument(f"{flag} {value}: profile {str(path)!r} measured {self.model} on {self.device}; "
                                      f"allowed: {flag} {have[flag]} with it, or --reprofile to profile {value} into "
                                      "it, or another --profile path", param=flag)
        threads = given.get("--threads")
        if threads is not None and threads not in self.models:
            raise InvalidArgument(f"--threads {threads}: profile {str(path)!r} measured workers of "
                                  f"{', '.join(map(str, sorted(self.models)))} thread(s); allowed: those, or "
                                  "--reprofile, or another --profile path", param="--threads")

    def describe(self, path: str | Path, now: float | None = None) -> str:
        """Which profile was read, of what, and how old it is."""
        if self.measured_unix is None:
            age = "when: not recorded (a profile saved before 2026-11-26 evening)"
        else:
            minutes = ((time.time() if now is None else now) - self.measured_unix) / 60
            age = (f"measured {minutes:.0f} min ago" if minutes < 120 else f"measured {minutes / 60:.1f} h ago"
                   if minutes < 48 * 60 else f"measured {minutes / 1440:.0f} days ago")
        threads = ", ".join(map(str, sorted(self.models)))
        return (f"read profile {str(path)!r}: {self.model} on {self.device}, workers of {threads} thread(s); {age} "
                "(--reprofile to measure anew)")

    def local(self, t: Topology, background_cores: float = 0.0) -> tuple[WorkerModel, Hosting]:
        """A topology on the profiling machine: its workers share the host as the launcher splits
        it, with the router, the clients and background_cores of other work."""
        if self.host_cores is None:  # GPUs: one device per worker, the host's CPU is no limit
            return next(iter(self.models.values())), Hosting()
        threads = threads_per_worker(t.devices, self.host_cores)
        have = min(self.models, key=lambda k: (abs(k - threads), k))
        return self.models[have], Hosting(host_cores=self.host_cores, front_on_host=True,
                                          background_cores=background_cores)

    @property
    def device_model(self) -> WorkerModel:
        """A device past this machine: as fast as the profiled worker with the fewest threads."""
        return self.models[min(self.models)]


def start_rate(m: WorkerModel, workload: Workload, t: Topology) -> float:
    """Half of what the topology serves one request at a time per worker: a rate that should pass."""
    reqs = [fit(r, m.engine.max_model_len) for r in workload.requests(1.0, 64)]
    prompt = sum(r.prompt_tokens for r in reqs) / len(reqs)
    out = sum(r.output_tokens for r in reqs) / len(reqs)
    one = m.step([(round(prompt), 0)], 0, 0) + m.handoff_s(round(prompt)) + out * m.step([], 1, round(prompt + out))
    return max(1e-3, 0.5 * max(t.mono, t.decode, 1) / one)


def predict(m: WorkerModel, hosting: Hosting, t: Topology, workload: Workload, slo: SLO, sweep: Sweep,
            start: float | None = None) -> Search:
    context = m.engine.max_model_len
    mean_output = workload.mean_output_tokens(context)

    def measure(rate: float) -> Point:
        reqs = [fit(r, context) for r in workload.requests(rate, sweep.requests_at(rate, slo, mean_output), sweep.seed)]
        return simulate(m, t.prefill, t.decode, t.mono, hosting, rate, reqs, slo, slo.attainment - CLEAR_MARGIN,
                        (t.local, t.queue))

    return find_goodput(measure, slo.attainment, start or sweep.start_rate or start_rate(m, workload, t),
                        sweep.growth, sweep.refine)


def bound(s: Search, slo: SLO) -> str:
    """What fails first just past goodput: 'prefill' (TTFT), 'decode' (TPOT), or '-' (nothing failed).
    Where as many requests miss each target (none, when only the backlog grew), the one whose
    latencies sit nearer their target."""
    fails = [p for p in s.points if p.rate > s.goodput and not p.meets(slo.attainment)]
    if not fails:
        return "-"
    p = min(fails, key=lambda p: p.rate)
    served = [r for r in p.records if r.ttft is not None]  # (a stopped simulation: requests not arrived yet)
    ttft = sum(r.ttft > slo.ttft_ms for r in served)
    tpot = sum(r.tpot is not None and r.tpot > slo.itl_ms for r in served)
    if ttft == tpot:
        ttft = sum(r.ttft / slo.ttft_ms for r in served)
        tpot = sum((r.tpot or 0.0) / slo.itl_ms for r in served)
    return "prefill" if ttft >= tpot else "decode"


def scaled(s: Search, hosts: int) -> Search:
    """A slice's search as the whole cluster's: hosts slices, each taking 1 / hosts of the rate and
    delivering 1 / hosts of the throughput."""
    return Search([replace(p, rate=p.rate * hosts, offered_rps=p.offered_rps * hosts, requests_s=p.requests_s * hosts,
                           output_tok_s=p.output_tok_s * hosts, in_flight=p.in_flight * hosts) for p in s.points],
                  s.goodput * hosts)


class Planner:
    """Predictions for one profile, workload and SLO, each topology simulated once: on this
    machine as it is, past it as one host's slice of the cluster."""

    def __init__(self, profile: Profile, workload: Workload, slo: SLO, sweep: Sweep, local_workers: int,
                 network_gbps: float, network_latency_ms: float, devices_per_host: int, say=print,
                 placements: tuple[tuple[int, int], ...] = ()):
        self.profile, self.workload, self.slo, self.sweep = profile, workload, slo, sweep
        self.placements = placements  # (local, queue) of each --placements: each xPyD split tried with each too
        self.local_workers, self.devices_per_host = local_workers, devices_per_host
        self.network = network_gbps, network_latency_ms / 1e3
        self.say = say
        self.searches: dict[tuple[Topology, float], Search] = {}

    def hosts(self, n: int) -> int:
        """How many hosts n devices past this machine fill (whole hosts only, or one partly)."""
        k = self.devices_per_host
        if n <= self.local_workers or n <= k:
            return 1
        if n % k:
            raise InvalidArgument(f"--plan-devices {n}: past this machine a plan is whole hosts of "
                                  f"--devices-per-host {k}; allowed: {n // k * k} or {(n // k + 1) * k}")
        return n // k

    def search(self, t: Topology, start: float | None = None, background_cores: float = 0.0) -> Search:
        key = (t, background_cores, start)
        if key not in self.searches:
            if t.devices <= self.local_workers:
                m, hosting = self.profile.local(t, background_cores)
                s = predict(m, hosting, t, self.workload, self.slo, self.sweep, start)
            else:  # every host runs the same slice; a load-blind router sends KV off-host (h - 1) / h of the time
                h = self.hosts(t.devices)
                part = Topology(t.prefill // h, t.decode // h, t.mono // h, t.local, t.queue)
                gbps, latency_s = self.network
                hosting = Hosting(cross_host=(h - 1) / h, network_gbps=gbps, network_latency_s=latency_s)
                s = scaled(predict(self.profile.device_model, hosting, part, self.workload, self.slo, self.sweep,
                                   start and start / h), h)
            self.searches[key] = s
            under = f" under {background_cores:.2f} cores of other work" if background_cores else ""
            self.say(f"{t.name}: predicted goodput {s.goodput:.3g} req/s{under} ({len(s.points)} rates simulated)")
        return self.searches[key]

    def goodput(self, t: Topology) -> float:
        return self.search(t).goodput

    def splits(self, n: int) -> list[Topology]:
        """The xPyD splits of n devices: all of them on one host; past it, the same split on every host."""
        h = self.hosts(n)
        k = n // h
        return [Topology(h * a, h * (k - a), 0, local, queue) for a in range(1, k)
                for local, queue in ((0, 0), *self.placements)]

    def plan(self, n: int) -> dict:
        mono = Topology(0, 0, n)
        tried = [mono] + self.splits(n)
        rows = [self.row(t) for t in tried]
        # a best among zeros is no answer: where nothing meets the SLO at any rate tried, none is best
        best = max((r for r in rows if r["goodput_rps"] > 0), key=lambda r: r["goodput_rps"], default=None)
        best_split = max((r for r in rows if r["mono"] == 0 and r["goodput_rps"] > 0), key=lambda r: r["goodput_rps"],
                         default=None)
        mono_g = rows[0]["goodput_rps"]
        # the search finds a goodput to a factor of its resolution: rows that close are a tie, not a ranking
        tied = [r["topology"] for r in rows if best and r is not best
                and r["goodput_rps"] * (1 + self.sweep.resolution) >= best["goodput_rps"]]
        return {"devices": n, "local": n <= self.local_workers, "best": best["topology"] if best else None,
                "tied_with_best": tied,
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
            t = Topology(x, y, 0)
            step = {"topology": t.name, "goodput_rps": round(self.goodput(t), 4), "add": None}
            steps.append(step)
            if x + y >= most:
                return steps
            more_p, more_d = Topology(x + 1, y, 0), Topology(x, y + 1, 0)
            if max(self.goodput(more_p), self.goodput(more_d)) <= 0:
                return steps  # neither meets the SLO at any rate: no worker to recommend
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
        apart = (None if planner.profile.measured_unix is None or r.get("finished_unix") is None
                 else round((planner.profile.measured_unix - r["finished_unix"]) / 60, 1))
        rows.append({"topology": t.name, "measured_rps": measured, "others_cores": others,
                     "predicted_rps": round(quiet, 4), "error": relative(quiet, measured),
                     "predicted_under_others_rps": round(loaded, 4),
                     "error_under_others": relative(loaded, measured), "profile_after_min": apart})
    return rows


MAX_SLICE = 16  # devices simulated together (one host, or this machine): its splits x workers x requests grow as n^3
MAX_PLAN_DEVICES = 1 << 16


def check_sizes(device_counts: list[int], local_workers: int, devices_per_host: int) -> None:
    """What is simulated stays within minutes: one host's (or this machine's) slice of at most
    MAX_SLICE devices (8 take about a minute on the 2-core machine; the cost grows with the cube,
    every split, each of more workers, at proportionally higher rates: 16 about 8 minutes, 32 an
    hour), and at most MAX_PLAN_DEVICES devices in all; else InvalidArgument naming the value and
    the range."""
    if not 1 <= devices_per_host <= MAX_SLICE:
        raise InvalidArgument(f"--devices-per-host {devices_per_host}; allowed: 1..{MAX_SLICE} (a host is simulated "
                              f"whole, every split of its devices: {MAX_SLICE} already takes minutes)",
                              param="--devices-per-host")
    for n in device_counts:
        if not 1 <= n <= MAX_PLAN_DEVICES:
            raise InvalidArgument(f"--plan-devices {n}; allowed: device counts 1..{MAX_PLAN_DEVICES:,}",
                                  param="--plan-devices")
        if devices_per_host < n <= local_workers and n > MAX_SLICE:
            raise InvalidArgument(f"--plan-devices {n} with --workers {local_workers}: this machine's {n} workers "
                                  f"would be simulated together (every split: hours); allowed: at most {MAX_SLICE} "
                                  f"on this machine (--workers), past it whole hosts of --devices-per-host",
                                  param="--plan-devices")


def load_scaling(path: str | Path) -> dict:
    """A bench scaling result for --compare, checked: InvalidArgument naming the file and what is
    allowed where it cannot be read or is not one (a profile, a plan, any other JSON)."""
    allowed = "allowed: the scaling.json that pdserve bench scaling wrote to its --out-dir"
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"--compare {str(path)!r} cannot be read ({type(e).__name__}: {e}); {allowed}",
                              param="--compare") from None
    if not isinstance(d, dict):
        what = f"a JSON {type(d).__name__}"
    elif "profile_version" in d:
        what = "a profile (pdserve plan --profile takes it)"
    elif d.get("bench") != "scaling":
        what = f"the result of {d['bench']!r}" if isinstance(d.get("bench"), str) else "no bench's result"
    else:
        try:
            SLO(**d["slo"]), Sweep(**d["sweep"])
            if not (isinstance(d["workload"], str) and isinstance(d["model"], str) and isinstance(d["workers"], int)
                    and isinstance(d["results"], list)):
                raise TypeError("workload, model, workers or results of the wrong type")
            for r in d["results"]:
                Topology.parse(r["topology"])
                if not (isinstance(r["goodput_rps"], (int, float)) and r["goodput_rps"] >= 0):
                    raise TypeError(f"goodput_rps {r['goodput_rps']!r} of {r['topology']}")
            return d
        except (KeyError, TypeError, ValueError, InvalidArgument) as e:
            what = f"a bench scaling result it cannot use ({type(e).__name__}: {e})"
    raise InvalidArgument(f"--compare {str(path)!r} is {what}; {allowed}", param="--compare")


REPLAYED = {"--workload": lambda d: d["workload"], "--ttft-slo-ms": lambda d: d["slo"]["ttft_ms"],
            "--itl-slo-ms": lambda d: d["slo"]["itl_ms"], "--attainment": lambda d: d["slo"]["attainment"],
            "--duration": lambda d: d["sweep"]["duration_s"], "--min-requests": lambda d: d["sweep"]["min_requests"],
            "--max-requests": lambda d: d["sweep"]["max_requests"], "--refine": lambda d: d["sweep"]["refine"],
            "--seed": lambda d: d["sweep"]["seed"]}


def check_replay(path: str | Path, scaling: dict, given: dict[str, object], model: str) -> None:
    """--compare replays the sweep's workload, SLO and search, in the comparison and the plans
    alike: a flag given with another value would be silently replaced, so it is refused by name;
    and the sweep must be of the model planned (the profile's)."""
    if scaling["model"] != model:
        raise InvalidArgument(f"--compare {str(path)!r} measured {scaling['model']}, and the profile is of {model}; "
                              "allowed: a sweep of the model profiled", param="--compare")
    for flag, value in given.items():
        if flag in REPLAYED and value != REPLAYED[flag](scaling):
            mine, theirs = (f"{v:g}" if isinstance(v, float) else v for v in (value, REPLAYED[flag](scaling)))
            raise InvalidArgument(f"{flag} {mine} with --compare {str(path)!r}, whose sweep ran with {flag} {theirs}: "
                                  "--compare replays the sweep's workload, SLO and search and plans with them; "
                                  f"allowed: {flag} {theirs} or none, or plan without --compare", param=flag)


def parse_placements(placements) -> tuple[tuple[int, int], ...]:
    """(--max-local-prefill-length, --max-prefill-queue) of each suffix XpYd takes (+localN,
    +queueN), or InvalidArgument naming the one that is not."""
    out = []
    for placing in placements:
        try:
            t = Topology.parse(f"1p1d{placing}")
        except InvalidArgument:
            raise InvalidArgument(f"--placements {placing!r}; allowed: +localN and/or +queueN with N >= 1 "
                                  "(e.g. +local256, +queue2, +local64+queue2)") from None
        out.append((t.local, t.queue))
    return tuple(out)


def relative(predicted: float, measured: float) -> float | None:
    """The prediction's error over the measurement; None where the measurement is 0 (no rate met
    the SLO: no relative error exists)."""
    return round((predicted - measured) / measured, 4) if measured > 0 else None


def percent(error: float | None) -> str:
    return "-" if error is None else f"{round(error, 3) + 0.0:+.1%}"  # + 0.0: no "-0.0%"


def run_plan(profile: Profile, workload_spec: str, slo: SLO, sweep: Sweep, device_counts: list[int],
             local_workers: int, network_gbps: float, network_latency_ms: float, devices_per_host: int,
             compare_with: dict | None = None, placements: tuple[tuple[int, int], ...] = ()) -> dict:
    if compare_with is not None:  # replay the measured sweep: its workload, SLO and search
        workload_spec = compare_with["workload"]
        slo = SLO(**compare_with["slo"])
        sweep = Sweep(**compare_with["sweep"])
        local_workers = max(local_workers, compare_with["workers"])
    workload = get_workload(workload_spec)
    if network_gbps <= 0 or network_latency_ms < 0 or devices_per_host < 1:
        raise InvalidArgument(f"--network-gbps {network_gbps}, --network-latency-ms {network_latency_ms}, "
                              f"--devices-per-host {devices_per_host}; allowed: > 0, >= 0, >= 1")

    def say(text):
        print(f"[plan] {text}", file=sys.stderr, flush=True)

    planner = Planner(profile, workload, slo, sweep, local_workers, network_gbps, network_latency_ms,
                      devices_per_host, say, placements)
    for n in device_counts:
        planner.hosts(n)  # whole hosts past this machine: say so before simulating anything
    result = {"bench": "plan", "model": profile.model, "profiled_on": profile.device, "workload": workload_spec,
              "search_resolution": round(sweep.resolution, 4),
              "workload_shape": workload.describe(), "slo": asdict(slo),
              "network": {"gbps": network_gbps, "latency_ms": network_latency_ms,
                          "devices_per_host": devices_per_host}}
    if compare_with is not None:
        rows = compare(planner, compare_with)
        result["validation"] = rows
        print_table(f"predicted vs measured goodput ({compare_with['model']}, {workload_spec}; the measured sweep "
                    f"replayed in simulation, each found to within {sweep.resolution:.1%} (--refine "
                    f"{sweep.refine}): an error under that is no error; 'others': cores other processes kept busy "
                    "during the measurement; "
                    "'profiled': minutes from the topology's sweep to the profile, over which a shared machine's "
                    "speed can drift)",
                    ["topology", "measured req/s", "others", "predicted (quiet)", "error", "predicted (others)",
                     "error", "profiled"],
                    [[r["topology"], r["measured_rps"], f"{r['others_cores']:.2f}", r["predicted_rps"],
                      percent(r["error"]), r["predicted_under_others_rps"], percent(r["error_under_others"]),
                      "-" if r["profile_after_min"] is None else f"{r['profile_after_min']:+.0f} min"]
                     for r in rows])
    plans = [planner.plan(n) for n in device_counts]
    result["plans"] = plans
    for p in plans:
        hosts = planner.hosts(p["devices"])
        where = "this machine" if p["local"] else f"{hosts} host{'s' * (hosts > 1)} of {p['devices'] // hosts} devices"
        best = (f"best {p['best']}" if p["best"] else "no topology meets the SLO at any rate tried (goodput 0: "
                "loosen --ttft-slo-ms / --itl-slo-ms / --attainment)")
        if p["tied_with_best"]:
            best += f" (tied with {', '.join(p['tied_with_best'])}: within the search's resolution)"
        print_table(f"plan for {p['devices']} devices ({where}): {best}"
                    + (f", best xPyD {p['best_xpyd']} = {p['xpyd_over_mono']}x {p['devices']}mono"
                       if p["xpyd_over_mono"] else ""),
                    ["topology", "goodput req/s", "per device", "bound past goodput"],
                    [[r["topology"], r["goodput_rps"], r["goodput_per_device_rps"], r["bound"]]
                     for r in p["topologies"]])
    most = min(max(device_counts), max(local_workers, devices_per_host))
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
    m = profile.device_model
    return [f"up to {local} workers: this machine, shared as measured"
            + (f" ({profile.host_cores} cores split between the workers, the router and the clients)"
               if profile.host_cores else " (one device per worker)"),
            f"past it: each device runs one worker as fast as the profiled {profile.model} worker on "
            f"{profile.device}" + (f" with {m.threads} thread(s), its cores its own" if profile.host_cores else ""),
            f"{per_host} devices per host, every host running the same split; the router and the clients on "
            "machines of their own",
            "the router pairs any prefill worker with any decode worker by load (it does not know hosts): "
            "with h hosts, (h - 1) / h of the KV handoffs cross the network",
            f"KV across hosts: {latency_ms:g} ms + bytes / {gbps:g} GB/s, not overlapped with the prefill; "
            "on one host: the profiled handoff",
            "balancing within a host's slice, not over the whole cluster: slightly pessimistic for TTFT",
            "no failures, no prefix-cache hits, outputs run to their length"]
