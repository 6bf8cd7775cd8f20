"""The router's ZeroMQ client port, the counterpart of its HTTP front (router/http.py): the SDK's
clients (router/client.py) and the API server processes (router/api_server.py) send Generate,
Cancel, StatusRequest and MetricsRequest here, and read Token, Done and Error back.

What it adds to the socket:
- a worker's TokenBatch goes on to each client as one TokenBatch of its Tokens (`batched`), for a
  client that reads them (Generate.token_batches), each stream kept in order;
- a client found gone (its socket closed, its process dead) has its requests cancelled, since
  nobody would read their tokens; one that reads nothing for SEND_WAIT_S has them ended, and each
  new one refused, until it reads again (Router.submit asks `stalled`);
- clients whose requests send them nothing yet (not streamed, or still queued or prefilling) are
  probed every CLIENT_PROBE_S, so that a gone one is found before its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING, Callable

from common import protocol as P
from common.channel import Channel, Envelope
from common.chat import TemplateArgs, check_template_kwargs
from common.errors import InvalidArgument

if TYPE_CHECKING:
    from router.server import Request, Router

log = logging.getLogger("pdserve.router")
CLIENT_PROBE_S = 1.0  # how often a ZeroMQ client is probed while its requests send it nothing
# What a worker at the client port is told: it would otherwise wait
CLIENT_PORT = ("this is the router's client port; workers connect to its worker port (--worker-port, by default "
               "--port + 1)")


class ZmqFront:
    def __init__(self, router: "Router", chan: Channel):
        self.router, self.chan = router, chan
        chan.on_stalled = self._stalled
        # While a worker's token batch is handled: each client's Tokens, held to go as one TokenBatch
        self._held: dict[bytes, list[P.Token]] | None = None
        self._gone: set[bytes] = set()  # clients found unreachable, their requests about to be cancelled
        self._next_probe = time.monotonic() + CLIENT_PROBE_S  # when probe() looks next

    async def serve(self):
        while True:
            env = await self.chan.arecv()
            try:
                self.on_message(env)
            except Exception as e:  # a fault of ours; the client must still hear, or it waits for good
                log.exception("client message handling failed")
                if isinstance(env.msg, P.Generate):
                    self.send(env.sender, P.Error(env.msg.request_id, "INTERNAL", f"{type(e).__name__}: {e}"))

    def on_message(self, env: Envelope):
        router = self.router
        if env.error is not None:
            log.info("refused a client message: %s", env.error)
            self.send(env.sender, P.Error(env.error.request_id, env.error.code, str(env.error)))
            return
        msg = env.msg
        if isinstance(msg, P.Generate):
            self._admit(env.sender, msg)
        elif isinstance(msg, P.Cancel):
            router.cancel(env.sender, msg.request_id)
        elif isinstance(msg, P.StatusRequest):
            self.send(env.sender, router.status(msg.ask_id))
        elif isinstance(msg, P.MetricsRequest):
            self.send(env.sender, P.MetricsReply(router.metrics.render(), msg.ask_id))
        elif isinstance(msg, P.Rejected):
            if msg.code in P.REJECT_CODES:  # a label per code: not one per string a client can make up
                router.metrics.on_error(msg.code)
        else:
            self.send(env.sender, P.Error(None, "INVALID_ARGUMENT",
                                          f"{type(msg).__name__} is not a client message: {CLIENT_PORT}"))

    def _admit(self, client: bytes, msg: P.Generate):
        router, received = self.router, time.monotonic()
        try:
            template = None if msg.messages is None else TemplateArgs(
                None, check_template_kwargs(msg.chat_template_kwargs), msg.add_generation_prompt,
                msg.continue_final_message)
            ids, params = router.prompts.validate(msg.prompt, msg.messages, msg.sampling, template=template,
                                                  add_special_tokens=msg.add_special_tokens)
        except InvalidArgument as e:
            router.metrics.on_error(e.code)
            router.request_log.refused(client, msg.request_id, e.code, str(e))
            self.send(client, P.Error(msg.request_id, e.code, str(e)))
            return
        router.submit(client, msg.request_id, ids, params, msg.stream, received=received,
                      reply_to=self.reply_to(client, msg.token_batches))

    def reply_to(self, client: bytes, batches: bool) -> Callable[[object], None]:
        """Where a request's replies go: to `client`, in TokenBatches if it reads them."""
        return functools.partial(self._reply, client, batches)

    def _reply(self, client: bytes, batches: bool, msg):
        """If the client reads TokenBatch, a Token waits for the rest of its worker's batch (_held);
        anything else to the client sends what waits first, so each stream stays in order."""
        held = self._held
        if held is not None:
            if batches and type(msg) is P.Token and msg.prompt_logprobs is None:  # those are big: alone
                held.setdefault(client, []).append(msg)
                return
            if client in held and not self._send_held(client, held.pop(client)):
                return
        self.send(client, msg)

    @contextlib.contextmanager
    def batched(self):
        """Around the handling of a worker's token batch: each client's Tokens go as one message."""
        self._held = {}
        try:
            yield
        finally:
            held, self._held = self._held, None
            for client, tokens in held.items():
                self._send_held(client, tokens)

    def _send_held(self, client: bytes, tokens: list[P.Token]) -> bool:
        return self.send(client, tokens[0] if len(tokens) == 1 else P.batch_tokens(tokens))

    def send(self, client: bytes, msg) -> bool:
        """Send to a client, unless it is gone; one found gone has its requests cancelled."""
        if client in self._gone:
            return False
        if self.router._send(self.chan, msg, client, quiet=True):  # _cancel_gone says it
            return True
        self.gone(client, msg)
        return False

    def stalled(self, client: bytes) -> str | None:
        """Why a new request of this client is refused, if it reads nothing and the router stopped
        its requests (each new one would only wait with them)."""
        if not self.chan.stalled(client):
            return None
        return (f"this client has read nothing for {self.chan.send_wait_s:.0f} s: what the router sent it waits; "
                "read it, then send again")

    def gone(self, client: bytes, dropped=None):
        """A client that can no longer be reached has its requests cancelled: on the loop's next
        turn, outside the handler that found it gone (a done() replying, a worker's batch); until
        then what is sent to it goes nowhere. dropped: the message a send of which found it gone
        (None: an API server's process exited)."""
        if client not in self._gone:
            self._gone.add(client)
            asyncio.get_running_loop().call_soon(self._cancel_gone, client, dropped)

    def _cancel_gone(self, client: bytes, dropped=None):
        reqs = self.router.requests_of(client)
        for req in reqs:  # their replies go nowhere: send() skips a client in _gone
            self.router.cancel(client, req.client_request_id)
        self._gone.discard(client)
        if reqs or dropped is not None:
            self.router.request_log.client_gone(client, reqs, dropped)

    def _stalled(self, client: bytes):
        """A client that took nothing for SEND_WAIT_S with its queue full (common/channel.py:
        _post_to): its requests end with UNAVAILABLE, after what waits for it, which it reads if it
        reads again (an API server then fails its HTTP requests), and their work stops: what waits
        for it grows no more."""
        router = self.router
        reqs: list[Request] = router.requests_of(client)
        for req in reqs:
            router._cancel_work(req)
            router.error(req, "UNAVAILABLE", f"the router stopped this request: its client read nothing for "
                                             f"{self.chan.send_wait_s:.0f} s", logged=False)
        if reqs:
            router.request_log.client_stalled(client, reqs, self.chan.send_wait_s)

    def probe(self, now: float):
        """Every CLIENT_PROBE_S, find clients gone while their requests send them nothing: not
        streamed, or streamed but still queued or prefilling (a stream's tokens find a gone client
        themselves, once they flow)."""
        if now < self._next_probe:
            return
        self._next_probe = now + CLIENT_PROBE_S
        waiting = {req.client for req in self.router.requests.values()
                   if isinstance(req.client, bytes) and (not req.stream or not req.tokens)}
        for client in waiting:
            self.send(client, P.Probe())
