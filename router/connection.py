"""The SDK's link to a router, shared with the API server processes: whether the socket reaches the
router (a ZeroMQ socket hides it: a send to no one queues, a refused CURVE key drops each
handshake), and the messages a reply holds. A call must fail UNAVAILABLE, not wait out its timeout,
when no router answers, and every reply in flight must fail when the connection drops.
"""

from __future__ import annotations

import time
from typing import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from common import protocol as P
from common.channel import Channel
from common.security import HANDSHAKE_EVENTS, refusal

LOST = "lost the connection to the router (it died or restarted); the request's outcome is unknown"
CONNECT_TIMEOUT_S = 10.0  # how long a request waits for any connection to the router before UNAVAILABLE
DROPPED_HANDSHAKES = 3  # dropped in a row (some 0.3 s of libzmq's retries): the router cannot read our CURVE hello


class RequestError(Exception):
    """A request or call that failed: the router's code and message, or the SDK's own (UNAVAILABLE
    when no router answers or the connection dropped, TIMEOUT when the call's timeout passed)."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.request_id = code, message, request_id


def replies(msg) -> tuple[list, list[P.ProtocolError]]:
    """The messages a reply from the router holds (a TokenBatch's Tokens, else the reply itself),
    and the errors of a batch's bad items, which leave the others standing. A Probe holds none."""
    if not isinstance(msg, P.TokenBatch):
        return ([] if isinstance(msg, P.Probe) else [msg]), []
    items = P.unbatch_tokens(msg)
    return ([m for m in items if not isinstance(m, P.ProtocolError)],
            [e for e in items if isinstance(e, P.ProtocolError)])


def until(*times: float | None) -> float | None:
    """Seconds until the earliest of times (None: never)."""
    times = [t for t in times if t is not None]
    return max(0.0, min(times) - time.monotonic()) if times else None


class Connection:
    """Whether a client's socket reaches the router, from the socket's monitor (made before it
    connects, so that the first handshake is seen). A call that has waited CONNECT_TIMEOUT_S with
    no connection (no router there) fails UNAVAILABLE rather than wait out its timeout, and one
    whose key the router refused fails at once (given another server key, once the router dropped
    DROPPED_HANDSHAKES of its handshakes); a connection that drops loses every reply in
    flight. The socket reconnects by itself: a router back is used again."""

    EVENTS = zmq.EVENT_DISCONNECTED | HANDSHAKE_EVENTS  # Channel.connect(monitor=EVENTS)

    def __init__(self, chan: Channel):
        self.chan = chan
        self.monitor = chan.monitor
        # drain()'s: an async client's loop may not have run since the router restarted (a notebook's
        # cells, run_until_complete), so each call takes the monitor's news first, without awaiting
        self._sync_monitor = (zmq.Socket.shadow(chan.monitor.underlying)
                              if isinstance(chan.monitor, zmq.asyncio.Socket) else chan.monitor)
        self.down_since: float | None = time.monotonic()  # None while connected
        self.refused: str | None = None  # why the router refused our handshake (libzmq then stops trying)
        self.dropped = 0  # handshakes the router dropped in a row: it cannot read our hello (another server.key)

    def on_event(self, event: dict) -> bool:
        """Take a monitor event; True if it was the connection dropping (not an attempt failing:
        a router refusing our key drops each one before its handshake)."""
        kind = event["event"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.down_since, self.refused, self.dropped = None, None, 0
            return False
        dropped = kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL  # also once by chance (a router stopping mid-handshake)
        self.dropped += dropped
        if not dropped or self.dropped >= DROPPED_HANDSHAKES:
            self.refused = refusal(kind, "client") or self.refused
        if self.down_since is not None:
            return False
        self.down_since = time.monotonic()
        return True

    def drain(self) -> bool:
        """Take every event waiting on the monitor, without waiting; True if the connection dropped."""
        dropped = False
        while self._sync_monitor.poll(0):
            dropped |= self.on_event(recv_monitor_message(self._sync_monitor))
        return dropped

    def give_up_at(self, since: float) -> float | None:
        """When a call begun at `since` stops waiting for a connection (None: connected)."""
        return None if self.down_since is None else max(self.down_since, since) + CONNECT_TIMEOUT_S

    def unreachable(self, address: str, since: float, request_id: str | None) -> RequestError | None:
        """The error for a call begun at `since`, if the router refused us or it waited too long."""
        if self.refused is not None:
            return RequestError("UNAVAILABLE", f"the router at {address} refused the connection: {self.refused}",
                                request_id)
        at = self.give_up_at(since)
        if at is not None and time.monotonic() >= at:
            return RequestError("UNAVAILABLE", f"no router answers at {address} (for {CONNECT_TIMEOUT_S:g}s): is one "
                                               "running there, with the same CURVE keys?", request_id)
        return None

    async def watch(self, lost: Callable[[], None]) -> None:
        """Call lost() each time the connection drops, until cancelled (an async socket's monitor)."""
        while True:
            if self.on_event(await recv_monitor_message(self.monitor)):
                lost()

    def close(self):
        self.chan.close_monitor()
