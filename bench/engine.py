"""`pdserve bench engine`: offline throughput of the monolithic engine, and decode speed over a
grid of batch sizes and KV lengths (does step time grow with the cache? it should barely)."""

from __future__ import annotations

import random
import time

import torch

from bench.report import print_json, print_table
from common.config import EngineConfig
from common.engine import Engine
from common.sampling import SamplingParams


def _random_prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_speed(engine: Engine, batch: int, kv_len: int, steps: int, rng: random.Random) -> float:
    """Decode tokens/s of `batch` requests whose caches hold about `kv_len` tokens."""
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in
           _random_prompts(rng, batch, kv_len, engine.model_config.vocab_size)]
    seqs = [engine.requests[i] for i in ids]
    while not all(s.is_decoding for s in seqs):  # prefill everything, plus one warm decode step
        engine.step()
    engine.step()
    _sync(engine.config.torch_device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(engine.config.torch_device)
    elapsed = time.perf_counter() - t0
    for i in ids:
        engine.abort_request(i)
    return batch * steps / elapsed


def run_engine_bench(engine_kwargs: dict, num_requests: int, prompt_len: int, output_len: int,
                     batch_sizes: list[int], kv_lens: list[int], steps: int, seed: int,
                     vs_transformers: bool = False) -> dict:
    rng = random.Random(seed)
    max_b, max_kv = max(batch_sizes + [1]), max(kv_lens + [prompt_len])
    engine_kwargs = dict(engine_kwargs)
    engine_kwargs["max_num_seqs"] = max(engine_kwargs.get("max_num_seqs", 64), max_b)
    engine_kwargs["max_num_batched_tokens"] = max(engine_kwargs.get("max_num_batched_tokens", 2048), max_b)
    engine_kwargs["enable_prefix_caching"] = False  # random prompts: hits would only be noise
    cfg = EngineConfig(**engine_kwargs)
    engine = Engine(cfg)
    need = max(max_b, num_requests) * engine.block_manager.blocks_needed(max_kv + max(steps, output_len) + 2)
    if engine.num_blocks < need and cfg.num_blocks is None:
        cfg.num_blocks = need
        engine = Engine(cfg)

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

    decode = {}
    for b in batch_sizes:
        for kv in kv_lens:
            decode[f"b{b}_kv{kv}"] = decode_speed(engine, b, kv, steps, rng)

    print_table(f"pdserve bench engine: {cfg.model} on {cfg.torch_device} ({cfg.dtype}), "
                f"{torch.get_num_threads()} threads",
                ["workload", "requests", "prompt", "output", "seconds", "output tok/s", "total tok/s"],
                [["offline", num_requests, prompt_len, output_len, round(elapsed, 2), output_tok_s, total_tok_s]])
    print_table("decode tokens/s by batch size (rows) and KV length (columns)",
                ["batch"] + [f"kv{kv}" for kv in kv_lens],
                [[b] + [decode[f"b{b}_kv{kv}"] for kv in kv_lens] for b in batch_sizes])
    result = {"bench": "engine", "model": cfg.model, "device": str(cfg.torch_device), "dtype": cfg.dtype,
              "num_requests": num_requests, "prompt_len": prompt_len, "output_len": output_len,
              "output_tok_s": round(output_tok_s, 1), "total_tok_s": round(total_tok_s, 1),
              "decode_tok_s": {k: round(v, 1) for k, v in decode.items()}}
    if vs_transformers:
        from bench.vs_transformers import run_vs_transformers

        result["vs_transformers"] = run_vs_transformers(engine, prompt_len, output_len, batch_sizes, seed)
    print_json(result)
    return result
