"""Every bench reaches a device as `pdserve launch` does (--devices, assigned in turn): the flags
reach the bench functions, bad ones are refused clearly, and a real run on cpu reports where it ran.
GPU runs are for a machine with one (../shared/GPU.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import bench.transfer as B
from common.cli import main
from common.errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[1]


def invoke(monkeypatch, module: str, function: str, *args) -> dict:
    """Run `pdserve bench ...` in-process with the bench function replaced by a recorder."""
    seen = {}

    def record(*a, **kw):
        seen.update(args=a, **kw)
    monkeypatch.setattr(f"{module}.{function}", record)
    r = CliRunner().invoke(main, ["bench", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return seen


def test_serve_handoff_and_chaos_take_devices_as_launch_does(monkeypatch):
    seen = invoke(monkeypatch, "bench.serve", "run_serve_bench", "serve", "--devices", "cuda:0,cuda:1")
    assert seen["devices"] == ["cuda:0", "cuda:1"]
    seen = invoke(monkeypatch, "bench.handoff", "run_handoff_bench", "handoff", "--devices", "cuda:0")
    assert seen["devices"] == ["cuda:0"]
    seen = invoke(monkeypatch, "bench.chaos", "run_chaos", "chaos", "--devices", "cuda:0", "--model",
                  "dummy:llama-1b", "--dtype", "float32", "--worker-arg=--max-num-seqs=16")
    assert (seen["devices"], seen["dtype"], seen["worker_args"]) == (["cuda:0"], "float32", ["--max-num-seqs=16"])
    for bench, module, function in (("serve", "bench.serve", "run_serve_bench"),
                                    ("handoff", "bench.handoff", "run_handoff_bench"),
                                    ("chaos", "bench.chaos", "run_chaos")):
        assert invoke(monkeypatch, module, function, bench)["devices"] == ["cpu"]  # the default, as launch's


def test_transfer_takes_devices_and_its_older_device_flag(monkeypatch):
    seen = invoke(monkeypatch, "bench.transfer", "run_transfer_bench", "transfer", "--transport", "nccl",
                  "--devices", "cuda:0,cuda:1")
    assert seen["args"][6] == ["cuda:0", "cuda:1"]
    assert invoke(monkeypatch, "bench.transfer", "run_transfer_bench", "transfer", "--device", "cuda:1")["args"][6] == \
        ["cuda:1"]
    assert invoke(monkeypatch, "bench.transfer", "run_transfer_bench", "transfer")["args"][6] is None


def test_transfer_refuses_a_third_device():
    with pytest.raises(InvalidArgument, match="names 3 devices; allowed: the sender's, then optionally the receiver's"):
        B.run_transfer_bench("shm", "dummy:nanogpt", 64, 1, devices=["cpu", "cpu", "cpu"])  # the third was ignored


@pytest.mark.parametrize("bench", ["serve", "chaos", "handoff", "transfer"])
def test_an_empty_device_entry_is_refused_clearly(bench):
    r = CliRunner().invoke(main, ["bench", bench, "--devices", "cpu,,cuda:0"])
    assert r.exit_code == 2
    assert "'cpu,,cuda:0' has an empty entry" in r.output


@pytest.mark.parametrize("command", [["bench", "serve"], ["launch", "--dry-run"]])
def test_a_device_that_is_none_is_refused_before_anything_starts(command):
    """launch --dry-run printed command lines for --devices gpu, and a launch started workers that
    each failed with it in their logs."""
    r = CliRunner().invoke(main, [*command, "--devices", "cpu,gpu"])
    assert r.exit_code == 2 and "router:" not in r.output
    assert "'gpu' is not a device; allowed: cpu, cuda, cuda:N or N, comma-separated" in r.output


def test_a_transport_is_refused_devices_it_cannot_use():
    with pytest.raises(InvalidArgument, match="transport='cuda_ipc' does not work with device='cpu'"):
        B.run_transfer_bench("cuda_ipc", "dummy:nanogpt", 16, 1, devices=["cpu"])
    cpu = B.resolve_device("cpu")
    with pytest.raises(InvalidArgument, match="transport='cuda_ipc' does not work with a receiver on 'cpu'"):
        B.peer_device("cuda_ipc", cpu, ["cpu", "cpu"])
    assert B.peer_device("shm", cpu, ["cpu", "cpu"]) == B.peer_device("zmq", cpu, None) == cpu
    gpu = torch.device("cuda", 0)  # nccl: never both ranks on one GPU, nor on one the machine lacks
    one_gpu = [["cuda:0", "cuda:0"]] if torch.cuda.is_available() else []
    for devices in one_gpu + ([None] if torch.cuda.device_count() < 2 else []):  # None: the next GPU, missing
        with pytest.raises(InvalidArgument, match="transport='nccl' needs its receiver on a second GPU"):
            B.peer_device("nccl", gpu, devices)


def test_transfer_on_cpu_devices_keeps_its_cpu_ceilings():
    """shm, one-sided: also when its copies were done, before its header went (the "in place" row)."""
    r = subprocess.run([sys.executable, "-m", "common.cli", "bench", "transfer", "--transport", "shm", "--model",
                        "dummy:nanogpt", "--tokens", "64", "--repeats", "2", "--devices", "cpu,cpu"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    *table, last = r.stdout.strip().splitlines()
    result = json.loads(last)
    assert (result["device"], result["peer_device"]) == ("cpu", "cpu")
    assert result["vs_memcpy"] > 0 and result["vs_raw_zmq"] > 0 and "vs_d2d" not in result
    assert 0 < result["in_place_p50_ms"] <= result["p50_ms"] and "in_place_over_d2d_ms" not in result
    assert any("shm cpu -> cpu" in line for line in table) and any("shm, in place" in line for line in table)
