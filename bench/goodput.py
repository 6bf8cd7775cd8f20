"""Goodput: the highest request rate at which a deployment still meets its latency targets for
enough of its requests (DistServe's definition), and the search that finds it.

A request meets the SLO when its time to first token is within `ttft_ms` and its time per output
token after the first (TPOT: (end - first token) / (tokens - 1), what a reader of the stream
feels) is within `itl_ms`; a request that failed meets nothing. Attainment at a rate is the
fraction of requests that meet it, and goodput the highest rate whose attainment is at least the
target (90% by default) and which the system keeps up with.

Keeping up matters where the TPOT target is loose: a worker absorbs a rate it cannot sustain by
growing its running batch, every request still within both targets, until `max_num_seqs` or its KV
pool is full; only then do requests queue and miss the TTFT target. On the 2-core CPU machine a
monolithic nanogpt worker at 17 req/s (capacity about 15.5) met a 1 s TTFT target for its first
40 s of arrivals, then missed it for good. So a rate also fails when its backlog grew: when
completions in the steady part (below) fell short of the arrivals there by more than
`BACKLOG_LIMIT`, and by more than chance explains: the requests in flight at the window's two
ends differ by about sqrt(2 x their mean) in a system that keeps up (Poisson-like; the mean by
Little's law, arrivals a second x mean latency), so the shortfall must pass 3 such deviations (a
12-request run is 11% short by one request still in flight). The window has to be long enough for
a backlog to stand out (`bench.scaling.Sweep.requests_at`).

The search is the same for a real cluster (`bench scaling`) and for the planner's simulator: it
only calls `measure(rate)`. It climbs geometrically from a start rate until a rate fails
*clearly* (attainment `margin` below the target, or a backlog over twice its limit; or it fails
twice running: one unlucky point near the knee is noise, not the knee), then bisects between the
highest passing and the lowest failing rate. A start rate that already fails is halved until one
passes.

What a rate delivered (requests and output tokens a second) is counted in the run's steady part:
the completions and tokens from a quarter of the way through the arrivals' time span to the last
arrival, over that window, beside the arrivals in the same window (what it was offered: a
Poisson draw puts more or fewer there than the rate names). Counted from the first arrival to the
last completion, a run's figure would fall short of what the system serves by the warm-up of an
empty system and the drain of the last requests (several seconds of long outputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from bench.report import pct
from common.errors import InvalidArgument


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    itl_ms: float  # per request: mean time per output token after the first (TPOT)
    attainment: float = 0.9

    def __post_init__(self):
        for key, flag in (("ttft_ms", "--ttft-slo-ms"), ("itl_ms", "--itl-slo-ms")):
            v = getattr(self, key)
            if not v > 0 or v == math.inf:
                raise InvalidArgument(f"{flag} {v}: an SLO of {v} ms cannot be met; allowed: a number of ms > 0")
        if not 0 < self.attainment <= 1:
            raise InvalidArgument(f"--attainment {self.attainment}; allowed: 0 < attainment <= 1 (0.9 is 90%)")


@dataclass
class Latency:
    """One request's outcome, in ms; ttft None: it failed."""

    ttft: float | None
    tpot: float | None = None  # None with fewer than two tokens
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)  # every gap between tokens

    @classmethod
    def of(cls, s) -> "Latency":
        """What a client saw of one bench.serve Sample (failed or unfinished: Latency(None))."""
        if s.error is not None or s.first is None or s.end is None:
            return cls(None)
        gaps = [(b - a) * 1e3 for a, b in zip(s.token_times, s.token_times[1:])]
        tpot = (s.token_times[-1] - s.first) * 1e3 / (len(s.token_times) - 1) if len(s.token_times) > 1 else None
        return cls((s.first - s.sent) * 1e3, tpot, (s.end - s.sent) * 1e3, gaps)

    def meets(self, slo: SLO) -> bool:
        return self.ttft is not None and self.ttft <= slo.ttft_ms and (self.tpot is None or self.tpot <= slo.itl_ms)


def attainment(records: list[Latency], slo: SLO) -> float:
    return sum(r.meets(slo) for r in records) / len(records) if records else 0.0


def percentiles(records: list[Latency], qs: tuple[int, ...],
                names: tuple[str, ...] = ("ttft", "itl", "tpot", "e2e")) -> dict:
    """{name_pQ_ms: the Q-th percentile of that latency over the records} (inter-token gaps pooled)."""
    values = {"ttft": [r.ttft for r in records if r.ttft is not None], "itl": [g for r in records for g in r.itl],
              "tpot": [r.tpot for r in records if r.tpot is not None],
              "e2e": [r.e2e for r in records if r.e2e is not None]}
    return {f"{name}_p{q}_ms": round(pct(values[name], q), 2) for name in names for q in qs}


@dataclass
class Point:
    """One rate measured (or simulated): the SLO attainment and what the system delivered."""

    rate: float
    attainment: float
    requests_s: float = 0.0  # completed per second in the run's steady part (`delivered`)
    output_tok_s: float = 0.0  # likewise
    records: list[Latency] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # cores used meanwhile, by whom (bench/hostload.py)
    offered_rps: float = 0.0  # arrivals per second in that steady part: a Poisson draw's differ from `rate`
    window_s: float = 0.0  # that steady part's length
    in_flight: float = 0.0  # requests in the system on average (Little: offered_rps x mean end-to-end latency)

    @property
    def backlog(self) -> float:
        """How far completions fell short of arrivals in the steady part, over the arrivals: what
        piled up in the system a second, as a fraction of the load (0 or less: it kept up)."""
        return 1 - self.requests_s / self.offered_rps if self.offered_rps > 0 else 0.0

    def backlog_over(self, limit: float) -> bool:
        """A backlog over limit of the load, and over what chance explains (3 deviations of the
        difference between the requests in flight at the window's two ends)."""
        short = (self.offered_rps - self.requests_s) * self.window_s
        return self.backlog > limit and short > 3 * math.sqrt(2 * self.in_flight + 1)

    def meets(self, target: float) -> bool:
        """Attainment at least target, and the system kept up with the rate."""
        return self.attainment >= target and not self.backlog_over(BACKLOG_LIMIT)

    def clearly_misses(self, target: float, margin: float) -> bool:
        """Far enough from passing that noise cannot explain it: attainment under target - margin,
        or a backlog over twice its limit."""
        return self.attainment < target - margin or self.backlog_over(2 * BACKLOG_LIMIT)

    def latency_summary(self) -> dict:
        return percentiles(self.records, (50, 90, 99))

    def to_json(self) -> dict:
        out = {"rate": round(self.rate, 4), "attainment": round(self.attainment, 4), "backlog": round(self.backlog, 4),
               "offered_rps": round(self.offered_rps, 3), "requests_s": round(self.requests_s, 3),
               "output_tok_s": round(self.output_tok_s, 1),
               **self.latency_summary()}
        if self.cpu:
            out["cpu_cores"] = {k: round(v, 3) for k, v in self.cpu.items()}
        return out


BACKLOG_LIMIT = 0.1  # completions this far short of arrivals: a backlog grows, the rate is not sustained
SETTLE = 0.25  # the first quarter of the arrivals' time span fills an empty system: not counted


@dataclass(frozen=True)
class Delivery:
    """What a run was offered and delivered a second, in its steady part (`delivered`)."""

    offered_rps: float  # arrivals
    requests_s: float  # completions
    output_tok_s: float
    window_s: float = 0.0  # the steady part's length (or the whole run's, where it has none)


def delivered(arrivals: list[float], ends: list[float], tokens: list[float], until: float | None = None) -> Delivery:
    """A run in its steady part: the arrivals, completions (`ends`) and output tokens (each one's
    time) from SETTLE of the way through the arrivals' time span to the last arrival (or `until`,
    where a run stopped sooner), over that window. One clock for all. A run with no such window
    (its requests arrived at once, or nearly: the window under a quarter of the run) is counted
    from its first arrival to its last event."""
    if not arrivals:
        return Delivery(0.0, 0.0, 0.0)
    first, last = min(arrivals), max(arrivals)
    latest = max(max(ends, default=first), max(tokens, default=first))
    if until is not None:
        last, latest = min(last, until), min(latest, until)
    start = first + SETTLE * (last - first)
    window = last - start
    if window <= SETTLE * (latest - first):
        wall = latest - first
        if wall <= 0:
            return Delivery(0.0, 0.0, 0.0)
        return Delivery(len(arrivals) / wall, sum(t <= latest for t in ends) / wall,
                        sum(t <= latest for t in tokens) / wall, wall)

    def rate(times):
        return sum(start < t <= last for t in times) / window

    return Delivery(rate(arrivals), rate(ends), rate(tokens), window)


def point_from(rate: float, records: list[Latency], slo: SLO, arrivals: list[float], ends: list[float],
               tokens: list[float], until: float | None = None) -> Point:
    """A measured (or simulated) rate: attainment over `records`, and what it delivered (`delivered`)."""
    d = delivered(arrivals, ends, tokens, until)
    e2e = [r.e2e for r in records if r.e2e is not None]
    in_flight = d.offered_rps * sum(e2e) / len(e2e) / 1e3 if e2e else 0.0
    return Point(rate, attainment(records, slo), d.requests_s, d.output_tok_s, records, offered_rps=d.offered_rps,
                 window_s=d.window_s, in_flight=in_flight)


@dataclass
class Search:
    points: list[Point]  # in the order measured
    goodput: float  # requests/s; 0 if even the lowest rate tried failed

    @property
    def at_goodput(self) -> Point | None:
        return next((p for p in self.points if p.rate == self.goodput), None)

    @property
    def saturation(self) -> Point | None:
        """The point that delivered the most output tokens per second: throughput at saturation."""
        return max(self.points, key=lambda p: p.output_tok_s, default=None)


CLEAR_MARGIN = 0.1  # attainment this far below the target is a clear miss, not noise


def find_goodput(measure: Callable[[float], Point], target: float, start: float, growth: float = 2.0,
                 refine: int = 3, margin: float = CLEAR_MARGIN, max_points: int = 24,
                 min_rate: float | None = None) -> Search:
    """Goodput by measure(rate) -> Point; see the module docstring. `refine` bisection steps narrow
    the knee to a factor growth ** (1 / 2 ** refine)."""
    if start <= 0 or growth <= 1:
        raise InvalidArgument(f"start={start}, growth={growth}; allowed: start > 0, growth > 1")
    min_rate = min_rate if min_rate is not None else start / growth ** 6
    points: list[Point] = []

    def at(rate: float) -> Point:
        p = measure(rate)
        points.append(p)
        return p

    rate, best = start, 0.0
    while not at(rate).meets(target):  # too fast a start: come down until one passes
        rate /= growth
        if rate < min_rate or len(points) >= max_points:
            return Search(points, 0.0)
    best, low_fails = rate, 0
    while len(points) < max_points:
        rate *= growth
        p = at(rate)
        if p.meets(target):
            best, low_fails = rate, 0
        elif p.clearly_misses(target, margin) or low_fails:
            break
        else:
            low_fails += 1
    fail = min((p.rate for p in points if p.rate > best and not p.meets(target)), default=None)
    for _ in range(refine):
        if fail is None or len(points) >= max_points:
            break
        mid = math.sqrt(best * fail)
        if at(mid).meets(target):
            best = mid
        else:
            fail = mid
    return Search(points, best)
