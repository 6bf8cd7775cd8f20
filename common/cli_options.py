"""The command line's shared options: what builds an EngineConfig, sampling, HTTP and devices, so the
serving commands (common/cli.py) and the benchmarks (bench/cli.py) take them alike."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import click

from common.config import device_type  # torch-free, as what follows
from common.errors import InvalidArgument
from common.generation_config import parse_overrides
from common.protocol import ATTENTION_BACKENDS, KV_TRANSPORTS  # no torch here: the CLI starts light
from common.signals import DRAIN_TIMEOUT_S
from router.placement import check_flags  # torch-free too
from router.registry import POLICIES
from router.reasoning import PARSERS as REASONING_PARSERS
from router.tool_parsers import PARSERS as TOOL_PARSERS


MODEL_HELP = ("dummy:<preset>, a named model (smollm2: `pdserve pull smollm2` first), a GGUF file or a Hugging Face "
              "checkpoint directory")


ENGINE_PARAMS = ("model", "device", "dtype", "block_size", "num_blocks", "kv_cache_gb", "gpu_memory_utilization",
                 "max_num_seqs", "max_num_batched_tokens", "max_model_len", "no_prefix_caching", "attention_backend",
                 "kv_transport", "batch_invariant", "enforce_eager", "async_scheduling",
                 "speculative_config")  # engine_options' own


def engine_options(f=None, *, one_device: bool = True):
    """Options that build an EngineConfig; the command receives them as `engine_kwargs`.
    one_device=False (launch, which places its workers with --devices): --device is left out of
    --help, and the command refuses it by name."""
    if f is None:
        return lambda g: engine_options(g, one_device=one_device)
    opts = [
        click.option("--model", default="dummy:nanogpt", show_default=True, help=MODEL_HELP),
        click.option("--device", default="cpu", show_default=True, help="cpu, cuda:N or N", hidden=not one_device),
        click.option("--dtype", default=None, help="float32, float16, bfloat16 [default: float32 on CPU, bfloat16 on GPU]"),
        click.option("--block-size", default=16, show_default=True, type=BLOCK_SIZE),
        click.option("--num-blocks", default=None, type=COUNT, help="KV pool size [default: from --kv-cache-gb]"),
        click.option("--kv-cache-gb", default=None, type=POSITIVE,
                     help="KV pool size [default: 1 on CPU; on GPU from --gpu-memory-utilization]"),
        click.option("--gpu-memory-utilization", default=None, type=FRACTION,
                     help="fraction of the GPU's total memory this worker may take, weights, activations and KV "
                          "included [default: 0.9; launch splits it between the workers of a device]"),
        click.option("--max-num-seqs", default=64, show_default=True, type=COUNT),
        click.option("--max-num-batched-tokens", default=2048, show_default=True, type=COUNT),
        click.option("--max-model-len", default=None, type=Integers(min=2)),
        click.option("--no-prefix-caching", is_flag=True),
        click.option("--attention-backend", default="auto", show_default=True,
                     type=click.Choice(ATTENTION_BACKENDS),
                     help="auto: the Triton paged kernel on CUDA (if triton is installed), SDPA elsewhere"),
        click.option("--kv-transport", default="auto", show_default=True, type=click.Choice(KV_TRANSPORTS),
                     help="how KV crosses from prefill to decode workers; auto: the fastest both ends support"),
        click.option("--batch-invariant/--no-batch-invariant", default=None,
                     help="kernels whose rounding does not depend on what else is in the batch, so a request's "
                          "tokens and logprobs are the same bits in any batch, chunking and after a migration "
                          "[default: on on CUDA; off on a CPU, where it costs a decode step about 1.6-2.5x and "
                          "a prefill 2x or more]. --no-batch-invariant on CUDA: torch's own, faster matmuls and norms"),
        click.option("--enforce-eager", is_flag=True,
                     help="no CUDA graphs: launch every decode step's kernels from Python (they are captured by "
                          "default on CUDA with the Triton attention)"),
        click.option("--async-scheduling/--no-async-scheduling", default=None,
                     help="schedule and launch each step while the device still runs the one before, whose tokens "
                          "the next step takes on the device: on a GPU the host's work hides behind the device's; "
                          "on a CPU it only delays each token by a step. Same tokens either way [default: on on "
                          "CUDA, off on a CPU]"),
        click.option("--speculative-config", default=None, metavar="JSON",
                     help='speculative decoding by n-gram lookup, as vLLM\'s: {"method": "ngram", '
                          '"num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M}. A decode '
                          "whose last N..M tokens occurred before feeds the K that followed them and keeps those the "
                          "model would have sampled: the same tokens, up to K + 1 a step (with --batch-invariant; "
                          "turns async scheduling off; a prefill worker ignores it)"),
    ]

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, engine_kwargs=engine_kwargs_of(kwargs), **kwargs)

    for opt in reversed(opts):
        wrapper = opt(wrapper)
    return wrapper


def engine_kwargs_of(params: dict) -> dict:
    """engine_options' flags, taken out of a command's params, as EngineConfig's arguments."""
    flags = {name: params.pop(name) for name in ENGINE_PARAMS}
    engine_kwargs = {name: value for name, value in flags.items() if not name.startswith("no_")}
    return dict(engine_kwargs, enable_prefix_caching=not flags["no_prefix_caching"])


class Finite(click.FloatRange):
    """click's FloatRange that refuses nan and inf: nan passes its bounds (every comparison with it
    is false), and a timeout of nan never fires."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            bounds = self._describe_range()
            self.fail(f"{value!r} is not allowed; allowed: a finite number{' ' * bool(bounds)}{bounds}", param, ctx)
        return number

    def _describe_range(self) -> str:
        """Nothing for no bounds: click's own said "x<=None" in every such flag's help."""
        return "" if self.min is None and self.max is None else super()._describe_range()


class Integers(click.IntRange):
    """click's IntRange, whose refusal of a non-integer says "not a valid integer", not "integer range"."""
    name = "integer"


class PowerOfTwo(Integers):
    def __init__(self):
        super().__init__(min=1)

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if number & (number - 1):
            self.fail(f"{number} is not a power of two; allowed: 1, 2, 4, ..., 16, 32, ...", param, ctx)
        return number


FLOAT = Finite()
POSITIVE = Finite(min=0, min_open=True)
NON_NEGATIVE = Finite(min=0)
FRACTION = Finite(min=0, max=1, min_open=True)
COUNT = Integers(min=1)  # of requests, tokens, steps, workers, threads: with 0 there is nothing to run
PORT = Integers(0, 65535)
BLOCK_SIZE = PowerOfTwo()


def default_worker_port(port: int, worker_port: int | None) -> int:
    """Where workers join a router serving clients at `port`: --worker-port, else port + 1, or
    any free port (0) where the client port is any free one."""
    if worker_port is not None:
        return worker_port
    if port == 65535:
        raise click.UsageError("--port 65535 leaves no port + 1 for the workers; give --worker-port")
    return port + 1 if port else 0


METRICS_PREFIXES = ("pdserve", "vllm")
ROUTER_OPTIONS = [  # (flag, default, type, help): the router's limits and placement, on `router` and `launch` alike
    ("--max-queue", 1024, Integers(min=1), "requests held at once; more are OVERLOADED"),
    # workers heartbeat every 0.2 s (common/worker.py): less than 0.5 s of silence is no death
    ("--heartbeat-timeout", 2.0, Finite(min=0.5), "seconds of silence before a worker is dead"),
    ("--max-attempts", 3, Integers(min=1), "dispatches of one request before it fails"),
    ("--prefill-timeout", 60.0, POSITIVE, "seconds from dispatch to first token, unless a worker holds it"),
    ("--decode-stall-timeout", 30.0, POSITIVE, "longest gap between tokens, unless a worker holds the request"),
    ("--queue-timeout", 30.0, POSITIVE, "longest wait for a live worker"),
    ("--max-message-bytes", 4 * 2**20, Integers(min=4096), "also the HTTP body limit"),
    ("--max-local-prefill-length", 0, Integers(min=0),
     "a prompt with at most this many tokens to compute (past what its decode worker's prefix cache likely holds) "
     "is prefilled by its decode worker, with no KV handoff (Dynamo's conditional disaggregation)"),
    ("--max-prefill-queue", 0, Integers(min=0),
     "while every prefill worker holds this many requests not yet decoding, decode workers prefill new ones "
     "themselves, whatever their length (0: never)"),
    ("--enforce-disagg", False, bool, "never prefill on a decode worker; without it, decode workers prefill what no "
                                      "prefill worker can take (none alive), as Dynamo's router does"),
    ("--log-requests", False, bool, "log a line as each request is admitted, refused and finished, and each HTTP "
                                    "request (vLLM's --enable-log-requests); failures are logged without it"),
    ("--drain-timeout", DRAIN_TIMEOUT_S, NON_NEGATIVE,
     "told to stop (SIGTERM, Ctrl-C), seconds it finishes the requests it holds, admitting no new one (vLLM's "
     "--shutdown-timeout; 0: they end at once; a second signal stops it at once); launch gives its workers the same"),
    ("--no-kv-events", False, bool, "prefix_affine: guess what each worker's prefix cache holds from the prompts sent "
                                    "to it, instead of being told by the workers (Dynamo's flag)"),
    ("--generation-config", "auto", str,
     "the sampling (temperature, top_p, top_k, min_p, repetition_penalty) a request that leaves it out takes, as "
     "vLLM's flag: auto, the model's generation_config.json; vllm, none; or a directory holding one"),
    ("--override-generation-config", None, str,
     "sampling fields set over --generation-config's, as a JSON object ('{\"temperature\": 0.5}')"),
    ("--metrics-prefix", "pdserve", click.Choice(METRICS_PREFIXES),
     "/metrics' names: pdserve:num_requests_waiting, or vllm:num_requests_waiting for dashboards, autoscalers "
     "and gateways made for vLLM's"),
]


def policy_option(f):
    return click.option("--policy", default="least_loaded", show_default=True, type=click.Choice(POLICIES),
                        help="how prefill workers are picked (decode workers: least loaded, or in turn with "
                             "round_robin); prefix_affine: by what their prefix caches likely hold, and load")(f)


def table_defaults(table: list[tuple]) -> dict:
    """{name: default} of an option table's (flag, default, type, help) rows; name: the flag in snake_case."""
    return {flag[2:].replace("-", "_"): default for flag, default, *_ in table}


def table_options(f, table: list[tuple]):
    """f with an option table's flags, in the table's order in --help."""
    for flag, default, kind, text in reversed(table):
        if kind is bool:
            f = click.option(flag, is_flag=True, help=text)(f)
        else:
            f = click.option(flag, default=default, show_default=default is not None, type=kind, help=text)(f)
    return f


def router_options(f):
    """The router's limits and placement; the command receives them as `router_kwargs` (flag
    names, snake_case)."""
    names = list(table_defaults(ROUTER_OPTIONS))

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        router_kwargs = {name: kwargs.pop(name) for name in names}
        try:  # before any process starts (launch), not in the router's log
            check_flags(router_kwargs["max_local_prefill_length"], router_kwargs["max_prefill_queue"],
                        router_kwargs["enforce_disagg"])
            parse_overrides(router_kwargs["override_generation_config"])
        except InvalidArgument as e:
            raise click.UsageError(str(e))
        return f(*args, router_kwargs=router_kwargs, **kwargs)

    return table_options(wrapper, ROUTER_OPTIONS)


def router_argv(router_kwargs: dict) -> list[str]:
    """router_kwargs back to the router's flags, those left at their defaults left out."""
    defaults = table_defaults(ROUTER_OPTIONS)
    argv = []
    for name, value in router_kwargs.items():
        if value != defaults[name]:
            flag = f"--{name.replace('_', '-')}"
            argv += [flag] if value is True else [flag, str(value)]
    return argv


def engine_argv(engine_kwargs: dict) -> list[str]:
    """engine_kwargs back to the command-line flags that produce them (for child processes)."""
    argv = []
    for key, value in engine_kwargs.items():
        if key in ("model", "device") or value is None:
            continue
        if key == "enable_prefix_caching":
            argv += [] if value else ["--no-prefix-caching"]
        elif key == "enforce_eager":
            argv += ["--enforce-eager"] if value else []
        elif key in ("batch_invariant", "async_scheduling"):
            flag = key.replace("_", "-")
            argv += [f"--{flag}" if value else f"--no-{flag}"]
        else:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def setup_logging(level: str = "INFO"):
    import logging

    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


class LogitBias(click.ParamType):
    """ID:BIAS,... -> {id: bias}, as OpenAI's logit_bias (SamplingParams checks the values)."""
    name = "ID:BIAS,..."

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        try:
            pairs = [item.split(":") for item in value.replace(" ", "").split(",") if item]
            return {int(token): float(bias) for token, bias in pairs}
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of TOKEN_ID:BIAS (e.g. 42:-100,7:2.5)", param, ctx)


class JsonSpec(click.ParamType):
    """A JSON map given inline, or @FILE holding one (SamplingParams checks what it says)."""
    name = "JSON|@FILE"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        text = value
        if value.startswith("@"):
            try:
                text = Path(value[1:]).read_text()
            except OSError as e:
                self.fail(f"{value!r}: cannot read {value[1:]!r} ({e.strerror})", param, ctx)
        try:
            spec = json.loads(text)
        except ValueError as e:
            self.fail(f"{value!r} is not JSON ({e})", param, ctx)
        if not isinstance(spec, dict):
            self.fail(f"{value!r} is not a JSON map", param, ctx)
        return spec


SAMPLING_OPTIONS = [  # (flag, default, type, help): SamplingParams' fields on the command line
    ("--temperature", 0.0, float, "0 is greedy"),
    ("--top-p", 1.0, float, None),
    ("--top-k", 0, int, "0 disables"),
    ("--min-p", 0.0, float, "0 disables"),
    ("--repetition-penalty", 1.0, float, "> 1 discourages the prompt's and output's tokens; 1 disables"),
    ("--frequency-penalty", 0.0, float, "in [-2, 2]"),
    ("--presence-penalty", 0.0, float, "in [-2, 2]"),
    ("--min-tokens", 0, int, "end-of-sequence and stop ids are barred before this many tokens"),
    ("--logit-bias", None, LogitBias(), "added to those tokens' logits: ID:BIAS,... (e.g. 42:-100,7:2.5)"),
    ("--seed", None, int, None),
    ("--structured-outputs", None, JsonSpec(), 'hold the output to a language, one of: {"json": SCHEMA}, '
     '{"json_object": true}, {"regex": "..."}, {"choice": [...]}, {"grammar": "..."} (Lark or GBNF); inline or @FILE'),
]


def sampling_options(f=None, *, max_tokens: int = 32):
    """Sampling options; the command receives them as `sampling`, SamplingParams' fields (max_tokens
    and temperature always, the others where they differ from their defaults, so that a router's
    client sends only what was asked for)."""
    defaults = table_defaults(SAMPLING_OPTIONS)

    def apply(f):
        @functools.wraps(f)
        def wrapper(*args, max_tokens, ignore_eos, **kwargs):
            given = {name: kwargs.pop(name) for name in defaults}
            sampling = {"max_tokens": max_tokens, "temperature": given["temperature"],
                        **{k: v for k, v in given.items() if v != defaults[k]}}
            if ignore_eos:
                sampling["ignore_eos"] = True
            return f(*args, sampling=sampling, **kwargs)

        wrapper = table_options(click.option("--ignore-eos", is_flag=True)(wrapper), SAMPLING_OPTIONS)
        return click.option("--max-tokens", default=max_tokens, show_default=True, type=int)(wrapper)

    return apply(f) if f is not None else apply


def parse_ints(text: str, flag: str = "--prompt-ids", what: str = "token ids") -> list[int]:
    """A comma-separated list of integers given to flag (an empty text: none); the error names both.
    An empty item ('1,,2') is refused: a typo there would silently drop a value."""
    items = text.replace(" ", "").split(",") if text.strip() else []
    try:
        if "" in items:
            raise ValueError
        return [int(t) for t in items]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of {what}", param_hint=flag)


class Counts(click.ParamType):
    """A comma-separated list of counts (parse_ints), each >= 1; the error names the flag, the
    value and what is allowed."""
    name = "N,N,..."

    def __init__(self, what: str):
        self.what = what

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        counts = parse_ints(value, param.opts[0], self.what)
        bad = [c for c in counts if c < 1]
        if not counts or bad:
            self.fail(f"{value!r} has {', '.join(map(str, bad)) if counts else 'none'}; allowed: {self.what} >= 1, "
                      "comma-separated", param, ctx)
        return counts


HTTP_PARAMS = ("http_port", "api_key", "allowed_origins", "served_model_names", "tool_call_parser", "reasoning_parser",
               "enable_auto_tool_choice", "api_server_count")  # http_options' own


def http_options(f):
    """The HTTP API's options; the command receives them as `http` (their names, snake_case), once
    checked: those that mean nothing without --http-port are refused without it."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        http = {name: kwargs.pop(name) for name in HTTP_PARAMS}
        refuse_http_flags_without_port(http)
        return f(*args, http=http, **kwargs)

    for opt in reversed([
        click.option("--http-port", default=None, type=PORT,
                     help="serve OpenAI's API and /metrics on this port (0: any free port) [default: no HTTP]"),
        click.option("--api-key", default=None, envvar="PDSERVE_API_KEY",
                     help="HTTP /v1/ requires 'Authorization: Bearer KEY' [env: PDSERVE_API_KEY]"),
        click.option("--allowed-origins", default="*", show_default=True,
                     help="the web origins whose pages may call the HTTP API (CORS), comma-separated: "
                          "'*' any (vLLM's default), '' none"),
        click.option("--served-model-name", "served_model_names", multiple=True,
                     help="the model's name in the HTTP API (vLLM's flag), repeatable: requests may name any, and "
                          "responses, /v1/models and metrics show the first [default: --model]"),
        click.option("--tool-call-parser", default=None, type=click.Choice(list(TOOL_PARSERS)),
                     help="how the model writes tool calls (vLLM's flag and names): hermes (Qwen2.5, Qwen3, "
                          "Hermes), llama3_json (Llama 3.1-3.3). Turns on tool_choice \"auto\", OpenAI's default "
                          "with tools: the calls are found in the model's text"),
        click.option("--reasoning-parser", default=None, type=click.Choice(list(REASONING_PARSERS)),
                     help="how the model writes its reasoning (vLLM's flag and names): qwen3 (Qwen3's hybrid models: "
                          "<think>...</think>), deepseek_r1 (DeepSeek-R1, its distills, QwQ, Qwen3 Thinking-2507: "
                          "the template opens <think>). A chat's response shows it as reasoning (and reasoning_content), "
                          "apart from the answer's content"),
        click.option("--enable-auto-tool-choice", is_flag=True,
                     help="vLLM's flag, taken for its command lines: --tool-call-parser, which it needs, is what "
                          "turns tool_choice \"auto\" on"),
        click.option("--api-server-count", default=1, show_default=True, type=COUNT,
                     help="1: HTTP served in the router process; N > 1: by N API server processes sharing "
                          "--http-port, for more HTTP tokens a second than one router process carries"),
    ]):
        wrapper = opt(wrapper)
    return wrapper


def given_flags(names) -> dict[str, object]:
    """The flags of these parameters that the command line gave the current command, as given (a
    pair's --no- side where that one was), in the order of names, with their values."""
    ctx = click.get_current_context()
    options = {p.name: p for p in ctx.command.params}

    def as_given(name: str) -> str:
        o = options[name]
        return o.secondary_opts[0] if o.secondary_opts and ctx.params[name] is False else o.opts[0]

    given = click.core.ParameterSource.COMMANDLINE
    return {as_given(name): ctx.params[name] for name in names if ctx.get_parameter_source(name) is given}


def refuse_http_flags_without_port(http: dict) -> None:
    """The HTTP API's flags without --http-port would be taken and do nothing; so would vLLM's
    --enable-auto-tool-choice without a parser."""
    if http["enable_auto_tool_choice"] and http["tool_call_parser"] is None:
        raise click.UsageError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json): how the "
                               "model writes its calls")
    given = {"--api-key": http["api_key"] is not None, "--api-server-count": http["api_server_count"] > 1,
             "--served-model-name": bool(http["served_model_names"]),
             "--tool-call-parser": http["tool_call_parser"] is not None,
             "--reasoning-parser": http["reasoning_parser"] is not None}
    http_only = [flag for flag, on in given.items() if on]
    if http["http_port"] is None and http_only:
        raise click.UsageError(f"{' and '.join(http_only)} {'is' if len(http_only) == 1 else 'are'} for the HTTP "
                               "API: give --http-port too")


def http_router_argv(http: dict) -> list[str]:
    """The router's flags for what `http` says of the API's answers (the launcher sets the port,
    the key and the API server count itself)."""
    from router.openai_api import OutputParsers

    argv = ["--allowed-origins", http["allowed_origins"]]
    argv += [a for name in http["served_model_names"] for a in ("--served-model-name", name)]
    return argv + OutputParsers(http["tool_call_parser"], http["reasoning_parser"]).argv()


def devices_option(default: str | None = "cpu", help: str = "comma-separated, assigned to workers in turn"):
    """--devices as launch takes it; the command receives the list (None if not given and no default)."""
    def parse(ctx, param, text):
        if text is None:
            return None
        devices = [d.strip() for d in text.split(",")]
        if not all(devices):
            raise click.BadParameter(f"{text!r} has an empty entry; give devices like cpu,cuda:0,cuda:1")
        for d in devices:  # here, not in each worker's log as it fails to start (and not past a --dry-run)
            try:
                device_type(d)
            except InvalidArgument:
                raise click.BadParameter(f"{d!r} is not a device; allowed: cpu, cuda, cuda:N or N, "
                                         "comma-separated") from None
        return devices
    return click.option("--devices", default=default, show_default=default is not None, callback=parse, help=help)


def threads_option(f):
    """--threads for a command that runs the engine in its own process (a worker's goes to its
    WorkerConfig): torch's default of a thread a core is slow beside other busy processes, over 50x
    on a shared 2-core machine. The command does not take it; it is set before the command runs."""
    @functools.wraps(f)
    def command(*args, threads, **kwargs):
        if threads is not None:
            import torch  # here, not at import: the CLI starts light

            torch.set_num_threads(threads)
        return f(*args, **kwargs)
    return click.option("--threads", default=None, type=COUNT,
                        help="torch threads [default: torch's, one a core; 1 where other processes share the "
                             "cores]")(command)


def engine_kwargs_from(worker_args: list[str]) -> dict:
    """The EngineConfig fields that these worker flags set (others ignored), by the CLI's own options."""
    found = {}

    @click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @engine_options
    def parse(engine_kwargs):
        found.update(engine_kwargs)

    parse.main(list(worker_args), standalone_mode=False)
    return found
