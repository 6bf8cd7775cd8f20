"""A step that outlasts the router's heartbeat timeout is not a dead worker: the worker's pulse
beats for it (common/pulse.py), up to --step-timeout, after which the step counts as hung."""

import contextlib
import signal
import subprocess
import sys
import time

import pytest

from router.client import Client
from router.launcher import free_port

pytestmark = pytest.mark.timeout(120)

HEARTBEAT_TIMEOUT_S = 0.5

# A mono worker whose first prefill step takes `delay` seconds (as a long CPU prefill chunk does).
SLOW_FIRST_PREFILL = """
import sys, time
import common.engine as engine
step, slowed = engine.Engine.step, []
def slow_step(self, *args, **kwargs):
    if self.scheduler.waiting and not slowed:
        slowed.append(True)
        time.sleep({delay})
    return step(self, *args, **kwargs)
engine.Engine.step = slow_step
from common.cli import run
sys.argv[0] = "pdserve"
run()
"""


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def slow_cluster(tmp_path, delay: float, worker_args=()):
    """A router (heartbeat timeout 0.5 s) and one mono worker whose first prefill step sleeps
    `delay` s, as processes; (client, worker's log path)."""
    port, worker_port = free_port(), free_port()
    procs = []
    log_path = tmp_path / "mono.log"
    try:
        with open(tmp_path / "router.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "common.cli", "router", "--port", str(port), "--worker-port", str(worker_port),
                 "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)], stdout=log, stderr=subprocess.STDOUT))
        with open(log_path, "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-c", SLOW_FIRST_PREFILL.format(delay=delay), "mono", "--router",
                 f"tcp://127.0.0.1:{worker_port}", "--threads", "1", *worker_args],
                stdout=log, stderr=subprocess.STDOUT))
        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
            deadline = time.monotonic() + 60
            while not [w for w in client.status().workers if w["alive"]]:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
            yield client, log_path
    finally:
        for proc in reversed(procs):
            _stop(proc)


def incarnation(client: Client) -> str:
    (worker,) = client.status().workers
    return worker["incarnation"]


def test_a_step_longer_than_the_heartbeat_timeout_is_no_death(tmp_path):
    with slow_cluster(tmp_path, delay=4 * HEARTBEAT_TIMEOUT_S) as (client, log_path):
        before = incarnation(client)
        result = client.generate([5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True)
        assert len(result.token_ids) == 4
        assert incarnation(client) == before, "the router counted the worker dead during its long step"
        assert "re-register" not in log_path.read_text()


def test_a_step_past_step_timeout_counts_as_hung_and_its_request_is_recovered(tmp_path):
    with slow_cluster(tmp_path, delay=6 * HEARTBEAT_TIMEOUT_S, worker_args=("--step-timeout", "0.5")) as (
            client, log_path):
        before = incarnation(client)
        result = client.generate([5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True)
        assert len(result.token_ids) == 4  # re-dispatched to the worker once it registered anew
        assert incarnation(client) != before
        log = log_path.read_text()
        assert "one step has run for" in log and "counted hung" in log
