"""Bad input to the benches and to deploy/launch.sh gets a clear error that names the flag, the
value and what is allowed (exit 2), never a traceback nor bash's own: a bench whose router is
not there says UNAVAILABLE before it measures, a run whose requests all failed still prints its
table, counts of 0 are refused when parsed, and a transfer larger than the memory says so first."""

import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import bench.transfer as B
import router.connection
import router.client
from bench.report import print_table
from bench.serve import compare_frontends, run_serve_bench
from common import protocol as P
from common.cli import main, run
from common.errors import InvalidArgument
from router.launcher import free_port
from tests.checkpoints import write_config_only
from tests.test_launch import CHECKOUT_ENV, processes_mentioning

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_SH = ["bash", str(ROOT / "deploy" / "launch.sh")]
pytestmark = pytest.mark.timeout(60)


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """`pdserve ARGS` in this process, as the console script runs it: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["pdserve", *args])
    with pytest.raises(SystemExit) as e:
        run()
    out, err = capsys.readouterr()
    return e.value.code, out, err


# ----------------------------------------------------------------------------- bench serve

def test_serve_to_no_router_says_unavailable_before_it_measures(monkeypatch, capsys):
    monkeypatch.setattr(router.connection, "CONNECT_TIMEOUT_S", 0.5)
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    code, out, err = run_cli(monkeypatch, capsys, "bench", "serve", "--scenarios", "smoke_test", "--router", address)
    assert code == 2, err
    assert f"error [UNAVAILABLE]: no router answers at {address}" in err, err
    assert "Traceback" not in err and time.monotonic() - started < 10
    assert out == ""  # no table: nothing was measured


@pytest.mark.parametrize("external", [["--router", "tcp://127.0.0.1:1"], ["--base-url", "http://127.0.0.1:1"]])
def test_serve_of_a_running_server_refuses_the_flags_of_a_launch_by_name(monkeypatch, capsys, external):
    """They would be ignored: the server is measured as it runs."""
    code, out, err = run_cli(monkeypatch, capsys, "bench", "serve", *external, "--topologies", "2p2d",
                             "--worker-arg=--dtype=float32", "--devices", "cuda:0", "--kv-events", "off",
                             "--frontends", "http")
    assert code == 2 and out == "", err
    assert (f"--topologies, --frontends, --kv-events, --worker-arg, --devices: for the clusters bench serve "
            f"launches; with {external[0]} it measures the server as it runs, so leave them out") in err, err


def test_a_run_whose_requests_all_failed_prints_its_table(monkeypatch, capsys):
    """The requests fail (no router, found out only once they are sent): each row counts them
    failed and shows "-" for what it could not measure, and the router's overhead line, which
    has no figure to take, is left out (it raised TypeError on the None)."""
    monkeypatch.setattr(router.connection, "CONNECT_TIMEOUT_S", 0.3)
    # pass the early check, which also names the router's model (one other than --model: it is said)
    monkeypatch.setattr(router.client.Client, "status", lambda self, timeout=None: P.StatusReply([], 0, 0, model="m2"))
    address = f"tcp://127.0.0.1:{free_port()}"
    result = run_serve_bench("dummy:nanogpt", [], ["smoke_test"], address, 0, [])
    assert (result["model"], result["served_model"]) == ("dummy:nanogpt", "m2")
    row, = result["results"]
    assert (row["requests"], row["failed"], row["output_tokens"], row["router_p50_ms"]) == (4, 4, 0, None)
    assert math.isnan(row["ttft_p50_ms"]) and "router_overhead_ms" not in result
    out = capsys.readouterr().out
    assert f"pdserve bench serve: 'm2' at {address} (prompts from dummy:nanogpt's vocabulary)" in out, out
    table_row = next(line for line in out.splitlines() if line.lstrip().startswith("smoke_test"))
    assert table_row.split()[5:] == ["4", "4", "0.0"] + ["-"] * 10, table_row  # after "external ADDRESS - zmq"
    assert "router overhead" not in out


@pytest.mark.parametrize("value", ["both", "on,on", ""])
def test_serve_refuses_kv_events_it_does_not_know(monkeypatch, capsys, value):
    code, out, err = run_cli(monkeypatch, capsys, "bench", "serve", "--kv-events", value)
    assert code == 2 and f"kv events {value!r} are not supported; allowed: on, off, on,off or off,on" in err, err


def test_frontends_are_compared_over_the_pairs_that_served():
    def row(frontend, ttft, tok_s):
        return {"topology": "mono", "policy": "least_loaded", "scenario": "smoke_test", "frontend": frontend,
                "ttft_p50_ms": ttft, "output_tok_s": tok_s}
    failed = [row("zmq", math.nan, 0.0), row("http", math.nan, 0.0)]
    assert compare_frontends(failed) == []  # was ZeroDivisionError
    served = [row("zmq", 10.0, 100.0), row("http", 12.0, 90.0)]
    out, = compare_frontends(served + failed)
    assert (out["runs"], out["ttft_p50_delta_ms"], out["output_tok_s_ratio"]) == (1, 2.0, 0.9)


def test_a_table_shows_a_missing_value_as_a_dash(capsys):
    print_table("t", ["a", "b", "c", "d"], [[None, math.nan, 1.25, 3]])
    assert capsys.readouterr().out.splitlines()[-2].split() == ["-", "-", "1.2", "3"]


# ----------------------------------------------------------------------------- counts, when parsed

BENCH_FUNCTIONS = {"engine": "bench.engine.run_engine_bench", "step-profile": "bench.step_profile.run_step_profile",
                   "serve": "bench.serve.run_serve_bench", "chaos": "bench.chaos.run_chaos",
                   "handoff": "bench.handoff.run_handoff_bench", "router": "bench.router_capacity.run_router_bench",
                   "transfer": "bench.transfer.run_transfer_bench", "scaling": "bench.scaling.run_scaling_bench",
                   "plan": "bench.plan.run_plan"}
AT_LEAST_1 = "is not in the range x>=1."
REFUSED = [  # (command, flag, value as click repeats it, what the error says of it)
    ("engine", "--num-requests", "0", AT_LEAST_1), ("engine", "--prompt-len", "0", AT_LEAST_1),
    ("engine", "--output-len", "-1", AT_LEAST_1), ("engine", "--steps", "0", AT_LEAST_1),
    ("engine", "--prefill-len", "0", AT_LEAST_1),
    ("engine", "--batch-sizes", "0", "'0' has 0; allowed: batch sizes >= 1, comma-separated"),
    ("engine", "--batch-sizes", "1,16,-4", "'1,16,-4' has -4; allowed: batch sizes >= 1"),
    ("engine", "--batch-sizes", "0,8,-1", "'0,8,-1' has 0, -1; allowed: batch sizes >= 1"),  # each, not the least
    ("engine", "--kv-lens", ",", "',' is not a comma-separated list of KV lengths"),
    ("engine", "--kv-lens", "", "'' has none; allowed: KV lengths >= 1"),
    ("engine", "--kv-lens", "64,x", "'64,x' is not a comma-separated list of KV lengths"),
    ("step-profile", "--batch-sizes", "0", "'0' has 0; allowed: batch sizes >= 1"),
    ("step-profile", "--kv-len", "0", AT_LEAST_1), ("step-profile", "--steps", "0", AT_LEAST_1),
    ("step-profile", "--top", "0", AT_LEAST_1),
    ("serve", "--repeats", "0", AT_LEAST_1), ("serve", "--num-requests", "0", AT_LEAST_1),
    ("chaos", "--prefill", "0", AT_LEAST_1), ("chaos", "--decode", "0", AT_LEAST_1),
    ("chaos", "--requests", "0", AT_LEAST_1), ("chaos", "--kills", "-1", "is not in the range x>=0."),
    ("chaos", "--concurrency", "0", AT_LEAST_1), ("chaos", "--interval", "-1.5", "is not in the range x>=0."),
    ("handoff", "--tokens", "0", AT_LEAST_1), ("handoff", "--requests", "0", AT_LEAST_1),
    ("router", "--concurrency", "16,0", "'16,0' has 0; allowed: request counts >= 1"),
    ("router", "--workers", "0", AT_LEAST_1), ("router", "--step-ms", "0.0", "is not in the range x>0."),
    ("router", "--seconds", "-1.5", "is not in the range x>0."), ("router", "--prompt-len", "0", AT_LEAST_1),
    ("router", "--max-tokens", "1", "is not in the range x>=2."), ("router", "--api-servers", "0", AT_LEAST_1),
    ("transfer", "--tokens", "0", AT_LEAST_1), ("transfer", "--repeats", "0", AT_LEAST_1),
    ("transfer", "--block-size", "0", AT_LEAST_1), ("transfer", "--layer-groups", "0", AT_LEAST_1),
    ("scaling", "--workers", "0", AT_LEAST_1),
    ("plan", "--workers", "0", AT_LEAST_1), ("plan", "--threads", "0", AT_LEAST_1),
    ("plan", "--plan-devices", "1,0", "'1,0' has 0; allowed: device counts >= 1"),
    ("plan", "--plan-devices", "1,,2", "'1,,2' is not a comma-separated list of device counts"),
    ("plan", "--network-gbps", "0.0", "is not in the range x>0."),
    ("plan", "--network-latency-ms", "-1.5", "is not in the range x>=0."),
    ("plan", "--devices-per-host", "0", AT_LEAST_1),
]


def never_reached(monkeypatch):
    """Every bench replaced by a failure: a value let through would otherwise start measuring."""
    def reached(*args, **kwargs):
        raise AssertionError("the bench was reached")
    for target in BENCH_FUNCTIONS.values():
        monkeypatch.setattr(target, reached)
    monkeypatch.setattr("bench.profile.run_profile", reached)


@pytest.mark.parametrize("command,flag,value,says", REFUSED, ids=[f"{c} {f} {v}" for c, f, v, _ in REFUSED])
def test_a_count_out_of_range_is_refused_when_parsed(monkeypatch, command, flag, value, says):
    never_reached(monkeypatch)
    args = [command] if command == "plan" else ["bench", command]
    r = CliRunner().invoke(main, [*args, *(["--profile", "p.json"] if command == "plan" else []), flag, value])
    assert r.exit_code == 2, r.output
    assert re.search(rf"Invalid value for '?{flag}'?: ", r.output), r.output
    assert f"{value} {says}" in r.output if says.startswith("is not") else says in r.output, r.output


def test_plan_refuses_an_unknown_workload_before_it_profiles(monkeypatch, tmp_path):
    """Found by the plan after the profile, it cost minutes of profiling first."""
    never_reached(monkeypatch)
    r = CliRunner().invoke(main, ["plan", "--profile", str(tmp_path / "new.json"), "--workload", "nosuch"])
    assert r.exit_code != 0 and "workload 'nosuch' is unknown; allowed:" in str(r.exception) + r.output, r.output


def test_counts_that_are_allowed_reach_the_bench(monkeypatch):
    def given(*args) -> tuple:
        seen = []
        monkeypatch.setattr(BENCH_FUNCTIONS[args[0]], lambda *a: seen.append(a))
        r = CliRunner().invoke(main, ["bench", *args])
        assert r.exit_code == 0, r.output
        return seen[0]
    assert given("engine", "--batch-sizes", "1, 16", "--kv-lens", "64")[4:6] == ([1, 16], [64])
    assert given("engine")[4:6] == (None, None)  # the device's default grid
    assert given("router", "--concurrency", "4,8")[1] == [4, 8]


def test_a_zero_batch_size_is_a_usage_error_not_a_traceback():
    r = subprocess.run([sys.executable, "-m", "common.cli", "bench", "engine", "--batch-sizes", "0"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "Invalid value for '--batch-sizes': '0' has 0; allowed: batch sizes >= 1" in r.stderr, r.stderr


def test_a_prefill_longer_than_the_models_context_is_refused_before_the_sweep():
    """Found by the prefill that follows the decode sweep, it cost the whole sweep first."""
    from bench.engine import engine_for_bench

    assert engine_for_bench({"model": "dummy:nanogpt"}, 1, 64, 1023).max_model_len == 1024
    for seq_len, prefill_len in ((64, 1024), (1025, 8)):
        with pytest.raises(InvalidArgument, match="is over dummy:nanogpt's context of 1024 tokens"):
            engine_for_bench({"model": "dummy:nanogpt"}, 1, seq_len, prefill_len)


# ----------------------------------------------------------------------------- bench transfer's size

def test_a_transfer_larger_than_the_memory_is_refused_before_it_allocates(monkeypatch):
    """A pool of 64 blocks of 16 tokens (1,024 tokens and a spare block) fits exactly in what is
    available; one block more does not, and the error says how many tokens would."""
    shape, dtype, device, n = B.kv_shape("dummy:llama-1b", 1024, 16, "float32", "cpu", "zmq")
    pool = math.prod(shape) * 4
    monkeypatch.setattr(B, "available_bytes", lambda device: B.POOL_COPIES * pool)
    B.check_memory("dummy:llama-1b", 1024, shape, dtype, {device})
    bigger, *_ = B.kv_shape("dummy:llama-1b", 1025, 16, "float32", "cpu", "zmq")
    with pytest.raises(InvalidArgument) as e:
        B.check_memory("dummy:llama-1b", 1025, bigger, dtype, {device})
    assert e.value.param == "--tokens"
    assert str(e.value).startswith("--tokens 1025: a KV pool of dummy:llama-1b (float32, 66 blocks of 16 tokens) is "
                                   "0.06 GiB"), e.value
    assert str(e.value).endswith("available on this machine; allowed: --tokens <= 1024 (or a smaller --model or "
                                 "--dtype)"), e.value


def sleep_in_try(path: str):
    """A bench child's stand-in: says it started, then sleeps; its finally block writes path."""
    Path(path + ".started").touch()
    try:
        time.sleep(60)
    finally:
        Path(path).write_text("finally ran")


def test_a_transfer_benchs_children_ignore_ctrl_c_and_leave_through_finally_when_stopped(tmp_path):
    """Ctrl-C reaches the whole process group: the children printed KeyboardInterrupt tracebacks
    beside the parent's "Aborted!", and one the parent could not tell to stop (still starting)
    was killed after 10 s, its shared memory left to the resource tracker's warning."""
    path = str(tmp_path / "left")
    proc = B._spawn(sleep_in_try, path)
    try:
        os.kill(proc.pid, signal.SIGINT)  # while it starts: deaf from its first instruction
        deadline = time.monotonic() + 30
        while not os.path.exists(path + ".started") and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)
        proc.join(0.3)
        assert proc.is_alive()
        started = time.monotonic()
        B._stop(proc, grace_s=0.0)
        assert time.monotonic() - started < 4 and proc.exitcode == 1
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert Path(path).read_text() == "finally ran"


def test_ten_million_tokens_is_an_error_that_names_the_flag(monkeypatch, capsys):
    started = time.monotonic()
    code, _, err = run_cli(monkeypatch, capsys, "bench", "transfer", "--transport", "shm", "--tokens", "10000000",
                           "--repeats", "1")
    assert code == 2, err
    assert re.fullmatch(r"error \[INVALID_ARGUMENT\]: --tokens 10000000: a KV pool of dummy:llama-1b \(float32, "
                        r"625001 blocks of 16 tokens\) is 610\.35 GiB, .* more than the [\d.]+ GiB available on this "
                        r"machine; allowed: --tokens <= \d+ \(or a smaller --model or --dtype\)\n", err), err
    assert time.monotonic() - started < 10


# ----------------------------------------------------------------------------- deploy/launch.sh

PORTS = "a port number 1..65535 (pdserve launch picks free ports for 0)"
LAUNCH_REFUSED = [  # (args, the error line)
    (["--prefill", "abc"], "--prefill abc: allowed: an integer >= 0"),
    (["--decode", "-1"], "--decode -1: allowed: an integer >= 0"),
    (["--mono", "1.5"], "--mono 1.5: allowed: an integer >= 0"),
    (["--prefill"], "--prefill needs a value (see --help)"),
    (["--dry-run", "--model"], "--model needs a value (see --help)"),
    (["--threads", "0", "--dry-run"], "--threads 0: allowed: an integer >= 1"),
    (["--api-server-count", "0"], "--api-server-count 0: allowed: an integer >= 1"),
    (["--port", "abc"], f"--port abc: allowed: {PORTS}"),
    (["--http-port", "70000"], f"--http-port 70000: allowed: {PORTS}"),
    (["--port", "65535", "--dry-run"], f"--worker-port 65536: allowed: {PORTS}"),  # the one --port implies
    (["--max-queue", "0"], "--max-queue 0: allowed: an integer >= 1"),
    (["--max-message-bytes", "100"], "--max-message-bytes 100: allowed: an integer >= 4096"),
    (["--heartbeat-timeout", "0.1"], "--heartbeat-timeout 0.1: allowed: a number >= 0.5"),
    (["--queue-timeout", "0"], "--queue-timeout 0: allowed: a number > 0"),
    (["--prefill-timeout", "soon"], "--prefill-timeout soon: allowed: a number > 0"),
    (["--drain-timeout", "-1"], "--drain-timeout -1: allowed: a number >= 0"),
    (["--prefill", ""], "--prefill '': allowed: an integer >= 0"),
    (["--max-local-prefill-length", "-5"], "--max-local-prefill-length -5: allowed: an integer >= 0"),
    (["--prefill", "2", "--decode", "0"],
     "--prefill 2 --decode 0: prefill workers need a decode worker to hand KV to; allowed: --decode >= 1, or "
     "--prefill 0 with --mono (mono workers prefill for themselves)"),
    (["--prefill", "70"], "71 workers; allowed: at most 64 on one host (each is a process with its own model; more "
                          "hosts join with pdserve prefill/decode --router)"),
    (["--prefill", "0", "--enforce-disagg"], "--prefill 0 --decode 1 with --enforce-disagg: no worker may prefill; "
                                             "allowed: --prefill >= 1, or decode workers alone without "
                                             "--enforce-disagg (they prefill)"),
    (["--policy", "bogus", "--dry-run"], "Invalid value for '--policy': 'bogus' is not one of 'least_loaded', "
                                         "'round_robin', 'prefix_affine'."),
    (["--dry-run", "--", "--max-num-seqs", "x"], "the worker flags after --: the prefill workers would not start: "
                                                 "Invalid value for '--max-num-seqs': 'x' is not a valid integer."),
    (["--dry-run", "--", "--max-num-seqs", "0"], "the worker flags after --: the prefill workers would not start: "
                                                 "Invalid value for '--max-num-seqs': 0 is not in the range x>=1."),
    (["--dry-run", "--devices", "cuda:0", "--", "--kv-transport", "shm"],  # a GPU this host lacks: its checks still
     "the prefill workers would not start: kv_transport='shm' does not work with device='cuda:0'; allowed there: "
     "['auto', 'zmq', 'gloo', 'cuda_ipc', 'nccl']"),
    (["--dry-run", "--model", "dummy:nope"], "model='dummy:nope': unknown dummy preset; allowed: dummy:nanogpt, "
                                             "dummy:llama-tiny, dummy:qwen3-tiny, dummy:llama-1b"),
    (["--dry-run", "--port", "17460", "--http-port", "17460"],
     "--http-port 17460: allowed: a port of its own, not --port's (--worker-port defaults to --port + 1)"),
    (["--max-model-len", "256"], "unknown option --max-model-len; a worker's or engine's flag goes after --, to "
                                 "every worker (launch.sh --prefill 1 -- --max-model-len ...; see --help)"),
]


@pytest.mark.parametrize("args,says", LAUNCH_REFUSED, ids=[" ".join(a) for a, _ in LAUNCH_REFUSED])
def test_launch_sh_refuses_a_bad_flag_value_by_name(tmp_path, args, says):
    r = subprocess.run([*LAUNCH_SH, "--log-dir", str(tmp_path / "logs"), *args], capture_output=True, text=True,
                       cwd=tmp_path, env=CHECKOUT_ENV, timeout=30)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"launch.sh: {says}\n")
    assert not (tmp_path / "logs").exists()


def test_launch_sh_takes_good_values_as_given():
    r = subprocess.run([*LAUNCH_SH, "--prefill", "2", "--decode", "010", "--threads", "3", "--heartbeat-timeout",
                        "1e3", "--queue-timeout", ".5", "--max-prefill-queue", "2", "--enforce-disagg",
                        "--no-kv-events", "--drain-timeout", "1.5", "--dry-run", "--", "--drain-timeout", "9"],
                       capture_output=True, text=True, cwd=ROOT, env=CHECKOUT_ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].endswith("--heartbeat-timeout 1e3 --queue-timeout .5 --max-prefill-queue 2 --enforce-disagg "
                             "--no-kv-events --drain-timeout 1.5")
    assert len(lines) == 1 + 2 + 10 and all("--threads 3" in line for line in lines[1:])  # 010: ten, not octal 8
    # the router's drain, and each worker's unless one is given to the workers after --, which wins
    assert all(line.endswith("--drain-timeout 1.5 --drain-timeout 9") for line in lines[1:])


def test_launch_sh_does_not_restart_a_process_that_exits_with_a_usage_error(tmp_path):
    """A model that is not there: each process exits 2, as it would again; the launch stops at once
    with the error, as `pdserve launch` does, without restarting anything first."""
    port = free_port()
    checkpoint = write_config_only(tmp_path / "no-weights")  # (a model that does not exist: refused before start)
    proc = subprocess.Popen([*LAUNCH_SH, "--model", str(checkpoint), "--port", str(port), "--log-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=CHECKOUT_ENV,
                            start_new_session=True)
    try:
        started = time.monotonic()
        _, err = proc.communicate(timeout=45)
        assert proc.returncode != 0 and time.monotonic() - started < 30, err
        assert re.search(r"launch.sh: \S+ exited with 2 during start-up", err), err
        assert "no-weights: no model.safetensors" in err, err
        assert "restarting" not in err + "".join(p.read_text() for p in tmp_path.glob("*.log")), err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    def left():  # the script's forks, the router, the workers
        return [p for text in (str(tmp_path), f"--port {port}", f":{port + 1}") for p in processes_mentioning(text)]
    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == []


def test_a_bench_json_line_is_strict_json_with_nan_as_null(capsys):
    """A run whose requests all failed has no percentiles: null, not NaN (which JSON has not)."""
    from bench.report import pct, print_json

    print_json({"ttft_p50": pct([], 50), "rows": [{"itl": float("inf"), "ok": 1.5}], "n": 0})
    line = capsys.readouterr().out.strip()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in {line}")) == \
        {"ttft_p50": None, "rows": [{"itl": None, "ok": 1.5}], "n": 0}


def test_a_failed_bench_keeps_the_cluster_logs_its_error_points_to(capsys):
    from bench.report import cluster_logs

    with cluster_logs() as ok:
        pathlib.Path(ok, "router.log").write_text("fine")
    assert not pathlib.Path(ok).exists()
    with pytest.raises(KeyboardInterrupt), cluster_logs() as stopped:
        raise KeyboardInterrupt
    assert not pathlib.Path(stopped).exists()
    told = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as left, cluster_logs() as terminated:
        os.kill(os.getpid(), signal.SIGTERM)  # left through the bench's finally blocks: not killed outright
        time.sleep(30)
    assert left.value.code == 128 + signal.SIGTERM and not pathlib.Path(terminated).exists()
    assert signal.getsignal(signal.SIGTERM) == told
    with pytest.raises(RuntimeError), cluster_logs() as failed:
        pathlib.Path(failed, "prefill-0.log").write_text("the cause")
        raise RuntimeError(f"see {failed}/prefill-0.log")
    assert pathlib.Path(failed, "prefill-0.log").read_text() == "the cause"
    assert f"logs are kept in {failed}" in capsys.readouterr().err
    shutil.rmtree(failed)
