"""What every HTTP request passes before its route, and how a refusal is written.

- CORS: a browser's preflight is answered before the API key is asked for, as vLLM's is; a page
  from an origin not in --allowed-origins gets FORBIDDEN, and the allowed ones their headers.
- The API key (--api-key) guards /v1/ and /invocations; /health, /metrics, /version, /tokenize
  and /detokenize stay open, as vLLM's do.
- Every error becomes OpenAI's JSON shape (router/openai_api.py ApiError): ours, aiohttp's own
  (no route, wrong method, a body too large or late), and an unexpected one, which is logged.
- A request's id: the client's X-Request-Id or body request_id, checked, since it is written into
  log lines; and its body, read within the limits and decoded.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections.abc import Callable

from aiohttp import web

from common.errors import InvalidArgument, short_repr
from router.http_conns import HeaderDeadline, read_body
from router.openai_api import RETRY_AFTER_S, ApiError

log = logging.getLogger("pdserve.http")
REQUEST_ID = web.RequestKey("pdserve_request_id", str)  # the X-Request-Id its response carries
REQUEST_ID_ALLOWED = "1 to 256 printable ASCII characters, no spaces, quotes or backslashes"


class Guard:
    def __init__(self, rejected: Callable[[str], None], api_key: str | None, allowed_origins: str,
                 max_body_bytes: int, routes: str):
        """rejected: counts a refusal's code (request_errors_total); allowed_origins: the web
        origins whose pages may call it, comma-separated, "*" any; routes: what is served, for a
        404 or 405 to say."""
        self.rejected, self.max_body_bytes, self.routes = rejected, max_body_bytes, routes
        self.api_key = api_key.encode() if api_key else None
        self.origins = {o.strip() for o in allowed_origins.split(",") if o.strip()}
        self.headers_due: HeaderDeadline | None = None  # the server's, once it runs (not in tests' own runners)

    def _origin(self, request: web.Request) -> str | None:
        """What Access-Control-Allow-Origin says to this request's page, or None (not allowed)."""
        origin = request.headers.get("Origin")
        if origin is None or not self.origins:
            return None
        return "*" if "*" in self.origins else origin if origin in self.origins else None

    async def cors_headers(self, request: web.Request, response: web.StreamResponse):
        """(A signal, not the middleware: before a stream's headers go.)"""
        allowed = self._origin(request)
        if allowed is not None:
            response.headers["Access-Control-Allow-Origin"] = allowed
        if "Origin" in request.headers and self.origins and "*" not in self.origins:
            response.headers["Vary"] = "Origin"  # a cache must not give one origin's answer to another
        if REQUEST_ID in request:
            response.headers["X-Request-Id"] = request[REQUEST_ID]

    def _preflight(self, request: web.Request) -> web.Response:
        """A browser's CORS preflight: answered before the API key is asked for, as vLLM's is."""
        if self._origin(request) is None:
            raise ApiError("FORBIDDEN", f"origin {request.headers.get('Origin')!r} may not call this API; "
                                        "allowed: the router's --allowed-origins")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "*"),
            "Access-Control-Max-Age": "600"})

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if self.headers_due is not None:  # None: the app served by another runner (tests)
            self.headers_due.serving(request)
        try:
            if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
                return self._preflight(request)
            if self.api_key is not None and (request.path.startswith("/v1/") or request.path == "/invocations"):
                self._authorize(request)
            return await handler(request)
        except ApiError as e:
            return error_response(e)
        except InvalidArgument as e:
            return error_response(ApiError("INVALID_ARGUMENT", str(e), e.param))
        except web.HTTPException as e:  # aiohttp's own: no route, wrong method, body too large
            error = self.http_error(request, e)
            if e.status in (404, 405) and request.path.startswith("/v1/"):  # the API's misuse, not a stray URL's
                self.rejected(error.code)
            return error_response(error)
        except ConnectionError:  # the client went away: this answer will not reach it (aiohttp takes that quietly)
            return web.Response(status=499, text="client closed the connection")
        except Exception as e:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return error_response(ApiError("INTERNAL", f"{type(e).__name__}: {e}"))

    def _authorize(self, request: web.Request):
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        # surrogateescape: a header's bytes that are not UTF-8 (aiohttp decodes them so) are a wrong key, not a 500
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"),
                                                                  self.api_key):
            self.rejected("UNAUTHENTICATED")
            raise ApiError("UNAUTHENTICATED", "a valid API key is required: send the header "
                                              "'Authorization: Bearer <key>'")

    def http_error(self, request: web.Request, e: web.HTTPException) -> ApiError:
        if e.status == 413:
            return ApiError("TOO_LARGE", f"the request body is over the limit of {self.max_body_bytes} bytes (the "
                                         "router's --max-message-bytes)")
        if e.status == 408:
            return ApiError("REQUEST_TIMEOUT", e.reason)
        if e.status == 405:
            return ApiError("METHOD_NOT_ALLOWED",
                            f"{request.method} {request.path} is not served; allowed: {self.routes}")
        if e.status == 404:
            return ApiError("NOT_FOUND", f"{request.method} {request.path} is not served; allowed: {self.routes}")
        return ApiError("INVALID_ARGUMENT" if e.status < 500 else "INTERNAL", e.reason)


# aiohttp's own (its parser refuses br and zstd itself, in plain text, without the libraries they need)
BODY_ENCODINGS = ("gzip", "deflate", "identity")
ENCODINGS_ALLOWED = "allowed: one of gzip or deflate, or none"


async def read_json(request: web.Request, max_bytes: int):
    """The body's JSON: at most max_bytes, in one of BODY_ENCODINGS, on time (read_body), or ApiError."""
    encodings = [e.strip().lower() for e in request.headers.get("Content-Encoding", "").split(",") if e.strip()]
    # else aiohttp would read an unknown one, or a list of them, as identity
    if len(encodings) > 1 or any(e not in BODY_ENCODINGS for e in encodings):
        raise ApiError("INVALID_ARGUMENT", f"Content-Encoding: {short_repr(request.headers['Content-Encoding'])} "
                                           f"is not supported; {ENCODINGS_ALLOWED}")
    try:
        raw = await read_body(request, max_bytes)  # 413 over the limit, 408 late
    except web.RequestPayloadError:  # a body that is not what its Content-Encoding says
        request.content.feed_eof()  # read no more of it: aiohttp would, after the answer, and log its error
        encoding = request.headers.get("Content-Encoding", "")
        raise ApiError("INVALID_ARGUMENT", f"the body could not be decoded (Content-Encoding: {encoding}); "
                                           f"{ENCODINGS_ALLOWED}") from None
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ApiError("INVALID_ARGUMENT", f"the body is not valid JSON ({e})") from None
    except RecursionError:
        raise ApiError("INVALID_ARGUMENT", "the body nests too deeply to be a request") from None


def given_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id (vLLM's), checked: it is written into log lines."""
    given = request.headers.get("X-Request-Id")
    return _checked_request_id(given, f"X-Request-Id: {short_repr(given)}")


def body_request_id(body) -> str | None:
    """A body's request_id (vLLM's), as X-Request-Id, which comes first."""
    given = body.get("request_id") if isinstance(body, dict) else None
    return _checked_request_id(given, f"request_id={short_repr(given)}", "request_id")


def _checked_request_id(given, shown: str, param: str | None = None) -> str | None:
    if given is not None and not (isinstance(given, str) and re.fullmatch(r"[!#-\[\]-~]{1,256}", given)):
        raise ApiError("INVALID_ARGUMENT", f"{shown} is invalid; allowed: {REQUEST_ID_ALLOWED}", param)
    return given


def error_response(e: ApiError) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status in (429, 503) else None
    return web.json_response(e.body(), status=e.status, headers=headers)
