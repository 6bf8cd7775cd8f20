"""The router's log of requests: a line an operator can grep for each request, by the id its
client knows (an SDK's request_id; over HTTP the response's id and X-Request-Id, router/http.py)
beside the router's own number, which the workers' lines use.

Always: a request that fails after it was admitted (WARNING: its code and why), and where a
failed attempt goes next. With --log-requests (vLLM's --enable-log-requests): each request as it
is admitted, refused and finished, cancelled included. A ZeroMQ client found gone, or that read
nothing for too long, is one line naming its requests. A client's id is its own text: a line shows
it as it is only where it is short and printable, else quoted and cut (a newline in an SDK's
request_id would forge a line of its own).
"""

from __future__ import annotations

import logging
import time

from common import protocol as P
from common.errors import short_repr

log = logging.getLogger("pdserve.router")
NAMED_AT_MOST = 8  # ids a line about many requests names
ID_CHARS = 128  # the longest id a line shows whole


def shown(client_request_id) -> str:
    """A client's request id as a log line may show it."""
    text = str(client_request_id)
    return text if len(text) <= ID_CHARS and text.isprintable() else short_repr(text, ID_CHARS)


def label(req) -> str:
    return f"{shown(req.client_request_id)} (#{req.rid})"


def client_name(client) -> str:
    """A ZeroMQ identity as text: an API server's is ASCII, an SDK client's five random bytes hex."""
    if isinstance(client, bytes):
        return client.decode() if client.isascii() and client.decode().isprintable() else client.hex()
    return str(client)


def _ids(reqs) -> str:
    names = [shown(r.client_request_id) for r in reqs[:NAMED_AT_MOST]]
    return ", ".join(names) + (f" and {len(reqs) - NAMED_AT_MOST} more" if len(reqs) > NAMED_AT_MOST else "")


class RequestLog:
    def __init__(self, verbose: bool):
        self.verbose = verbose  # --log-requests

    def admitted(self, req):
        if self.verbose:
            log.info("request %s admitted from %s: %d prompt tokens, max_tokens %d%s", label(req),
                     client_name(req.client), len(req.prompt_ids), req.params.max_tokens,
                     ", streamed" if req.stream else "")

    def refused(self, client, client_request_id: str, code: str, message: str):
        if self.verbose:
            log.info("request %s from %s refused: %s: %s", shown(client_request_id), client_name(client), code,
                     message)

    def finished(self, req, reason: str):
        if not self.verbose:
            return
        e2e = time.monotonic() - req.arrival
        first = "" if req.first_token_at is None else f", the first after {req.first_token_at - req.arrival:.3f} s"
        how = "cancelled by its client" if reason == "cancelled" else f"finished ({reason})"
        log.info("request %s %s: %d tokens in %.3f s%s, %d attempt%s", label(req), how, len(req.tokens), e2e, first,
                 req.attempt, "" if req.attempt == 1 else "s")

    def failed(self, req, code: str, message: str, logged: bool = True):
        """logged: False where a line about many requests says it (client_stalled); --log-requests
        still gives each its own."""
        if logged or self.verbose:
            log.warning("request %s failed after %d tokens: %s: %s", label(req), len(req.tokens), code, message)

    def redispatched(self, req, failed_attempt: int, why: str):
        """After Router.dispatch: where the next attempt went, or that it waits for a worker."""
        carried = f", carrying its {len(req.tokens)} delivered tokens" if req.tokens else ""
        if req.state == "done":
            where, carried = f"the {len(req.tokens)} tokens it delivered end it", ""
        elif req.attempt > failed_attempt:
            where = f"attempt {req.attempt} on {req.prefill_worker}" + \
                    ("" if req.prefill_worker == req.decode_worker else f" -> {req.decode_worker}")
        else:
            where = "it waits for a live worker"
        log.info("request %s attempt %d failed (%s); %s%s", label(req), failed_attempt, why, where, carried)

    def client_gone(self, client, reqs: list, dropped=None):
        """dropped: the message a send of which found it gone, if one did."""
        lost = ""
        if dropped is not None:
            about = P.reply_id(dropped)
            lost = f" ({type(dropped).__name__}{f' of {shown(about)}' if about else ''} not delivered)"
        log.warning("client %s is gone%s%s", client_name(client), lost,
                    f": its {len(reqs)} requests cancelled: {_ids(reqs)}" if reqs else "")

    def http_client_stalled(self, remote: str | None, request_id: str, choices: int, wait_s: float):
        log.warning("HTTP client %s read nothing of response %s for %.0f s: its connection closes%s", remote,
                    request_id, wait_s, f" and its {choices} choices stop" if choices else "")

    def client_stalled(self, client, reqs: list, wait_s: float):
        log.warning("client %s read nothing for %.0f s: its %d requests end with UNAVAILABLE: %s", client_name(client),
                    wait_s, len(reqs), _ids(reqs))
