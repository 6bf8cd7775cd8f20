"""The client SDK: talk to a running router over ZeroMQ.

    with Client("tcp://127.0.0.1:7100") as c:
        print(c.generate("Hello", max_tokens=16, temperature=0).text)
        for chunk in c.stream([1, 2, 3], max_tokens=8):
            print(chunk.token_ids, chunk.text)
        results = c.generate_many(["a", "b"], max_tokens=4, seed=1)

    async with AsyncClient(addr) as c:
        result = await c.generate("Hello")
        stream = c.stream("Hello")
        async for chunk in stream: ...
        print(stream.result.text)

A chat goes as `messages=[{"role": "user", "content": "Hi"}]` instead of a prompt; the router
renders it with the model's chat template. Sampling options are SamplingParams' fields
(temperature, top_p, top_k, max_tokens, seed, stop_token_ids, ignore_eos, stop, logprobs, ...):
`stop=["\n\n"]` ends the text at that string (finish_reason "stop"), `logprobs=N` gives each
token's logprob and N alternatives (Chunk.logprobs, Result.logprobs). `add_special_tokens`
(vLLM's) goes with them: False, a text without the tokenizer's BOS; True, a chat with it before
its template's. Failures raise
RequestError carrying the router's code (INVALID_ARGUMENT, OVERLOADED, UNAVAILABLE, TIMEOUT, ...)
and message. Many requests may be in
flight on one client; replies are matched to them by request id. If the connection to the router
drops (the router died or restarted), every request in flight fails at once with UNAVAILABLE
rather than waiting out its timeout; the client reconnects by itself for new requests. A request
its caller stops waiting for (a stream left before its end, a call cancelled or interrupted) is
cancelled on the router, as vLLM's AsyncLLM does, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from common import protocol as P
from common.channel import Channel
from common.errors import InvalidArgument, short_repr
from router.connection import LOST, Connection, RequestError, replies, until

__all__ = ["AsyncClient", "AsyncStream", "Chunk", "Client", "RequestError", "Result", "Stream"]

SEND_RETRY_MS = 50  # a send the socket cannot take yet: how often it looks again, and at the connection
# Requests cancelled whose end came and was never read: the newest this many are kept for a wait();
# older ones are forgotten (submit, then cancel, and no wait, is the usual way to drop one)
CANCELLED_ENDS_KEPT = 1024


@dataclass
class Chunk:
    request_id: str
    index: int  # position of token_ids[0] in the generated output
    token_ids: list[int]
    text: str
    logprobs: list | None = None  # per token: [logprob, top ids, top logprobs] (common/sampling.py)


@dataclass
class Result:
    request_id: str
    token_ids: list[int]
    text: str | None
    finish_reason: str
    prompt_token_ids: list[int] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


def _result(msg: P.Done) -> Result:
    return Result(msg.request_id, msg.token_ids, msg.text, msg.finish_reason, msg.prompt_token_ids, msg.timings,
                  msg.logprobs, msg.prompt_logprobs, msg.stop_reason)


def _chunk(msg: P.Token) -> Chunk:
    return Chunk(msg.request_id, msg.index, msg.token_ids, msg.text, msg.logprobs)


def _request_id(request_id) -> str | None:
    """A caller's request_id: a string, or None for one of ours (the router could not name another
    in its refusal, and the call would wait for its timeout)."""
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidArgument(f"request_id={short_repr(request_id)} is invalid; allowed: a string", param="request_id")
    return request_id


def _generate(request_id: str, prompt, messages, sampling: dict, stream: bool) -> P.Generate:
    if (prompt is None) == (messages is None):
        raise InvalidArgument(f"prompt={short_repr(prompt)} with messages={short_repr(messages)} is invalid; allowed: "
                              "exactly one of prompt (text or token ids) or messages (chat)", param="prompt")
    sampling = dict(sampling)
    special = sampling.pop("add_special_tokens", None)  # the prompt's, not the sampling's
    bias = sampling.get("logit_bias")
    if isinstance(bias, dict):  # the protocol's maps take string keys only: [token, bias] pairs
        sampling["logit_bias"] = [[t, b] for t, b in bias.items()]
    return P.Generate(request_id, "" if prompt is None else prompt, sampling, stream, messages, token_batches=True,
                      add_special_tokens=special)


def _raise(msg: P.Error):
    raise RequestError(msg.code, msg.message, msg.request_id)


def _cancel_nowait(chan: Channel, request_id: str) -> None:
    """Cancel a request on the router if the socket takes the message now: a send must never
    block (with no connection, as after a refused handshake, a DEALER's send waits for good), and
    with no connection there is nothing to cancel. Sync, so that a finalizer can call it."""
    chan.send_nowait(P.Cancel(request_id))


class _Ids:
    def __init__(self):
        self._prefix = uuid.uuid4().hex[:8]
        self._n = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}-{next(self._n)}"


@dataclass
class Deadline:
    at: float | None  # time.monotonic() past which a call gives up; None: never
    seconds: float | None  # the timeout it came from, for the message

    def passed(self) -> bool:
        return self.at is not None and self.at <= time.monotonic()

    def error(self, key: str | None, client: str) -> "RequestError":
        return RequestError("TIMEOUT", f"no reply within {self.seconds:g}s (the call's timeout=, else "
                                       f"{client}(timeout=...))", key)


class _Abandonable:
    """A stream closed (or dropped) before its end cancels its request (the client's _abandon)."""
    client: "_Requests"
    request_id: str | None
    result: "Result | None"
    streamed = 0  # characters of text its chunks carried

    def close(self) -> None:
        if self.request_id is not None:
            self.client._abandon(self.request_id)

    def __del__(self):
        self.close()

    def _take(self, msg) -> Chunk | None:
        """A Token's chunk. At Done: the Result, and a last chunk with the text the router held back
        while it might begin a stop string, where the output then ended another way (None if none)."""
        if isinstance(msg, P.Token):
            self.streamed += len(msg.text)
            return _chunk(msg)
        self.result = _result(msg)
        rest = (self.result.text or "")[self.streamed:]
        return Chunk(self.result.request_id, len(self.result.token_ids), [], rest) if rest else None


class Stream(_Abandonable):
    """Iterator of Chunks for one request; `.result` holds the Result once it is exhausted.
    Closed (or dropped) before its end, it cancels the request. Its timeout is for each chunk, as
    AsyncStream's: a long answer may stream for as long as its tokens keep coming."""

    def __init__(self, client: "Client", request_id: str, timeout: float | None):
        self.client, self.request_id, self.timeout = client, request_id, timeout
        self.result: Result | None = None

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        if self.result is not None:
            raise StopIteration
        chunk = self._take(self.client._next(self.request_id, self.client._deadline(self.timeout)))
        if chunk is None:
            raise StopIteration
        return chunk

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncStream(_Abandonable):
    """Async iterator of Chunks for one request; `.result` holds the Result once it is exhausted
    (as Stream). Closed (aclose, or dropped) before its end, it cancels the request."""

    def __init__(self, client: "AsyncClient", prompt, timeout: float | None, sampling: dict):
        self.client, self.request_id = client, None
        self._submit = (prompt, sampling)
        self.timeout = client.timeout_of(timeout)
        self.result: Result | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        if self.result is not None:
            raise StopAsyncIteration
        if self.request_id is None:
            prompt, sampling = self._submit
            self.request_id = await self.client.submit(prompt, stream=True, **sampling)
        try:
            msg = await self.client._next(self.request_id, self.timeout)
        except asyncio.CancelledError:
            self.close()
            raise
        if (chunk := self._take(msg)) is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        self.close()


def _connect(ctx, address: str) -> Channel:
    """A DEALER to the router, or InvalidArgument for an address ZeroMQ cannot take."""
    try:
        return Channel.connect(ctx, zmq.DEALER, address, monitor=Connection.EVENTS)
    except zmq.ZMQError as e:
        ctx.term()
        raise InvalidArgument(f"router address {address!r} is invalid ({e.strerror}); allowed: tcp://HOST:PORT, "
                              "as the router prints it") from None


class _Requests:
    """What both clients keep of their requests in flight: `_open` (submitted, no Done or Error
    yet), `_unsent` (open, its send waiting for the socket: a connection that drops meanwhile
    does not lose it, since libzmq sends it once connected again) and `_replies` (what came for
    each, not yet read)."""

    closed = False
    pid = 0  # the process that made it: its sockets are not a forked child's
    timeout: float | None = None  # the client's: a call's timeout=None means this one
    _cancelled: set[str]  # open, and cancel() was called for it
    _cancelled_ends: deque  # of those, the ids whose end came, oldest first

    def _init_requests(self, queue: type):
        """queue: what holds one request's replies (a deque, or an AsyncClient's asyncio.Queue)."""
        self._replies = defaultdict(queue)
        self._open: set[str] = set()  # submitted, no Done or Error read yet
        self._unsent: set[str] = set()
        self._cancelled, self._cancelled_ends = set(), deque()
        self._new_id = _Ids()

    def _filed(self, owner: str, msg) -> None:
        """After a reply was filed: a cancelled request's end is kept for a wait() that may come,
        up to CANCELLED_ENDS_KEPT of them; the oldest beyond are forgotten."""
        if owner in self._cancelled and isinstance(msg, (P.Done, P.Error)):
            self._cancelled_ends.append(owner)
            while len(self._cancelled_ends) > CANCELLED_ENDS_KEPT:
                old = self._cancelled_ends.popleft()
                if old in self._cancelled:  # (else read meanwhile, and maybe its id used again)
                    self._forget(old)

    def _forget(self, request_id: str) -> None:
        self._open.discard(request_id)
        self._cancelled.discard(request_id)
        self._replies.pop(request_id, None)

    def _cancelling(self, request_id: str) -> None:
        if request_id in self._open:
            self._cancelled.add(request_id)
        _cancel_nowait(self.chan, request_id)

    def timeout_of(self, timeout: float | None) -> float | None:
        """A call's timeout: its own, else the client's."""
        return self.timeout if timeout is None else timeout

    def _deadline(self, timeout) -> "Deadline":
        timeout = self.timeout_of(timeout)
        return Deadline(None if timeout is None else time.monotonic() + timeout, timeout)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} is closed; make another")
        if self.pid != os.getpid():
            raise RuntimeError(f"this {type(self).__name__} was made in process {self.pid}, before a fork; make one "
                               "in this process")

    def _open_id(self, msg) -> str | None:
        """The id of the open request, or status or metrics call, a reply is for; None if none is
        open: an abandoned request's late tokens and Done would be kept for nobody, for as long as
        the client lives, and a timed-out status call's reply would answer the next call."""
        key = P.reply_id(msg)
        return key if key in self._open else None

    @contextlib.contextmanager
    def _asking(self):
        """Around a status or metrics call: its id, open until the call returns or fails."""
        ask_id = self._new_id()
        self._open.add(ask_id)
        try:
            yield ask_id
        finally:
            self._open.discard(ask_id)
            self._replies.pop(ask_id, None)

    @contextlib.contextmanager
    def _opening(self, request_id: str):
        """Around a request's send: it is open from before it (the first reply may be read while an
        async send is awaited), and not if the send fails. An id already open on this client is
        refused here: the router's refusal, carrying the same id, would end the first request too."""
        if request_id in self._open:
            raise RequestError("INVALID_ARGUMENT", f"request_id={request_id!r} is already in flight on this client",
                               request_id)
        self._open.add(request_id)
        try:
            yield
        except BaseException:
            self._open.discard(request_id)
            raise

    def _check_waitable(self, request_id: str) -> None:
        """A wait for an id that is not this client's (never submitted here, or its result already
        read) would wait its whole timeout, or for good: nothing will come for it."""
        queued = self._replies.get(request_id)  # a deque (Client) or an asyncio.Queue (AsyncClient)
        if request_id not in self._open and not (queued.qsize() if isinstance(queued, asyncio.Queue) else queued):
            raise RequestError("INVALID_ARGUMENT", f"request_id={short_repr(request_id)} is not in flight on this "
                                                   "client; allowed: an id its submit returned, until its result "
                                                   "is read", request_id)

    def _abandon(self, request_id: str) -> None:
        """Its caller stopped waiting for it before its end: cancel it, and drop what came for it."""
        if request_id in self._open:
            self._forget(request_id)
            _cancel_nowait(self.chan, request_id)


class Client(_Requests):
    """A blocking client for one thread at a time (its ZeroMQ socket is not to be shared between
    threads: make a Client per thread, or use AsyncClient for many requests at once)."""

    def __init__(self, address: str, timeout: float | None = 120.0):
        self.address, self.timeout, self.pid = address, timeout, os.getpid()
        self._in_use = threading.Lock()  # held while a call uses the socket (_one_thread)
        self.ctx = zmq.Context()
        self.chan = _connect(self.ctx, address)
        self.connection = Connection(self.chan)
        self._poller = zmq.Poller()
        self._poller.register(self.chan.sock, zmq.POLLIN)
        self._poller.register(self.connection.monitor, zmq.POLLIN)
        self._init_requests(deque)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Close the sockets (again: nothing)."""
        if not self.closed:
            self.closed = True
            self.connection.close()
            self.chan.close()
            self.ctx.term()

    def submit(self, prompt: str | list[int] | None = None, stream: bool = True, request_id: str | None = None,
               messages: list[dict] | None = None, **sampling) -> str:
        """Send a request and return its id at once: read it with wait() (stream=False) or cancel() it."""
        self._check_open()
        request_id = _request_id(request_id) or self._new_id()
        message = _generate(request_id, prompt, messages, sampling, stream)
        with self._one_thread():
            self._take_events()  # a drop seen now loses what was sent before it, not this request
            error = self.connection.unreachable(self.address, 0.0, request_id)  # down that long already: queue nothing
            if error is not None:
                raise error
            with self._opening(request_id):
                self._send(message, request_id)
        return request_id

    def _send(self, message, key: str, deadline: Deadline | None = None) -> None:
        """Send once the socket takes it, or fail UNAVAILABLE as a read would (or TIMEOUT at a
        call's deadline): a DEALER's send waits while it has no connection to queue on, and after
        a handshake the router refused, libzmq stops trying (a blocking send there waited for good)."""
        since, message = time.monotonic(), P.encode(message)  # once, however many tries
        self._unsent.add(key)
        try:
            while not self.chan.send_nowait(message):
                self._take_events()
                error = self.connection.unreachable(self.address, since, key)
                if error is not None:
                    raise error
                if deadline is not None and deadline.passed():
                    raise deadline.error(key, "Client")
                self.chan.sock.poll(SEND_RETRY_MS, zmq.POLLOUT)
        finally:
            self._unsent.discard(key)

    @contextlib.contextmanager
    def _one_thread(self):
        """Around a call's use of the socket: a second thread's, meanwhile, is refused by name (two
        threads on one socket lost replies, and a call waited out its timeout, or forever)."""
        if not self._in_use.acquire(blocking=False):
            raise RuntimeError("this Client is in use by another thread; a Client serves one thread at a time: make "
                               "one per thread, or use AsyncClient for many requests at once")
        try:
            yield
        finally:
            self._in_use.release()

    def cancel(self, request_id: str) -> None:
        """Ask the router to cancel it; its stream then ends with finish_reason "cancelled"."""
        with self._one_thread():
            self._cancelling(request_id)

    def _take_events(self) -> None:
        """The connection's news: a drop loses every reply in flight, past what the router sent
        before it went (a stopping router's last tokens, and its word on what it did not finish),
        which the socket still holds and is filed first."""
        if self.connection.drain():
            while (env := self.chan.recv(0)) is not None:
                self._file(env)
            for rid in self._open - self._unsent:
                if not any(isinstance(msg, (P.Done, P.Error)) for msg in self._replies.get(rid, ())):
                    self._replies[rid].append(P.Error(rid, "UNAVAILABLE", LOST))
            self._open &= self._unsent

    def _file(self, env) -> str | None:
        """File a message's replies under their requests; what is wrong with it, if anything."""
        if env.error is not None:
            return f"undecodable reply from {self.address} (a router's client port?): {env.error}"
        msgs, bad = replies(env.msg)
        for msg in msgs:
            if (owner := self._open_id(msg)) is not None:
                self._replies[owner].append(msg)
                self._filed(owner, msg)
        return f"undecodable reply from the router: {bad[0]}" if bad else None

    def _next(self, key: str | None, deadline: "Deadline"):
        """The next message for `key`, reading (and filing) others' messages meanwhile. After
        CONNECT_TIMEOUT_S of this call with no connection to the router, UNAVAILABLE (and the
        request, queued for a router that may yet come, is cancelled): nothing would come."""
        self._check_open()  # (a stream read after its client closed)
        with self._one_thread():
            return self._next_unshared(key, deadline)

    def _next_unshared(self, key: str | None, deadline: "Deadline"):
        since = time.monotonic()
        if not self._replies[key]:
            self._take_events()  # what the monitor holds, before deciding anything; later, as the poll finds it
        while not self._replies[key]:
            error = self.connection.unreachable(self.address, since, key)
            if error is not None:
                self._abandon(key)  # queued for a router that may yet come
                raise error
            if deadline.passed():
                self._abandon(key)
                raise deadline.error(key, "Client")
            wait = until(deadline.at, self.connection.give_up_at(since))
            ready = dict(self._poller.poll(None if wait is None else max(1, int(wait * 1000) + 1)))
            if self.connection.monitor in ready:
                self._take_events()
            if self.chan.sock not in ready:
                continue
            env = self.chan.recv(0)
            if env is not None and (problem := self._file(env)) is not None:
                raise RequestError("INTERNAL", problem)
        msg = self._replies[key].popleft()
        if not self._replies[key]:
            del self._replies[key]
        if isinstance(msg, (P.Error, P.Done)):
            self._forget(key)
        if isinstance(msg, P.Error):
            _raise(msg)
        return msg

    def stream(self, prompt=None, timeout: float | None = None, **sampling) -> Stream:
        """Iterator of Chunks as the tokens come; `.result` once exhausted."""
        return Stream(self, self.submit(prompt, stream=True, **sampling), self.timeout_of(timeout))

    def generate(self, prompt=None, timeout: float | None = None, **sampling) -> Result:
        """The whole output of one request (submit, then wait)."""
        rid = self.submit(prompt, stream=False, **sampling)
        return self.wait(rid, timeout)

    def wait(self, request_id: str, timeout: float | None = None) -> Result:
        """The Result of a request submitted with stream=False (its tokens, if it streams, are skipped)."""
        self._check_waitable(request_id)
        deadline = self._deadline(timeout)
        try:
            while True:
                msg = self._next(request_id, deadline)
                if isinstance(msg, P.Done):
                    return _result(msg)
        finally:  # a KeyboardInterrupt, or an error: nobody waits for it any more
            self._abandon(request_id)

    def generate_many(self, prompts: list, timeout: float | None = None, **sampling) -> list[Result]:
        """All prompts in flight at once; results in prompt order. The first failure raises (and
        cancels the others)."""
        ids = []
        try:  # a submit that fails (a bad prompt) cancels those sent before it
            for p in prompts:
                ids.append(self.submit(p, stream=False, **sampling))
            return [self.wait(rid, timeout) for rid in ids]
        finally:
            for rid in ids:
                self._abandon(rid)

    def status(self, timeout: float | None = 10.0) -> P.StatusReply:
        """The router's view of its workers and requests (what `pdserve status` prints)."""
        return self._ask(P.StatusRequest, timeout)

    def metrics(self, timeout: float | None = 10.0) -> bytes:
        """The router's Prometheus metrics, as its HTTP /metrics serves them."""
        return self._ask(P.MetricsRequest, timeout).text

    def _ask(self, request: type, timeout: float | None):
        """A status or metrics call's reply, filed under the call's id."""
        self._check_open()
        with self._one_thread():
            self._take_events()  # as submit's
        with self._asking() as ask_id:
            deadline = self._deadline(timeout)
            with self._one_thread():
                self._send(request(ask_id), ask_id, deadline)
            return self._next(ask_id, deadline)


class AsyncClient(_Requests):
    """The asyncio client: Client's calls, awaited, with any number of requests in flight from the
    tasks of one event loop."""

    def __init__(self, address: str, timeout: float | None = 120.0):
        self.address, self.timeout, self.pid = address, timeout, os.getpid()
        self.ctx = zmq.asyncio.Context()
        self.chan = _connect(self.ctx, address)
        self.connection = Connection(self.chan)
        self._init_requests(asyncio.Queue)
        self._reader: asyncio.Task | None = None
        self._losing: set[asyncio.Task] = set()  # _lose_open's, kept: the loop holds only a weak reference

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        """Close the sockets (again: nothing). What is in flight is cancelled on the router, and its
        callers' waits (other tasks') fail at once."""
        if self.closed:
            return
        self.closed = True
        for rid in self._open:
            _cancel_nowait(self.chan, rid)
            self._replies[rid].put_nowait(P.Error(rid, "UNAVAILABLE", "its AsyncClient was closed meanwhile"))
        self._open.clear()
        if self._reader is not None and self._reader.get_loop() is asyncio.get_running_loop():
            for task in (self._reader, *self._losing):
                task.cancel()
            await asyncio.gather(self._reader, *self._losing, return_exceptions=True)
        self.connection.close()
        self.chan.close()
        self.ctx.term()

    def _start(self):
        """Start reading replies, in the event loop of the client's first call: it serves that loop only
        (a second asyncio.run would wait for replies the first loop's reader can no longer read).
        A drop the watcher has not seen yet (the loop ran only during calls) loses what was in
        flight then, not the call starting now, which goes out on the connection there is now."""
        self._check_open()
        if self._reader is not None and self._reader.get_loop() is not asyncio.get_running_loop():
            raise RuntimeError("this AsyncClient serves the event loop of its first call; make one in each "
                               "asyncio.run (or event loop)")
        if self._reader is None:
            self._reader = asyncio.ensure_future(asyncio.gather(self._read(), self._watch()))
            # ended by its loop's end (asyncio.run cancels what runs) rather than close(): not an error to report
            self._reader.add_done_callback(lambda f: f.cancelled() or f.exception())
        if self.connection.drain():
            self._lost()

    async def _read(self):
        while True:
            env = await self.chan.arecv()
            if env.error is not None:
                continue
            for msg in replies(env.msg)[0]:  # a bad item is skipped, as an undecodable reply is
                if (owner := self._open_id(msg)) is not None:
                    self._replies[owner].put_nowait(msg)
                    self._filed(owner, msg)

    async def _watch(self):
        await self.connection.watch(self._lost)

    def _lost(self):
        task = asyncio.ensure_future(self._lose_open(self._open - self._unsent))
        self._losing.add(task)
        task.add_done_callback(self._losing.discard)

    async def _lose_open(self, lost: set[str]):
        """What the router sent before it went (a stopping router's last tokens, and its word on
        what it did not finish) is still in the socket: the reader files it first."""
        while await self.chan.sock.poll(0):
            await asyncio.sleep(0)
        for rid in lost & self._open:  # after its Done, if that came: never read (_next drops the queue at a Done)
            self._replies[rid].put_nowait(P.Error(rid, "UNAVAILABLE", LOST))
        self._open -= lost

    async def submit(self, prompt=None, stream: bool = True, request_id: str | None = None,
                     messages: list[dict] | None = None, **sampling) -> str:
        """Send a request and return its id at once: read it with wait() (stream=False) or cancel() it."""
        self._start()
        request_id = _request_id(request_id) or self._new_id()
        message = _generate(request_id, prompt, messages, sampling, stream)
        with self._opening(request_id):
            await self._send(message, request_id)
        return request_id

    async def _send(self, message, key: str, deadline: Deadline | None = None) -> None:
        """Client._send's, awaited."""
        since, message = time.monotonic(), P.encode(message)  # once, however many tries
        self._unsent.add(key)
        try:
            while not self.chan.send_nowait(message):
                error = self.connection.unreachable(self.address, since, key)
                if error is not None:
                    raise error
                if deadline is not None and deadline.passed():
                    raise deadline.error(key, "AsyncClient")
                await self.chan.sock.poll(SEND_RETRY_MS, zmq.POLLOUT)
        finally:
            self._unsent.discard(key)

    async def cancel(self, request_id: str) -> None:
        """Ask the router to cancel it; its stream then ends with finish_reason "cancelled"."""
        self._cancelling(request_id)

    async def _next(self, key, timeout):
        self._check_open()  # (a stream read after its client closed)
        since = time.monotonic()
        deadline = None if timeout is None else since + timeout
        while True:
            error = self.connection.unreachable(self.address, since, key)
            if error is not None:
                self._abandon(key)  # queued for a router that may yet come
                raise error
            try:
                msg = await asyncio.wait_for(self._replies[key].get(),
                                             until(deadline, self.connection.give_up_at(since)))
                break
            except asyncio.TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    self._abandon(key)
                    raise Deadline(deadline, timeout).error(key, "AsyncClient") from None
        if isinstance(msg, (P.Error, P.Done)):
            self._forget(key)
        if isinstance(msg, P.Error):
            _raise(msg)
        return msg

    def stream(self, prompt=None, timeout: float | None = None, **sampling) -> AsyncStream:
        """Async iterator of Chunks (submitted at the first step); `.result` once exhausted."""
        return AsyncStream(self, prompt, timeout, sampling)

    async def generate(self, prompt=None, timeout: float | None = None, **sampling) -> Result:
        """The whole output of one request (submit, then wait)."""
        return await self.wait(await self.submit(prompt, stream=False, **sampling), timeout)

    async def wait(self, request_id: str, timeout: float | None = None) -> Result:
        """The Result of a request submitted with stream=False (its tokens, if it streams, are skipped)."""
        self._check_waitable(request_id)
        timeout = self.timeout_of(timeout)
        try:
            while True:
                msg = await self._next(request_id, timeout)
                if isinstance(msg, P.Done):
                    return _result(msg)
        finally:  # cancelled (asyncio.wait_for, a task's cancel), or an error: nobody waits for it
            self._abandon(request_id)

    async def generate_many(self, prompts: list, timeout: float | None = None, **sampling) -> list[Result]:
        """All prompts in flight at once; results in prompt order. The first failure raises (and
        cancels the others), as Client.generate_many."""
        tasks = [asyncio.ensure_future(self.generate(p, timeout, **sampling)) for p in prompts]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def status(self, timeout: float | None = 10.0) -> P.StatusReply:
        """The router's view of its workers and requests (what `pdserve status` prints)."""
        return await self._ask(P.StatusRequest, timeout)

    async def metrics(self, timeout: float | None = 10.0) -> bytes:
        """The router's Prometheus metrics, as its HTTP /metrics serves them."""
        return (await self._ask(P.MetricsRequest, timeout)).text

    async def _ask(self, request: type, timeout: float | None):
        """A status or metrics call's reply, filed under the call's id."""
        self._start()
        with self._asking() as ask_id:
            await self._send(request(ask_id), ask_id, self._deadline(timeout))
            return await self._next(ask_id, self.timeout_of(timeout))
