"""The `pdserve` command line, run as a user runs it: a real subprocess."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from common.engine import Engine
from common.sampling_params import SamplingParams


def pdserve(*args, timeout=120, env=None, input=None):
    exe = shutil.which("pdserve")
    cmd = [exe] if exe else [sys.executable, "-m", "common.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=env, input=input)


def test_generate_json_matches_engine():
    r = pdserve("generate", "--prompt", "Hello", "--prompt-ids", "1,2,3", "--max-tokens", "6",
                "--ignore-eos", "--temperature", "0.7", "--seed", "5", "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", [1, 2, 3]]
    expected = Engine(model="dummy:nanogpt").generate(
        ["Hello", [1, 2, 3]], SamplingParams(temperature=0.7, seed=5, max_tokens=6, ignore_eos=True))
    assert [line["token_ids"] for line in lines] == [e.token_ids for e in expected]
    assert [line["text"] for line in lines] == [e.text for e in expected]


def test_generates_system_message_goes_before_each_chat_message():
    r = pdserve("generate", "--chat", "Hi", "--chat", "Yo", "--system", "Be brief.", "--max-tokens", "2", "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [bytes(line["prompt_token_ids"]) for line in lines] == [
        b"<|system|>\nBe brief.\n<|user|>\n" + m + b"\n<|assistant|>\n" for m in (b"Hi", b"Yo")]
    r = pdserve("generate", "--prompt", "Hi", "--system", "Be brief.")
    assert r.returncode == 2 and "--system starts a chat: give --chat too" in r.stderr, r.stderr


def test_commands_that_run_the_engine_in_their_own_process_take_threads():
    """generate, chat and the engine benches: --threads sets torch's threads in their process (they
    had none, and torch's default of a thread a core ran 50x slower beside busy processes)."""
    import torch
    from click.testing import CliRunner
    from common.cli import main

    before = torch.get_num_threads()
    try:
        r = CliRunner().invoke(main, ["generate", "--prompt-ids", "1,2", "--max-tokens", "1", "--threads", "3"])
        assert r.exit_code == 0, r.output
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    for command in (["chat"], ["bench", "engine"], ["bench", "structured"], ["bench", "speculative"],
                    ["bench", "step-profile"]):
        assert "--threads INTEGER" in CliRunner().invoke(main, command + ["--help"]).output, command


def test_generate_takes_every_logit_adjustment():
    r = pdserve("generate", "--prompt-ids", "1,2,3", "--max-tokens", "8", "--repetition-penalty", "1.3",
                "--frequency-penalty", "0.5", "--presence-penalty", "0.2", "--min-p", "0.05", "--min-tokens", "3",
                "--logit-bias", "7:5, 9:-100", "--json")
    assert r.returncode == 0, r.stderr
    params = SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5,
                            presence_penalty=0.2, min_p=0.05, min_tokens=3, logit_bias={7: 5.0, 9: -100.0})
    (expected,) = Engine(model="dummy:nanogpt").generate([[1, 2, 3]], params)
    assert json.loads(r.stdout)["token_ids"] == expected.token_ids
    unbiased = Engine(model="dummy:nanogpt").generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))
    assert expected.token_ids != unbiased[0].token_ids  # the flags changed something
    r = pdserve("generate", "--prompt-ids", "1", "--logit-bias", "7=5")
    assert r.returncode == 2 and "'7=5' is not a comma-separated list of TOKEN_ID:BIAS" in r.stderr


def test_generate_holds_the_output_to_a_structured_output(tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    (tmp_path / "spec.json").write_text(json.dumps({"json": schema}))
    r = pdserve("generate", "--prompt", "JSON:", "--max-tokens", "30", "--temperature", "0.8", "--seed", "2",
                "--structured-outputs", f"@{tmp_path / 'spec.json'}", "--json")
    assert r.returncode == 0, r.stderr
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=2, structured_outputs={"json": schema})
    (expected,) = Engine(model="dummy:nanogpt").generate(["JSON:"], params)
    line = json.loads(r.stdout)
    assert line["token_ids"] == expected.token_ids and 0 <= json.loads(line["text"])["n"] <= 9
    r = pdserve("generate", "--prompt", "x", "--structured-outputs", '{"choice": ["yes", "no"]}', "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["text"] in ("yes", "no"), r.stderr
    for value, words in [("{not json", "is not JSON"), ("@/no/such/file", "cannot read '/no/such/file'"),
                         ('{"regex": "a("}', "structured_outputs.regex does not compile")]:
        r = pdserve("generate", "--prompt", "x", "--structured-outputs", value)
        assert r.returncode == 2 and words in r.stderr, r.stderr


def test_generate_rejects_bad_values_clearly():
    r = pdserve("generate", "--prompt", "x", "--temperature", "-1")
    assert r.returncode == 2
    assert "INVALID_ARGUMENT" in r.stderr and "temperature=-1.0" in r.stderr
    r = pdserve("generate", "--prompt-ids", "1,x")
    assert r.returncode == 2 and "comma-separated" in r.stderr
    r = pdserve("generate", "--model", "dummy:nope", "--prompt", "x")
    assert r.returncode == 2 and "dummy:nanogpt" in r.stderr
    r = pdserve("chat", "--temperature", "-3", input="hi\n")  # at start, not at each turn
    assert r.returncode == 2 and "temperature=-3.0 is invalid" in r.stderr and ">>>" not in r.stdout


def test_launch_refuses_flags_it_would_silently_ignore():
    """Each names the value and what to do instead; nothing starts."""
    cases = [
        (["--device", "cuda:0"], "--device cuda:0 is a worker's flag; launch places its workers with --devices"),
        (["--api-key", "k"], "--api-key is for the HTTP API: give --http-port too"),
        (["--api-server-count", "2", "--served-model-name", "m"],
         "--api-server-count and --served-model-name are for the HTTP API: give --http-port too"),
        (["--heartbeat-timeout", "0"], "'--heartbeat-timeout': 0.0 is not in the range x>=0.5"),
        (["--heartbeat-timeout", "nan"],
         "'--heartbeat-timeout': 'nan' is not allowed; allowed: a finite number x>=0.5"),
        (["--kv-cache-gb", "inf"], "'--kv-cache-gb': 'inf' is not allowed; allowed: a finite number"),
        (["--prefill", "-1"], "'--prefill': -1 is not in the range x>=0"),
        (["--threads", "0"], "'--threads': 0 is not in the range x>=1"),
        (["--tool-call-parser", "hermes"], "--tool-call-parser is for the HTTP API: give --http-port too"),
        (["--http-port", "0", "--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--http-port", "0", "--tool-call-parser", "mistral"], "'mistral' is not one of 'hermes', 'llama3_json'"),
        (["--speculative-config", '{"method": "x"}'], "speculative_config method='x'; allowed: 'ngram'"),
        (["--max-prefill-queue", "2", "--enforce-disagg"],
         "--max-prefill-queue 2 with --enforce-disagg: the one has decode workers prefill, the other never"),
        (["--decode", "0"], "--prefill 1 --decode 0: prefill workers need a decode worker to hand KV to"),
        (["--prefill", "0", "--enforce-disagg"], "--prefill 0 --decode 1 with --enforce-disagg: no worker may prefill"),
        (["--host", "10.9.9.9", "--port", "0"], "host '10.9.9.9' is not an address of this machine, so --port 0"),
        (["--host", "nosuchhost.invalid", "--port", "0"],
         "host 'nosuchhost.invalid' is not an address of this machine"),
        (["--host", "10.9.9.9", "--worker-port", "0"], "host '10.9.9.9' is not an address of this machine, so "
                                                       "--worker-port 0"),
        (["--port", "65535"], "--port 65535 leaves no port + 1 for the workers; give --worker-port"),
        (["--no-kv-stream"], "--no-kv-stream is a worker's flag, not launch's; give it to every worker as "
                             "--worker-arg=--no-kv-stream"),  # click offered --no-kv-events
        (["--kv-lease", "3"], "give it to every worker as --worker-arg=--kv-lease=VALUE"),
        (["--bogus"], "No such option '--bogus'"),
        # a worker's flag it would not start with: here, not in each worker's log (nor past --dry-run)
        (["--worker-arg=--no-such-flag"], "--worker-arg: the prefill workers would not start: No such option "
                                          "'--no-such-flag'"),
        (["--mono", "1", "--worker-arg=--max-num-seqs=x"], "--worker-arg: the mono workers would not start: Invalid "
                                                           "value for '--max-num-seqs': 'x' is not a valid integer"),
        # values, and the engine they make together, as a worker checks them at start
        (["--max-num-seqs", "0"], "Invalid value for '--max-num-seqs': 0 is not in the range x>=1"),
        (["--worker-arg=--max-num-seqs=0"], "--worker-arg: the prefill workers would not start: Invalid value for "
                                            "'--max-num-seqs': 0 is not in the range x>=1"),
        (["--worker-arg=--block-size=7"], "'--block-size': 7 is not a power of two; allowed: 1, 2, 4"),
        (["--gpu-memory-utilization", "1.5"], "'--gpu-memory-utilization': 1.5 is not in the range 0<x<=1"),
        (["--worker-arg=--max-num-batched-tokens=8"], "the prefill workers would not start: max_num_batched_tokens=8 "
                                                      "must be >= max_num_seqs=64"),
        (["--devices", "cuda:0", "--worker-arg=--kv-transport=shm"],  # a GPU this host lacks: only the device checks
         "the prefill workers would not start: kv_transport='shm' does not work with device='cuda:0'"),
        (["--model", "nope"], "model='nope' is not a dummy preset"),
        (["--port", "17460", "--http-port", "17460"], "--http-port 17460 is also --port"),
    ]
    for args, message in cases:
        r = pdserve("launch", "--dry-run", *args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
    assert "--device " not in pdserve("launch", "--help").stdout  # refused, so not offered either
    # the router alone too (it would start, and the flags do nothing)
    r = pdserve("router", "--port", "1", "--served-model-name", "m", timeout=30)
    assert r.returncode == 2 and "--served-model-name is for the HTTP API: give --http-port too" in r.stderr
    r = pdserve("router", "--host", "nosuchhost.invalid", "--port", "0", timeout=30)  # ZeroMQ: "No such device"
    assert r.returncode == 2 and "host 'nosuchhost.invalid' is not an address of this machine" in r.stderr, r.stderr
    r = pdserve("router", "--port", "65535", timeout=30)
    assert r.returncode == 2 and "--port 65535 leaves no port + 1 for the workers; give --worker-port" in r.stderr
    r = pdserve("launch", "--log-dir", "/proc/pdserve-logs", "--port", "0", timeout=30)  # no folder can be made there
    assert r.returncode == 2 and "--log-dir '/proc/pdserve-logs': No such file or directory; allowed: a folder" in \
        r.stderr, r.stderr
    r = pdserve("generate", "--prompt", "x", "--max-model-len", "5000")  # dummy:nanogpt's context is 1,024
    assert r.returncode == 2 and "--max-model-len 5000; allowed: 2..1024" in r.stderr, r.stderr


def test_a_router_on_any_free_port_takes_any_free_worker_port():
    """--port 0 without --worker-port: both ports free ones (port + 1 would be port 1)."""
    from tests.cluster import stop

    proc = subprocess.Popen([sys.executable, "-m", "common.cli", "router", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # router: clients at tcp://127.0.0.1:P, workers at tcp://127.0.0.1:W
        ports = [int(part.split(":")[-1].split(",")[0]) for part in line.strip().split(" at ")[1:]]
        assert len(ports) == 2 and min(ports) > 1024 and ports[0] != ports[1], line
    finally:
        stop(proc)


def test_bad_addresses_keys_and_backends_are_one_line_errors(tmp_path):
    """Each a line naming the value and what is allowed, exit code 2, no traceback."""
    from router.launcher import free_port

    port = free_port()
    cases = [
        (["router", "--host", "10.255.255.1", "--port", str(port)], "host '10.255.255.1' is not an address of this machine"),
        (["router", "--port", str(port), "--http-port", str(port + 1)], f"--http-port {port + 1} is also --worker-port"),
        (["launch", "--dry-run", "--port", "70000"], "'--port': 70000 is not in the range 0<=x<=65535"),
        (["generate", "--prompt", "x", "--attention-backend", "triton"], "'triton' runs on CUDA devices, not cpu"),
        (["--curve-dir", str(tmp_path / "none"), "status"], "none is not a directory; allowed: one `pdserve keys"),
        (["chat", "--router", "tcp://127.0.0.1:9", "--model", "smollm2"], "--model: the cluster's workers choose"),
        (["generate", "--router", "tcp://127.0.0.1:9", "--prompt", "x", "--no-prefix-caching", "--no-batch-invariant"],
         "--no-prefix-caching, --no-batch-invariant: the cluster's workers choose"),
        (["chat", "--router", "tcp://127.0.0.1:9", "--threads", "2"], "--threads: the cluster's workers choose"),
    ]
    as_users_run_it = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the tests interpret Triton
    for args, message in cases:
        r = pdserve(*args, timeout=60, env=as_users_run_it)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_launch_with_mono_workers_runs_only_them_unless_told_otherwise():
    names = lambda r: [line.split(":")[0] for line in r.stdout.splitlines()]  # noqa: E731
    assert names(pdserve("launch", "--dry-run", "--mono", "2")) == ["router", "mono-0", "mono-1"]
    assert names(pdserve("launch", "--dry-run", "--mono", "1", "--prefill", "1", "--decode", "1")) == \
        ["router", "prefill-0", "decode-0", "mono-0"]
    assert names(pdserve("launch", "--dry-run")) == ["router", "prefill-0", "decode-0"]


def test_launch_gives_its_drain_timeout_to_the_router_and_every_worker():
    """The README's Ctrl-C paragraph names --drain-timeout: launch takes it and hands it on."""
    r = pdserve("launch", "--dry-run", "--prefill", "1", "--decode", "1", "--mono", "1", "--drain-timeout", "1.5")
    lines = r.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["router", "prefill-0", "decode-0", "mono-0"]
    assert "--drain-timeout 1.5" in lines[0] and all("--drain-timeout=1.5" in line for line in lines[1:]), lines


def test_bench_engine_prints_table_and_json():
    """Also --vs-transformers on a dummy preset, which has no file: transformers builds the same
    shapes from its config, and the speeds compare while the tokens (other weights) and load
    times are not compared."""
    r = pdserve("bench", "engine", "--num-requests", "4", "--prompt-len", "8", "--output-len", "4",
                "--batch-sizes", "1,2", "--kv-lens", "8,16", "--steps", "2", "--prefill-len", "32", "--vs-transformers",
                timeout=300)
    assert r.returncode == 0, r.stderr
    *table, last = r.stdout.strip().splitlines()
    assert any("output tok/s" in line for line in table) and any("of floor" in line for line in table)
    result = json.loads(last)
    assert result["output_tok_s"] > 0
    assert list(result["modes"]) == ["torch_ops"]  # on a CPU the mode changes nothing: one run
    run = result["modes"]["torch_ops"]
    assert set(run["decode"]) == {"b1_kv8", "b1_kv16", "b2_kv8", "b2_kv16"}
    for point in run["decode"].values():  # a step reads at least the weights, so it cannot beat the floor
        assert 0 < point["floor_ms"] < point["step_ms"]
        assert point["of_floor"] == pytest.approx(point["floor_ms"] / point["step_ms"], abs=0.002)
    assert result["weight_bytes"] > 0 and result["kv_bytes_per_token"] == 4 * 2 * 4 * 16 * 4  # nanogpt, float32
    assert run["prefill"]["tokens"] == 32 and 0 < run["prefill"]["of_peak"]
    assert all(p["async_step_ms"] > 0 for p in run["decode"].values())
    assert "async scheduling (torch ops)" in r.stdout
    # progress, each point with its figures (a run cut short still says what it measured)
    assert f"[torch_ops 4/4] decode batch 2, KV 16: {run['decode']['b2_kv16']['step_ms']:.3f} ms/step" in r.stderr
    vs = result["vs_transformers"]
    assert vs["load"] is None and vs["transformers_cache"] == "static"
    assert vs["generate"]["b2"]["same_tokens"] == "n/a (its own weights)" and vs["generate"]["b2"]["ratio"] > 0


def test_bench_engines_timed_steps_each_decode_the_whole_batch(monkeypatch):
    """bench engine counts batch x steps tokens, so every timed step must decode every request: the
    first of a batch decode while the rest prefill (here 16 prompts of 200 tokens, 256 tokens a
    step: 15 steps), and with max_tokens counted from when all decode they ended inside the last
    timed steps, which then ran fewer rows (sync, timed last, looked faster than async)."""
    import random

    from bench import engine as bench_engine

    steps = 8
    engine = bench_engine.engine_for_bench({"model": "dummy:nanogpt", "max_num_batched_tokens": 256}, 16,
                                           200 + 2 * steps + 8, 8)
    rows, timing = [], []
    launch = engine.runner.launch
    monkeypatch.setattr(engine.runner, "launch", lambda batch, *a, **k: (rows.append((bool(timing), len(batch))),
                                                                          launch(batch, *a, **k))[1])
    sync = bench_engine._sync
    monkeypatch.setattr(bench_engine, "_sync", lambda device: (timing.append(None) if len(timing) == 0 else
                                                               timing.clear(), sync(device)))
    sync_speed, async_speed = bench_engine.decode_speed(engine, 16, 200, steps, random.Random(0), compare_async=True)
    timed = [n for in_block, n in rows if in_block]
    assert len(timed) == 2 * steps and set(timed) == {16}, timed
    assert sync_speed > 0 and async_speed > 0 and not engine.has_unfinished()


def test_bench_step_profile_splits_a_step_into_device_and_host_and_names_the_kernels():
    """On a CPU: no graphs, so the forward is the eager one of a step's own inputs, timed again;
    the kernel table is torch's ops by their own time and the host's Python functions by theirs;
    a prefill's ops too, with --prefill-len."""
    r = pdserve("bench", "step-profile", "--batch-sizes", "1,3", "--kv-len", "24", "--steps", "4", "--top", "5",
                "--prefill-len", "40", timeout=300)
    assert r.returncode == 0, r.stderr
    *table, last = r.stdout.strip().splitlines()
    result = json.loads(last)
    assert result["bench"] == "step_profile" and list(result["modes"]) == ["torch_ops"]
    points = result["modes"]["torch_ops"]
    assert [p["batch"] for p in points] == [1, 3]
    for p in points:
        assert p["captured_size"] is None and p["sample_ms"] == 0  # eager: no graph, no sampler's
        # (the forward, timed apart, may take longer than a whole step on a busy CPU: host 0, not negative)
        assert p["host_ms"] == pytest.approx(max(0.0, p["step_ms"] - p["forward_ms"]), abs=2e-4)
        assert 0 < p["forward_ms"]  # the same forward, timed apart (how long: a bench's figure, not a test's)
        assert 0 < len(p["kernels"]) <= 5 and p["kernels_per_forward"] >= len(p["kernels"])
        assert any("addmm" in k["kernel"] or "linear" in k["kernel"] or "mm" in k["kernel"] for k in p["kernels"])
        assert sum(k["share"] for k in p["kernels"]) <= 1 + 1e-9
        assert any("prepare" in f["function"] for f in p["host_functions"]) or len(p["host_functions"]) == 5
    assert any("where a step's time goes" in line for line in table)
    assert f"batch 3: step {points[1]['step_ms']:.3f} ms" in r.stderr
    prefill = result["prefill"]["torch_ops"]
    assert prefill["tokens"] == 40 and prefill["ms"] > 0 and prefill["tflop_s"] > 0
    assert 0 < len(prefill["kernels"]) <= 5 and any("mm" in k["kernel"] for k in prefill["kernels"])
    assert any(line.startswith("prefill of one 40-token prompt, torch ops") for line in table)


def test_weight_bytes_of_a_step_count_the_output_projection_once():
    """nanogpt ties its output projection to the embedding: a step reads the table as the
    projection, and not the position embeddings."""
    from bench.engine import weight_bytes_per_step
    from common.engine import Engine

    engine = Engine(model="dummy:nanogpt")
    m = engine.model
    layers = sum(p.numel() for p in m.layers.parameters()) + sum(p.numel() for p in m.norm.parameters())
    assert weight_bytes_per_step(engine) == 4 * (layers + m.embed.weight.numel())



def test_launch_passes_a_workers_own_flags_to_every_worker():
    lines = pdserve("launch", "--dry-run", "--worker-arg=--no-kv-stream").stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.endswith(" --no-kv-stream")] == ["prefill-0", "decode-0"]


def test_kernel_occupancy_reads_each_compiled_variant_and_counts_its_programs_per_sm():
    """What step-profile prints on CUDA: each loaded variant's registers, spills and shared memory,
    and the programs an SM runs (H100: 64K registers, 228 KiB shared, 2,048 threads)."""
    import types

    from bench import kernel_occupancy as ko

    h100 = types.SimpleNamespace(shared_memory_per_multiprocessor=233472, max_threads_per_multi_processor=2048)
    assert ko.programs_per_sm(4, 96, 20512, h100) == 5  # a decode's attention tile: by its registers
    assert ko.programs_per_sm(4, 112, 20512, h100) == 4  # (3,584 a warp, rounded to 256)
    assert ko.programs_per_sm(8, 180, 147456, h100) == 1  # a prefill's matmul tile: by its shared memory
    assert ko.programs_per_sm(1, 16, 0, h100) == ko.MAX_PROGRAMS

    def kernel(regs, spills, warps, shared, **constants):
        return types.SimpleNamespace(n_regs=regs, n_spills=spills, metadata=types.SimpleNamespace(num_warps=warps,
                                     shared=shared), src=types.SimpleNamespace(
            constants={(["A", "BLOCK_M", "IEEE", "N"].index(k),): v for k, v in constants.items()}))
    fn = types.SimpleNamespace(arg_names=["A", "BLOCK_M", "IEEE", "N"], device_caches={
        0: ({"a": kernel(96, 0, 4, 20512, BLOCK_M=16, IEEE=False), "b": kernel(255, 56, 2, 24608, BLOCK_M=64),
             "not loaded": kernel(None, None, 4, 0)}, None, None, None, None)})
    module = types.ModuleType("stand_in_kernels")
    module._split_kernel, module.helper = fn, len
    import sys
    sys.modules["stand_in_kernels"] = module
    try:
        rows = ko.compiled_kernels(h100, modules=("stand_in_kernels",))
    finally:
        del sys.modules["stand_in_kernels"]
    assert rows == [
        {"kernel": "_split_kernel", "variant": "BLOCK_M=16 IEEE=0", "warps": 4, "registers": 96, "spilled_bytes": 0,
         "shared_bytes": 20512, "programs_per_sm": 5},
        {"kernel": "_split_kernel", "variant": "BLOCK_M=64", "warps": 2, "registers": 255, "spilled_bytes": 56,
         "shared_bytes": 24608, "programs_per_sm": 4}]


def test_a_worker_refuses_a_router_host_or_kv_port_it_cannot_use_by_name():
    """Found before the model is built: before, each was a ZeroMQ traceback (and a KV pool left in
    shared memory)."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    cases = [(["decode", "--router", "bogus"], "--router 'bogus' is invalid"),
             (["mono", "--router", "tcp://127.0.0.1:1", "--host", "10.255.255.1"],
              "--host '10.255.255.1' is not an address of this machine"),
             (["decode", "--router", "tcp://127.0.0.1:1", "--kv-port", str(port)],
              f"port {port} on 127.0.0.1 is in use (another pdserve router or worker")]
    try:
        for argv, text in cases:
            r = pdserve(*argv)
            assert r.returncode == 2 and f"error [INVALID_ARGUMENT]: {text}" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr and "leaked" not in r.stderr, r.stderr
    finally:
        taken.close()
