"""A discrete-event simulation of a pdserve cluster: the router, each worker's queue and batching,
and the KV handoffs, timed by a measured profile (`bench/profile.py`). The planner
(`bench/plan.py`) runs it at many request rates and topologies to predict goodput.

What is modelled, and how faithfully:

- **Batching** is the real thing: every simulated worker owns a real `common.scheduler.Scheduler`
  and `BlockManager` (prefix caching off: the workloads' prompts share nothing), so decode-first
  continuous batching under the token budget, chunked prefill, max_num_seqs, admission by free
  blocks and preemption are the engine's own code. `SimEngine` mirrors the little bookkeeping
  around it that `common.engine.Engine` does (a step's tokens, prefill-only requests held for
  their transfer, reservations for arriving KV).
- **A step's duration** comes from the profile: a fixed cost, plus per prefill token and per
  token x context (attention) for prefill chunks, plus per running sequence and per token of KV
  for decodes, and per KV token squared: on a CPU a read past the caches' size costs more per
  byte (`StepCost`); one step mixes both on a monolithic worker, where a prefill token beside
  decodes costs more than alone (`prefill_mixed`, fitted from the worker's own steps).
- **The router** picks workers by its least-loaded policy (requests assigned + half the queue
  the worker last reported by heartbeat, every 0.2 s; ties by worker id), holds a prefill
  worker's count until the decode worker's first token, and adds the measured front latency
  (client -> router -> worker and back) to what a client sees.
- **KV handoff**: a prefill worker asks its decode worker for blocks when the work arrives
  (refused while the decode worker's pool or batch is full: retried with the worker's backoff;
  the prefill worker's scheduler admits prompts not granted yet only within the room it keeps);
  once prefilled and granted the KV moves in the profiled time for its bytes, or, for the share
  of handoffs that cross hosts, in network latency + bytes / bandwidth; the decode worker starts
  the request at its next step.
- **CPU contention** (only where the workers run on the host's CPU cores, as on the CPU
  machine; `host_slowdown`): the router, the clients and other work take their CPU first (they
  sleep between messages, and Linux runs a task that wakes ahead of one that computes without
  pause), and the steps under way share what is left; while two or more workers step at once,
  each step also takes `co_run` times the CPU work (caches and memory shared; profiled).
  Measured on the 2-core machine: two monolithic workers beside a router and a client using 0.63
  cores got 1.35 cores between them, not the 1.5 that sharing all cores alike gives.
- **Local prefill** (the router's --max-local-prefill-length and --max-prefill-queue): a prompt
  that short, or any while every prefill worker holds the queue limit, goes to the least loaded
  decode worker, which prefills it beside its decodes (a step that mixes them costs what a
  monolithic worker's does) with no handoff.

The simulated workers share one host. A cluster of many hosts is planned as one host's slice of it
(`bench/plan.py`), whose handoffs cross to other hosts as often as a load-blind router makes them.

Not modelled: failures and retries, prefix-cache hits, stop tokens (outputs run to their length).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

from bench.goodput import SLO, Latency, Point, point_from
from bench.workloads import Request
from common.attention import decode_kv_read
from common.kv_cache import BlockManager
from common.sampling_params import SamplingParams
from common.scheduler import ScheduledSeq, Scheduler, step_shape
from common.sequence import PREFILLED, Sequence, Status

HEARTBEAT_S = 0.2  # common/worker.py WorkerConfig.heartbeat_interval_s
STALL_HORIZON_S = 600.0  # of simulated time past the last arrival: a run still going is stuck
GIVE_UP_CHECK_S = 0.25  # how often a run that may stop early counts the requests sure to miss


@dataclass(frozen=True)
class StepCost:
    """Seconds of one engine step, fitted from a profile."""

    prefill_base: float = 0.0
    prefill_token: float = 0.0
    prefill_attn: float = 0.0  # per chunk token x (context before it + chunk)
    decode_base: float = 0.0
    decode_seq: float = 0.0
    decode_kv: float = 0.0  # per token of KV the decodes read
    decode_kv2: float = 0.0  # per token of KV squared: a read that outgrows the caches costs more per byte
    prefill_mixed: float = 0.0  # per prefill token more in a step that also decodes (a monolithic worker's)

    def __call__(self, chunks: list[tuple[int, int]], batch: int, kv: int) -> float:
        """chunks: (tokens, tokens already computed) of each prefill chunk; batch decodes reading kv tokens."""
        return self.of_sums(sum(n for n, _ in chunks), sum(n * (n + c) for n, c in chunks), batch, kv)

    def of_sums(self, tokens: float, token_ctx: float, batch: float, kv: float) -> float:
        """The same from a step's sums (a step trace's columns): prefill tokens, and over the chunks
        tokens x (context before + tokens)."""
        t = 0.0
        if tokens:
            t += (self.prefill_token + (self.prefill_mixed if batch else 0.0)) * tokens + self.prefill_attn * token_ctx
        if batch:
            t += self.decode_seq * batch + self.decode_kv * kv + self.decode_kv2 * kv * kv
        return t + max(self.prefill_base if tokens else 0.0, self.decode_base if batch else 0.0)


@dataclass(frozen=True)
class EngineShape:
    """What a worker's engine schedules with (EngineConfig's knobs and its pool)."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 1024


@dataclass(frozen=True)
class WorkerModel:
    """One worker as profiled, and what surrounds it."""

    step: StepCost
    engine: EngineShape
    kv_bytes_per_token: int
    handoff_base_s: float = 0.0  # KV handoff on one host: first token sampled -> decode may start
    handoff_s_per_byte: float = 0.0
    front_latency_s: float = 0.0  # client -> router -> worker, plus worker -> router -> client
    front_cpu_request_s: float = 0.0  # router + client CPU seconds per request ...
    front_cpu_token_s: float = 0.0  # ... and per output token
    threads: int = 1
    cores: float = 1.0  # CPU cores a stepping worker keeps busy (counts in the contention for a host's cores)
    co_run: float = 1.0  # a step's CPU work while another worker on the host steps too, over alone
    decode_reads_padded: bool = False  # the portable attention pads runs of similar lengths to their longest
    mono_step: StepCost | None = None  # a monolithic worker's steps, if profiled apart (else `step`)

    def kv_read(self, lengths: list[int]) -> int:
        """KV tokens a decode step over sequences of these lengths reads."""
        return decode_kv_read(lengths, self.engine.block_size) if self.decode_reads_padded else sum(lengths)

    def handoff_s(self, tokens: int) -> float:
        return self.handoff_base_s + self.handoff_s_per_byte * tokens * self.kv_bytes_per_token


@dataclass(frozen=True)
class Hosting:
    """Where the workers run: one host. host_cores None: each worker has a device of its own (no
    CPU contention); else they share the host's cores (with the router and clients, if there)."""

    host_cores: int | None = None
    front_on_host: bool = False  # the router and clients use the host's cores (a single-machine run)
    background_cores: float = 0.0  # what other work on a shared machine keeps busy
    cross_host: float = 0.0  # the share of KV handoffs that go to another host, over the network
    network_gbps: float = 25.0  # gigabytes per second between hosts
    network_latency_s: float = 5e-5

    def network_s(self, nbytes: int) -> float:
        return self.network_latency_s + nbytes / (self.network_gbps * 1e9)


def host_slowdown(stepping: int, worker_cores: float, front_cores: float, host_cores: float, co_run: float = 1.0
                  ) -> float:
    """How much slower than alone each of `stepping` workers runs on a host whose router, clients
    and other work keep front_cores busy: they run first, the workers share the rest, and a step
    beside another takes co_run times the work."""
    share = max(1.0, stepping * worker_cores / max(0.1 * host_cores, host_cores - front_cores))
    return share * (co_run if stepping >= 2 else 1.0)


@dataclass
class SimRequest:
    req: Request
    index: int
    prefill: "SimWorker | None" = None
    decode: "SimWorker | None" = None
    first_token: int | None = None  # the token id the prefill sampled (any id: outputs run to length)
    prefilled_at: float | None = None
    granted: list[int] | None = None  # the decode worker's reserved blocks
    seq: Sequence | None = None  # on its prefill worker
    token_times: list[float] = field(default_factory=list)  # worker-side, every output token
    done: bool = False
    failed: bool = False  # refused by every decode worker (NO_ROOM): the client got an error


class SimEngine:
    """A worker's engine without a model: the real scheduler and block manager, and the
    bookkeeping of common.engine.Engine around them (step, held prefills, reservations)."""

    def __init__(self, shape: EngineShape):
        self.shape = shape
        self.block_manager = BlockManager(shape.num_blocks, shape.block_size, enable_prefix_caching=False)
        self.scheduler = Scheduler(self.block_manager, shape.max_num_seqs, shape.max_num_batched_tokens,
                                   shape.max_model_len)
        self.held = self.scheduler.held
        self.num_reserved_seqs = 0

    def add(self, rid: int, prompt: int, output: int, prefill_only: bool, generated: int = 0) -> Sequence:
        params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
        seq = Sequence(rid, [0] * prompt, params, 0, (), self.shape.max_model_len, [0] * generated, prefill_only)
        if not generated:
            self.scheduler.add(seq)
        return seq

    def schedule(self) -> list[ScheduledSeq]:
        return self.scheduler.schedule()

    def finish_step(self, batch: list[ScheduledSeq]) -> list[Sequence]:
        """Engine.step's bookkeeping after the forward; -> the sequences that got a token."""
        out = []
        for s in batch:
            seq = s.seq
            seq.num_computed_tokens += s.num_tokens
            if not s.samples:
                continue
            seq.append_token(0)
            if seq.finish_reason is not None:
                held = seq.finish_reason == PREFILLED
                self.scheduler.finish(seq, seq.finish_reason, free_blocks=not held)
                if held:
                    self.held[seq.request_id] = seq
            out.append(seq)
        return out

    def release(self, rid: int) -> None:
        self.block_manager.free_seq(self.held.pop(rid))

    def reserve(self, rid: int, num_tokens: int, now: float) -> list[int] | None:
        """Engine.reserve: blocks and a batch slot for KV arriving from a prefill worker, or None (BUSY)."""
        need = self.scheduler.reservable(str(rid), num_tokens, self.num_reserved_seqs, now)
        if need is None:
            return None
        self.num_reserved_seqs += 1
        return self.block_manager.take_blocks(need)

    def add_prefilled(self, rid: int, prompt: int, output: int, blocks: list[int]) -> None:
        seq = self.add(rid, prompt, output, False, generated=1)
        self.num_reserved_seqs -= 1
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(seq) - 1
        self.scheduler.admit_prefilled(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()


@dataclass
class Step:
    """A step under way: its work in seconds of an uncontended worker, and how far it has got."""

    batch: list[ScheduledSeq]
    work_left: float
    since: float  # when work_left was last brought up to date
    slowdown: float = 1.0  # contention since then
    version: int = 0  # its end event is the one with this version; earlier ones are stale


@dataclass(eq=False)
class SimWorker:
    worker_id: str
    role: str  # prefill | decode | mono
    engine: SimEngine
    assigned: set[int] = field(default_factory=set)
    queued: int = 0  # as of the last heartbeat
    step: Step | None = None
    reservations: dict[int, "SimRequest"] = field(default_factory=dict)  # a decode worker's, queued for room

    def load(self) -> tuple[float, str]:
        return len(self.assigned) + self.queued / 2, self.worker_id


class Simulation:
    def __init__(self, model: WorkerModel, prefill: int, decode: int, mono: int, hosting: Hosting,
                 rate: float, requests: list[Request], slo: SLO | None = None, stop_below: float | None = None,
                 local_prefill: tuple[int, int] = (0, 0)):
        if (prefill == 0) != (decode == 0) or prefill + decode + mono == 0 or (mono and prefill):
            raise ValueError(f"topology {prefill}p{decode}d + {mono} mono is not one pdserve runs")
        self.model, self.hosting = model, hosting
        # the router's --max-local-prefill-length and --max-prefill-queue (router/placement.py)
        self.local_limit, self.queue_limit = local_prefill
        roles = [("prefill", prefill), ("decode", decode), ("mono", mono)]
        self.workers = [SimWorker(f"{role}-{i}", role, SimEngine(model.engine)) for role, n in roles for i in range(n)]
        self.crossing = random.Random(len(requests))  # which handoffs cross hosts: the same every run
        self.requests = [SimRequest(r, i) for i, r in enumerate(requests)]
        self.events: list = []
        self._order = itertools.count()
        self.now = 0.0
        self.unfinished = len(requests)
        mean_out = sum(r.output_tokens for r in requests) / max(1, len(requests))
        self.front_cores = rate * (model.front_cpu_request_s + model.front_cpu_token_s * mean_out)
        # what runs on the host before the workers (host_slowdown): other work, and the router and clients if there
        self.host_front_cores = hosting.background_cores + (self.front_cores if hosting.front_on_host else 0.0)
        self.slo = slo
        # Give up once so many requests are sure to miss the SLO that attainment is below stop_below.
        self.give_up_at = None if stop_below is None else math.floor((1 - stop_below) * len(requests)) + 1

    # ------------------------------------------------------------------ the event loop

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.events, (t, next(self._order), fn, args))

    def run(self) -> list[SimRequest]:
        half = self.model.front_latency_s / 2
        for r in self.requests:
            self.at(r.req.arrival + half, self.dispatch, r)
        for k, w in enumerate(self.workers):
            self.at(HEARTBEAT_S * k / len(self.workers), self.heartbeat, w)
        self.gave_up = False
        # A safety net: a run still going this long after its last arrival is stuck (none is known
        # to be: a request no decode pool can hold fails at once); what is unfinished counts as missed.
        last = max((r.req.arrival for r in self.requests), default=0.0)
        self.at(last + STALL_HORIZON_S, self.stop)
        if self.give_up_at is not None:
            self.at(GIVE_UP_CHECK_S, self.check_misses)
        while self.events and self.unfinished and not self.gave_up:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)
        return self.requests

    def stop(self) -> None:
        self.gave_up = True

    def check_misses(self) -> None:
        """Count the requests already sure to miss the SLO: no first token within the TTFT target,
        or more time since it than TPOT target x the tokens still to come allows."""
        half, ttft, tpot = self.model.front_latency_s / 2, self.slo.ttft_ms / 1e3, self.slo.itl_ms / 1e3
        missed = 0
        for r in self.requests:
            t = r.token_times
            if (t[0] if t else self.now) + half - r.req.arrival > ttft:
                missed += 1
            elif t and r.req.output_tokens > 1 and (t[-1] if r.done else self.now) - t[0] > tpot * (r.req.output_tokens - 1):
                missed += 1
        self.gave_up = missed >= self.give_up_at
        self.at(self.now + GIVE_UP_CHECK_S, self.check_misses)

    def heartbeat(self, w: SimWorker) -> None:
        w.queued = len(w.engine.scheduler.waiting)
        self.at(self.now + HEARTBEAT_S, self.heartbeat, w)

    # ------------------------------------------------------------------ the router

    def pick(self, roles: tuple[str, ...]) -> SimWorker:
        return min((w for w in self.workers if w.role in roles), key=SimWorker.load)

    def dispatch(self, r: SimRequest) -> None:
        p = self.local(r) or self.pick(("prefill", "mono"))
        d = p if p.role != "prefill" else self.pick(("decode",))
        r.prefill, r.decode = p, d
        p.assigned.add(r.index)
        d.assigned.add(r.index)
        r.seq = p.engine.add(r.index, r.req.prompt_tokens, r.req.output_tokens, prefill_only=p is not d)
        if p is not d:
            prompt = r.req.prompt_tokens
            if d.engine.scheduler.no_room(prompt, prompt + r.req.output_tokens):
                # the decode workers are alike: every one refuses it, and the router fails it at once
                p.engine.scheduler.finish(r.seq, "abort")
                r.failed = True
                return self.finish(r)
            self.reserve(r)
        self.kick(p)

    def local(self, r: SimRequest) -> SimWorker | None:
        """The decode worker to prefill r itself (router/placement.py; no prefix cache here, and no
        failures: the whole prompt counts, and a prefill worker is always there), or None."""
        prefillers = [w for w in self.workers if w.role == "prefill"]
        if not prefillers:
            return None
        short = r.req.prompt_tokens <= self.local_limit
        queued = self.queue_limit and all(w.load()[0] >= self.queue_limit for w in prefillers)
        return self.pick(("decode",)) if short or queued else None

    # ------------------------------------------------------------------ workers

    def kick(self, w: SimWorker) -> None:
        if w.step is not None or not w.engine.has_unfinished():
            return
        batch = w.engine.schedule()
        if not batch:
            return
        chunks, lengths = step_shape(batch)
        mixed = w.role == "mono" or (w.role == "decode" and chunks)  # a decode worker's local prefill, too
        cost = self.model.mono_step if mixed and self.model.mono_step else self.model.step
        w.step = Step(batch, cost(chunks, len(lengths), self.model.kv_read(lengths)), self.now)
        if self.hosting.host_cores:
            self.share()
        else:
            self.at(self.now + w.step.work_left, self.step_done, w, w.step, 0)

    def share(self) -> None:
        """The host's cores shared (host_slowdown): a step starting or ending changes how fast every
        step under way progresses; their end events are moved accordingly."""
        stepping = [w for w in self.workers if w.step is not None]
        slowdown = host_slowdown(len(stepping), self.model.cores, self.host_front_cores, self.hosting.host_cores,
                                 self.model.co_run)
        for w in stepping:
            s = w.step
            s.work_left = max(0.0, s.work_left - (self.now - s.since) / s.slowdown)
            s.since, s.slowdown, s.version = self.now, slowdown, s.version + 1
            self.at(self.now + s.work_left * slowdown, self.step_done, w, s, s.version)

    def step_done(self, w: SimWorker, step: Step, version: int) -> None:
        if w.step is not step or step.version != version:
            return  # moved by contention: a later event ends it
        batch, w.step = w.step.batch, None
        if self.hosting.host_cores:
            self.share()
        for seq in w.engine.finish_step(batch):
            r = self.requests[seq.request_id]
            r.token_times.append(self.now)
            if seq.finish_reason == PREFILLED:
                r.prefilled_at = self.now
                if r.granted is not None:
                    self.handoff(r)
                continue
            if w.role == "decode" and r.prefill is not w:  # the router hears from the decode worker: the prefill is done
                r.prefill.assigned.discard(r.index)
            if seq.status is Status.FINISHED:
                if w.role == "prefill":  # ended at its first token: KVRelease
                    r.decode.reservations.pop(r.index, None)
                    if r.granted is not None:
                        r.decode.engine.num_reserved_seqs -= 1
                        r.decode.engine.block_manager.release_blocks(r.granted)
                        self.grant_queued(r.decode)
                self.finish(r)
        if w.role == "decode":
            self.grant_queued(w)
        self.kick(w)

    def finish(self, r: SimRequest) -> None:
        r.done = True
        self.unfinished -= 1
        r.prefill.assigned.discard(r.index)
        r.decode.assigned.discard(r.index)

    def reserve(self, r: SimRequest) -> None:
        """A KVReserve reaches r's decode worker: granted now if none is queued ahead of it and
        there is room, else queued (decode_worker/worker.py)."""
        if r.done or r.granted is not None:
            return
        queue = r.decode.reservations
        blocks = None if queue else r.decode.engine.reserve(r.index, r.req.prompt_tokens, self.now)
        if blocks is None:
            queue[r.index] = r
        else:
            self.granted(r, blocks)

    def grant_queued(self, w: SimWorker) -> None:
        """The decode worker's queued reservations, in order, while there is room (DecodeWorker._grant_queued)."""
        for index, r in list(w.reservations.items()):
            blocks = w.engine.reserve(index, r.req.prompt_tokens, self.now)
            if blocks is not None:
                del w.reservations[index]
                self.granted(r, blocks)
            elif w.engine.scheduler.refuses_all(w.engine.num_reserved_seqs):
                break

    def granted(self, r: SimRequest, blocks: list[int]) -> None:
        r.granted = blocks
        r.seq.awaits_kv_grant = False
        if r.prefilled_at is not None:
            self.handoff(r)
        else:
            self.kick(r.prefill)  # it may be admitted now

    def handoff(self, r: SimRequest) -> None:
        tokens = r.req.prompt_tokens
        if self.crossing.random() < self.hosting.cross_host:
            t = self.hosting.network_s(tokens * self.model.kv_bytes_per_token)
        else:
            t = self.model.handoff_s(tokens)
        self.at(self.now + t, self.arrived, r)

    def arrived(self, r: SimRequest) -> None:
        r.prefill.engine.release(r.index)
        r.decode.engine.add_prefilled(r.index, r.req.prompt_tokens, r.req.output_tokens, r.granted)
        self.kick(r.decode)
        self.kick(r.prefill)  # the freed blocks may admit a waiting prompt


def latency(r: SimRequest, front_latency_s: float, now: float) -> Latency:
    """What the client saw of r; for a request a stopped run did not finish, its latencies so far
    (lower bounds: enough to tell which target it was missing), or None if it had not arrived."""
    half = front_latency_s / 2
    t = r.token_times
    if r.failed:
        return Latency(None)
    if not t:
        return Latency((now + half - r.req.arrival) * 1e3 if now >= r.req.arrival else None)
    gaps = [(b - a) * 1e3 for a, b in zip(t, t[1:])]
    end = t[-1] if r.done else now
    tpot = (end - t[0]) * 1e3 / (r.req.output_tokens - 1) if r.req.output_tokens > 1 else None
    return Latency((t[0] + half - r.req.arrival) * 1e3, tpot, (t[-1] + half - r.req.arrival) * 1e3 if r.done else None,
                   gaps)


def simulate(model: WorkerModel, prefill: int, decode: int, mono: int, hosting: Hosting, rate: float,
             requests: list[Request], slo: SLO, stop_below: float | None = None,
             local_prefill: tuple[int, int] = (0, 0)) -> Point:
    """One rate: every request served to its length; the SLO attainment and what was delivered.
    With stop_below, a run whose attainment is sure to end below it stops there: the search only
    needs to know it failed clearly. The requests not finished then count by their latencies so
    far (what they were missing, for `plan.bound`), so such a point's attainment is an upper bound."""
    sim = Simulation(model, prefill, decode, mono, hosting, rate, requests, slo, stop_below, local_prefill)
    done = sim.run()
    records = [latency(r, model.front_latency_s, sim.now) for r in done]
    half = model.front_latency_s / 2  # a client sees a worker's token this much later
    served = [r for r in done if not r.failed]
    return point_from(rate, records, slo, [r.req.arrival for r in done],
                      [r.token_times[-1] + half for r in served if r.done],
                      [t + half for r in served for t in r.token_times], until=sim.now + half)
