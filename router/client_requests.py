"""What the SDK's two clients (router/client.py's Client, router/async_client.py's AsyncClient)
share: a call's arguments made a Generate, its Token and Done read back as Chunk and Result, and
the bookkeeping of requests in flight (open, unsent, replies not yet read, the kept ends of
cancelled ones), their deadlines and ids. The two clients differ only in how they wait.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass, field

import zmq

from common import protocol as P
from common.channel import Channel
from common.errors import InvalidArgument, short_repr
from router.connection import LOST, Connection, RequestError

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


def result_of(msg: P.Done) -> Result:
    return Result(msg.request_id, msg.token_ids, msg.text, msg.finish_reason, msg.prompt_token_ids, msg.timings,
                  msg.logprobs, msg.prompt_logprobs, msg.stop_reason)


def chunk_of(msg: P.Token) -> Chunk:
    return Chunk(msg.request_id, msg.index, msg.token_ids, msg.text, msg.logprobs)


def checked_request_id(request_id) -> str | None:
    """A caller's request_id: a string, or None for one of ours (the router could not name another
    in its refusal, and the call would wait for its timeout)."""
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidArgument(f"request_id={short_repr(request_id)} is invalid; allowed: a string", param="request_id")
    return request_id


CHAT_TEMPLATE_OPTIONS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")  # P.Generate's


def generate_message(request_id: str, prompt, messages, sampling: dict, stream: bool) -> P.Generate:
    if (prompt is None) == (messages is None):
        raise InvalidArgument(f"prompt={short_repr(prompt)} with messages={short_repr(messages)} is invalid; allowed: "
                              "exactly one of prompt (text or token ids) or messages (chat)", param="prompt")
    sampling = dict(sampling)
    special = sampling.pop("add_special_tokens", None)  # the prompt's, not the sampling's
    template = {name: sampling.pop(name) for name in CHAT_TEMPLATE_OPTIONS if name in sampling}  # the chat's
    if template and messages is None:
        raise InvalidArgument(f"{sorted(template)[0]} without messages is invalid; allowed: with messages (chat)",
                              param=sorted(template)[0])
    bias = sampling.get("logit_bias")
    if isinstance(bias, dict):  # the protocol's maps take string keys only: [token, bias] pairs
        sampling["logit_bias"] = [[t, b] for t, b in bias.items()]
    for name, value in sampling.items():  # (else the router refuses the whole message, naming no field)
        P.check_maps(value, name)
    if messages is not None:
        P.check_maps(messages, "messages")
    P.check_maps(template.get("chat_template_kwargs"), "chat_template_kwargs")
    return P.Generate(request_id, "" if prompt is None else prompt, sampling, stream, messages, token_batches=True,
                      add_special_tokens=special, **template)


def raise_error(msg: P.Error):
    raise RequestError(msg.code, msg.message, msg.request_id)


def cancel_nowait(chan: Channel, request_id: str) -> None:
    """Cancel a request on the router if the socket takes the message now: a send must never
    block (with no connection, as after a refused handshake, a DEALER's send waits for good), and
    with no connection there is nothing to cancel. Sync, so that a finalizer can call it."""
    chan.send_nowait(P.Cancel(request_id))


class Ids:
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


class Abandonable:
    """A stream closed (or dropped) before its end cancels its request (the client's _abandon)."""
    client: "InFlight"
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
            return chunk_of(msg)
        self.result = result_of(msg)
        rest = (self.result.text or "")[self.streamed:]
        return Chunk(self.result.request_id, len(self.result.token_ids), [], rest) if rest else None


def connect(ctx, address: str) -> Channel:
    """A DEALER to the router, or InvalidArgument for an address ZeroMQ cannot take."""
    try:
        return Channel.connect(ctx, zmq.DEALER, address, monitor=Connection.EVENTS)
    except zmq.ZMQError as e:
        ctx.term()
        raise InvalidArgument(f"router address {address!r} is invalid ({e.strerror}); allowed: tcp://HOST:PORT, "
                              "as the router prints it") from None


class InFlight:
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
        self._new_id = Ids()

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
        cancel_nowait(self.chan, request_id)

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
        if request_id not in self._open and not self._queued(request_id):
            raise RequestError("INVALID_ARGUMENT", f"request_id={short_repr(request_id)} is not in flight on this "
                                                   "client; allowed: an id its submit returned, until its result "
                                                   "is read", request_id)

    def _queued(self, request_id: str) -> int:
        """How many replies wait to be read for it."""
        raise NotImplementedError

    def _put(self, request_id: str, msg) -> None:
        """File a reply the client makes itself (the connection lost, the client closed)."""
        raise NotImplementedError

    def _lose(self, lost: set[str]) -> None:
        """The connection to the router dropped: each of `lost` still open fails UNAVAILABLE, after
        what the router sent before it went (filed already: a stopping router's last tokens, and its
        word on what it did not finish). After a Done the error is never read: a Done drops its queue."""
        for rid in lost & self._open:
            self._put(rid, P.Error(rid, "UNAVAILABLE", LOST))
        self._open -= lost

    def _sending(self, since: float, key: str, deadline: Deadline | None) -> None:
        """Between a send's tries (the socket cannot take it yet): why it gives up, if it does."""
        if (error := self._given_up(since, key, deadline)) is not None:
            raise error

    def _expired(self, since: float, key: str, deadline: Deadline) -> None:
        """While a read waits: why it gives up, if it does; the request, queued for a router that
        may yet come, is then cancelled."""
        if (error := self._given_up(since, key, deadline)) is not None:
            self._abandon(key)
            raise error

    def _given_up(self, since: float, key: str, deadline: Deadline | None) -> RequestError | None:
        """UNAVAILABLE after CONNECT_TIMEOUT_S of a call (since) with no connection to the router;
        TIMEOUT at the call's deadline."""
        error = self.connection.unreachable(self.address, since, key)
        if error is None and deadline is not None and deadline.passed():
            error = deadline.error(key, type(self).__name__)
        return error

    def _read_out(self, key: str, msg):
        """A message read for `key`: at its end (Done or Error) the request is forgotten, and an
        Error raises."""
        if isinstance(msg, (P.Error, P.Done)):
            self._forget(key)
        if isinstance(msg, P.Error):
            raise_error(msg)
        return msg

    def _abandon(self, request_id: str) -> None:
        """Its caller stopped waiting for it before its end: cancel it, and drop what came for it."""
        if request_id in self._open:
            self._forget(request_id)
            cancel_nowait(self.chan, request_id)
