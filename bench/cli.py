"""`pdserve bench ...` and `pdserve plan`: the measuring commands, registered on the main group by
common/cli.py. Each is a thin layer over its bench module, imported when the command runs."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from common.cli_options import (COUNT, FLOAT, NON_NEGATIVE, POSITIVE, Counts, Integers, devices_option,
                                engine_options, given_flags, threads_option)
from common.protocol import KV_TRANSPORTS

@click.group()
def bench():
    """Benchmarks: each prints a table, then one JSON line."""


@bench.command("engine")
@click.option("--num-requests", default=64, show_default=True, type=COUNT)
@click.option("--prompt-len", default=128, show_default=True, type=COUNT)
@click.option("--output-len", default=128, show_default=True, type=COUNT)
@click.option("--batch-sizes", default=None, type=Counts("batch sizes"),
              help="decode grid's batch sizes [default: 1,16,64,256 on a GPU, 1,16,64 on CPU]")
@click.option("--kv-lens", default=None, type=Counts("KV lengths"),
              help="decode grid's KV lengths [default: 64,512,2048 on a GPU, 64,512 on CPU]")
@click.option("--prefill-len", default=None, type=COUNT,
              help="tokens of the timed prefill [default: 2048 on a GPU, 512 on CPU]")
@click.option("--steps", default=32, show_default=True, type=COUNT, help="timed decode steps per sweep point")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--vs-transformers", is_flag=True,
              help="also load the same model file with transformers and generate the same prompts (batch sizes)")
@click.option("--transformers-cache", default="static", show_default=True, type=click.Choice(["static", "dynamic"]),
              help="transformers' KV cache with --vs-transformers")
@engine_options
@threads_option
def bench_engine(num_requests, prompt_len, output_len, batch_sizes, kv_lens, prefill_len, steps, seed, vs_transformers,
                 transformers_cache, engine_kwargs):
    """Offline throughput of the monolithic engine, a decode sweep over batch and KV length, and a
    prefill, each against the floor or peak measured on the device in the same run."""
    from bench.engine import run_engine_bench

    run_engine_bench(engine_kwargs, num_requests, prompt_len, output_len, batch_sizes, kv_lens, steps, seed,
                     vs_transformers, prefill_len, transformers_cache)


@bench.command("structured")
@click.option("--batch", default=16, show_default=True, type=COUNT, help="requests decoded together")
@click.option("--max-tokens", default=64, show_default=True, type=COUNT)
@click.option("--rounds", default=3, show_default=True, type=COUNT, help="alternating rounds of every kind")
@click.option("--seed", default=0, show_default=True, type=int)
@engine_options
@threads_option
def bench_structured(batch, max_tokens, rounds, seed, engine_kwargs):
    """What structured outputs (regex, JSON schema, any JSON object) cost a decode against free
    output, the same prompts side by side."""
    from bench.structured import run_structured_bench

    run_structured_bench(engine_kwargs, batch, max_tokens, rounds, seed)


@bench.command("speculative")
@click.option("--batch-sizes", default="1,8", show_default=True, type=Counts("batch sizes"))
@click.option("--max-tokens", default=96, show_default=True, type=COUNT)
@click.option("--rounds", default=3, show_default=True, type=COUNT, help="alternating rounds, off then on")
@click.option("--temperature", default=0.0, show_default=True, type=NON_NEGATIVE)
@click.option("--seed", default=0, show_default=True, type=int)
@engine_options
@threads_option
def bench_speculative(batch_sizes, max_tokens, rounds, temperature, seed, engine_kwargs):
    """What n-gram speculative decoding (--speculative-config; default: 4 tokens from 3- or 2-grams)
    gains against plain decoding, on answers that repeat their prompt and answers that do not."""
    from bench.speculative import run_speculative_bench

    run_speculative_bench(engine_kwargs, batch_sizes, max_tokens, rounds, temperature, seed)


@bench.command("step-profile")
@click.option("--batch-sizes", default="1,64", show_default=True, type=Counts("batch sizes"))
@click.option("--kv-len", default=512, show_default=True, type=COUNT, help="tokens cached per request")
@click.option("--steps", default=32, show_default=True, type=COUNT, help="steps timed and profiled per point")
@click.option("--top", default=15, show_default=True, type=COUNT, help="rows of each kernel and function table")
@click.option("--modes", default="both", show_default=True, type=click.Choice(["both", "invariant", "torch"]),
              help="kernel modes: batch-invariant, torch's ops, or both in turn (a CPU profiles its default only)")
@click.option("--prefill-len", default=0, show_default=True, type=Integers(min=0),
              help="also profile one prompt of this many tokens' prefill (0: none)")
@click.option("--seed", default=0, show_default=True, type=int)
@engine_options
@threads_option
def bench_step_profile(batch_sizes, kv_len, steps, top, modes, prefill_len, seed, engine_kwargs):
    """Where a decode step's time goes: the forward's graph and the sampler on the device, the host's
    rest and its Python functions, and the forward's kernels by device time; with --prefill-len,
    a prefill's kernels too."""
    from bench.step_profile import run_step_profile

    run_step_profile(engine_kwargs, batch_sizes, kv_len, steps, seed, top, modes, prefill_len)


@bench.command("serve")
@click.option("--model", default="dummy:nanogpt", show_default=True)
@click.option("--topologies", default="mono,1p1d,2p2d", show_default=True,
              help="mono, Nmono, XpYd; XpYd+localN: prompts up to N tokens prefilled by decode workers; "
                   "XpYd+queueN: decode workers prefill while every prefill worker holds N")
@click.option("--scenarios", default="smoke_test,staggered_arrivals,batch_pressure,long_prompts,long_decode,"
              "stress_test,realistic", show_default=True)
@click.option("--router", "router_address", default=None, help="bench a running cluster instead of launching")
@click.option("--base-url", default=None, help="bench any OpenAI-compatible server (http://HOST:PORT) instead")
@click.option("--frontends", default="zmq", show_default=True,
              help="zmq (the SDK), http (OpenAI's API) or zmq,http: both on each launched cluster, in turn")
@click.option("--repeats", default=1, show_default=True, type=COUNT, help="runs of each scenario per frontend")
@click.option("--num-requests", default=None, type=COUNT,
              help="requests in each scenario (conversations, for multi_turn) [default: the scenario's own]")
@click.option("--policies", default="least_loaded", show_default=True,
              help="the router's policies, comma-separated: a cluster of each topology per policy, in turn")
@click.option("--kv-events", default="on", show_default=True,
              help="prefix_affine told the workers' caches (on), guessing them (off: the router's --no-kv-events), "
                   "or on,off / off,on: a cluster of each, in that order")
@click.option("--api-key", default=None, envvar="PDSERVE_API_KEY", help="for --base-url or launched clusters' HTTP")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--worker-arg", "worker_args", multiple=True, help="extra flag for every worker (repeatable)")
@devices_option()
def bench_serve(model, topologies, scenarios, router_address, base_url, frontends, repeats, num_requests, policies,
                kv_events, api_key, seed, worker_args, devices):
    """Serving load: TTFT, inter-token and end-to-end latency, throughput, per topology and frontend."""
    from bench.serve import run_serve_bench

    if router_address or base_url:
        launch_only = given_flags(["topologies", "frontends", "policies", "kv_events", "worker_args", "devices"])
        if launch_only:
            raise click.UsageError(f"{', '.join(launch_only)}: for the clusters bench serve launches; with "
                                   f"{'--router' if router_address else '--base-url'} it measures the server as it "
                                   "runs, so leave them out")
    try:
        run_serve_bench(model, topologies.split(","), scenarios.split(","), router_address, seed, list(worker_args),
                        tuple(frontends.split(",")), base_url, repeats, api_key, devices=devices,
                        policies=policies.split(","),
                        kv_events=kv_events.split(","), num_requests=num_requests)
    except ValueError as e:
        raise click.UsageError(str(e))


@bench.command("chaos")
@click.option("--model", default="dummy:nanogpt", show_default=True)
@click.option("--prefill", default=2, show_default=True, type=COUNT)
@click.option("--decode", default=2, show_default=True, type=COUNT)
@click.option("--requests", default=500, show_default=True, type=COUNT)
@click.option("--kills", default=10, show_default=True, type=Integers(min=0),
              help="faults to inject (SIGKILL, SIGTERM or SIGSTOP)")
@click.option("--concurrency", default=24, show_default=True, type=COUNT)
@click.option("--interval", default=1.5, show_default=True, type=NON_NEGATIVE, help="seconds between faults")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--log-dir", default=None, help="keep the cluster's logs here")
@devices_option(help="comma-separated, assigned to workers in turn; the reference runs on the first")
@click.option("--dtype", default=None, help="of the workers and the reference [default: float32 on CPU, bfloat16 on GPU]")
@click.option("--worker-arg", "worker_args", multiple=True, help="extra flag for every worker (repeatable)")
@click.option("--router-arg", "router_args", multiple=True,
              help="extra flag for the router (repeatable; e.g. --router-arg=--max-prefill-queue=2)")
def bench_chaos(model, prefill, decode, requests, kills, concurrency, interval, seed, log_dir, devices, dtype,
                worker_args, router_args):
    """Kill and stop random workers under load; check every request completes token-exact."""
    from bench.chaos import run_chaos

    run_chaos(model, prefill, decode, requests, kills, concurrency, seed, interval_s=interval,
              log_dir=Path(log_dir) if log_dir else None, devices=devices, dtype=dtype, worker_args=list(worker_args),
              router_args=list(router_args))


@bench.command("handoff")
@click.option("--model", default="dummy:nanogpt", show_default=True)
@click.option("--tokens", default=1000, show_default=True, type=COUNT, help="prompt length")
@click.option("--requests", default=8, show_default=True, type=COUNT, help="per mode, after one warm-up")
@click.option("--transport", default="auto", show_default=True, type=click.Choice(KV_TRANSPORTS))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--worker-arg", "worker_args", multiple=True, help="extra flag for every worker (repeatable)")
@devices_option()
def bench_handoff(model, tokens, requests, transport, seed, worker_args, devices):
    """Prefill start to decode start of long prompts, KV streamed layer by layer vs sent after."""
    from bench.handoff import run_handoff_bench

    run_handoff_bench(model, tokens, requests, transport, seed, list(worker_args), devices=devices)


@bench.command("router")
@click.option("--model", default="dummy:nanogpt", show_default=True, help="its tokenizer streams the text")
@click.option("--concurrency", "concurrencies", default="16,64,256", show_default=True, type=Counts("request counts"),
              help="streaming requests in flight, one level each")
@click.option("--workers", default=2, show_default=True, type=COUNT, help="synthetic workers")
@click.option("--step-ms", default=1.0, show_default=True, type=POSITIVE,
              help="each worker's step: one token per running request this often (a GPU decode step)")
@click.option("--seconds", default=3.0, show_default=True, type=POSITIVE, help="measured per level")
@click.option("--prompt-len", default=16, show_default=True, type=COUNT)
@click.option("--max-tokens", default=256, show_default=True, type=Integers(min=2))  # as run_router_bench
@click.option("--frontend", default="zmq", show_default=True,
              help="the clients' way in: zmq (the SDK: tokens batched per client and step), zmq-per-token (a "
                   "ZeroMQ client that takes a message per token), or http (OpenAI's streaming API)")
@click.option("--api-servers", default=1, show_default=True, type=COUNT,
              help="with --frontend http: 1 serves HTTP in the router process, N > 1 from N API server processes")
@click.option("--seed", default=0, show_default=True, type=int)
def bench_router(model, concurrencies, workers, step_ms, seconds, prompt_len, max_tokens, frontend, api_servers, seed):
    """Tokens/s one router carries and its CPU per token, fed by synthetic workers at GPU step rates."""
    from bench.router_capacity import run_router_bench

    run_router_bench(model, concurrencies, workers, step_ms, seconds, prompt_len, max_tokens, seed, frontend,
                     api_servers)


@bench.command("transfer")
@click.option("--transport", default="zmq", show_default=True, type=click.Choice(KV_TRANSPORTS[1:]))
@click.option("--model", default="dummy:llama-1b", show_default=True, help="only its KV layout is used")
@click.option("--tokens", default=1024, show_default=True, type=COUNT,
              help="KV of this many tokens per transfer; more than the memory holds is refused (with what fits)")
@click.option("--repeats", default=20, show_default=True, type=COUNT)
@click.option("--block-size", default=16, show_default=True, type=COUNT)
@click.option("--dtype", default=None, help="[default: float32 on CPU, bfloat16 on GPU]")
@devices_option(None, help="the sender's, then the receiver's (one: both's; nccl's receiver then takes the next "
                          "GPU) [default: cpu; cuda:0 for cuda_ipc and nccl]")
@click.option("--device", default=None, hidden=True, help="the sender's device: --devices with one")
@click.option("--fragmented", is_flag=True, help="scattered block ids on both sides instead of runs")
@click.option("--layer-groups", default=1, show_default=True, type=COUNT,
              help="send each transfer in this many groups of layers, as layer-wise streaming does")
@click.option("--profile", default=0, show_default=True, type=Integers(min=0),
              help="also list this many of the sender's Python functions by their own time (cProfile)")
def bench_transfer(transport, model, tokens, repeats, block_size, dtype, devices, device, fragmented, layer_groups,
                   profile):
    """One KV transport between two processes: GB/s and latency, beside its ceilings: raw ZeroMQ and
    memcpy for the CPU transports, a device-to-device copy for the GPU ones."""
    from bench.transfer import run_transfer_bench

    if device is not None and devices is not None:
        raise click.UsageError("give --devices (or the older --device), not both")
    devices = devices if device is None else [device]
    run_transfer_bench(transport, model, tokens, repeats, block_size, dtype, devices, fragmented, layer_groups,
                       profile)


def goodput_options(start_rate: bool = False):
    """The workload, the latency targets and the rate search that goodput is measured (bench scaling)
    or predicted (plan) with; the command receives `workload`, `slo` and `sweep`."""
    def decorate(f):
        @functools.wraps(f)
        def wrapper(*args, ttft_slo_ms, itl_slo_ms, attainment, duration, min_requests, max_requests, refine, seed,
                    start_rate=None, **kwargs):
            from bench.goodput import SLO
            from bench.scaling import Sweep

            return f(*args, slo=SLO(ttft_slo_ms, itl_slo_ms, attainment),
                     sweep=Sweep(duration, min_requests, max_requests, start_rate, refine=refine, seed=seed), **kwargs)

        opts = [
            click.option("--workload", default="chat", show_default=True,
                         help="chat, long-context, realistic, or a .jsonl file of {arrival, prompt_tokens, "
                              "output_tokens} rows"),
            click.option("--ttft-slo-ms", default=1000.0, show_default=True, type=FLOAT,
                         help="time to first token target"),
            click.option("--itl-slo-ms", default=100.0, show_default=True, type=FLOAT,
                         help="inter-token latency target: each request's mean time per output token after the first"),
            click.option("--attainment", default=0.9, show_default=True, type=FLOAT,
                         help="fraction of requests that must meet both targets"),
            click.option("--duration", default=15.0, show_default=True, type=FLOAT,
                         help="seconds of arrivals per rate"),
            click.option("--min-requests", default=30, show_default=True, type=int),
            click.option("--max-requests", default=400, show_default=True, type=int,
                         help="per rate, unless a quarter of --duration, 10 TTFT targets or 4 request "
                              "lifetimes of arrivals need more"),
            click.option("--refine", default=4, show_default=True, type=int, help="bisection steps at the knee"),
            click.option("--seed", default=0, show_default=True, type=int),
        ]
        if start_rate:
            opts.append(click.option("--start-rate", default=None, type=FLOAT,
                                     help="req/s [default: from one request on the idle cluster]"))
        for opt in reversed(opts):
            wrapper = opt(wrapper)
        return wrapper
    return decorate


@bench.command("scaling")
@click.option("--model", default="dummy:nanogpt", show_default=True)
@click.option("--devices", default="cpu", show_default=True, help="cpu, or cuda:0,cuda:1,...")
@click.option("--workers", default=None, type=COUNT,
              help="most workers per topology [default: one per device; cpu: 1]; on cpu at most the cores")
@click.option("--topologies", default=None,
              help="comma-separated Nmono / XpYd, XpYd+localN / +queueN as bench serve's [default: Nmono and every "
                   "XpYd with X+Y=N, N=1..workers]")
@goodput_options(start_rate=True)
@click.option("--out-dir", default="pdserve-scaling", show_default=True, type=click.Path(file_okay=False),
              help="scaling.json, the PNG plots and the clusters' logs")
@click.option("--worker-arg", "worker_args", multiple=True, help="extra flag for every worker (repeatable)")
def bench_scaling(model, devices, workers, topologies, workload, slo, sweep, out_dir, worker_args):
    """Goodput per topology (Nmono, every XpYd): SLO attainment swept over request rate, plots."""
    from bench.scaling import run_scaling_bench

    if not out_dir.strip():  # Path("") is the current folder
        raise click.BadParameter(f"{out_dir!r} is empty; allowed: a folder's path", param_hint="'--out-dir'")
    run_scaling_bench(model, devices, workers, topologies.split(",") if topologies else None, workload, slo, sweep,
                      Path(out_dir), list(worker_args))


@click.command()
@click.option("--profile", "profile_path", required=True,
              help="profile JSON: read if it exists, else the workers are profiled now and it is saved there")
@click.option("--reprofile", is_flag=True, help="profile again even if --profile exists")
@click.option("--model", default="dummy:nanogpt", show_default=True, help="to profile")
@click.option("--device", default="cpu", show_default=True, help="to profile on: cpu or cuda:N")
@click.option("--workers", default=2, show_default=True, type=COUNT,
              help="workers this machine runs at most (cpu: each topology splits the cores between them)")
@click.option("--worker-arg", "worker_args", multiple=True, help="extra flag for the profiled workers (repeatable)")
@click.option("--threads", default=None, type=COUNT,
              help="torch threads of the profiled workers [default: cpu: each topology's share of the cores]")
@goodput_options()
@click.option("--plan-devices", default=None, type=Counts("device counts"),
              help="device counts to plan for [default: 1..workers,8,16,64]")
@click.option("--network-gbps", default=25.0, show_default=True, type=POSITIVE, help="GB/s between hosts")
@click.option("--network-latency-ms", default=0.05, show_default=True, type=NON_NEGATIVE,
              help="between hosts")
@click.option("--devices-per-host", default=8, show_default=True, type=COUNT, help="past this machine (GPUs)")
@click.option("--compare", "compare_path", default=None,
              help="a bench scaling JSON: predict each topology it measured, with its workload, SLO and search")
@click.option("--placements", default="",
              help="comma-separated +localN / +queueN (e.g. +local256,+queue2): each xPyD split is also planned with "
                   "decode workers that prefill so (the router's --max-local-prefill-length, --max-prefill-queue)")
def plan(profile_path, reprofile, model, device, workers, worker_args, threads, workload, slo, sweep, plan_devices,
         network_gbps, network_latency_ms, devices_per_host, compare_path, placements):
    """Predict goodput per topology by simulation from a measured worker profile; plan past this machine."""
    import sys

    from bench.plan import Profile, check_replay, check_sizes, load_scaling, parse_placements, run_plan
    from bench.profile import run_profile
    from bench.workloads import get_workload

    # everything checked before a profile takes minutes
    get_workload(workload)
    placements = parse_placements(p for p in placements.split(",") if p)
    given = given_flags(["model", "device", "threads", "workload", "ttft_slo_ms", "itl_slo_ms", "attainment",
                         "duration", "min_requests", "max_requests", "refine", "seed"])
    profile = None if reprofile or not Path(profile_path).exists() else Profile.load(profile_path)
    if profile is not None:  # a saved profile: of what was asked for
        profile.check_reuse(profile_path, given)
    counts = plan_devices or sorted({*range(1, workers + 1), 8, 16, 64})
    compare_with = None
    if compare_path:
        compare_with = load_scaling(compare_path)
        check_replay(compare_path, compare_with, given, profile.model if profile else model)
    check_sizes(counts, max(workers, compare_with["workers"] if compare_with else 0), devices_per_host)
    if profile is None:
        run_profile(model, device, workers, list(worker_args), Path(profile_path), threads=threads)
        profile = Profile.load(profile_path)
    else:
        print(f"[plan] {profile.describe(profile_path)}", file=sys.stderr, flush=True)
    run_plan(profile, workload, slo, sweep, counts, workers, network_gbps, network_latency_ms,
             devices_per_host, compare_with, placements)
