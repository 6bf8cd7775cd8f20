"""The SDK's asyncio client: Client's calls (router/client.py), awaited, with any number of
requests in flight from the tasks of one event loop.

    async with AsyncClient("tcp://127.0.0.1:7100") as c:
        result = await c.generate("Hello")
        stream = c.stream("Hello")
        async for chunk in stream: ...
        print(stream.result.text)
"""

from __future__ import annotations

import asyncio
import os
import time

import zmq
import zmq.asyncio

from common import protocol as P
from router.client_requests import (SEND_RETRY_MS, Abandonable, Chunk, Deadline, InFlight, Result, cancel_nowait,
                                    checked_request_id, connect, generate_message, result_of)
from router.connection import Connection, replies, until


class AsyncStream(Abandonable):
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
            msg = await self.client._next(self.request_id, self.client._deadline(self.timeout))
        except asyncio.CancelledError:
            self.close()
            raise
        if (chunk := self._take(msg)) is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        self.close()


class AsyncClient(InFlight):
    """The asyncio client: Client's calls, awaited, with any number of requests in flight from the
    tasks of one event loop."""

    def __init__(self, address: str, timeout: float | None = 120.0):
        self.address, self.timeout, self.pid = address, timeout, os.getpid()
        self.ctx = zmq.asyncio.Context()
        self.chan = connect(self.ctx, address)
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
            cancel_nowait(self.chan, rid)
            self._put(rid, P.Error(rid, "UNAVAILABLE", "its AsyncClient was closed meanwhile"))
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
        """What the router sent before it went is still in the socket: the reader files it first."""
        while await self.chan.sock.poll(0):
            await asyncio.sleep(0)
        self._lose(lost)

    def _put(self, request_id: str, msg) -> None:
        self._replies[request_id].put_nowait(msg)

    def _queued(self, request_id: str) -> int:
        queue = self._replies.get(request_id)
        return queue.qsize() if queue is not None else 0

    async def submit(self, prompt=None, stream: bool = True, request_id: str | None = None,
                     messages: list[dict] | None = None, **sampling) -> str:
        """Send a request and return its id at once: read it with wait() (stream=False) or cancel() it."""
        self._start()
        request_id = checked_request_id(request_id) or self._new_id()
        message = generate_message(request_id, prompt, messages, sampling, stream)
        with self._opening(request_id):
            await self._send(message, request_id)
        return request_id

    async def _send(self, message, key: str, deadline: Deadline | None = None) -> None:
        """Client._send's, awaited."""
        since, message = time.monotonic(), P.encode(message)  # once, however many tries
        self._unsent.add(key)
        try:
            while not self.chan.send_nowait(message):
                self._sending(since, key, deadline)
                await self.chan.sock.poll(SEND_RETRY_MS, zmq.POLLOUT)
        finally:
            self._unsent.discard(key)

    async def cancel(self, request_id: str) -> None:
        """Ask the router to cancel it; its stream then ends with finish_reason "cancelled"."""
        self._cancelling(request_id)

    async def _next(self, key, deadline: Deadline):
        """The next message for `key` (Client._next's, awaited)."""
        self._check_open()  # (a stream read after its client closed)
        since = time.monotonic()
        while True:
            queue = self._replies[key]
            if not queue.empty():
                return self._read_out(key, queue.get_nowait())
            self._expired(since, key, deadline)
            try:
                msg = await asyncio.wait_for(queue.get(), until(deadline.at, self.connection.give_up_at(since)))
            except asyncio.TimeoutError:
                continue
            return self._read_out(key, msg)

    def stream(self, prompt=None, timeout: float | None = None, **sampling) -> AsyncStream:
        """Async iterator of Chunks (submitted at the first step); `.result` once exhausted."""
        return AsyncStream(self, prompt, timeout, sampling)

    async def generate(self, prompt=None, timeout: float | None = None, **sampling) -> Result:
        """The whole output of one request (submit, then wait)."""
        return await self.wait(await self.submit(prompt, stream=False, **sampling), timeout)

    async def wait(self, request_id: str, timeout: float | None = None) -> Result:
        """The Result of a request submitted with stream=False (its tokens, if it streams, are skipped)."""
        self._check_waitable(request_id)
        deadline = self._deadline(timeout)
        try:
            while True:
                msg = await self._next(request_id, deadline)
                if isinstance(msg, P.Done):
                    return result_of(msg)
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
            deadline = self._deadline(timeout)
            await self._send(request(ask_id), ask_id, deadline)
            return await self._next(ask_id, deadline)
