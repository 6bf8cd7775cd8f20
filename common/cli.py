"""The `pdserve` command line. Each subcommand is a thin layer over an in-process API."""

from __future__ import annotations

import functools
import json
import sys

import click

from common.errors import PdserveError


def engine_options(f):
    """Options that build an EngineConfig; the command receives them as `engine_kwargs`."""
    opts = [
        click.option("--model", default="dummy:nanogpt", show_default=True,
                     help="dummy:<preset> or a Hugging Face checkpoint directory"),
        click.option("--device", default="cpu", show_default=True, help="cpu, cuda:N or N"),
        click.option("--dtype", default=None, help="float32, float16, bfloat16 [default: float32 on CPU, bfloat16 on GPU]"),
        click.option("--block-size", default=16, show_default=True, type=int),
        click.option("--num-blocks", default=None, type=int, help="KV pool size [default: from --kv-cache-gb]"),
        click.option("--kv-cache-gb", default=None, type=float),
        click.option("--max-num-seqs", default=64, show_default=True, type=int),
        click.option("--max-num-batched-tokens", default=2048, show_default=True, type=int),
        click.option("--max-model-len", default=None, type=int),
        click.option("--no-prefix-caching", is_flag=True),
        click.option("--attention-backend", default="auto", show_default=True,
                     type=click.Choice(["auto", "sdpa", "flex"])),
    ]

    @functools.wraps(f)
    def wrapper(*args, model, device, dtype, block_size, num_blocks, kv_cache_gb, max_num_seqs,
                max_num_batched_tokens, max_model_len, no_prefix_caching, attention_backend, **kwargs):
        engine_kwargs = dict(model=model, device=device, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
                             kv_cache_gb=kv_cache_gb, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                             enable_prefix_caching=not no_prefix_caching, attention_backend=attention_backend)
        return f(*args, engine_kwargs=engine_kwargs, **kwargs)

    for opt in reversed(opts):
        wrapper = opt(wrapper)
    return wrapper


def sampling_options(f):
    for opt in reversed([
        click.option("--max-tokens", default=32, show_default=True, type=int),
        click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy"),
        click.option("--top-p", default=1.0, show_default=True, type=float),
        click.option("--top-k", default=0, show_default=True, type=int, help="0 disables"),
        click.option("--seed", default=None, type=int),
        click.option("--ignore-eos", is_flag=True),
    ]):
        f = opt(f)
    return f


def parse_prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of token ids", param_hint="--prompt-ids")


@click.group()
def main():
    """pdserve: LLM serving with disaggregated prefill and decode."""


@main.command()
@click.option("--prompt", "prompts", multiple=True, help="prompt text (repeatable)")
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="comma-separated token ids (repeatable)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per prompt per line")
@sampling_options
@engine_options
def generate(prompts, prompt_ids, as_json, max_tokens, temperature, top_p, top_k, seed, ignore_eos, engine_kwargs):
    """Generate text for one or more prompts with the monolithic engine."""
    from common.engine import Engine
    from common.sampling import SamplingParams

    all_prompts = list(prompts) + [parse_prompt_ids(p) for p in prompt_ids]
    if not all_prompts:
        raise click.UsageError("give at least one --prompt or --prompt-ids")
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                            seed=seed, ignore_eos=ignore_eos)
    engine = Engine(**engine_kwargs)
    for prompt, out in zip(all_prompts, engine.generate(all_prompts, params)):
        if as_json:
            print(json.dumps({"prompt": prompt, "prompt_token_ids": out.prompt_token_ids,
                              "token_ids": out.token_ids, "text": out.text,
                              "finish_reason": out.finish_reason}), flush=True)
        else:
            shown = prompt if isinstance(prompt, str) else out.prompt_token_ids
            print(f"{shown!r} -> {out.text if out.text is not None else out.token_ids!r}", flush=True)


@main.group()
def bench():
    """Benchmarks: each prints a table, then one JSON line."""


@bench.command("engine")
@click.option("--num-requests", default=64, show_default=True, type=int)
@click.option("--prompt-len", default=128, show_default=True, type=int)
@click.option("--output-len", default=128, show_default=True, type=int)
@click.option("--batch-sizes", default="1,16,64", show_default=True)
@click.option("--kv-lens", default="64,512", show_default=True)
@click.option("--steps", default=32, show_default=True, type=int, help="timed decode steps per sweep point")
@click.option("--seed", default=0, show_default=True, type=int)
@engine_options
def bench_engine(num_requests, prompt_len, output_len, batch_sizes, kv_lens, steps, seed, engine_kwargs):
    """Offline throughput of the monolithic engine, and a decode sweep over batch and KV length."""
    from bench.engine import run_engine_bench

    run_engine_bench(engine_kwargs, num_requests, prompt_len, output_len, parse_prompt_ids(batch_sizes),
                     parse_prompt_ids(kv_lens), steps, seed)


def run():
    try:
        main(standalone_mode=True)
    except PdserveError as e:
        print(f"error [{e.code}]: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run()
