"""The router's log of requests: a line an operator can grep for each request, by the id its
client knows (an SDK's request_id; over HTTP the response's id and X-Request-Id, router/http.py)
beside the router's own number, which the workers' lines use.

Always: a request that fails after it was admitted (WARNING: its code and why), and where a
failed attempt goes next. With --log-requests (vLLM's --enable-log-requests): each request as it
is admitted, refused and finished, cancelled included. A ZeroMQ client found gone is one line
naming its requests.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("pdserve.router")
NAMED_AT_MOST = 8  # ids a line about many requests names


def label(req) -> str:
    return f"{req.client_request_id} (#{req.rid})"


def client_name(client) -> str:
    """A ZeroMQ identity as text: an API server's is ASCII, an SDK client's five random bytes hex."""
    if isinstance(client, bytes):
        return client.decode() if client.isascii() and client.decode().isprintable() else client.hex()
    return str(client)


def _ids(reqs) -> str:
    names = [r.client_request_id for r in reqs[:NAMED_AT_MOST]]
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
            log.info("request %s from %s refused: %s: %s", client_request_id, client_name(client), code, message)

    def finished(self, req, reason: str):
        if not self.verbose:
            return
        e2e = time.monotonic() - req.arrival
        first = "" if req.first_token_at is None else f", the first after {req.first_token_at - req.arrival:.3f} s"
        how = "cancelled by its client" if reason == "cancelled" else f"finished ({reason})"
        log.info("request %s %s: %d tokens in %.3f s%s, %d attempt%s", label(req), how, len(req.tokens), e2e, first,
                 req.attempt, "" if req.attempt == 1 else "s")

    def failed(self, req, code: str, message: str):
        log.warning("request %s failed after %d tokens: %s: %s", label(req), len(req.tokens), code, message)

    def redispatched(self, req, failed_attempt: int, why: str):
        """After Router.dispatch: where the next attempt went, or that it waits for a worker."""
        if req.state == "done":
            where = "the tokens it delivered end it"
        elif req.attempt > failed_attempt:
            where = f"attempt {req.attempt} on {req.prefill_worker}" + \
                    ("" if req.prefill_worker == req.decode_worker else f" -> {req.decode_worker}")
        else:
            where = "it waits for a live worker"
        carried = f", carrying its {len(req.tokens)} delivered tokens" if req.tokens else ""
        log.info("request %s attempt %d failed (%s); %s%s", label(req), failed_attempt, why, where, carried)

    def clients_requests_cancelled(self, client, reqs: list, why: str):
        log.warning("client %s %s: its %d requests cancelled: %s", client_name(client), why, len(reqs), _ids(reqs))
