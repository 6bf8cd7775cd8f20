"""Workloads for scaling experiments: what requests arrive, how long their prompts and outputs
are, and how bursty their arrivals are, at any request rate.

A workload is a *shape* (length distributions and an arrival process) that `requests(rate, n)`
turns into a concrete, seeded list of (arrival offset s, prompt tokens, output tokens). The rate
is what `bench scaling` sweeps and what the planner's simulator varies, so both see the very same
requests at the same rate. Named workloads:

- `chat`: short prompts, medium outputs (ShareGPT-like: long-tailed, lognormal lengths);
- `long-context`: long prompts, short outputs (summarization, retrieval-augmented QA);
- `realistic`: the mix `bench serve` runs (its `realistic` scenario's ranges), uniform lengths.

A JSONL file gives a trace instead, one request per line:
`{"arrival": 0.12, "prompt_tokens": 812, "output_tokens": 64}` (arrival in seconds from the
start, non-decreasing). A sweep replays the trace compressed or stretched in time to each rate;
lengths are kept as they are, and the trace is cycled if more requests are asked for than it has.

Prompts longer than the model's context are cut so that prompt + output fits (`fit`), the same way
`bench serve` does.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from bench.serve import SCENARIOS
from common.errors import InvalidArgument, short_repr

ARRIVALS = ("poisson", "gamma", "constant")


@dataclass(frozen=True)
class Lengths:
    """Token counts: uniform in [lo, hi], or lognormal with this median (sigma: spread), clipped to [lo, hi]."""

    lo: int
    hi: int
    median: int = 0  # > 0: lognormal
    sigma: float = 0.0

    def __post_init__(self):
        if not 1 <= self.lo <= self.hi:
            raise InvalidArgument(f"lengths lo={self.lo}, hi={self.hi}; allowed: 1 <= lo <= hi")

    def draw(self, rng: random.Random) -> int:
        if self.median <= 0:
            return rng.randint(self.lo, self.hi)
        return min(self.hi, max(self.lo, round(rng.lognormvariate(math.log(self.median), self.sigma))))

    def describe(self) -> str:
        if self.median <= 0:
            return f"{self.lo}-{self.hi}" if self.lo != self.hi else str(self.lo)
        return f"lognormal median {self.median} ({self.lo}-{self.hi})"


@dataclass(frozen=True)
class Request:
    arrival: float  # seconds from the start of the run
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    prompt: Lengths | None = None
    output: Lengths | None = None
    arrival: str = "poisson"  # poisson | gamma (bursty, coefficient of variation cv) | constant
    cv: float = 1.0
    trace: tuple[Request, ...] = ()  # from a JSONL file: replayed at each rate instead of drawn

    def __post_init__(self):
        if self.arrival not in ARRIVALS:
            raise InvalidArgument(f"arrival={self.arrival!r}; allowed: {', '.join(ARRIVALS)}")
        if self.cv <= 0:
            raise InvalidArgument(f"cv={self.cv}; allowed: > 0")
        if not self.trace and (self.prompt is None or self.output is None):
            raise InvalidArgument(f"workload {self.name!r} needs prompt and output lengths, or a trace")

    def requests(self, rate: float, n: int, seed: int = 0) -> list[Request]:
        """n requests arriving at `rate` per second on average (their gaps' mean is 1 / rate), the
        same for the same arguments; their lengths are the same at any rate and n (a prefix)."""
        if rate <= 0:
            raise InvalidArgument(f"rate={rate}; allowed: > 0 requests per second")
        if self.trace:
            return self._replay(rate, n)
        rng = random.Random(f"{self.name}/{seed}")
        out, t = [], 0.0
        for i in range(n):
            if i:
                t += self._gap(rng, rate)
            out.append(Request(t, self.prompt.draw(rng), self.output.draw(rng)))
        # Gaps scaled to a mean of exactly 1 / rate, as a trace is replayed: a sweep draws the same
        # gaps at every rate, so a draw 7% slow (chat's seed 0 at 300 requests) would offer every
        # rate 7% fewer requests than it names, and goodput would be overstated by as much.
        scale = (n - 1) / rate / t if t > 0 else 1.0
        return [Request(r.arrival * scale, r.prompt_tokens, r.output_tokens) for r in out]

    def _gap(self, rng: random.Random, rate: float) -> float:
        if self.arrival == "constant":
            return 1 / rate
        if self.arrival == "poisson":
            return rng.expovariate(rate)
        shape = 1 / self.cv ** 2  # gamma with mean 1/rate and this coefficient of variation
        return rng.gammavariate(shape, 1 / (shape * rate))

    def _replay(self, rate: float, n: int) -> list[Request]:
        rows = self.trace
        span = rows[-1].arrival - rows[0].arrival
        if span > 0:  # the trace's own mean rate, scaled to this one; it repeats a mean gap after its last row
            scale = (len(rows) - 1) / span / rate
            period = (span + span / (len(rows) - 1)) * scale
        else:  # one burst (or one row): repeat it len(rows) / rate apart
            scale, period = 1.0, len(rows) / rate
        out = []
        for i in range(n):
            r = rows[i % len(rows)]
            t = (r.arrival - rows[0].arrival) * scale + (i // len(rows)) * period
            out.append(Request(t, r.prompt_tokens, r.output_tokens))
        return out

    def mean_output_tokens(self, context: int, n: int = 1000) -> float:
        """The mean output length of n requests cut to a model's context (`fit`), as a sweep draws them."""
        reqs = [fit(r, context) for r in self.requests(1.0, n)]
        return sum(r.output_tokens for r in reqs) / len(reqs)

    def describe(self) -> str:
        if self.trace:
            return f"{self.name}: trace of {len(self.trace)} requests, replayed at each rate"
        arrival = f"gamma cv {self.cv}" if self.arrival == "gamma" else self.arrival
        return f"{self.name}: prompts {self.prompt.describe()}, outputs {self.output.describe()}, {arrival} arrivals"


def fit(req: Request, context: int) -> Request:
    """req cut to a model's context: the output first kept whole (up to half the context), then the prompt."""
    out = min(req.output_tokens, max(1, context // 2))
    return Request(req.arrival, max(1, min(req.prompt_tokens, context - out - 1)), out)


WORKLOADS = {w.name: w for w in [
    Workload("chat", Lengths(16, 2048, median=256, sigma=0.8), Lengths(16, 1024, median=128, sigma=0.6)),
    Workload("long-context", Lengths(2048, 8192), Lengths(8, 64)),
    Workload("realistic", Lengths(*SCENARIOS["realistic"].prompt), Lengths(*SCENARIOS["realistic"].new)),
]}


def load_trace(path: str | Path) -> Workload:
    """A workload from a JSONL file of {"arrival", "prompt_tokens", "output_tokens"} rows."""
    path = Path(path)
    rows: list[Request] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise InvalidArgument(f"workload file {str(path)!r} cannot be read: {e.strerror}") from e
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"{where}: not JSON ({e.msg}); each line is one object "
                                  '{"arrival": s, "prompt_tokens": n, "output_tokens": n}') from e
        if not isinstance(row, dict):
            raise InvalidArgument(f"{where}: {short_repr(row)} is not a JSON object")
        values = {}
        for key, kind, low in (("arrival", (int, float), 0), ("prompt_tokens", int, 1), ("output_tokens", int, 1)):
            v = row.get(key)
            if v is None:
                raise InvalidArgument(f"{where}: field {key!r} is missing; allowed fields: arrival, "
                                      "prompt_tokens, output_tokens")
            if isinstance(v, bool) or not isinstance(v, kind) or not v >= low or v != v or v == math.inf:
                kind_name = "a number" if key == "arrival" else "an integer"
                raise InvalidArgument(f"{where}: field {key!r} is {short_repr(v)}; allowed: {kind_name} >= {low}")
            values[key] = v
        if rows and values["arrival"] < rows[-1].arrival:
            raise InvalidArgument(f"{where}: field 'arrival' is {values['arrival']}, before the previous row's "
                                  f"{rows[-1].arrival}; arrivals must not decrease")
        rows.append(Request(float(values["arrival"]), values["prompt_tokens"], values["output_tokens"]))
    if not rows:
        raise InvalidArgument(f"workload file {str(path)!r} has no requests")
    return Workload(path.stem, trace=tuple(rows))


def get_workload(spec: str) -> Workload:
    """A named workload, or a JSONL trace by path (anything ending in .jsonl)."""
    if spec in WORKLOADS:
        return WORKLOADS[spec]
    if spec.endswith(".jsonl") or Path(spec).is_file():
        return load_trace(spec)
    raise InvalidArgument(f"workload {spec!r} is unknown; allowed: {', '.join(WORKLOADS)}, or a .jsonl file "
                          "of {arrival, prompt_tokens, output_tokens} rows")
