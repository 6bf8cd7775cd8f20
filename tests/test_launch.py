"""deploy/launch.sh and `pdserve launch` bring up a cluster that answers, and stop without leaving
a single process behind."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from router.client import Client
from router.launcher import free_port
from tests.checkpoints import write_config_only
from tests.cluster import cluster

ROOT = Path(__file__).resolve().parents[1]
# launch.sh runs `pdserve` if one is installed: make it this checkout's, which a test is about.
CHECKOUT_ENV = dict(os.environ, PDSERVE=f"{sys.executable} -m common.cli")
pytestmark = pytest.mark.timeout(300)


def processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,pgid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()[1:] if text in line and "ps -ww" not in line]


def read_until_ready(proc, timeout=180.0, lines=None) -> str:
    deadline = time.monotonic() + timeout
    lines = [] if lines is None else lines
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("ready: router at "):
            return line.split()[-1]
    raise AssertionError(f"no ready line; output: {''.join(lines)}")


def launch_cmd(how: str, args: list[str]) -> list[str]:
    """deploy/launch.sh or `pdserve launch` with these flags."""
    if how == "launch.sh":
        return ["bash", str(ROOT / "deploy" / "launch.sh"), *args]
    return [sys.executable, "-m", "common.cli", "launch", *args]


def start_launcher(how: str, args: list[str]) -> subprocess.Popen:
    """The launcher in a process group of its own (its children join it), its output on stdout."""
    return subprocess.Popen(launch_cmd(how, args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, start_new_session=True, env=CHECKOUT_ENV)


@pytest.mark.parametrize("how", ["launch.sh", "pdserve launch"])
def test_launch_answers_and_stops_cleanly(tmp_path, how):
    port, http_port = free_port(), free_port()
    args = ["--prefill", "1", "--decode", "1", "--port", str(port), "--log-dir", str(tmp_path / "logs"),
            "--http-port", str(http_port)]
    # a drain that outlasts a loaded machine's stream (below)
    args += ["--", "--drain-timeout", "30"] if how == "launch.sh" else ["--worker-arg=--drain-timeout=30"]
    cmd = launch_cmd(how, args)
    proc = start_launcher(how, args)
    marker = f"--port {port}"
    try:
        lines = []
        address = read_until_ready(proc, lines=lines)
        assert address == f"tcp://127.0.0.1:{port}"
        assert f"HTTP API at http://127.0.0.1:{http_port}\n" in lines
        with Client(address, timeout=60) as client:
            r = client.generate("Hello", max_tokens=5, temperature=0, ignore_eos=True)
        assert len(r.token_ids) == 5
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=30) as health:
            assert json.load(health)["status"] == "ok"
        assert len(processes_mentioning(marker)) >= 1
        assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["decode-0.log", "prefill-0.log", "router.log"]
        # A second launch (or router) on these ports says so and starts nothing: before, its workers
        # joined this router, which answered its readiness check, while its own router crash-looped.
        for again in ([str(tmp_path / "again") if a == str(tmp_path / "logs") else a for a in cmd],
                      [sys.executable, "-m", "common.cli", "router", "--port", str(free_port()), "--worker-port",
                       address.rsplit(":", 1)[1]]):
            second = subprocess.run(again, capture_output=True, text=True, cwd=ROOT, env=CHECKOUT_ENV, timeout=60)
            assert second.returncode == 2, second
            assert f"port {port} on 127.0.0.1 is in use" in second.stderr, second.stderr
            assert "Traceback" not in second.stderr and not (tmp_path / "again").exists()
        # A crashed worker is restarted and rejoins under a new incarnation.
        with Client(address, timeout=60) as client:
            def incarnation():
                return {w["incarnation"] for w in client.status().workers if w["worker_id"] == "prefill-0" and w["alive"]}
            before = incarnation()
            victim = [int(line.split()[0]) for line in processes_mentioning("--worker-id prefill-0")
                      if int(line.split()[1]) == proc.pid]
            assert len(victim) == 1
            os.kill(victim[0], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while not (incarnation() and incarnation() != before):
                assert time.monotonic() < deadline, "prefill-0 was not restarted"
                time.sleep(0.2)
            assert len(client.generate("Hello", max_tokens=3, ignore_eos=True).token_ids) == 3
        assert "restarting in" in (tmp_path / "logs" / "prefill-0.log").read_text()
        # Ctrl-C, as a terminal sends it, to the whole process group: the launcher alone takes it and
        # stops the workers, then the router, so a stream in flight finishes. Before, the workers took
        # it too, then the launcher's SIGTERM as a second signal, and left at once with the router.
        with Client(address, timeout=60) as client:
            stream = client.stream([1], max_tokens=1000, temperature=0, ignore_eos=True)
            got = len(next(stream).token_ids)
            os.killpg(proc.pid, signal.SIGINT)
            got += sum(len(chunk.token_ids) for chunk in stream)
        assert (got, stream.result.finish_reason) == (1000, "length")
        assert proc.wait(timeout=30) == 0 and proc.stdout.read().rstrip().endswith("stopped")
        assert "finishing what it holds" in (tmp_path / "logs" / "decode-0.log").read_text()
        # the prefill worker, idle as it went, left the request it prefilled with the decode worker
        log = (tmp_path / "logs" / "router.log").read_text()
        assert " failed (" not in log, log[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(marker) == []
    workers_left = processes_mentioning(str(tmp_path / "logs")) + [
        p for p in processes_mentioning("common.cli") if f":{port}" in p]
    assert workers_left == []


def http_stream(url: str, body: dict, first: threading.Event, out: list):
    """Stream a completion from url, setting `first` at its first event; out gets its last two."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
                first.set()
    out.extend(events[-2:])


@pytest.mark.parametrize("how", ["launch.sh", "pdserve launch"])
def test_a_process_groups_sigterm_drains_the_cluster_as_ctrl_c_does(tmp_path, how):
    """systemd stops a unit, and `kill -- -PGID` a group, by SIGTERM to every process: the launcher,
    which then signals each child, and each child. A child took the launcher's signal as a second
    one and stopped at once, and the API servers closed at once: every stream was cut. Now an SDK
    stream and an HTTP stream through an API server both finish."""
    port, http_port = free_port(), free_port()
    args = ["--mono", "1", "--port", str(port), "--log-dir", str(tmp_path / "logs"), "--http-port", str(http_port),
            "--api-server-count", "2", "--drain-timeout", "30"]  # a drain that outlasts a loaded machine's streams
    proc = start_launcher(how, args)
    try:
        address = read_until_ready(proc)
        first, http_events = threading.Event(), []
        body = {"model": "dummy:nanogpt", "prompt": [2], "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        reader = threading.Thread(target=http_stream, args=(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                                            first, http_events))
        reader.start()
        with Client(address, timeout=60) as client:
            stream = client.stream([1], max_tokens=1000, temperature=0, ignore_eos=True)
            got = len(next(stream).token_ids)
            assert first.wait(60)
            os.killpg(proc.pid, signal.SIGTERM)
            got += sum(len(chunk.token_ids) for chunk in stream)
        reader.join(120)
        assert (got, stream.result.finish_reason) == (1000, "length")
        assert http_events[-1] == b"[DONE]" and json.loads(http_events[0])["usage"]["completion_tokens"] == 1000
        assert proc.wait(timeout=60) == 0 and proc.stdout.read().rstrip().endswith("stopped")
        logs = {p.name: p.read_text() for p in (tmp_path / "logs").iterdir()}
        assert "the 2 requests it held ended" in logs["router.log"], logs["router.log"][-3000:]
        assert "leaving now (a second signal)" not in logs["mono-0.log"]
        assert "second signal came" not in logs["router.log"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["launch.sh", "pdserve launch"])
def test_killing_the_launcher_outright_takes_its_cluster_down(tmp_path, how):
    """SIGKILL runs no handler: the workers and the router must notice their launcher is gone."""
    port = free_port()
    args = ["--prefill", "1", "--decode", "1", "--port", str(port), "--log-dir", str(tmp_path / "logs")]
    proc = start_launcher(how, args)
    try:
        read_until_ready(proc)

        def group():  # every process the launcher started stays in its process group
            return [p for p in processes_mentioning("") if int(p.split()[1]) == proc.pid]
        assert len(group()) >= 4, group()  # the launcher, the router and two workers at least
        proc.kill()
        proc.wait(10)  # reaped at once, as a shell would
        deadline = time.monotonic() + 30
        while group() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert group() == []
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("how", ["launch.sh", "pdserve launch"])
def test_a_process_that_fails_to_start_fails_the_launch_with_its_error(tmp_path, how):
    """A checkpoint whose config reads but whose weights are missing (what the launcher checks
    first, a model that does not exist, is refused before anything starts): the launch stops at
    once with the error from the process's log (launch.sh used to restart it quietly and poll for
    about 100 minutes), as one error line, not a traceback, and leaves nothing running."""
    port = free_port()
    checkpoint = write_config_only(tmp_path / "no-weights")
    args = ["--model", str(checkpoint), "--port", str(port), "--log-dir", str(tmp_path / "logs")]
    cmd = launch_cmd(how, args)
    started = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=CHECKOUT_ENV, timeout=120)
    assert r.returncode != 0
    assert time.monotonic() - started < 60
    assert "exited with 2 during start-up" in r.stderr and "no-weights: no model.safetensors" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert not processes_mentioning(f"--port {port}")
    # again into the same logs, which keep the first run's lines: the error shown is this run's alone
    (checkpoint / "model.safetensors").write_bytes(b"not safetensors")
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=CHECKOUT_ENV, timeout=120)
    assert r.returncode != 0 and "exited with 2 during start-up" in r.stderr, r.stderr
    assert "no model.safetensors" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    # a model that does not exist: refused before anything starts, not in each worker's log
    cmd[cmd.index(str(checkpoint))] = "dummy:nope"
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=CHECKOUT_ENV, timeout=120)
    assert r.returncode == 2 and "'dummy:nope': unknown dummy preset" in r.stderr, r.stderr
    assert "during start-up" not in r.stderr, r.stderr


def test_free_ports_are_never_the_kernels_to_hand_out():
    """The router binds a port chosen before it starts, beside workers binding theirs to "*": a port
    from the kernel's ephemeral range could be given to one of them in between (CI saw
    'Address already in use'). free_port picks below that range, and never twice."""
    from router.launcher import _ephemeral_range

    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports), (low, sorted(ports))


@pytest.mark.parametrize("after_s", [0, 0.05, 0.15, 0.3])
def test_a_worker_stopped_while_it_starts_exits_cleanly(after_s):
    """A launcher stopping a worker it has just started sends SIGTERM while the worker still
    imports torch: the worker exits 0, not by the signal (-15), nor by an abort (an exception
    raised inside torch's C++), nor serving on (one swallowed inside torch's numpy import)."""
    proc = subprocess.Popen([sys.executable, "-m", "common.cli", "decode", "--router", f"tcp://127.0.0.1:{free_port()}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text():  # in its imports, past the CLI's
            assert proc.poll() is None and time.monotonic() < deadline, "the worker never began importing torch"
            time.sleep(0.01)
        time.sleep(after_s)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_worker_the_router_refuses_exits_with_an_error(tmp_path):
    """A worker of another model is sent away at registration: it says why and exits 1, so that a
    supervisor or script sees it failed (it had exited 0)."""
    with cluster(tmp_path, prefill=0, decode=0, mono=1) as c:
        r = subprocess.run([sys.executable, "-m", "common.cli", "mono", "--router", f"tcp://127.0.0.1:{c.worker_port}",
                            "--model", "dummy:llama-tiny", "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "model mismatch: router serves dummy:nanogpt" in r.stderr, (r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("how", ["launch.sh", "pdserve launch"])
def test_a_worker_that_dies_under_no_restart_is_reported_once(tmp_path, how):
    port = free_port()
    args = ["--mono", "1", "--port", str(port), "--log-dir", str(tmp_path / "logs"), "--no-restart"]
    proc = start_launcher(how, args)
    try:
        read_until_ready(proc)
        (worker,) = [line.split() for line in processes_mentioning("--worker-id mono-0")
                     if line.split()[1] == str(proc.pid)]  # in the launcher's process group
        os.kill(int(worker[0]), signal.SIGKILL)
        lines = [proc.stdout.readline()]
        while "not restarted" not in lines[-1]:
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines)
        # both launchers say it alike (Python's returncode -9, bash's 137), stamped
        assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[launch(er|\.sh)\] mono-0 was killed by SIGKILL; "
                         r"not restarted \(--no-restart\)$", lines[-1]), lines[-1]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    assert output.count("not restarted") == 0, output  # said once, before the stop
    assert "Killed" not in "".join(lines) + output  # launch.sh's own line says it, not bash's job notice too
    assert not processes_mentioning(f"--port {port}")


def test_a_child_that_left_as_told_restarts_without_backoff(tmp_path):
    """A worker that exited 0 (a rolling restart's SIGTERM: it drained and left) comes back at the
    first delay however soon it went; one that crashed soon after its start waits twice as long
    each time (before, a clean exit doubled it too: 0.5, 1, 2, 4, 8 s over a quick rolling restart)."""
    from router.launcher import Child, Cluster

    cluster = Cluster.__new__(Cluster)  # supervise_once alone: its children and restart flag
    cluster.restart, cluster.workers = True, []
    delays = {}
    for code in (0, 3):
        child = Child(f"exits-{code}", [sys.executable, "-c", f"raise SystemExit({code})"], tmp_path / f"{code}.log")
        cluster.router = child
        for _ in range(3):  # three quick exits in a row
            child.start()
            child.proc.wait(30)
            cluster.supervise_once()  # says when it restarts
            child.next_start = 0.0
            child.restarts += 1
        delays[code] = re.findall(r"restarting in ([0-9.]+)s", child.log_path.read_text())
    assert delays == {0: ["0.5", "0.5", "0.5"], 3: ["0.5", "1.0", "2.0"]}, delays
