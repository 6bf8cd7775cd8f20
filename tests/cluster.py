"""Real clusters for tests: router and workers as separate OS processes on loopback, free ports,
logs in a temporary directory, and every child stopped (then killed) however the test ends."""

from __future__ import annotations

import contextlib
import time

from common import protocol as P
from router.client import Client
from router.launcher import Cluster


@contextlib.contextmanager
def cluster(tmp_path, model="dummy:nanogpt", prefill=1, decode=1, mono=0, worker_args=(), router_args=(),
            restart=False, http=False, api_key=None, devices=("cpu",)):
    """http: the router also serves its HTTP API, at c.http_url (a free port)."""
    c = Cluster(model, prefill, decode, mono, list(devices), "127.0.0.1", 0, 0, tmp_path / "logs", "least_loaded",
                list(worker_args), threads=1, restart=restart, router_args=list(router_args),
                http_port=0 if http else None, api_key=api_key)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        for child in c.children:
            assert child.proc.poll() is not None, f"{child.name} still running"


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
