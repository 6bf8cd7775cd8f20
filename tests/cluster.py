"""Real clusters for tests: router and workers as separate OS processes on loopback, free ports,
logs in a temporary directory, and every child stopped (then killed) however the test ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import zmq
import zmq.asyncio

from bench.hostload import children
from common import protocol as P
from common.channel import Channel
from common.model_spec import model_config
from router.client import Client
from router.launcher import Cluster, free_port
from router.server import Router, RouterConfig


@contextlib.contextmanager
def cluster(tmp_path, model="dummy:nanogpt", prefill=1, decode=1, mono=0, worker_args=(), router_args=(),
            restart=False, http=False, api_key=None, devices=("cpu",), api_servers=1):
    """http: the router also serves its HTTP API, at c.http_url (a free port); api_servers > 1 from
    that many API server processes (router_children lists them)."""
    c = Cluster(model, prefill, decode, mono, list(devices), "127.0.0.1", 0, 0, tmp_path / "logs", "least_loaded",
                list(worker_args), threads=1, restart=restart, router_args=list(router_args),
                http_port=0 if http else None, api_key=api_key, api_server_count=api_servers)
    api_server_pids = []
    try:
        c.start()
        api_server_pids = router_children(c)
        yield c
    finally:
        c.stop()
        for child in c.children:
            assert child.proc.poll() is not None, f"{child.name} still running"
        assert not c.killed, f"{c.killed} did not stop on SIGTERM"
        for pid in api_server_pids:  # the router's own children stop with it
            assert not running(pid), f"API server {pid} still running"


def http_request(url: str, method: str = "GET", body=None, key: str | None = None, raw: bytes | None = None,
                 headers: dict | None = None) -> tuple[int, dict, object]:
    """(status, headers, parsed JSON or text) of one plain HTTP request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, headers, text = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, headers, text = e.code, dict(e.headers), e.read().decode()
    try:
        return status, headers, json.loads(text)
    except ValueError:
        return status, headers, text


def running(pid: int) -> bool:
    """Whether process pid exists and is not a zombie."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def router_children(c: Cluster) -> list[int]:
    """The pids of the router's child processes (its API servers)."""
    return children(c.router.proc.pid)


@contextlib.asynccontextmanager
async def serving_router(**config):
    """A Router serving in this event loop on free ports, and connect(address, identity=None) for
    the test's DEALER sockets: they are closed and the router stopped however the test ends."""
    async with stoppable_router(**config) as (router, connect, _):
        yield router, connect


@contextlib.asynccontextmanager
async def stoppable_router(**config):
    """serving_router's, and stop(now=False): the router is told to stop, as by a signal (now: as
    by a second one), and stop() returns once it has; the test's sockets stay open."""
    router = Router(RouterConfig(port=free_port(), worker_port=free_port(), **config))
    stopped, stopped_now = asyncio.Event(), asyncio.Event()
    serving = asyncio.ensure_future(router.serve(stopped, stop_now=stopped_now))
    ctx = zmq.asyncio.Context()
    chans: list[Channel] = []

    def connect(address: str, identity: bytes | None = None) -> Channel:
        chans.append(Channel.connect(ctx, zmq.DEALER, address, identity=identity))
        return chans[-1]

    async def stop(now: bool = False):
        stopped.set()
        if now:
            stopped_now.set()
        await serving
    try:
        yield router, connect, stop
    finally:
        for chan in chans:
            chan.close()
        ctx.term()
        await stop(now=True)


async def scripted_worker(router: Router, connect, name: str, role: str = "mono", device: str = "cpu",
                          kv_dtype: str = "float32", batch_invariant: bool | None = None,
                          max_model_len: int = 0) -> Channel:
    """A socket registered with the router as worker `name` (incarnation 1), its Registered read:
    the test speaks the worker protocol on it."""
    chan = connect(router.backend.address, f"{name}/1".encode())
    await chan.send(P.Register(role, name, "1", device, 64, 16, "tcp://127.0.0.1:1",
                               model_config(router.cfg.model).fingerprint, [], kv_dtype, batch_invariant,
                               max_model_len=max_model_len))
    assert isinstance((await chan.arecv()).msg, P.Registered)
    return chan


def wait_blocks_free(client: Client, timeout: float = 10.0) -> list[dict]:
    """Workers' status once every worker reports all its KV blocks free (or the last seen)."""
    deadline = time.monotonic() + timeout
    while True:
        workers = client.status().workers
        if all(w["free_blocks"] == w["total_blocks"] for w in workers) or time.monotonic() > deadline:
            return workers
        time.sleep(0.1)


def tokens_of(msg) -> list[P.WorkerTokens]:
    """The WorkerTokens a worker's message carries (a decode worker sends a step's in a batch)."""
    if isinstance(msg, P.WorkerTokens):
        return [msg]
    return P.unbatch_tokens(msg) if isinstance(msg, P.WorkerTokenBatch) else []


# A worker process whose steps sleep `delay` s before they run, as long CPU prefill steps take: the
# first step that admits a request only (first_only), or every step with work.
SLOWED_STEPS = """
import sys, time
import common.engine as engine
step, slowed = engine.Engine.step, []
def slow_step(self, *args, **kwargs):
    if self.scheduler.waiting if {first_only} else self.scheduler.has_unfinished():
        if not ({first_only} and slowed):
            slowed.append(True)
            time.sleep({delay})
    return step(self, *args, **kwargs)
engine.Engine.step = slow_step
from common.cli import run
sys.argv[0] = "pdserve"
run()
"""


@contextlib.contextmanager
def hand_made_cluster(tmp_path: Path, router_args: list[str], workers: list[tuple[str, list[str], str | None]]):
    """A router and workers as processes, each (role, flags, SLOWED_STEPS code or None), logs in
    tmp_path/<role>-<i>.log; yields (client, [log paths]) once every worker is alive, and stops
    (then kills) every process however the test ends."""
    port, worker_port = free_port(), free_port()
    procs, logs = [], []

    def start(name: str, argv: list[str]):
        logs.append(tmp_path / f"{name}.log")
        with open(logs[-1], "wb") as log:
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
    try:
        start("router", [sys.executable, "-m", "common.cli", "router", "--port", str(port), "--worker-port",
                         str(worker_port), *router_args])
        for i, (role, flags, code) in enumerate(workers):
            head = [sys.executable, "-c", code] if code else [sys.executable, "-m", "common.cli"]
            start(f"{role}-{i}", head + [role, "--router", f"tcp://127.0.0.1:{worker_port}", "--threads", "1", *flags])
        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
            deadline = time.monotonic() + 60
            while sum(w["alive"] for w in client.status().workers) < len(workers):
                exited = [log for proc, log in zip(procs, logs) if proc.poll() is not None]
                assert time.monotonic() < deadline and not exited, \
                    "\n".join(log.read_text()[-1000:] for log in exited or logs)
                time.sleep(0.1)
            yield client, logs[1:]
    finally:
        for proc in reversed(procs):
            stop(proc)


def stop(proc: subprocess.Popen):
    """A test's child process stopped and reaped: SIGTERM, then SIGKILL if it has not exited 20 s
    later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
