"""What stops HTTP clients holding the router's connections, and so its file descriptors: the
router's ZeroMQ sockets need descriptors too, so with all of them taken by idle HTTP connections,
workers could not register and clients could not connect.

- A connection that has not finished a request's headers within HEADER_TIMEOUT_S is closed. That
  covers one opened and left idle, and one that sends its headers a byte at a time (slowloris).
  aiohttp has no such timeout.
- A request's body must arrive within BODY_TIMEOUT_S, plus its length at MIN_BODY_RATE, or the
  request is refused (408); one whose Content-Length is over the limit is refused (413) before any
  of it is read. aiohttp waited for a body with no deadline, and read up to the limit first: a
  client that sent its headers and then a byte a minute, or nothing, held its connection forever.
- Past a cap of open connections (the process's file limit, raised to its hard limit as vLLM
  does, less FD_RESERVE for the ZeroMQ sockets and files), a new one is answered 503 and closed
  before aiohttp takes it: the deadlines bound how long a connection is held, not how many are.
- One idle between requests is closed after KEEPALIVE_S. That is uvicorn's default, which vLLM
  users get; aiohttp's own default is an hour.
- aiohttp logs a malformed request at ERROR with a traceback quoting the line it could not parse,
  which may hold the client's API key. That becomes one line naming the error's kind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time

from aiohttp import http_exceptions, web

HEADER_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 30.0
MIN_BODY_RATE = 1 << 16  # bytes a second (64 KiB): a body's deadline grows with its length at this rate
KEEPALIVE_S = 5.0
SWEEP_S = 2.0
FD_RESERVE = 512  # descriptors no HTTP connection may take: the ZeroMQ sockets', the logs', the model's files
MIN_CONNECTIONS = 64  # the cap however low the file limit


class HeaderDeadline:
    """Closes connections that have not finished a request's headers in time. serving(request)
    from a middleware marks a connection as having sent one; sweep() runs beside the server."""

    def __init__(self, runner: web.AppRunner, timeout_s: float = HEADER_TIMEOUT_S):
        self.runner, self.timeout_s = runner, timeout_s
        self._first_seen: dict = {}  # connection -> when a sweep first saw it (of those still open)
        self._served: set = set()  # connections that have sent a request (of those open at the last sweep)

    def serving(self, request: web.BaseRequest) -> None:
        self._served.add(request.protocol)

    async def sweep(self) -> None:
        log = logging.getLogger("pdserve.http")
        while True:
            await asyncio.sleep(min(SWEEP_S, self.timeout_s / 2))
            now, closed = time.monotonic(), 0
            conns = self.runner.server.connections if self.runner.server is not None else []
            self._served &= set(conns)
            self._first_seen = {conn: self._first_seen.get(conn, now) for conn in conns if conn not in self._served}
            for conn, since in self._first_seen.items():
                if now - since > self.timeout_s:
                    conn.force_close()
                    closed += 1
            if closed:
                log.info("closed %d HTTP connections that sent no request's headers within %.0f s", closed,
                         self.timeout_s)


async def read_body(request: web.BaseRequest, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The request's body, or web.HTTPRequestEntityTooLarge at once where its Content-Length is
    over max_bytes, or web.HTTPRequestTimeout where it has not all come by its deadline (timeout_s
    plus its length, or max_bytes where it gives none, at MIN_BODY_RATE). aiohttp then reads what
    is left of it for a few seconds, and closes the connection."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=length)
    due = timeout_s + (max_bytes if length is None else length) / MIN_BODY_RATE
    try:
        return await asyncio.wait_for(request.read(), due)
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(reason=f"the request's body did not arrive within {due:.0f} s") from None


def connection_cap() -> int:
    """How many HTTP connections this process may hold open: its file limit (raised first to the
    hard limit, as vLLM raises it) less FD_RESERVE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):  # a container's limit below the hard one: keep the soft one
            pass
    return max(MIN_CONNECTIONS, soft - FD_RESERVE)


class _Refused(asyncio.Protocol):
    """A connection past the cap: answered 503, in OpenAI's error shape, and closed."""

    BODY = json.dumps({"error": {"message": "the server holds as many HTTP connections as it may; retry",
                                 "type": "service_unavailable_error", "param": None, "code": "UNAVAILABLE"}}).encode()
    RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))

    def connection_made(self, transport):
        transport.write(self.RESPONSE)
        transport.close()


def capped(server: web.Server, cap: int):
    """A protocol factory for loop.create_server: aiohttp's server's, while it holds fewer than
    cap connections, else one that refuses (_Refused)."""
    return lambda: server() if len(server.connections) < cap else _Refused()


class QuietBadRequests(logging.Filter):
    """A malformed request, logged by aiohttp, as one line without the text it quoted."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, http_exceptions.HttpProcessingError):
            record.msg, record.args = "refused a malformed HTTP request (%s)", (type(exc).__name__,)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_bad_requests() -> None:
    """Install QuietBadRequests once on aiohttp's server logger."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, QuietBadRequests) for f in logger.filters):
        logger.addFilter(QuietBadRequests())
