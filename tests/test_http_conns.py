"""Connections that hold the HTTP server without sending a request (router/http_conns.py): one
left idle and one sending its headers a byte at a time are closed once their headers are due,
while a client that asks in time is served; one whose body stalls is answered 408 once its body
is due, and one that declares a body over the limit 413 at once; past a cap of open connections a
new one is refused. Left open, 20,000 of them took every descriptor the router had, and workers
could no longer register."""

import asyncio
import time

import pytest
from aiohttp import web

from router.http_conns import HeaderDeadline, capped, read_body

pytestmark = pytest.mark.timeout(60)


def test_connections_that_send_no_headers_in_time_are_closed():
    async def scenario():
        deadline = None

        @web.middleware
        async def mark(request, handler):
            deadline.serving(request)
            return await handler(request)

        async def ok(request):
            return web.Response(text="ok")

        app = web.Application(middlewares=[mark])
        app.router.add_get("/", ok)
        runner = web.AppRunner(app, keepalive_timeout=30)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        deadline = HeaderDeadline(runner, timeout_s=1.0)
        sweeping = asyncio.ensure_future(deadline.sweep())
        try:
            idle = await asyncio.open_connection("127.0.0.1", port)
            slow = await asyncio.open_connection("127.0.0.1", port)
            served = await asyncio.open_connection("127.0.0.1", port)
            served[1].write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(served[0].readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                if slow[0].at_eof():
                    break
                slow[1].write(bytes([byte]))
                await asyncio.sleep(0.05)
            for reader, _ in (idle, slow):  # closed by the server: an end, or a reset if bytes were unread
                try:
                    assert await asyncio.wait_for(reader.read(), 10) == b""
                except ConnectionResetError:
                    pass
            assert 1.0 <= time.monotonic() - t0 < 8
            served[1].write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # one that asked in time stays open
            assert (await asyncio.wait_for(served[0].readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
            served[1].close()
        finally:
            sweeping.cancel()
            await runner.cleanup()
    asyncio.run(scenario())


def test_a_body_over_the_limit_is_refused_at_once_and_a_stalled_one_once_it_is_due():
    async def scenario():
        async def echo(request):
            return web.Response(body=await read_body(request, max_bytes=1000, timeout_s=1.0))

        app = web.Application()
        app.router.add_post("/", echo)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]

        async def post(length: int, body: bytes, dribble_s: float = 0.0) -> tuple[bytes, float]:
            """The status line, and how long it took to come, for a POST declaring `length` bytes
            that sends `body`, a byte every dribble_s, then nothing."""
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.monotonic()
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length)
            for i in range(len(body)):
                writer.write(body[i:i + 1])
                await asyncio.sleep(dribble_s)
            try:
                return await asyncio.wait_for(reader.readline(), 10), time.monotonic() - t0
            finally:
                writer.close()
        try:
            status, took = await post(5_000_000, b"{")
            assert status.startswith(b"HTTP/1.1 413") and took < 1.0
            status, took = await post(100, b"x" * 10)
            assert status.startswith(b"HTTP/1.1 408") and 1.0 <= took < 5
            status, took = await post(8, b"12345678", dribble_s=0.05)  # slow, but all in time
            assert status.startswith(b"HTTP/1.1 200")
        finally:
            await runner.cleanup()
    asyncio.run(scenario())


def test_a_connection_past_the_cap_is_refused_and_one_is_served_once_another_closes():
    async def scenario():
        async def ok(request):
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        listener = await asyncio.get_running_loop().create_server(capped(runner.server, 3), "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]

        async def get() -> tuple[bytes, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5), writer
        try:
            held = [await get() for _ in range(3)]  # kept alive: each holds its connection
            assert all(head.startswith(b"HTTP/1.1 200") for head, _ in held)
            head, writer = await get()
            assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head
            writer.close()
            held[0][1].close()
            for _ in range(50):  # the server sees the close
                if len(runner.server.connections) < 3:
                    break
                await asyncio.sleep(0.02)
            head, writer = await get()
            assert head.startswith(b"HTTP/1.1 200")
            for w in [writer] + [w for _, w in held[1:]]:
                w.close()
        finally:
            listener.close()
            await runner.cleanup()
    asyncio.run(scenario())
