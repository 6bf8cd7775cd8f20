"""Real clusters for tests: router and workers as separate OS processes on loopback, free ports,
logs in a temporary directory, and every child stopped (then killed) however the test ends."""

from __future__ import annotations

import asyncio
import contextlib
import time

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
    router = Router(RouterConfig(port=free_port(), worker_port=free_port(), **config))
    stop = asyncio.Event()
    serving = asyncio.ensure_future(router.serve(stop))
    ctx = zmq.asyncio.Context()
    chans: list[Channel] = []

    def connect(address: str, identity: bytes | None = None) -> Channel:
        chans.append(Channel.connect(ctx, zmq.DEALER, address, identity=identity))
        return chans[-1]
    try:
        yield router, connect
    finally:
        for chan in chans:
            chan.close()
        ctx.term()
        stop.set()
        await serving


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
