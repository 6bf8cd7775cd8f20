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
its template's; so do a chat's template options, as over HTTP: `chat_template_kwargs`
({"enable_thinking": False}), `add_generation_prompt` and `continue_final_message`. Failures raise
RequestError carrying the router's code (INVALID_ARGUMENT, OVERLOADED, UNAVAILABLE, TIMEOUT, ...)
and message. Many requests may be in
flight on one client; replies are matched to them by request id. If the connection to the router
drops (the router died or restarted), every request in flight fails at once with UNAVAILABLE
rather than waiting out its timeout; the client reconnects by itself for new requests. A request
its caller stops waiting for (a stream left before its end, a call cancelled or interrupted) is
cancelled on the router, as vLLM's AsyncLLM does, so its KV blocks are freed at once.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque

import zmq

from common import protocol as P
from router.async_client import AsyncClient, AsyncStream
from router.client_requests import (SEND_RETRY_MS, Abandonable, Chunk, Deadline, InFlight, Result, checked_request_id,
                                    connect, generate_message, result_of)
from router.connection import Connection, RequestError, replies, until

__all__ = ["AsyncClient", "AsyncStream", "Chunk", "Client", "RequestError", "Result", "Stream"]


class Stream(Abandonable):
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


class Client(InFlight):
    """A blocking client for one thread at a time (its ZeroMQ socket is not to be shared between
    threads: make a Client per thread, or use AsyncClient for many requests at once)."""

    def __init__(self, address: str, timeout: float | None = 120.0):
        self.address, self.timeout, self.pid = address, timeout, os.getpid()
        self._in_use = threading.Lock()  # held while a call uses the socket (_one_thread)
        self.ctx = zmq.Context()
        self.chan = connect(self.ctx, address)
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
        request_id = checked_request_id(request_id) or self._new_id()
        message = generate_message(request_id, prompt, messages, sampling, stream)
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
                self._sending(since, key, deadline)
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
            self._lose(self._open - self._unsent)

    def _put(self, request_id: str, msg) -> None:
        self._replies[request_id].append(msg)

    def _queued(self, request_id: str) -> int:
        return len(self._replies.get(request_id, ()))

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
            self._expired(since, key, deadline)
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
        return self._read_out(key, msg)

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
                    return result_of(msg)
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
