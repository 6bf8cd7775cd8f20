"""The router's HTTP front: OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models),
vLLM's /tokenize, /detokenize and /version, /health and Prometheus /metrics, served in the router process, on its event loop, or by API
server processes beside it (router/api_server.py, --api-server-count).

    HTTP client --POST /v1/completions--> HttpFront --backend.submit(reply_to=queue)--> request state machine
                <--SSE chunks / JSON--    (one asyncio.Queue per HTTP request)  <--Token/Done/Error--

An HTTP request becomes one or more router requests (a batch of prompts, n choices each). In the
router process (LocalBackend) they are admitted in-process: no extra socket hop, the same
validation, dispatch, recovery and stop strings as a ZeroMQ client gets. In an API server they go
to the router as a ZeroMQ client's do (RouterLink). Either way their replies land in an asyncio
queue that the handler turns into OpenAI's shapes (router/openai_responses.py). A client that goes away
(its connection closes) cancels every one of its requests at once: aiohttp cancels the handler,
and the handler's `finally` cancels the work on the workers, which free its KV blocks.

Why aiohttp: it runs as an AppRunner on the loop the process already has (uvloop), with no second
loop, thread or ASGI layer between a token and its socket write; each SSE chunk is one transport
write. FastAPI on uvicorn (vLLM's and SGLang's choice) could be run the same way, but adds ASGI
message passing and pydantic validation per request and per chunk to a process that must stay
within a millisecond of the ZeroMQ path, and we check requests ourselves anyway (to name the field
and what is allowed, as every pdserve error does). aiohttp's client also drives
`pdserve bench serve --base-url`.

Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with our codes:
INVALID_ARGUMENT 400 (malformed JSON too), UNAUTHENTICATED 401, FORBIDDEN 403 (a CORS preflight
from an origin not allowed), NOT_FOUND 404 (model or route), METHOD_NOT_ALLOWED 405,
REQUEST_TIMEOUT 408 (a body not all sent within router/http_conns.py's deadline),
TOO_LARGE 413 (a body over --max-message-bytes), OVERLOADED 429 with Retry-After, INTERNAL 500,
UNAVAILABLE 503 with Retry-After, TIMEOUT 504. Refusals before the router (a bad body, key, method or /v1/ route)
count in request_errors_total as its own do.
A stream sends its headers with its first token, so an error before it still gets its status; one
after it comes as an SSE event {"error": ...}, then [DONE].
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import fcntl
import json
import logging
import socket
import struct
import termios
import time
import uuid
from collections.abc import Callable, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from common import protocol as P
from common.channel import SEND_WAIT_S
from common.errors import InvalidArgument
from common.sampling_params import SamplingParams
from router.openai_api import (ApiError, Job, OutputParsers, check_model, parse_chat, parse_completion,
                               parse_detokenize, parse_tokenize, served_names)
from router.openai_responses import Choice, Envelope, usage
from router.http_conns import KEEPALIVE_S, HeaderDeadline, capped, connection_cap, quiet_bad_requests
from router.http_guard import REQUEST_ID, Guard, body_request_id, given_request_id, read_json
from router.prompts import Prompts
from router.reasoning import thinking_end
from router.drain import STOPPING
from router.request_log import RequestLog

log = logging.getLogger("pdserve.http")
HTTP_CLIENT = "http"  # the Router.submit client of every HTTP request (their request ids are unique)
ROUTES = ("GET /health, GET or POST /ping, GET /metrics, GET /version, GET /v1/models, GET /v1/models/{model}, "
          "POST /v1/completions, POST /v1/chat/completions, POST /invocations, POST /tokenize, POST /detokenize")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
JSON_CONTENT_TYPE = "application/json; charset=utf-8"  # as web.json_response writes it
SHUTDOWN_GRACE_S = 2.0  # for handlers to answer their requests' UNAVAILABLE when the server stops
TOKENS_PER_PIECE = 65536  # /tokenize: ids serialized as one piece of its body
BODY_PIECE_BYTES = 1 << 20  # a JSON body serialized between two turns of the event loop
# what a client must read of a response in each send_wait_s (5 s) to keep its connection: 3 KB/s
MIN_READ_BYTES = 16 * 1024
JSON_THREADS = 4
# the access log (--log-requests): who, the request line, status, bytes, seconds, and the request's id
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tf "%{X-Request-Id}o"'
access_logger = logging.getLogger("pdserve.http.access")


class LocalBackend:
    """What HttpFront serves from, in the router process: the Router itself. RouterLink
    (router/api_server.py) is the same, over ZeroMQ, for an API server process."""

    def __init__(self, router):
        self.router = router
        self.prompts: Prompts = router.prompts
        self.max_queue: int = router.cfg.max_queue

    def submit(self, request_id: str, ids: list[int], params: SamplingParams, stream: bool,
               reply_to: Callable[[object], None]) -> bool:
        """Admit a checked request; its Token, Done and Error go to reply_to. False if refused
        (the Error went to reply_to): submit no more for this HTTP request."""
        return self.router.submit(HTTP_CLIENT, request_id, ids, params, stream, reply_to)

    def cancel(self, request_id: str):
        self.router.cancel(HTTP_CLIENT, request_id)

    def rejected(self, code: str):
        self.router.metrics.on_error(code)

    async def health(self) -> tuple[int, list[str], bool]:
        """The workers that take work, the roles none serves, and whether the router is stopping."""
        serving, missing = self.router.serving()
        return len(serving), missing, self.router.stopping is not None

    async def metrics(self) -> bytes:
        return self.router.metrics.render()


class HttpFront:
    def __init__(self, backend, host: str, port: int, api_key: str | None, max_body_bytes: int,
                 sock: socket.socket | None = None, allowed_origins: str = "*",
                 served_model_names: tuple[str, ...] = (), parsers: OutputParsers = OutputParsers(),
                 access_log: bool = False):
        """Serves backend (LocalBackend or RouterLink) on host:port, or on sock, a listening socket
        that API server processes share. allowed_origins: the web origins whose pages may call it
        (CORS), comma-separated; "*" any, as vLLM's default. served_model_names: what requests may
        call the model (vLLM's --served-model-name), the first shown; by default its --model.
        parsers: how the model writes tool calls and reasoning (--tool-call-parser, --reasoning-parser).
        access_log: a line for each HTTP request (the router's --log-requests)."""
        self.backend, self.host, self.port, self.sock = backend, host, port, sock
        self.names = served_names(served_model_names, backend.prompts.model)
        self.model = self.names[0]
        self.parsers = parsers
        self.access_log = access_log
        self.request_log = RequestLog(access_log)  # the requests it refuses itself, as the router's are
        self.max_body_bytes = max_body_bytes
        self.send_wait_s = SEND_WAIT_S  # how long a stream's client may take nothing, as a ZeroMQ client's
        self.created = int(time.time())
        self.guard = Guard(backend.rejected, api_key, allowed_origins, max_body_bytes, ROUTES)
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self.guard.middleware])
        self.app.on_response_prepare.append(self.guard.cors_headers)
        self.app.router.add_get("/health", self.health)
        for method in ("GET", "POST"):  # vLLM's, for SageMaker's health checks
            self.app.router.add_route(method, "/ping", self.health)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model:.+}", self.model_card)
        self.app.router.add_get("/version", self.version)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_post("/detokenize", self.detokenize)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/invocations", self.invocations)
        self.runner: web.AppRunner | None = None
        self.listener: asyncio.Server | None = None
        self._sweeping: asyncio.Future | None = None
        self._inflight: set[asyncio.Queue] = set()  # each HTTP request's reply queue
        # choices' logprobs made JSON (_collect): threads of their own, not those that tokenize new requests;
        # several, so that one request's hundred choices interleave with another's one
        self._json_threads = concurrent.futures.ThreadPoolExecutor(JSON_THREADS, thread_name_prefix="http-json")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self):
        self.runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S,
                                    keepalive_timeout=KEEPALIVE_S, access_log_format=ACCESS_LOG_FORMAT,
                                    access_log=access_logger if self.access_log else None)
        await self.runner.setup()
        quiet_bad_requests()
        self.guard.headers_due = HeaderDeadline(self.runner)
        self._sweeping = asyncio.ensure_future(self.guard.headers_due.sweep())
        # our own listener, not an aiohttp site: a connection past the cap is refused before aiohttp takes it
        factory, loop = capped(self.runner.server, connection_cap()), asyncio.get_running_loop()
        if self.sock is not None:
            self.listener = await loop.create_server(factory, sock=self.sock, backlog=1024)
        else:
            self.listener = await loop.create_server(factory, self.host, self.port, backlog=1024, reuse_address=True)
        self.port = self.listener.sockets[0].getsockname()[1]  # the real one, if port 0 asked for any

    async def close(self):
        """Every request in flight ends with UNAVAILABLE (an error response, or a stream's error
        event), not a cut connection; handlers get SHUTDOWN_GRACE_S to write it."""
        for queue in self._inflight:
            queue.put_nowait((0, P.Error(None, "UNAVAILABLE", "the server is stopping")))
        if self._sweeping is not None:
            self._sweeping.cancel()
        if self.listener is not None:
            self.listener.close()
        if self.runner is not None:
            await self.runner.cleanup()
        self._json_threads.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ routes

    async def health(self, request: web.Request) -> web.Response:
        """200 while the live workers serve: one of each role (prefill or mono, decode or mono), or
        decode workers alone where they prefill too (not --enforce-disagg)."""
        workers, missing, stopping = await self.backend.health()
        if stopping:
            raise ApiError("UNAVAILABLE", STOPPING)
        if missing:
            raise ApiError("UNAVAILABLE", f"no live {' or '.join(missing)} worker")
        return web.json_response({"status": "ok", "workers": workers})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=await self.backend.metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "root": self.backend.prompts.model, "max_model_len": self.backend.prompts.context}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card(name) for name in self.names]})

    async def model_card(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        try:
            check_model(name, self.names)
        except ApiError as e:  # a /v1/ refusal, counted as the others are
            self.backend.rejected(e.code)
            raise
        return web.json_response(self._card(name))

    async def version(self, request: web.Request) -> web.Response:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return web.json_response({"version": version("pdserve")})
        except PackageNotFoundError:  # run from a checkout that was never installed
            return web.json_response({"version": "unknown"})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt's token ids (messages: through the chat template)."""
        asked = parse_tokenize(await read_json(request, self.max_body_bytes), self.names)
        prompts = self.backend.prompts
        ids = await asyncio.to_thread(prompts.encode, asked.prompt, asked.messages, asked.template,
                                      add_special_tokens=asked.add_special_tokens)
        head = {"count": len(ids), "max_model_len": prompts.context}

        def pieces():  # millions of ids are a second of json.dumps
            yield json.dumps(head)[:-1].encode()
            yield from _list_pieces("tokens", ids)
            if asked.return_token_strs:
                yield from _list_pieces("token_strs", ids, prompts.tokenizer.token_strs)
            yield b"}"
        return await self._json_body(request, pieces(), "/tokenize")

    async def detokenize(self, request: web.Request) -> web.Response:
        prompts = self.backend.prompts
        body = await read_json(request, self.max_body_bytes)
        ids = parse_detokenize(body, self.names, prompts.model_config.vocab_size)
        text = prompts.text(ids, skip_special_tokens=False)  # as vLLM's: special tokens shown
        if text is None:
            raise InvalidArgument(f"model {self.model!r} has no tokenizer", param="tokens")
        return web.json_response({"prompt": text})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._chat)

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's inference route (vLLM serves it, beside /ping): a chat's body or a completion's,
        told apart by its messages or prompt."""
        def parse(body):
            if isinstance(body, dict) and "messages" in body:
                return self._chat(body)
            if isinstance(body, dict) and "prompt" in body:
                return self._completion(body)
            raise InvalidArgument("the body holds neither messages nor prompt; allowed: a /v1/chat/completions "
                                  "body or a /v1/completions body")
        return await self._serve(request, parse)

    def _completion(self, body) -> Job:
        return parse_completion(body, self.names, self.backend.prompts.defaults)

    def _chat(self, body) -> Job:
        prompts = self.backend.prompts
        return parse_chat(body, self.names, prompts.context, self.parsers, prompts.defaults)

    # ------------------------------------------------------------------ requests

    async def _serve(self, request: web.Request, parse) -> web.StreamResponse:
        backend, prompts = self.backend, self.backend.prompts
        try:
            # the client's X-Request-Id, or one of ours: in the response's id and header, and the router's log
            # (the body's request_id, vLLM's, if no header: a body that fails to parse is logged by ours)
            given = given_request_id(request)
            request[REQUEST_ID] = given or uuid.uuid4().hex
            body = await read_json(request, self.max_body_bytes)
            if given is None and (given := body_request_id(body)) is not None:
                request[REQUEST_ID] = given
            base = f"{given}-{uuid.uuid4().hex[:8]}" if given else request[REQUEST_ID]  # unique if the client's repeat
            # off the event loop: tokenizing megabytes of text, or compiling a structured output's
            # grammar, would stall every stream (and, in the router's own process, its reading of
            # workers' heartbeats)
            job, prepared = await asyncio.to_thread(_prepare, parse, body, prompts, backend.max_queue)
            total = len(prepared) * job.n
        except (ApiError, InvalidArgument, web.HTTPRequestEntityTooLarge, web.HTTPRequestTimeout) as e:
            error = self.guard.http_error(request, e) if isinstance(e, web.HTTPException) else e
            backend.rejected(error.code)
            self.request_log.refused(HTTP_CLIENT, request.get(REQUEST_ID, "-"), error.code,
                                     getattr(error, "message", None) or str(error))
            raise
        choices = []
        for i in range(total):
            prompt, (ids, _) = job.prompts[i // job.n], prepared[i // job.n]
            # an echoed prompt of token ids shows its special tokens, as vLLM's (and its logprobs) do
            prompt_text = (prompt if isinstance(prompt, str) else prompts.text(ids, False) or "") if job.echo else ""
            choices.append(Choice(i, job, prompts.tokenizer, ids, prompt_text))
        queue: asyncio.Queue = asyncio.Queue()
        self._inflight.add(queue)
        try:
            for c in choices:
                reply_to = lambda msg, i=c.index: queue.put_nowait((i, msg))
                if not backend.submit(f"{base}-{c.index}", c.prompt_ids, job.choice_params(c.index), job.stream,
                                      reply_to):
                    break  # its Error is in the queue
            first = await queue.get()
            if isinstance(first[1], P.Error):
                raise ApiError(first[1].code, first[1].message)
            if job.stream:
                return await self._stream(request, job, choices, queue, first, base)
            return await self._collect(request, job, choices, queue, first, base)
        finally:  # done, failed, or the client went away: nothing of it goes on
            self._inflight.discard(queue)
            for c in choices:
                backend.cancel(f"{base}-{c.index}")

    async def _collect(self, request: web.Request, job: Job, choices: list[Choice], queue: asyncio.Queue, item,
                       request_id: str) -> web.StreamResponse:
        entries: list[bytes] = [b""] * len(choices)
        remaining = len(choices)
        while True:
            i, msg = item
            if isinstance(msg, P.Error):
                raise ApiError(msg.code, msg.message)
            if isinstance(msg, P.Done):
                # in JSON at once: the dicts of n choices' logprobs would be millions of objects, for the GC
                # to walk; logprobs in a thread, as the GIL lets it, beside the loop (a choice's can be 30 ms)
                if job.logprobs is None:
                    entries[i] = _final_json(choices[i], msg)
                else:
                    entries[i] = await asyncio.get_running_loop().run_in_executor(self._json_threads, _final_json,
                                                                                  choices[i], msg)
                remaining -= 1
                if not remaining:
                    break
            item = await queue.get()
        return await self._json_body(request, Envelope(job, request_id).response(job, choices, entries), request_id)

    async def _json_body(self, request: web.Request, pieces: Iterator[bytes], request_id: str) -> web.StreamResponse:
        """A JSON body made by pieces: one response where it is small; otherwise written as it is
        made, with the event loop (every stream, and the router's own work) run between pieces: a
        body of 200 MB was seconds of json.dumps holding it."""
        held, size, response = [], 0, None
        try:
            for piece in pieces:
                held.append(piece)
                size += len(piece)
                if size >= BODY_PIECE_BYTES:
                    if response is None:
                        response = web.StreamResponse(headers={"Content-Type": JSON_CONTENT_TYPE})
                        await response.prepare(request)
                    if not await self._write(request, response, b"".join(held), request_id, 0):
                        return response
                    held, size = [], 0
                    await asyncio.sleep(0)
            if response is None:
                return web.Response(body=b"".join(held), headers={"Content-Type": JSON_CONTENT_TYPE})
            if await self._write(request, response, b"".join(held), request_id, 0):
                await response.write_eof()
        except ConnectionError:  # the client went away
            pass
        return response

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes, request_id: str,
                     choices: int) -> bool:
        """data written to the client, or False: in send_wait_s it read under MIN_READ_BYTES of what
        waits, and its connection is closed (its requests' tokens would wait here for good, their
        choices decoding). One that reads, if slowly, is waited for."""
        transport = request.transport
        if not _write_may_wait(transport, len(data)):
            await response.write(data)  # (a timer a write cost the router a tenth of its HTTP tokens/s)
            return True
        writing = asyncio.ensure_future(response.write(data))
        try:
            await asyncio.sleep(0)  # its bytes handed to the transport, which waits for the client
            waiting = _unread(transport)
            while not (await asyncio.wait({writing}, timeout=self.send_wait_s))[0]:
                left = _unread(transport)
                if waiting - left < MIN_READ_BYTES:
                    self.request_log.http_client_stalled(request.remote, request_id, choices, self.send_wait_s)
                    transport.abort()
                    return False
                waiting = left
            writing.result()  # (a connection lost meanwhile raises, as a write does)
            return True
        finally:
            if not writing.done():  # stalled, or the handler cancelled (the client went away)
                writing.cancel()
            elif not writing.cancelled():
                writing.exception()  # taken, if any: else asyncio logs it as never retrieved

    async def _stream(self, request: web.Request, job: Job, choices: list[Choice], queue: asyncio.Queue,
                      item, request_id: str) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        envelope = Envelope(job, request_id)
        remaining, batch, last = len(choices), [item], False
        try:
            await response.prepare(request)  # its headers go out with the first chunk
            while not last:
                while not queue.empty():  # what arrived meanwhile goes in the same write
                    batch.append(queue.get_nowait())
                out = []
                for i, msg in batch:
                    if isinstance(msg, P.Error):
                        out.append(b"data: " + json.dumps(ApiError(msg.code, msg.message).body()).encode() + b"\n\n")
                        remaining = -1
                        break
                    choice = choices[i]
                    out += [envelope.chunk([entry], choice.usage(entry) if job.continuous_usage else None)
                            for entry in choice.chunks(msg)]
                    remaining -= isinstance(msg, P.Done)
                last = remaining <= 0
                if last:
                    if job.include_usage and remaining == 0:
                        out.append(envelope.chunk([], usage(job, choices)))
                    out.append(b"data: [DONE]\n\n")
                if not await self._write(request, response, b"".join(out), request_id, len(choices)):
                    break
                if not last:
                    batch = [await queue.get()]
        except ConnectionError:  # the client went away (the caller cancels its requests)
            pass
        return response


def _final_json(choice: Choice, done: P.Done) -> bytes:
    return json.dumps(choice.final(done)).encode()


def _list_pieces(name: str, ids: list[int], shown: Callable[[list[int]], list] = list) -> Iterator[bytes]:
    """', "name": [...]' of ids (or what shown makes of them), TOKENS_PER_PIECE a piece."""
    yield f', "{name}": ['.encode()
    for i in range(0, len(ids), TOKENS_PER_PIECE):
        yield (b", " if i else b"") + json.dumps(shown(ids[i:i + TOKENS_PER_PIECE]))[1:-1].encode()
    yield b"]"


def _unread(transport) -> int:
    """Bytes written to a connection that its client has not read yet: in the transport's buffer,
    and on Linux in the socket's send queue too, which holds megabytes and takes more from the
    transport only once much of it is read."""
    sock = transport.get_extra_info("socket")
    try:
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (AttributeError, OSError, ValueError):  # no socket, or not Linux: the transport's alone
        queued = 0
    return transport.get_write_buffer_size() + queued


def _write_may_wait(transport, size: int) -> bool:
    """Whether writing size more bytes may wait for the client to read: they take the transport's
    buffer to its high-water mark, where it pauses its writers (None: the connection is gone)."""
    return transport is not None and transport.get_write_buffer_size() + size >= transport.get_write_buffer_limits()[1]


def _prepare(parse, body, prompts, max_queue: int) -> tuple[Job, list]:
    """A body checked into a Job, and each of its prompts' ids and sampling: refused before any is
    tokenized where they make more choices than max_queue (900,000 one-letter prompts took 2 s)."""
    job: Job = parse(body)
    total = len(job.prompts) * job.n
    if total > max_queue:
        raise ApiError("INVALID_ARGUMENT", f"{len(job.prompts)} prompts x n={job.n} make {total} choices; "
                                           f"allowed: at most {max_queue} (the router's max_queue)",
                       "n" if job.n > 1 else "prompt")
    prepared = [prompts.validate(prompt, job.messages, job.params, job.max_tokens_field, job.template,
                                 job.add_special_tokens) for prompt in job.prompts]
    if job.think_first:  # a chat: one prompt
        end = thinking_end(prompts.tokenizer, prepared[0][0])
        if end is None:  # it cannot think first: JSON from its first token, all answer
            job = dataclasses.replace(job, reasoning=None)
        else:
            job = dataclasses.replace(job, params=dataclasses.replace(job.params, structured_outputs_after=end))
    return job, prepared
