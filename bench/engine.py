"""`pdserve bench engine`: offline throughput of the monolithic engine, decode speed over a grid of
batch sizes and KV lengths, and prefill speed, each against what the hardware allows, measured in
the same run:

- a decode step must read every weight and every cached K/V once, so its floor is those bytes over
  the device's copy bandwidth (a device-to-device copy reads and writes each byte: the floor counts
  the read at twice the copy rate);
- a prefill is matmuls, so its ceiling is the dtype's matmul rate on a large square product.

The first mode's decode points are also timed with async scheduling, on the same requests in
alternating blocks: what hiding the host's work behind the device's is worth (on a CPU nothing runs beside
the host, so about 1x there).
"""

from __future__ import annotations

import random
import sys
import time

import torch

from bench.report import print_json, print_table
from common.config import EngineConfig, resolve_device
from common.engine import Engine, freeze_startup_objects
from common.errors import InvalidArgument
from common.sampling_params import SamplingParams


def sig(x: float, figures: int = 4) -> float:
    """x to a few significant figures: a tiny model's floor (6e-4 ms) rounds to 0 at 3 decimals."""
    return float(f"{x:.{figures}g}")


def step_times(engine: Engine, prompts: list[list[int]], params: SamplingParams, counted
               ) -> tuple[list[float], list[list[int]]]:
    """Generate prompts to the end: (the seconds of each step whose batch `counted(engine.last_batch)`
    is true of, each request's output tokens). The speculative and structured benches time their
    decode steps by it."""
    ids = [engine.add_request(p, params) for p in prompts]
    times, done = [], {}
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        if counted(engine.last_batch):
            times.append(time.perf_counter() - t0)
        done.update((o.request_id, o.token_ids) for o in outs if o.finished)
    return times, [done[i] for i in ids]


def _random_prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_grid(device: torch.device) -> tuple[list[int], list[int]]:
    """(batch sizes, KV lengths): issue 11's grid on a GPU; on a CPU a smaller one that runs in minutes."""
    if device.type == "cuda":
        return [1, 16, 64, 256], [64, 512, 2048]
    return [1, 16, 64], [64, 512]


def read_bandwidth(device: torch.device, repeats: int = 5) -> float:
    """Bytes/s a kernel can read on `device`: twice the rate of the best of `repeats` copies (a copy
    reads and writes every byte) of 256 MiB on a GPU, 64 MiB on a CPU."""
    from bench.transfer import DeviceCopyRun, MemcpyRun

    nbytes = (256 if device.type == "cuda" else 64) << 20
    run = DeviceCopyRun(nbytes, device, device) if device.type == "cuda" else MemcpyRun(nbytes)
    return 2 * nbytes / min(run.one() for _ in range(repeats))


def matmul_rate(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` square products (8192 on a GPU, 1024 on a CPU)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def weight_bytes_per_step(engine: Engine) -> int:
    """Weights a decode step reads: every layer, the final norm, and the output projection (the
    embedding table itself only where tied to it: a step looks up a few of its rows)."""
    model = engine.model
    skip = {id(model.embed.weight)} if model.lm_head is not None else set()
    if model.pos_embed is not None:
        skip.add(id(model.pos_embed.weight))
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def prefill_flops(engine: Engine, tokens: int) -> float:
    """FLOPs of one prompt's prefill: 2 per weight per token in the layers, the output projection
    for the last token, and causal attention (QK^T and PV over half the square)."""
    cfg = engine.model_config
    layer_params = sum(p.numel() for layer in engine.model.layers for p in layer.parameters() if p.dim() == 2)
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    return 2 * layer_params * tokens + 2 * cfg.hidden_size * cfg.vocab_size + attention


def prefill_seconds(engine: Engine, tokens: int, rng: random.Random, repeats: int = 3) -> float:
    """Best of `repeats` prefills of one `tokens`-token prompt (first token sampled)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        prompt = _random_prompts(rng, 1, tokens, engine.model_config.vocab_size)
        _sync(engine.config.torch_device)
        t0 = time.perf_counter()
        engine.generate(prompt, params)
        _sync(engine.config.torch_device)
        best = min(best, time.perf_counter() - t0)
    return best


def prefill_lead(batch: int, kv_len: int, max_num_batched_tokens: int) -> int:
    """How many tokens the first of `batch` requests of `kv_len`-token prompts may decode while the
    rest prefill (a step's token budget less its decodes), and the warm step after: what their
    max_tokens and blocks need beyond the steps a bench times. Without it the first finished
    inside the last timed steps, which then ran fewer rows than they counted (on the H200, sync,
    timed last, looked faster than async at batch 64 and KV 512)."""
    return -(-batch * kv_len // max(1, max_num_batched_tokens - batch)) + 1


def decoding_batch(engine: Engine, batch: int, kv_len: int, max_tokens: int, rng: random.Random) -> list[int]:
    """Add `batch` greedy requests of `kv_len`-token random prompts that may decode `max_tokens`
    once all decode, and step until all do, plus one warm decode step: their ids."""
    lead = prefill_lead(batch, kv_len, engine.config.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens + lead, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in
           _random_prompts(rng, batch, kv_len, engine.model_config.vocab_size)]
    seqs = [engine.requests[i] for i in ids]
    while not all(s.is_decoding for s in seqs):
        engine.step()
    engine.step()
    return ids


def release(engine: Engine, ids: list[int]) -> None:
    """Abort the requests and run the engine dry: a launched step's blocks come back once it is collected."""
    for i in ids:
        engine.abort_request(i)
    while engine.has_unfinished():
        engine.step()


def decode_speed(engine: Engine, batch: int, kv_len: int, steps: int, rng: random.Random,
                 compare_async: bool = False) -> tuple[float, float | None]:
    """Decode tokens/s of `batch` requests whose caches hold about `kv_len` tokens; with
    compare_async also with async scheduling (else None), on the same requests, in four blocks of
    steps / 2 (sync, async, async, sync) so that the contexts' growth favours neither. The engine's
    own setting is back in place after."""
    default = engine.config.async_scheduling
    engine.config.async_scheduling = False
    try:
        return _decode_speed(engine, batch, kv_len, steps, rng, compare_async)
    finally:
        engine.config.async_scheduling = default


def _decode_speed(engine: Engine, batch: int, kv_len: int, steps: int, rng: random.Random,
                  compare_async: bool) -> tuple[float, float | None]:
    ids = decoding_batch(engine, batch, kv_len, 2 * steps + 8, rng)
    blocks = [(False, steps)] if not compare_async else [(on, max(1, steps // 2)) for on in (False, True, True, False)]
    seconds, counted = {False: 0.0, True: 0.0}, {False: 0, True: 0}
    if compare_async:  # untimed: a process's first async steps at a batch size allocate its pinned buffers
        engine.config.async_scheduling = True
        for _ in range(2):
            engine.step()
        engine.config.async_scheduling = False
        engine.step()  # collects the last one launched
    for on, n in blocks:
        if on != engine.config.async_scheduling:
            engine.config.async_scheduling = on
            engine.step()  # the switch: a step that only launches, or one that reads two steps' tokens
        _sync(engine.config.torch_device)
        t0 = time.perf_counter()
        for _ in range(n):
            engine.step()
        _sync(engine.config.torch_device)
        seconds[on] += time.perf_counter() - t0
        counted[on] += n
    engine.config.async_scheduling = False  # the last block's launched step is collected
    ended = sum(i not in engine.requests for i in ids)
    release(engine, ids)
    if ended:  # the steps after ran fewer rows than counted
        raise RuntimeError(f"{ended} of the {batch} requests ended inside the timed steps: a bench bug "
                           "(decoding_batch's max_tokens)")
    speed = {on: batch * counted[on] / seconds[on] for on in seconds if counted[on]}
    return speed[False], speed.get(True)


def measure_mode(engine: Engine, name: str, batch_sizes: list[int], kv_lens: list[int], steps: int, prefill_len: int,
                 rng: random.Random, bandwidth: float, peak: float, weights: int, kv_token: int,
                 compare_async: bool = False) -> dict:
    """The decode grid, each point against its bytes-read floor, and a prefill against the
    matmul peak, in the engine's current mode; with compare_async each decode point also with
    async scheduling ("async_step_ms")."""
    decode, points = {}, len(batch_sizes) * len(kv_lens)
    for i, (b, kv) in enumerate((b, kv) for b in batch_sizes for kv in kv_lens):
        tok_s, async_tok_s = decode_speed(engine, b, kv, steps, rng, compare_async)
        step_ms = 1e3 * b / tok_s
        floor_ms = 1e3 * (weights + b * (kv + steps / 2) * kv_token) / bandwidth
        decode[f"b{b}_kv{kv}"] = point = {"tok_s": round(tok_s, 1), "step_ms": round(step_ms, 3),
                                          "floor_ms": sig(floor_ms), "of_floor": sig(floor_ms / step_ms)}
        if async_tok_s is not None:
            point["async_step_ms"] = round(1e3 * b / async_tok_s, 3)
        # each point's figures as it is taken: a run cut short by a time limit still says them
        print(f"[{name} {i + 1}/{points}] decode batch {b}, KV {kv}: {step_ms:.3f} ms/step, {tok_s:,.1f} tok/s, "
              f"{floor_ms / step_ms:.1%} of the floor"
              + (f", async {point['async_step_ms']:.3f} ms" if async_tok_s is not None else ""),
              file=sys.stderr, flush=True)
    print(f"[{name}] prefill of one {prefill_len}-token prompt", file=sys.stderr, flush=True)
    prefill_s = prefill_seconds(engine, prefill_len, rng)
    flops = prefill_flops(engine, prefill_len)
    print(f"[{name}] prefill: {1e3 * prefill_s:.2f} ms, {flops / prefill_s / peak:.1%} of matmul peak",
          file=sys.stderr, flush=True)
    prefill = {"tokens": prefill_len, "ms": round(1e3 * prefill_s, 2), "tflop_s": sig(flops / prefill_s / 1e12),
               "matmul_peak_tflop_s": sig(peak / 1e12), "of_peak": sig(flops / prefill_s / peak, 3)}
    return {"decode": decode, "prefill": prefill}


def attention_label(engine: Engine) -> str:
    """The attention backend, and for the Triton one its prefill tiles and decode launch (`auto`
    picks the fastest on the device at start: common/attention/triton_choice.py)."""
    attention = engine.model.layers[0].attention
    if attention.name != "triton":
        return attention.name
    from common.attention.triton_choice import launch_name
    from common.attention.triton_paged import PREFILL_ROWS, tile_name

    return (f"triton (prefill tiles of {tile_name(attention.prefill_tile or (PREFILL_ROWS, 0))}, decode tiles "
            f"{launch_name(attention.decode_launch or {})})")


def engine_for_bench(engine_kwargs: dict, max_batch: int, seq_len: int, prefill_len: int) -> Engine:
    """An engine for a bench whose batches reach `max_batch` sequences of up to `seq_len` tokens,
    and whose prefill takes `prefill_len`, with no prefix caching (random prompts: hits would only
    be noise) and, unless asked otherwise, a KV pool of what the bench uses, not of the device's free
    memory: a larger one is not faster, and --vs-transformers needs the rest for its model and cache."""
    cfg = EngineConfig(**{**engine_kwargs, "enable_prefix_caching": False})
    cfg.max_num_seqs = max(cfg.max_num_seqs, max_batch)
    cfg.max_num_batched_tokens = max(cfg.max_num_batched_tokens, max_batch, prefill_len)
    seq_len += prefill_lead(max_batch, seq_len, cfg.max_num_batched_tokens)  # decoding_batch's
    longest = max(seq_len, prefill_len + 1)
    if cfg.max_model_len is not None and cfg.max_model_len < longest:
        raise InvalidArgument(f"--max-model-len {cfg.max_model_len} is shorter than the longest sequence of the "
                              f"bench ({longest} tokens); allowed: at least that")
    if cfg.num_blocks is None:
        need = max(max_batch * -(-seq_len // cfg.block_size), -(-(prefill_len + 1) // cfg.block_size))
        cfg.num_blocks = need + need // 50  # and the scheduler's 1% watermark
    engine = Engine(cfg)
    if engine.max_model_len < longest:  # found here, not by the prefill after the whole sweep
        raise InvalidArgument(f"the bench's longest sequence ({longest} tokens: --prefill-len and a token out, or "
                              "a --kv-lens length, its steps and its decodes while the batch prefills) is over "
                              f"{cfg.model}'s context of {engine.max_model_len} tokens; allowed: at most that")
    return engine


def run_engine_bench(engine_kwargs: dict, num_requests: int, prompt_len: int, output_len: int,
                     batch_sizes: list[int] | None, kv_lens: list[int] | None, steps: int, seed: int,
                     vs_transformers: bool = False, prefill_len: int | None = None,
                     transformers_cache: str = "static") -> dict:
    rng = random.Random(seed)
    device = resolve_device(engine_kwargs.get("device", "cpu"))
    grid = default_grid(device)
    batch_sizes, kv_lens = batch_sizes or grid[0], kv_lens or grid[1]
    prefill_len = prefill_len or (2048 if device.type == "cuda" else 512)
    max_b = max(batch_sizes + [1, num_requests])
    engine = engine_for_bench(engine_kwargs, max_b, max(kv_lens + [prompt_len]) + max(2 * steps + 8, output_len),
                              prefill_len)
    freeze_startup_objects()  # as a worker does: the timed steps see the collections serving sees
    cfg = engine.config

    # Offline throughput: all requests at once, to completion.
    prompts = _random_prompts(rng, num_requests, prompt_len, engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.generate(prompts[:2], params)  # warm-up
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.token_ids) for o in outs)
    output_tok_s = out_tokens / elapsed
    total_tok_s = (out_tokens + num_requests * prompt_len) / elapsed

    bandwidth = read_bandwidth(device)
    peak = matmul_rate(device, cfg.torch_dtype)
    weights = weight_bytes_per_step(engine)
    kv_token = engine.kv_cache.numel() // (engine.num_blocks * cfg.block_size) * engine.kv_cache.element_size()
    # Both modes, the engine's first, each with its own graphs on a GPU; on a CPU only torch's ops
    # unless --batch-invariant asked for its cost too.
    both = device.type == "cuda" or engine.batch_invariant
    modes = [engine.batch_invariant, not engine.batch_invariant] if both else [False]
    runs = {}
    for on in modes:
        engine.set_batch_invariant(on)
        name = "batch_invariant" if engine.batch_invariant else "torch_ops"
        if name in runs:  # the kernels declined at start: one mode only
            break
        runs[name] = measure_mode(engine, name, batch_sizes, kv_lens, steps, prefill_len, rng, bandwidth, peak,
                                  weights, kv_token, compare_async=not runs)

    print_table(f"pdserve bench engine: {cfg.model} on {device} ({cfg.dtype}), {torch.get_num_threads()} threads, "
                f"attention {attention_label(engine)}",
                ["workload", "requests", "prompt", "output", "seconds", "output tok/s", "total tok/s"],
                [["offline", num_requests, prompt_len, output_len, round(elapsed, 2), output_tok_s, total_tok_s]])
    for name, run in runs.items():
        print_table(f"decode, {name.replace('_', ' ')}: floor = weights ({weights / 2**20:,.0f} MiB) + KV read once, "
                    f"at {bandwidth / 1e9:,.0f} GB/s (twice a {device} copy's rate, this run)",
                    ["batch", "KV", "tok/s", "step ms", "floor ms", "of floor"],
                    [[*k[1:].split("_kv"), p["tok_s"], f"{p['step_ms']:.3f}", f"{p['floor_ms']:.3f}", f"{p['of_floor']:.1%}"]
                     for k, p in run["decode"].items()])
    print_table(f"prefill of one prompt, against a square {cfg.dtype} matmul's rate this run",
                ["mode", "tokens", "ms", "TFLOP/s", "matmul TFLOP/s", "of peak"],
                [[name.replace("_", " "), p["tokens"], f"{p['ms']:.2f}", f"{p['tflop_s']:.3f}",
                  f"{p['matmul_peak_tflop_s']:.3f}", f"{p['of_peak']:.1%}"] for name, p in
                 ((name, run["prefill"]) for name, run in runs.items())])
    first, first_run = next(iter(runs.items()))
    print_table(f"async scheduling ({first.replace('_', ' ')}): decode step time, synchronous / async, the same "
                f"requests in alternating blocks of steps", ["batch", "KV", "sync ms", "async ms", "speedup"],
                [[*k[1:].split("_kv"), f"{p['step_ms']:.3f}", f"{p['async_step_ms']:.3f}",
                  f"{p['step_ms'] / p['async_step_ms']:.2f}x"] for k, p in first_run["decode"].items()])
    if len(runs) == 2:
        inv, fast = runs["batch_invariant"], runs["torch_ops"]
        print_table("what batch invariance costs: decode step time, invariant / torch's ops",
                    ["batch", "KV", "invariant ms", "torch ms", "cost"],
                    [[*k[1:].split("_kv"), f"{inv['decode'][k]['step_ms']:.3f}", f"{fast['decode'][k]['step_ms']:.3f}",
                      f"{inv['decode'][k]['step_ms'] / fast['decode'][k]['step_ms'] - 1:+.0%}"] for k in inv["decode"]])
    result = {"bench": "engine", "model": cfg.model, "device": str(device), "dtype": cfg.dtype,
              "attention": attention_label(engine),
              "num_requests": num_requests, "prompt_len": prompt_len, "output_len": output_len,
              "output_tok_s": round(output_tok_s, 1), "total_tok_s": round(total_tok_s, 1),
              "read_gb_s": round(bandwidth / 1e9, 1), "weight_bytes": weights, "kv_bytes_per_token": kv_token,
              "modes": runs}
    if vs_transformers:
        from bench.vs_transformers import run_vs_transformers

        result["vs_transformers"] = run_vs_transformers(engine, prompt_len, output_len, batch_sizes, seed,
                                                        cache=transformers_cache)
    print_json(result)
    return result
