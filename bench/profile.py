"""`pdserve plan`'s profile: one prefill worker and one decode worker of a model on a device (and one
monolithic worker, the baseline), measured once through the real router with the SDK, and fitted
into what the simulator needs (`bench/simulate.py`: StepCost per role, handoff time, the front's
latency and CPU).

- Prefill time against prompt tokens: one request at a time, max_tokens=2, prompts of rising
  length; the prefill worker's own `prefill_s` (work received -> first token sampled). Fitted per
  step as base + per token + per token x context, over the chunks the token budget makes.
- KV handoff time against bytes: the same requests' `handoff_s` (first token sampled -> the decode
  worker starts it: what layer-wise streaming left to move). Fitted as base + per byte.
- Decode step time against batch size and total KV: B requests sent at once, prompts of L tokens;
  while all B are decoding, the median gap between a request's tokens as the client receives them
  (so the worker's per-token messages, the router and the client are in it), from 32 tokens to
  the end of the context. Fitted as base + per sequence + per KV token read + per KV token read
  squared (the portable attention pads runs of similar lengths to their longest, here one run of
  equal requests: batch x longest; a paged kernel reads each sequence's own; on a CPU the cost per
  token rises as the read outgrows the caches).
- The front: what a client sees beyond the worker (TTFT - prefill_s, median), and the CPU seconds
  the router and the client spend per request and per token (from /proc and this process).
- A monolithic worker: under load its steps mix prefill chunks into decode batches, which the
  runs above never do, and the client's view of isolated runs under-costed the steps it served
  (2-core CPU machine, a `chat` load beside its profile: 1.15x the fit's time overall, 1.21x on
  the mixed steps). So it is measured by its own steps (its step trace, common/step_trace.py):
  the same prefill and decode runs, then prompts of every length arriving while batches decode;
  each step's loop time (step, sending, the loop's own gap, not idling) in a run is divided by
  that run's contention, steps of one shape averaged, and the means fitted, with a cost per
  prefill token beside decodes (a GPU replays decode-only steps as graphs, mixed ones eagerly).
  Its client-side times stay for `co_run`, which compares them with a pair's.
- On a CPU, two monolithic workers decoding at once (`co_run`: a step's cost beside another
  worker over alone, once the cores it lacked are divided out; shared caches and memory).

On a CPU device the workers share the host's cores with the router, the client and whatever else
runs on the machine (bench/hostload.py measures it), so times are divided by the contention they
ran under (`contention`, the simulator's own rule: the router, the client and others first), and
a profile is taken for each thread count a topology of up to --workers workers gets (the
launcher's split). Fits drop the points they miss badly (a step slowed by a neighbour is not the
cost of the step).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from bench.hostload import CpuWatch
from bench.report import cluster_logs, print_table
from bench.serve import drive, random_prompt
from common.cli_options import engine_kwargs_from
from bench.simulate import EngineShape, StepCost, WorkerModel, host_slowdown
from common.model_spec import model_config
from common.attention import decode_kv_read, make_attention
from common import step_trace
from common.config import EngineConfig, resolve_device
from common.errors import InvalidArgument, made_dir
from router.client import Client
from router.launcher import Cluster, threads_per_worker

PROFILE_VERSION = 3  # 2: co_run, decode_kv2, KV read in runs, the router and client first in `contention`;
# 3: a monolithic worker's steps fitted from its step trace, mixed steps included
DECODE_TOKENS = 256  # output tokens of each decode-profile request: long enough for a full batch to form


def decode_tokens(context: int) -> int:
    """DECODE_TOKENS, or a quarter of a short context (--max-model-len 256 leaves room for prompts)."""
    return max(8, min(DECODE_TOKENS, context // 4))


def contention(worker_cores: float, cpu: dict[str, float], host_cores: int | None, stepping: int = 1) -> float:
    """How much slower each of `stepping` workers ran than alone for want of cores, beside the
    router, the client and everyone else (the simulator's rule, without co_run: what it measures)."""
    if host_cores is None:
        return 1.0
    return host_slowdown(stepping, worker_cores, cpu["router"] + cpu["client"] + cpu["others"], host_cores)


def _nonneg_lstsq(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a negative cost is noise): drop the most negative
    term and refit until none is left."""
    scale = np.linalg.norm(X, axis=0)
    scale[scale == 0] = 1.0
    X = X / scale  # features span 1 to 1e9 (KV tokens squared): solve on columns of one size
    active = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        if active:
            coef[active] = np.linalg.lstsq(X[:, active], Y, rcond=None)[0] / scale[active]
        worst = min(active, key=lambda i: coef[i], default=None)
        if worst is None or coef[worst] >= 0:
            return coef
        active.remove(worst)


def nonneg_fit(rows: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least squares of relative errors (times span 1 ms to 100s of ms: each point
    counts alike), refitted once without the points it misses by more than 3x its median miss (at
    least 30%): a step slowed by a neighbour on a shared machine is not the cost of the step.
    Points at or below 0 (a measurement smaller than what it subtracts) are left out."""
    X, Y = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    X, Y = X[Y > 0], Y[Y > 0]
    if len(Y) == 0:
        return [0.0] * len(rows[0])
    coef = _nonneg_lstsq(X / Y[:, None], np.ones_like(Y))
    miss = np.abs(Y - X @ coef) / Y
    keep = miss <= max(0.3, 3 * float(np.median(miss)))
    if keep.sum() >= X.shape[1] + 2 and not keep.all():
        coef = _nonneg_lstsq(X[keep] / Y[keep, None], np.ones(int(keep.sum())))
    return [float(c) for c in coef]


def fit_steps(rows: list[dict], windows: list[tuple[float, float, dict]], padded: bool, slow
              ) -> tuple[StepCost, list[list[float]]]:
    """A worker's StepCost from its step trace (common/step_trace.py rows). A step's time is its loop:
    the step, sending its outputs, and the gap before it up to twice the median gap (the loop's own
    polling and messages; more is idling for work). Each is divided by the contention of the run it
    fell in (windows: (start, end, cpu), monotonic; slow(cpu) -> factor); steps outside every run
    (warm-up) are left out. Steps of one shape (prefill tokens and KV read to a quarter octave,
    decodes exactly) are averaged, so a fit of relative errors over shapes is not pulled under the
    mean by the skew of single steps. One base serves prefill and decode steps alike; a prefill
    token beside decodes may cost more than alone (prefill_mixed).
    Returns the cost and the means: [prefill tokens, token x context, decodes, KV read, seconds, steps]."""
    gaps = sorted(r["gap_ms"] for r in rows if r["gap_ms"] is not None)
    cap = 2 * gaps[len(gaps) // 2] if gaps else 0.0
    shapes: dict[tuple, list[list[float]]] = {}
    for r in rows:
        run = next((cpu for start, end, cpu in windows if start <= r["start"] <= end), None)
        if run is None:
            continue
        kv = r["kv_padded"] if padded else r["kv_tokens"]
        loop_s = (r["step_ms"] + r["send_ms"] + min(r["gap_ms"] or 0.0, cap)) / 1e3 / slow(run)
        key = (round(4 * math.log2(1 + r["prefill_tokens"])), int(r["decodes"]), round(4 * math.log2(1 + kv)))
        shapes.setdefault(key, []).append([r["prefill_tokens"], r["prefill_token_ctx"], r["decodes"], kv, loop_s])
    means = [[*(statistics.fmean(col) for col in zip(*steps)), len(steps)] for steps in shapes.values()]
    if not means:
        raise RuntimeError("the worker's step trace holds no step of the profile's runs")
    base, pt, pa, ds, dk, dk2, pm = nonneg_fit([[1, n, ctx, b, kv, kv * kv, n if b else 0.0]
                                                for n, ctx, b, kv, *_ in means], [t for *_, t, _ in means])
    return StepCost(base, pt, pa, base, ds, dk, dk2, pm), [[round(v, 9) for v in m] for m in means]


def prefill_features(n: int, budget: int) -> list[float]:
    """[steps, tokens, token x context] of prefilling n tokens alone, chunked by the token budget."""
    chunks = [(min(budget, n - start), start) for start in range(0, n, budget)]
    return [len(chunks), n, sum(k * (k + c) for k, c in chunks)]


def default_lengths(context: int) -> list[int]:
    top = min(context - 3, 8192)
    out = [16]
    while out[-1] * 2 < top:
        out.append(out[-1] * 2)
    return out + [top]


class Profiler:
    """Drives one small cluster with the SDK and keeps what the fits need: each run's samples and
    the CPU (cores) that the router, the workers, the client and everyone else used meanwhile."""

    def __init__(self, cluster: Cluster, threads: int, prompt, say, block_size: int, decode_tokens: int):
        self.cluster, self.threads, self.prompt, self.say = cluster, threads, prompt, say
        self.block_size, self.decode_tokens = block_size, decode_tokens
        self.front_rows: list[list[float]] = []  # [requests, tokens] of each run ...
        self.front_cpu: list[float] = []  # ... and the router's + client's CPU seconds in it
        self.runs_cpu: list[dict[str, float]] = []
        self.windows: list[tuple[float, float, dict[str, float]]] = []  # (start, end, cpu) of each run, monotonic

    def run(self, load):
        c = self.cluster
        watch = CpuWatch({"router": [c.router.proc.pid], "workers": [w.proc.pid for w in c.workers]})
        began = time.monotonic()
        samples, _ = asyncio.run(drive(c.address, load))
        cpu = watch.stop()
        self.windows.append((began, time.monotonic(), cpu))
        bad = [s.error for s in samples if s.error]
        if bad:
            raise RuntimeError(f"profile requests failed: {bad[:3]}")
        self.front_rows.append([len(load), sum(s.tokens for s in samples)])
        self.front_cpu.append((cpu["router"] + cpu["client"]) * watch.elapsed)
        self.runs_cpu.append(cpu)
        return samples, cpu

    def prefill(self, lengths: list[int], repeats: int, max_tokens: int) -> list[tuple[int, list]]:
        """One request at a time per length: (length, [(sample, cpu)] of each repeat)."""
        return [(n, [(s, cpu) for _ in range(repeats) for (s,), cpu in [self.run([(0.0, self.prompt(n), max_tokens)])]])
                for n in lengths]

    def mixed(self, lengths: list[int], batch: int, prompt_len: int, step_s: float) -> None:
        """Prompts of every length arriving, one every few steps, while `batch` requests of
        prompt_len tokens decode (step_s: about their step): the mixed steps a monolithic worker runs
        under load, for its step trace. The prompts arrive over the first half of the batch's decode,
        so that a run up to twice as fast as step_s (a neighbour's load gone) still decodes beside the last."""
        spacing = max(0.01, step_s * self.decode_tokens / (2 * (len(lengths) + 1)))
        self.run([(0.0, self.prompt(prompt_len), self.decode_tokens) for _ in range(batch)]
                 + [((i + 1) * spacing, self.prompt(n), 2) for i, n in enumerate(lengths)])
        self.say(f"profile (threads {self.threads}): mono: prompts of {len(lengths)} lengths into a decode batch of "
                 f"{batch}")

    def decode(self, lengths: list[int], batches: list[int], padded: bool, what: str, pool_tokens: int,
               workers: int = 1) -> list[tuple]:
        """(batch, KV read, step s as measured, cpu) while a batch of equal requests all decode, on
        each of `workers` workers at once; for each length, the batches whose KV fits the pool
        (pool_tokens), and the largest that does."""
        points = []
        for L in lengths:
            need = L + self.decode_tokens
            fits = pool_tokens * 9 // 10 // (need + 16)  # room for the block manager's watermark
            if not fits:
                raise InvalidArgument(f"a KV pool of {pool_tokens} tokens holds no {need}-token request "
                                      f"to profile; allowed: a pool of at least {(need + 16) * 10 // 9} "
                                      "tokens (--num-blocks, --kv-cache-gb)")
            for B in sorted({b for b in batches if b <= fits} | {min(fits, max(batches))}):
                samples, cpu = self.run([(0.0, self.prompt(L), self.decode_tokens) for _ in range(B * workers)])
                start = max(s.token_times[1] for s in samples)
                end = min(s.token_times[-1] for s in samples)
                # each request's mean gap while all decode (robust to tokens the router forwards in bursts)
                means = [(inside[-1] - inside[0]) / (len(inside) - 1) for s in samples
                         for inside in [[t for t in s.token_times if start <= t <= end]] if len(inside) > 2]
                if len(means) < B * workers:
                    self.say(f"profile: batch {B} x {L} never decoded all at once; skipped")
                    continue
                mid = (start + end) / 2
                lens = [L + sum(t <= mid for t in s.token_times) for s in samples[:B]]
                points.append((B, decode_kv_read(lens, self.block_size) if padded else sum(lens),
                               statistics.median(means), cpu))
                self.say(f"profile (threads {self.threads}): {what} decode batch {B}, KV {points[-1][1]} tokens: "
                         f"{points[-1][2] * 1e3:.2f} ms/step")
        return points


def mixed(pr: Profiler, decoded: list[tuple], lengths: list[int], prompt_len: int, out_tokens: int, pool_tokens: int,
          max_seqs: int) -> None:
    """A monolithic worker's mixed steps: prompts of every length into a small and a large decode
    batch (an eighth and half of max_num_seqs), as many as the pool holds beside the prompts.
    decoded: the decode runs' (batch, KV read, step s, cpu), for the pace of the arrivals."""
    room = pool_tokens * 9 // 10 - sum(n + 2 + 16 for n in lengths)
    most = max(1, room // (prompt_len + out_tokens + 16))
    for batch in sorted({min(most, max(1, max_seqs // 8)), min(most, max(1, max_seqs // 2))}):
        near = min(decoded, key=lambda d: (abs(d[0] - batch), abs(d[1] - batch * prompt_len)), default=None)
        step_s = near[2] if near else 0.01  # (no decode run formed its batch: arrivals 10 ms a step apart)
        pr.mixed(lengths, batch, prompt_len, step_s)


def profile_workers(model: str, device: str, threads: int | None, worker_args: list[str], repeats: int = 5,
                    say=print) -> dict:
    """Profile one prefill and one decode worker (a 1P1D cluster) and one monolithic worker: the
    raw points and the fits."""
    cfg = model_config(model)
    if engine_kwargs_from(worker_args)["async_scheduling"] is None:  # (on by default on CUDA)
        worker_args = [*worker_args, "--no-async-scheduling"]  # a traced step's row holds its own work alone
    engine = EngineConfig(**{**engine_kwargs_from(worker_args), "model": model, "device": device})  # checks the flags
    context = min(engine.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    budget, max_seqs = engine.max_num_batched_tokens, engine.max_num_seqs
    kv_bytes = cfg.kv_values_per_token * engine.torch_dtype.itemsize
    host_cores = (os.cpu_count() or 1) if device == "cpu" else None
    threads = threads or threads_per_worker(2)
    # The portable attention pads runs of similar lengths to their longest; FlexAttention reads each
    # sequence's own pages. `auto` picks by the same start-up check the workers run.
    attention = make_attention(engine.attention_backend, resolve_device(device), cfg.num_heads, cfg.num_kv_heads,
                               cfg.head_dim)
    padded = attention.name == "sdpa"
    if engine.async_scheduling:  # asked for: unless so, the profile's workers step synchronously
        say("profile: --async-scheduling: a step's trace row holds the wait for the step before it, so the "
            "monolithic worker's fit blurs neighbouring shapes")
    rng = random.Random(0)

    def prompt(n):
        return random_prompt(rng, n, cfg.vocab_size)

    # Decodes read from 32 tokens to the context's end (less the tokens decoded): on a CPU a read that
    # outgrows the caches costs more per token, and a loaded worker's batches read the most.
    out_tokens = decode_tokens(context)
    mid = min(max(256, context // 2), context - out_tokens - 2)
    kv_lengths = sorted({min(32, mid), mid, min(2 * mid, context - out_tokens - 2)})
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_seqs} | {max_seqs})
    raw, profilers = {}, {}
    # On a CPU, two monolithic workers decoding side by side: how much more each step costs beside
    # another than alone, once the cores they lacked are divided out (the simulator's co_run).
    clusters = [("disaggregated", (1, 1, 0)), ("mono", (0, 0, 1))]
    if host_cores is not None and host_cores >= 2:
        clusters.append(("pair", (0, 0, 2)))
    with cluster_logs() as tmp:
        for name, topology in clusters:
            cluster = Cluster(model, *topology, [device], "127.0.0.1", 0, 0, Path(tmp) / name, "least_loaded",
                              list(worker_args), threads=threads, restart=False)
            if name == "mono":
                for w in cluster.workers:
                    w.env[step_trace.ENV] = str(Path(tmp) / "mono-steps")
            try:
                cluster.start()
                with Client(cluster.address) as c:
                    pool = min(w["total_blocks"] for w in c.status().workers)
                if name == "disaggregated":
                    total_blocks = pool
                pr = Profiler(cluster, threads, prompt, say, engine.block_size, out_tokens)
                profilers[name] = pr
                asyncio.run(drive(cluster.address, [(0.0, prompt(64), 4)] * 2))  # warm-up
                if name == "pair":
                    raw[name] = ([], pr.decode([mid], [b for b in (4, 16, 32) if b <= max_seqs], padded, "pair:",
                                               pool * engine.block_size, 2))
                    continue
                # both report their prefill time (work received -> first token sampled)
                raw[name] = (pr.prefill(default_lengths(context), repeats, 2 if name == "disaggregated" else 1),
                             pr.decode(kv_lengths, batches, padded, f"{name}:", pool * engine.block_size))
                if name == "mono":
                    mixed(pr, raw[name][1], default_lengths(context), mid, out_tokens, pool * engine.block_size,
                          max_seqs)
            finally:
                cluster.stop()
        mono_steps = [row for path in sorted((Path(tmp) / "mono-steps").glob("*.tsv")) for row in step_trace.read(path)]

    # A stepping worker uses this many cores (at most its threads): what it adds to the contention.
    cores = min(float(threads), max(cpu["workers"] for name, (_, dec) in raw.items() if name != "pair"
                                    for *_, cpu in dec))

    def slow(cpu):
        return contention(cores, cpu, host_cores)

    prefill_runs, decode_runs = raw["disaggregated"]
    front = statistics.median(s.first - s.sent - s.timings["prefill_s"] for _, r in prefill_runs for s, _ in r)
    mono_prefill_runs, mono_decode_runs = raw["mono"]
    pts = {"prefill_s": [[n, statistics.median(s.timings["prefill_s"] / slow(c) for s, c in r)] for n, r in prefill_runs],
           "handoff_s": [[n * kv_bytes, statistics.median(s.timings.get("handoff_s", 0.0) for s, _ in r)]
                         for n, r in prefill_runs],
           "decode_s": [[b, kv, t / slow(c)] for b, kv, t, c in decode_runs],
           "mono_prefill_s": [[n, statistics.median(s.timings["prefill_s"] / slow(c) for s, c in r)]
                              for n, r in mono_prefill_runs],
           "mono_decode_s": [[b, kv, t / slow(c)] for b, kv, t, c in mono_decode_runs]}
    for kind in ("prefill_s", "mono_prefill_s"):
        say(f"profile (threads {threads}): {kind[:-2].replace('_', ' ')} ms by prompt tokens: "
            + ", ".join(f"{n}: {t * 1e3:.2f}" for n, t in pts[kind]))

    def step_cost(prefill, decode) -> StepCost:
        pb, pt, pa = nonneg_fit([prefill_features(n, budget) for n, _ in prefill], [t for _, t in prefill])
        db, ds, dk, dk2 = nonneg_fit([[1, b, kv, kv * kv] for b, kv, _ in decode], [t for _, _, t in decode])
        return StepCost(pb, pt, pa, db, ds, dk, dk2)

    hb, hp = nonneg_fit([[1, nbytes] for nbytes, _ in pts["handoff_s"]], [t for _, t in pts["handoff_s"]])
    cr, ct = nonneg_fit([r for p in profilers.values() for r in p.front_rows],
                        [c for p in profilers.values() for c in p.front_cpu])
    shape = EngineShape(total_blocks, engine.block_size, max_seqs, budget, context)
    mono_client = step_cost(pts["mono_prefill_s"], pts["mono_decode_s"])  # timed as the pair's are, for co_run
    mono, pts["mono_steps"] = fit_steps(mono_steps, profilers["mono"].windows, padded, slow)
    mixed_shapes = [m for m in pts["mono_steps"] if m[0] and m[2]]
    if mixed_shapes:
        parts = replace(mono, prefill_mixed=0.0)
        ratio = sum(t for *_, t, _ in mixed_shapes) / sum(parts.of_sums(*m[:4]) for m in mixed_shapes)
        say(f"profile (threads {threads}): mono: steps with a prefill beside decodes ({len(mixed_shapes)} shapes) "
            f"took {ratio:.2f}x what the fit gives their prefill and decodes alone; fitted as "
            f"{mono.prefill_mixed * 1e6:.2f} ms more per 1k prefill tokens beside decodes")
    else:
        say(f"profile (threads {threads}): mono: no step prefilled beside decodes (--max-num-seqs "
            f"{max_seqs}); mixed steps are costed as their parts")
    co_run = 1.0
    if raw.get("pair"):
        pts["pair_decode_s"] = [[b, kv, t / contention(cores, c, host_cores, stepping=2)] for b, kv, t, c in raw["pair"][1]]
        alone = [t / mono_client([], b, kv) for b, kv, t in pts["pair_decode_s"]]
        co_run = max(1.0, statistics.median(alone)) if alone else 1.0
        say(f"profile (threads {threads}): a step beside another worker costs {co_run:.2f}x alone "
            f"({', '.join(f'{r:.2f}' for r in alone)})")
    wm = WorkerModel(step_cost(pts["prefill_s"], pts["decode_s"]), shape, kv_bytes, hb, hp, max(0.0, front), cr, ct,
                     threads, round(cores, 3), round(co_run, 3), padded, mono)
    others = [c["others"] for p in profilers.values() for c in p.runs_cpu]
    return {"threads": threads, "worker_model": asdict(wm), "others_cores": round(statistics.mean(others), 3),
            "points": pts}


def model_from_json(d: dict) -> WorkerModel:
    return WorkerModel(**{**d, "step": StepCost(**d["step"]), "engine": EngineShape(**d["engine"]),
                          "mono_step": StepCost(**d["mono_step"]) if d.get("mono_step") else None})


def profile_thread_counts(device: str, workers: int) -> list[int | None]:
    """The threads per worker of every topology of 1..workers workers (the launcher's split on CPU)."""
    if device != "cpu":
        return [None]
    return sorted({threads_per_worker(n) for n in range(1, workers + 1)})


def writable(out: Path) -> Path:
    """--profile's path, its folder made and a file written there and removed: a path the profile
    cannot be saved to is refused by name before the workers are profiled (minutes), not after."""
    made_dir(out.parent, "--profile")
    if out.is_dir():
        raise InvalidArgument(f"--profile {str(out)!r} is a folder; allowed: a file path "
                              f"(e.g. {str(out / 'profile.json')!r})", param="--profile")
    try:
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"):
            pass
    except OSError as e:
        raise InvalidArgument(f"--profile {str(out)!r}: {e.strerror}; allowed: a file in a folder this user can "
                              "write to", param="--profile") from None
    return out


def save(out: Path, text: str) -> None:
    """text as the file out, whole or not at all: written beside it, then renamed over it (an
    interrupted save leaves the profile before it, never half of one)."""
    with tempfile.NamedTemporaryFile("w", dir=out.parent, prefix=f".{out.name}.", suffix=".tmp", delete=False) as f:
        f.write(text)
    try:
        os.replace(f.name, out)
    except OSError:
        os.unlink(f.name)
        raise


def run_profile(model: str, device: str, workers: int, worker_args: list[str], out: Path, repeats: int = 5,
                threads: int | None = None) -> dict:
    if device != "cpu" and not device.startswith("cuda"):
        raise InvalidArgument(f"--device {device!r}; allowed: cpu or cuda:N (one device is profiled)")
    cores = os.cpu_count() or 1
    if device == "cpu" and not 1 <= workers <= cores:
        raise InvalidArgument(f"--workers {workers} on cpu; allowed: 1..{cores} (this machine's cores)")

    def say(text):
        print(f"[plan] {text}", file=sys.stderr, flush=True)

    if threads is not None and threads < 1:
        raise InvalidArgument(f"--threads {threads}; allowed: >= 1")
    out = writable(Path(out))  # now, not after minutes of profiling
    counts = [threads] if threads else profile_thread_counts(device, workers)
    profiles = [profile_workers(model, device, t, worker_args, repeats, say=say) for t in counts]
    result = {"profile_version": PROFILE_VERSION, "model": model, "device": device,
              "host_cores": cores if device == "cpu" else None, "worker_args": list(worker_args),
              "measured_unix": round(time.time()), "profiles": profiles}
    save(out, json.dumps(result, indent=1))
    for p in profiles:
        wm = p["worker_model"]
        print_table(f"profile of {model} on {device}, {p['threads']} threads per worker (fitted costs, ms)",
                    ["worker", "prefill step", "per 1k tokens", "+ beside decodes", "per 1M tok x ctx", "decode step",
                     "per seq", "per 1k KV read", "per (1k KV)^2", "handoff per MB", "front latency"],
                    [[role, s["prefill_base"] * 1e3, s["prefill_token"] * 1e6, s.get("prefill_mixed", 0.0) * 1e6,
                      s["prefill_attn"] * 1e9,
                      s["decode_base"] * 1e3, s["decode_seq"] * 1e3, s["decode_kv"] * 1e6,
                      s["decode_kv2"] * 1e9, wm["handoff_s_per_byte"] * 1e9 if role != "mono" else "-", wm["front_latency_s"] * 1e3]
                     for role, s in (("prefill/decode", wm["step"]), ("mono", wm["mono_step"]))])
    print(f"profile saved to {out}\n")
    return result
