"""`pdserve bench engine --vs-transformers`: the same model file and the same prompts through
`transformers` in the same run, so that the ratios mean something on a noisy machine.

- load: pdserve's load_model (config, weights dequantized into the dtype, tokenizer) against
  transformers' from_pretrained of the model and its tokenizer, alternating, page cache warm;
- generate: greedy, fixed output length, at each batch size: pdserve's Engine.generate against
  transformers' generate on the same token ids (equal-length prompts: no padding), output tokens/s.
  transformers runs with its static cache by default (its fastest: on a GPU it compiles the step
  on first use, so every batch size is warmed up before it is timed).

A dummy preset has no file: transformers then builds the same architecture and shapes from its
config with weights of its own, so the speeds compare but the tokens do not (and load times are
not compared).
"""

from __future__ import annotations

import random
import sys
import time

import torch

from bench.report import print_table
from common.checkpoint import load_model
from common.model_spec import model_path
from common.engine import Engine
from common.errors import InvalidArgument
from common.sampling_params import SamplingParams


def hf_config(mc):
    """transformers' config for one of our architectures and shapes (a dummy preset's twin)."""
    from transformers import GPT2Config, LlamaConfig

    if mc.qk_norm or mc.o_bias:
        raise InvalidArgument(f"--vs-transformers on {mc.name}: only Llama and GPT-2 shapes are built without a file; "
                              "allowed: dummy:nanogpt, dummy:llama-tiny, dummy:llama-1b, or a model file")
    if mc.arch == "gpt2":
        return GPT2Config(vocab_size=mc.vocab_size, n_embd=mc.hidden_size, n_layer=mc.num_layers, n_head=mc.num_heads,
                          n_inner=mc.intermediate_size, n_positions=mc.max_position_embeddings,
                          layer_norm_epsilon=mc.norm_eps)
    return LlamaConfig(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
                       num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads,
                       num_key_value_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                       max_position_embeddings=mc.max_position_embeddings, rms_norm_eps=mc.norm_eps,
                       rope_theta=mc.rope_theta, rope_scaling=mc.rope_scaling, tie_word_embeddings=mc.tie_word_embeddings,
                       attention_bias=mc.qkv_bias, mlp_bias=mc.mlp_bias)


def _transformers_loader(spec: str, dtype: torch.dtype, device: torch.device, mc=None):
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise InvalidArgument("--vs-transformers needs transformers and accelerate: pip install 'pdserve[bench]'") from e
    if spec.startswith("dummy:"):
        config = hf_config(mc)
        return lambda: AutoModelForCausalLM.from_config(config, dtype=dtype).eval().to(device)

    path = model_path(spec)
    kwargs = dict(gguf_file=path.name) if path.is_file() else {}
    where = str(path.parent if path.is_file() else path)

    def load():
        AutoTokenizer.from_pretrained(where, **kwargs)
        return AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs).eval().to(device)

    return load


def _timed(f):
    t0 = time.perf_counter()
    out = f()
    return time.perf_counter() - t0, out


def run_vs_transformers(engine: Engine, prompt_len: int, output_len: int, batch_sizes: list[int], seed: int,
                        load_repeats: int = 2, cache: str = "static") -> dict:
    from common import gguf_file

    cfg = engine.config
    spec, device, dtype = cfg.model, cfg.torch_device, cfg.torch_dtype
    dummy = spec.startswith("dummy:")
    hf_load = _transformers_loader(spec, dtype, device, engine.model_config)
    path = None if dummy else model_path(spec)
    if path is not None and path.is_file():  # page cache warm for whichever loads first
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
    ours_s, theirs_s = [], []
    repeats = 1 if dummy else load_repeats
    for i in range(repeats):
        print(f"[vs transformers {i + 1}/{repeats}] loading {spec} by pdserve and by transformers"
              + (" (transformers dequantizes a GGUF in Python: about 15 s on a CPU)" if path is not None and path.is_file() else ""),
              file=sys.stderr, flush=True)
        gguf_file._open.cache_clear()  # parse the file again, as a fresh process would
        if not dummy:
            ours_s.append(_timed(lambda: load_model(spec, device, dtype, cfg.attention_backend))[0])
        seconds, hf_model = _timed(hf_load)
        theirs_s.append(seconds)

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(max(batch_sizes))]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    def hf_generate(batch):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor(batch, device=device), attention_mask=torch.ones(
                len(batch), prompt_len, dtype=torch.long, device=device), max_new_tokens=output_len,
                min_new_tokens=output_len, do_sample=False, pad_token_id=0, cache_implementation=cache)
        return out[:, prompt_len:].tolist()

    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    rows, gen = [], {}
    for b in batch_sizes:
        print(f"[vs transformers] greedy generate, batch {b}", file=sys.stderr, flush=True)
        hf_generate(prompts[:b])  # warm-up: a static cache compiles per shape
        ours, outs = _timed(lambda: engine.generate(prompts[:b], params))
        theirs, hf_outs = _timed(lambda: hf_generate(prompts[:b]))
        same = "n/a (its own weights)" if dummy else f"{sum(o.token_ids == h for o, h in zip(outs, hf_outs))}/{b}"
        tokens = b * output_len
        gen[f"b{b}"] = {"pdserve_tok_s": round(tokens / ours, 1), "transformers_tok_s": round(tokens / theirs, 1),
                        "ratio": round(theirs / ours, 2), "same_tokens": same}
        rows.append([b, tokens / ours, tokens / theirs, f"{theirs / ours:.2f}x", same])
    load = None
    if not dummy:
        load = {"pdserve_s": round(min(ours_s), 2), "transformers_s": round(min(theirs_s), 2),
                "ratio": round(min(theirs_s) / min(ours_s), 2)}
        print_table(f"load {spec} ({cfg.dtype}), best of {load_repeats}, alternating",
                    ["loader", "seconds", "each run"],
                    [["pdserve load_model", min(ours_s), " ".join(f"{s:.2f}" for s in ours_s)],
                     ["transformers from_pretrained", min(theirs_s), " ".join(f"{s:.2f}" for s in theirs_s)],
                     ["ratio (transformers / pdserve)", load["ratio"], ""]])
    print_table(f"greedy generate, {prompt_len}-token prompts, {output_len} new tokens: output tokens/s "
                f"(transformers' {cache} cache)",
                ["batch", "pdserve", "transformers", "pdserve speedup", "same tokens"], rows)
    return {"load": load, "generate": gen, "transformers_cache": cache}
