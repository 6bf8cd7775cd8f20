"""Connections that hold the HTTP server without sending a request (router/http_conns.py): one
left idle and one sending its headers a byte at a time are closed once their headers are due,
while a client that asks in time is served. Left open, 20,000 of them took every descriptor the
router had, and workers could no longer register."""

import asyncio
import time

import pytest
from aiohttp import web

from router.http_conns import HeaderDeadline

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
