"""API server processes: the HTTP front (router/http.py) in processes of its own beside the router,
for when one router process cannot carry both its requests' state and their HTTP
(`--api-server-count N`, vLLM's name for the same).

    HTTP clients --> API server 0..N-1 --ZeroMQ, the SDK's protocol--> router --> workers
                     (one listening socket, shared)

Served in the router process, HTTP costs the router about three times the CPU per streamed token
that a ZeroMQ client does (JSON per chunk, a socket write per stream and step), and one router
process carried about 30,000 HTTP tokens a second on the 2-core machine (bench router): less than
one GPU decode worker makes at batch 64. An API server parses and checks its requests and
tokenizes their prompts itself (router/prompts.py), sends each to the router as a Generate of
token ids whose tokens come back one TokenBatch per worker step, and writes OpenAI's chunks. The
router keeps what only it can know: request state, recovery and stop strings, the metrics (an API
server asks for them: MetricsRequest; it reports the requests it refused: Rejected) and the
workers' health (StatusRequest).

The router binds the listening socket once and its API servers inherit it (gunicorn's model): the
port can be 0, and the kernel hands each connection to whichever server accepts first. They die
with the router (PR_SET_PDEATHSIG), and the router restarts one that dies (after 1 s, doubling to
8 s while it keeps dying); the connections it held are lost with it, and the router cancels their
requests at once, streamed or not (it knows each server's ZeroMQ identity). When the router stops,
each API server ends its requests with UNAVAILABLE before it goes. The router alone stops them:
by a Shutdown sent after its last replies, which the server so reads first (its word on what it
did not finish), else by STOP_SIGNAL, which is also what its death sends them. They ignore SIGTERM
and SIGINT, which a process group's or a systemd unit's stop sends every process, so that they
serve on while the router drains (router/drain.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

import zmq
import zmq.asyncio

from common import protocol as P
from common.channel import Channel
from common.errors import PdserveError
from common.sampling_params import SamplingParams
from router.connection import LOST, Connection, replies
from router.launcher import HEALTHY_S, die_with_parent, ended, restart_delay
from router.openai_api import ApiError, OutputParsers
from router.prompts import Prompts

log = logging.getLogger("pdserve.api_server")
ASK_TIMEOUT_S = 5.0  # for the router's status or metrics
FOLLOW_CONTEXT_S = 1.0  # how often an API server asks the context the router admits
TRUSTED_REPLY_BYTES = 2**30
READY_TIMEOUT_S = 120.0  # for an API server to load its tokenizer and serve
FIRST_RESTART_S = 1.0  # after an API server dies: the first wait (router/launcher.py restart_delay doubles it)
STOP_SIGNAL = signal.SIGUSR1  # how the router stops an API server (it ignores SIGTERM and SIGINT)


class RouterLink:
    """HttpFront's backend in an API server: the router over ZeroMQ, as router/http.py's
    LocalBackend is the router in-process."""

    def __init__(self, address: str, model: str, max_queue: int, identity: bytes | None = None,
                 max_model_len: int | None = None, sampling_defaults: dict | None = None):
        self.prompts = Prompts(model, max_model_len, sampling_defaults)
        self.max_queue = max_queue
        self.ctx = zmq.asyncio.Context()
        # Its own router's replies are trusted, and as large as in-process replies may be (a Done
        # with every logprob): no cap but a sanity one.
        self.chan = Channel.connect(self.ctx, zmq.DEALER, address, identity=identity, max_frame_bytes=-1,
                                    max_header_bytes=TRUSTED_REPLY_BYTES, monitor=Connection.EVENTS)
        self._routes: dict[str, Callable[[object], None]] = {}  # request id -> its reply_to, until Done or Error
        self._asked: dict[str, asyncio.Future] = {}  # a status or metrics call's ask_id -> its caller's reply
        self._ask_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self.connection = Connection(self.chan)
        self.closed = False
        self.told_to_stop = asyncio.Event()  # the router's Shutdown: after every reply it sent before it

    def start(self):
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self.connection.watch(self._lost)),
                       asyncio.ensure_future(self._follow_context())]

    async def _follow_context(self):
        """Admit what the router admits: it lowers its context to the least its workers serve
        (router/worker_messages.py's _fit_context), and an API server checks max_tokens against it
        and shows it in /v1/models. Within FOLLOW_CONTEXT_S of a change; a longer prompt meanwhile is still refused
        by the router, and a max_tokens past it ends the output there."""
        while not self.closed:  # (a cancel that meets the reply in asyncio.wait_for is lost, before Python 3.12)
            try:
                reply = await self._ask(P.StatusRequest)
            except ApiError:  # the router is busy or away: keep the last context
                pass
            else:
                if reply.context and reply.context != self.prompts.context:
                    log.info("the router admits a context of %d tokens (was %d)", reply.context, self.prompts.context)
                    self.prompts.context = reply.context
            await asyncio.sleep(FOLLOW_CONTEXT_S)

    async def close(self):
        self.closed = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.connection.close()
        self.chan.close()
        self.ctx.term()

    def _lost(self):
        """The connection to the router dropped with every reply in flight (the router cancels the
        requests of a client it cannot reach): their HTTP requests fail now, not never."""
        log.warning("lost the connection to the router; failing %d requests", len(self._routes))
        routes, self._routes = self._routes, {}
        for rid, reply_to in routes.items():
            reply_to(P.Error(rid, "UNAVAILABLE", LOST))

    def submit(self, request_id: str, ids: list[int], params: SamplingParams, stream: bool,
               reply_to: Callable[[object], None]) -> bool:
        self._routes[request_id] = reply_to
        self.chan.post(P.Generate(request_id, ids, params.to_dict(), stream, token_batches=True))
        return True  # a refusal comes back as its Error

    def cancel(self, request_id: str):
        if self._routes.pop(request_id, None) is not None:
            self.chan.post(P.Cancel(request_id))

    def rejected(self, code: str):
        self.chan.post(P.Rejected(code))

    async def health(self) -> tuple[int, list[str], bool]:
        reply = await self._ask(P.StatusRequest)
        return reply.serving, list(reply.missing), reply.stopping

    async def metrics(self) -> bytes:
        return (await self._ask(P.MetricsRequest)).text

    async def _ask(self, request: type):
        """A status or metrics call's reply, matched by its ask_id: one that comes after its call
        gave up is dropped, not given to the next call."""
        ask_id = f"ask-{next(self._ask_ids)}"
        future = self._asked[ask_id] = asyncio.get_running_loop().create_future()
        self.chan.post(request(ask_id))
        try:
            return await asyncio.wait_for(future, ASK_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError("UNAVAILABLE", f"the router did not answer a {request.__name__} "
                                          f"within {ASK_TIMEOUT_S:.0f}s") from None
        finally:
            self._asked.pop(ask_id, None)

    async def _read(self):
        while True:
            env = await self.chan.arecv()
            if env.error is not None:
                log.warning("undecodable reply from the router: %s", env.error)
                continue
            msgs, bad = replies(env.msg)
            for e in bad:
                log.warning("undecodable item of a TokenBatch: %s", e)
            for msg in msgs:
                try:
                    self._deliver(msg)
                except Exception:
                    log.exception("could not deliver %s", type(msg).__name__)

    def _deliver(self, msg):
        if isinstance(msg, P.Shutdown):
            self.told_to_stop.set()
            return
        if isinstance(msg, (P.StatusReply, P.MetricsReply)):
            future = self._asked.pop(msg.ask_id, None)
            if future is not None and not future.done():
                future.set_result(msg)
            return
        rid = getattr(msg, "request_id", None)
        final = isinstance(msg, (P.Done, P.Error))
        reply_to = self._routes.pop(rid, None) if final else self._routes.get(rid)
        if reply_to is not None:
            reply_to(msg)
        elif isinstance(msg, P.Error) and rid is None:
            log.warning("the router answered %s: %s", msg.code, msg.message)


async def serve(args):
    from router.http import HttpFront

    link = RouterLink(args.router, args.model, args.max_queue, identity(args.index, os.getpid()), args.max_model_len,
                      json.loads(args.sampling_defaults))
    sock = socket.socket(fileno=args.fd)
    host, port = sock.getsockname()[:2]
    front = HttpFront(link, host, port, os.environ.get("PDSERVE_API_KEY") or None, args.max_body_bytes, sock=sock,
                      allowed_origins=args.allowed_origins, served_model_names=args.served_model_name or (),
                      parsers=OutputParsers(args.tool_call_parser, args.reasoning_parser), access_log=args.log_requests)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(STOP_SIGNAL, stop.set)
    link.start()
    await front.start()
    log.info("API server %d ready: HTTP at %s, router at %s", args.index, front.url, args.router)
    if args.ready_fd is not None:  # the router waits for this before it says it is ready
        os.write(args.ready_fd, b"1")
        os.close(args.ready_fd)
    try:
        await asyncio.wait([asyncio.ensure_future(stop.wait()), asyncio.ensure_future(link.told_to_stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        await front.close()  # its requests end with UNAVAILABLE, and their Cancels go to the router
        await link.close()


def main(argv=None):
    """The entry point of one API server process; the router starts them (ApiServers)."""
    import uvloop

    parser = argparse.ArgumentParser(prog="python -m router.api_server")
    parser.add_argument("--router", required=True, help="the router's client address")
    parser.add_argument("--model", required=True)
    parser.add_argument("--fd", type=int, required=True, help="the listening socket, inherited")
    parser.add_argument("--max-queue", type=int, required=True)
    parser.add_argument("--max-body-bytes", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, default=None, help="the router's served context")
    parser.add_argument("--allowed-origins", default="*", help="web origins allowed to call it (CORS)")
    parser.add_argument("--served-model-name", action="append", help="the model's names in the API (repeated)")
    parser.add_argument("--tool-call-parser", default=None, help="how the model writes tool calls (auto tool choice)")
    parser.add_argument("--reasoning-parser", default=None, help="how the model writes its reasoning")
    parser.add_argument("--log-requests", action="store_true", help="a log line for each HTTP request")
    parser.add_argument("--sampling-defaults", default="{}", help="the router's, resolved: a JSON object")
    parser.add_argument("--log-level", default="INFO", help="the router's")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--parent", type=int, default=None, help="exit if this process is no longer the parent")
    parser.add_argument("--ready-fd", type=int, default=None, help="a pipe to write a byte to once serving")
    args = parser.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):  # the router's to take: it stops us once it has drained
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(STOP_SIGNAL)  # here, not in a preexec_fn: the router forks from a threaded process (libzmq's)
    if args.parent is not None and os.getppid() != args.parent:
        return  # the router died before this process could ask to die with it
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s api_server[{args.index}] %(message)s")
    uvloop.run(serve(args))


def identity(index: int, pid: int) -> bytes:
    """An API server's ZeroMQ identity at the router: the router knows it when the process dies."""
    return f"api-server/{index}/{pid}".encode()


async def _read_byte(fd: int, timeout_s: float) -> bytes | None:
    """A byte from fd (a pipe), b"" at its end, None if neither comes within timeout_s."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future = loop.create_future()
    loop.add_reader(fd, lambda: got.done() or got.set_result(os.read(fd, 1)))
    try:
        return await asyncio.wait_for(got, timeout_s)
    except asyncio.TimeoutError:
        return None
    finally:
        loop.remove_reader(fd)


class ApiServers:
    """The router's API server processes: started on one listening socket, restarted when one dies,
    stopped with the router."""

    def __init__(self, count: int, router_address: str, model: str, host: str, port: int, max_queue: int,
                 max_body_bytes: int, api_key: str | None, max_model_len: int, allowed_origins: str = "*",
                 served_model_names: tuple[str, ...] = (), parsers: OutputParsers = OutputParsers(),
                 on_exit: Callable[[bytes], None] = lambda identity: None, access_log: bool = False,
                 sampling_defaults: dict | None = None):
        """on_exit(identity): an API server died; its requests have nobody to go to (ZmqFront.gone)."""
        self.on_exit = on_exit
        self.sock = socket.create_server((host, port), backlog=4096)
        self.sock.set_inheritable(True)
        self.host, self.port = host, self.sock.getsockname()[1]
        # The router's key, not one the router inherited; not in argv, which ps shows
        self.env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
        if api_key:
            self.env["PDSERVE_API_KEY"] = api_key
        self.argv = [sys.executable, "-m", "router.api_server", "--router", router_address, "--model", model,
                     "--fd", str(self.sock.fileno()), "--max-queue", str(max_queue), "--max-model-len", str(max_model_len),
                     "--max-body-bytes", str(max_body_bytes), "--allowed-origins", allowed_origins,
                     "--parent", str(os.getpid())]
        self.argv += [a for name in served_model_names for a in ("--served-model-name", name)]
        self.argv += parsers.argv() + (["--log-requests"] if access_log else [])
        self.argv += ["--sampling-defaults", json.dumps(sampling_defaults or {})]
        self.argv += ["--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]  # the router's
        self.procs: list[subprocess.Popen | None] = [None] * count
        self.started = [0.0] * count
        self.restarts = [0] * count  # of each server, in a row
        self._watch: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _spawn(self, i: int, ready_fd: int | None = None):
        self.started[i] = time.monotonic()
        argv = self.argv + ["--index", str(i)] + ([] if ready_fd is None else ["--ready-fd", str(ready_fd)])
        fds = (self.sock.fileno(),) + (() if ready_fd is None else (ready_fd,))
        self.procs[i] = subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL, env=self.env)

    async def start(self, timeout_s: float = READY_TIMEOUT_S):
        """Start every API server and wait until each serves: the router is not ready before. One
        that exits first (a module missing on this host, say) fails the router's start, naming it."""
        pipes = [os.pipe() for _ in self.procs]
        try:
            for i, (r, w) in enumerate(pipes):
                self._spawn(i, ready_fd=w)
                os.close(w)
            for i, (r, _) in enumerate(pipes):
                got = await _read_byte(r, timeout_s)
                if got == b"":  # its end of the pipe closed: it exited
                    raise PdserveError(f"API server {i} {ended(self.procs[i].wait(10))} before it served; "
                                       "its error is in the log above")
                if got is None:
                    raise PdserveError(f"API server {i} did not serve within {timeout_s:.0f}s of its start")
        except BaseException:
            await self.close()
            raise
        finally:
            for r, _ in pipes:
                os.close(r)
        self._watch = asyncio.ensure_future(self._supervise())

    async def _supervise(self):
        while True:
            await asyncio.sleep(0.2)
            for i, proc in enumerate(self.procs):
                if proc is None or proc.poll() is None:
                    continue
                if time.monotonic() - self.started[i] > HEALTHY_S:
                    self.restarts[i] = 0
                log.warning("API server %d (pid %d) %s; restarting it in %.0fs", i, proc.pid, ended(proc.returncode),
                            restart_delay(self.restarts[i], FIRST_RESTART_S))
                self.on_exit(identity(i, proc.pid))
                self.procs[i] = None
                self._restart_later(i)

    def _restart_later(self, i: int):
        """Restart server i after its delay, which doubles each time in a row."""
        delay = restart_delay(self.restarts[i], FIRST_RESTART_S)
        self.restarts[i] += 1
        asyncio.get_running_loop().call_later(delay, self._restart, i)

    def _restart(self, i: int):
        if self._watch is None or self._watch.done():
            return  # stopping
        try:
            self._spawn(i)
        except OSError as e:
            log.error("could not restart API server %d: %s; trying again in %.0fs", i, e,
                      restart_delay(self.restarts[i], FIRST_RESTART_S))
            self._restart_later(i)

    def identities(self) -> list[bytes]:
        """The ZeroMQ identities of the servers running now."""
        return [identity(i, p.pid) for i, p in enumerate(self.procs) if p is not None and p.poll() is None]

    async def close(self, told_s: float = 2.0, grace_s: float = 5.0):
        """Stop them: those the router told to (a Shutdown) have told_s to go; the rest are
        signalled, and killed grace_s later."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        live = [p for p in self.procs if p is not None and p.poll() is None]
        deadline = time.monotonic() + told_s
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in live:
            if p.poll() is None:
                p.send_signal(STOP_SIGNAL)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in live:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.sock.close()


if __name__ == "__main__":
    main()
