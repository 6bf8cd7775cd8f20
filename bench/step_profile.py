"""`pdserve bench step-profile`: where a decode step's time goes, host against device, kernel by
kernel: what to make faster next.

`bench engine` says how far a step is from its floor; this says why. For each batch size, in each
kernel mode, on requests decoding with about `kv_len` tokens cached:

- the step as `bench engine` times it (`engine.step()`, synchronous), and with async scheduling (the
  default on CUDA), on the same requests in alternating blocks of steps (bench/engine.py:
  decode_speed), so that their contexts are alike;
- the device's share: the forward's CUDA graph replayed alone and the sampler's graph alone, timed
  by events (on a CPU, or without graphs, the eager forward on the same inputs);
- the host's share: the step less the device's, and the Python functions that spend it (cProfile
  over the same steps, by own time);
- the async step's Python functions by own time, where it waits for the device, and what torch's
  caching allocator did in its steps (a retried allocation, or a segment taken from or given back
  to the device, leaves the device idle: the same for a prefill);
- the forward's kernels, by device time per step (torch.profiler over eager forwards of the captured
  shape, which launch the kernels the graph holds: a graph's replay hides them from the profiler
  on some CUDA versions). Their sum against the graph's replay is what launching costs inside it.

With --prefill-len N, also one N-token prompt's prefill (first token sampled), as `bench engine`
times it against the matmul peak: its time, its FLOP rate, and its kernels by device time, the
matmuls' against the attention's and the rest's. On CUDA, last, the Triton kernels' registers,
spills and programs per SM (bench/kernel_occupancy.py).
"""

from __future__ import annotations

import cProfile
import pstats
import random
import sys
import time
import warnings

import torch
from torch.autograd import DeviceType

from bench.engine import (_random_prompts, _sync, decode_speed, decoding_batch, engine_for_bench, prefill_flops,
                          prefill_seconds, release, sig)
from bench.kernel_occupancy import compiled_kernels
from bench.report import print_json, print_table
from common.engine import freeze_startup_objects
from common.sampling import GREEDY
from common.sampling_params import SamplingParams


def _device_ms(device: torch.device, fn, repeats: int) -> float:
    """Mean ms of fn() on the device (events on CUDA, the wall clock elsewhere), after one warm call."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return 1e3 * (time.perf_counter() - t0) / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


_profiler_started: list = []


def kernel_table(device: torch.device, fn, repeats: int, top: int) -> tuple[list[dict], int, float]:
    """The kernels fn() launches, by device time per call: (top rows, kernels per call, their
    total µs per call). On a CPU: torch's ops by their own CPU time instead."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    fn()
    _sync(device)
    if not _profiler_started:  # a process's first profile pays the profiler's own start (50x a small step's ops)
        with torch.profiler.profile(activities=activities):
            fn()
            _sync(device)
        _profiler_started.append(True)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
        _sync(device)
    rows = []
    for avg in prof.key_averages():
        if device.type == "cuda":
            if avg.device_type != DeviceType.CUDA or avg.self_device_time_total <= 0:
                continue
            us = avg.self_device_time_total
        else:
            if avg.self_cpu_time_total <= 0 or avg.key.startswith("ProfilerStep"):
                continue
            us = avg.self_cpu_time_total
        rows.append({"kernel": avg.key, "calls": avg.count / repeats, "us": us / repeats})
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    count = round(sum(r["calls"] for r in rows))
    for r in rows:
        r["share"] = r["us"] / total if total else 0.0
    return rows[:top], count, total


def host_functions(fn, steps: int, top: int) -> list[dict]:
    """The Python functions of `steps` calls of fn by their own time per call (cProfile)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        fn()
    profiler.disable()
    return profiled_functions(profiler, steps, top)


def profiled_functions(profiler: cProfile.Profile, calls: int, top: int) -> list[dict]:
    """The `top` Python functions a profiler saw, by their own time per one of `calls` calls."""
    stats = pstats.Stats(profiler).stats
    rows = [{"function": f"{fn} ({path.rsplit('/', 2)[-1] if '/' in path else path}:{line})",
             "calls": ncalls / calls, "us": 1e6 * tottime / calls}
            for (path, line, fn), (_, ncalls, tottime, _, _) in stats.items()]
    rows.sort(key=lambda r: -r["us"])
    return rows[:top]


def _eager_forward(engine):
    """The forward of one engine step's decode batch, as a function to call again: the inputs its
    runner prepared (a call writes the same K/V to the same slots again)."""
    runner, kept = engine.runner, []

    def prepare(*args, **kwargs):
        kept.append(type(runner).prepare(runner, *args, **kwargs))
        return kept[-1]

    runner.prepare = prepare
    try:
        engine.step()
    finally:
        del runner.prepare
    _, input_ids, positions, meta, _ = kept[-1]
    return lambda: engine.model.logits(engine.model(input_ids, positions, engine.kv_cache, meta))


def sync_points(device: torch.device, fn) -> list[str]:
    """Where fn() makes the host wait for the device, as torch's sync debug mode sees it (a
    pageable copy, .item(), .tolist(), nonzero...; not an event's synchronize, which is how a step
    reads its tokens): each 'file:line' of ours once, with the count. Empty on a CPU."""
    if device.type != "cuda":
        return []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            at = f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}"
            where[at] = where.get(at, 0) + 1
    return [f"{at} x{n}" for at, n in sorted(where.items())]


ALLOCATOR_EVENTS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def allocator_events(device: torch.device, fn) -> tuple[object, dict[str, int]]:
    """fn()'s result, and what torch's caching allocator did during it, where each such event makes
    the device idle: retries after a failed cudaMalloc (the cache is freed first: a device-wide
    sync), and segments taken from and given back to the device (cudaMalloc, cudaFree). No events
    on a CPU."""
    if device.type != "cuda":
        return fn(), {}
    before = torch.cuda.memory_stats(device)
    result = fn()
    after = torch.cuda.memory_stats(device)
    return result, {key: after.get(key, 0) - before.get(key, 0) for key in ALLOCATOR_EVENTS}


def async_profile(engine, steps: int, top: int) -> tuple[list[dict], list[str], dict[str, int]]:
    """The Python functions of `steps` steps with async scheduling, where one more waits for the
    device (sync_points), and what the allocator did in those steps (allocator_events)."""
    engine.config.async_scheduling = True
    try:
        engine.step()  # the switch: launches only
        host, events = allocator_events(engine.config.torch_device, lambda: host_functions(engine.step, steps, top))
        return host, sync_points(engine.config.torch_device, engine.step), events
    finally:
        engine.config.async_scheduling = False  # the next step collects the one launched last


STEPS_PER_POINT = 3  # times --steps, for the profiles after the timing: cProfile, async cProfile, and warm-ups


def profile_point(engine, batch: int, kv_len: int, steps: int, rng: random.Random, top: int) -> dict:
    """One decode point, timed synchronous (the step is then its host's work plus its device's) and
    with async scheduling, then profiled on fresh requests of the same contexts. Profiling the async
    steps after the others timed them at contexts `steps` longer a phase: at batch 256 and KV 64 on a
    CPU that made them look 2.5x slower than the synchronous ones."""
    device = engine.config.torch_device
    tok_s, async_tok_s = decode_speed(engine, batch, kv_len, steps, rng, compare_async=True)
    sync_ms, async_ms = 1e3 * batch / tok_s, 1e3 * batch / async_tok_s
    ids = decoding_batch(engine, batch, kv_len, STEPS_PER_POINT * steps + 8, rng)
    try:
        graphs = engine.runner.graphs
        size = graphs.size_for(batch) if graphs is not None else None
        if graphs is not None and size in graphs.graphs:
            forward_ms = _device_ms(device, graphs.graphs[size][0].replay, steps)
            greedy = graphs.samplers.get((size, GREEDY))  # the bench's requests are greedy
            sample_ms = _device_ms(device, greedy[0].replay, steps) if greedy else 0.0
            eager = lambda: graphs._forward(size)  # noqa: E731  the captured shape, eagerly
        else:  # eager steps: the forward of one step's inputs, again
            size, sample_ms, eager = None, 0.0, _eager_forward(engine)
            with torch.inference_mode():
                forward_ms = _device_ms(device, eager, steps)
        with torch.inference_mode():
            kernels, launches, kernel_us = kernel_table(device, eager, max(2, steps // 4), top)
        host = host_functions(engine.step, steps, top)
        async_host, async_syncs, async_allocator = async_profile(engine, steps, top)
    finally:
        release(engine, ids)
    return {"batch": batch, "kv": kv_len, "captured_size": size, "step_ms": round(sync_ms, 4),
            "forward_ms": round(forward_ms, 4), "sample_ms": round(sample_ms, 4),
            # timed apart, the forward may take longer than a whole step on a noisy CPU: no negative host
            "host_ms": round(max(0.0, sync_ms - forward_ms - sample_ms), 4), "kernels_per_forward": launches,
            "kernel_ms": round(kernel_us / 1e3, 4), "kernels": kernels, "host_functions": host,
            "async_step_ms": round(async_ms, 4), "async_host_functions": async_host, "async_sync_points": async_syncs,
            "async_allocator": async_allocator}


def profile_prefill(engine, tokens: int, repeats: int, rng: random.Random, top: int) -> dict:
    """One `tokens`-token prompt's prefill: its best time, its FLOP rate, and its kernels by time."""
    seconds = prefill_seconds(engine, tokens, rng, repeats)
    prompt = _random_prompts(rng, 1, tokens, engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with torch.inference_mode():
        kernels, launches, kernel_us = kernel_table(engine.config.torch_device, lambda: engine.generate(prompt, params),
                                                    repeats, top)
        host = host_functions(lambda: engine.generate(prompt, params), repeats, top)
        syncs = sync_points(engine.config.torch_device, lambda: engine.generate(prompt, params))
        _, allocator = allocator_events(engine.config.torch_device, lambda: engine.generate(prompt, params))
    flops = prefill_flops(engine, tokens)
    return {"tokens": tokens, "ms": round(1e3 * seconds, 3), "tflop_s": sig(flops / seconds / 1e12),
            "kernels_per_prefill": launches, "kernel_ms": round(kernel_us / 1e3, 4), "kernels": kernels,
            "host_functions": host, "sync_points": syncs, "allocator": allocator}


def _events(events: dict[str, int]) -> str:
    return (f"retried {events.get('num_alloc_retries', 0)} failed allocations, took "
            f"{events.get('num_device_alloc', 0)} segments and gave back {events.get('num_device_free', 0)}")


def run_step_profile(engine_kwargs: dict, batch_sizes: list[int], kv_len: int, steps: int, seed: int,
                     top: int = 15, modes: str = "both", prefill_len: int = 0) -> dict:
    rng = random.Random(seed)
    engine = engine_for_bench({**engine_kwargs, "async_scheduling": False}, max(batch_sizes),
                              kv_len + STEPS_PER_POINT * steps + 8, prefill_len)
    freeze_startup_objects()  # as a worker does
    device = engine.config.torch_device
    order = {"both": [engine.batch_invariant, not engine.batch_invariant], "invariant": [True], "torch": [False]}[modes]
    if device.type != "cuda" and modes == "both":
        order = [engine.batch_invariant]  # a CPU's invariant mode is a different kernel set, not a cheaper one
    results, prefills = {}, {}
    for on in order:
        engine.set_batch_invariant(on)
        name = "batch_invariant" if engine.batch_invariant else "torch_ops"
        if name in results:
            break
        points = []
        for b in batch_sizes:
            print(f"[{name}] profiling decode batch {b}, KV {kv_len}", file=sys.stderr, flush=True)
            points.append(profile_point(engine, b, kv_len, steps, rng, top))
            p = points[-1]
            print(f"[{name}] batch {b}: step {p['step_ms']:.3f} ms = forward {p['forward_ms']:.3f} + sample "
                  f"{p['sample_ms']:.3f} + host {p['host_ms']:.3f}; {p['kernels_per_forward']} kernels, "
                  f"{p['kernel_ms']:.3f} ms of them", file=sys.stderr, flush=True)
        if prefill_len:
            print(f"[{name}] profiling a {prefill_len}-token prefill", file=sys.stderr, flush=True)
            prefills[name] = profile_prefill(engine, prefill_len, 3, rng, top)
        results[name] = points

    unit = "device" if device.type == "cuda" else "CPU"

    def busy(p: dict) -> str:  # (a CPU's op times overlap on its threads: no share of the wall)
        return f" ({p['kernel_ms'] / p['ms']:.0%} of the prefill's)" if device.type == "cuda" else ""

    for name, points in results.items():
        print_table(f"decode step, {name.replace('_', ' ')} ({engine.config.model} on {device}, "
                    f"{engine.config.dtype}, KV {kv_len}): where a step's time goes",
                    ["batch", "graph", "step ms", "forward ms", "sample ms", "host ms", "host share", "kernels",
                     f"kernels' {unit} ms", "forward / kernels", "async step ms"],
                    [[p["batch"], p["captured_size"] or "eager", f"{p['step_ms']:.3f}", f"{p['forward_ms']:.3f}",
                      f"{p['sample_ms']:.3f}", f"{p['host_ms']:.3f}", f"{p['host_ms'] / p['step_ms']:.0%}",
                      p["kernels_per_forward"], f"{p['kernel_ms']:.3f}",
                      f"{p['forward_ms'] / p['kernel_ms']:.2f}x" if p["kernel_ms"] else "-",
                      f"{p['async_step_ms']:.3f}"] for p in points])
        for p in points:
            print_table(f"{name.replace('_', ' ')}, batch {p['batch']}: the forward's kernels by {unit} time per step",
                        ["kernel", "calls", "µs", "share"],
                        [[r["kernel"][:90], f"{r['calls']:g}", f"{r['us']:.1f}", f"{r['share']:.1%}"]
                         for r in p["kernels"]])
            print_table(f"{name.replace('_', ' ')}, batch {p['batch']}: the step's Python functions by own time per step",
                        ["function", "calls", "µs"],
                        [[r["function"][:90], f"{r['calls']:g}", f"{r['us']:.1f}"] for r in p["host_functions"]])
            print_table(f"{name.replace('_', ' ')}, batch {p['batch']}: with async scheduling, "
                        f"{p['async_step_ms']:.3f} ms a step: its Python functions by own time per step",
                        ["function", "calls", "µs"],
                        [[r["function"][:90], f"{r['calls']:g}", f"{r['us']:.1f}"]
                         for r in p["async_host_functions"]])
            if device.type == "cuda":
                print(f"{name.replace('_', ' ')}, batch {p['batch']}, async: the host waits for the device (torch's "
                      f"sync debug mode) at: {', '.join(p['async_sync_points']) or 'nowhere'}; in {steps} steps the "
                      f"allocator {_events(p['async_allocator'])}")
    for name, p in prefills.items():
        print_table(f"prefill of one {p['tokens']}-token prompt, {name.replace('_', ' ')}: {p['ms']:.2f} ms, "
                    f"{p['tflop_s']:.3g} TFLOP/s; {p['kernels_per_prefill']} kernels, {p['kernel_ms']:.2f} ms of "
                    f"{unit} time{busy(p)}; by {unit} time", ["kernel", "calls", "µs", "share"],
                    [[r["kernel"][:90], f"{r['calls']:g}", f"{r['us']:.1f}", f"{r['share']:.1%}"] for r in p["kernels"]])
        print_table(f"prefill of one {p['tokens']}-token prompt, {name.replace('_', ' ')}: the Python functions by "
                    f"own time per prefill (a wait for the device shows as a synchronize)",
                    ["function", "calls", "µs"],
                    [[r["function"][:90], f"{r['calls']:g}", f"{r['us']:.1f}"] for r in p["host_functions"]])
        if device.type == "cuda":
            print(f"prefill, {name.replace('_', ' ')}: the host waits for the device (torch's sync debug mode) at: "
                  f"{', '.join(p['sync_points']) or 'nowhere'}; in one prefill the allocator {_events(p['allocator'])}")
    result = {"bench": "step_profile", "model": engine.config.model, "device": str(device),
              "dtype": engine.config.dtype, "kv_len": kv_len, "steps": steps, "modes": results}
    if prefills:
        result["prefill"] = prefills
    if device.type == "cuda":
        kernels = compiled_kernels(torch.cuda.get_device_properties(device))
        print_table("the Triton kernels these steps compiled: what one program holds, and how many an SM runs",
                    ["kernel", "variant", "warps", "registers", "spilled bytes", "shared bytes", "programs/SM"],
                    [[k["kernel"], k["variant"][:60], k["warps"], k["registers"], k["spilled_bytes"], k["shared_bytes"],
                      k["programs_per_sm"]] for k in kernels])
        result["triton_kernels"] = kernels
    print_json(result)
    return result
