"""Typed ZeroMQ endpoints: one socket plus the protocol, so no process's logic touches raw
sockets or bytes.

    chan = Channel.bind(ctx, zmq.ROUTER, "tcp://127.0.0.1:0")
    env = chan.recv()                      # Envelope(sender, msg, frames, error)
    chan.send(Reply(...), to=env.sender)

A ROUTER endpoint's envelopes carry the peer's identity; DEALER ones do not. Extra frames (KV
bytes) are sent without copying and received as zmq.Frame objects whose `.buffer` is a
zero-copy memoryview. Works with a plain or a zmq.asyncio context (`arecv` and `post` for the
latter).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import zmq
import zmq.asyncio

from common import protocol
from common.protocol import ProtocolError
from common.security import secure

log = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 64 * 2**20  # every socket has a cap; KV ingress sets its own, larger
SEND_WAIT_S = 5.0  # try_send's wait for a peer that does not take a message (a slow one catches up by then)
RETRY_S = 0.005  # how often post() offers a peer at its high-water mark what waits for it


@dataclass
class Backlog:
    """What waits for a peer at its high-water mark (Channel._post_to), since when it took nothing,
    and whether on_stalled was told."""
    waiting: deque
    since: float
    told: bool = False


@dataclass
class Envelope:
    sender: bytes | None
    msg: object | None
    frames: list = field(default_factory=list)  # zmq.Frame, after the header
    error: ProtocolError | None = None


WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "")  # bound there, a socket takes connections on every interface


def reachable_host(host: str, toward: str) -> str:
    """What other machines reach a socket bound at `host` by: host itself, or for a wildcard (an
    address no peer can connect to) this machine's address on its route toward `toward`
    (tcp://HOST:PORT: the router's), as the kernel picks it; the router's other hosts reach it
    there. A decode worker advertises it to prefill workers."""
    if host not in WILDCARD_HOSTS:
        return host
    peer = toward.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))  # a UDP socket's connect sends nothing: it only picks the route
            return s.getsockname()[0]
    except OSError as e:
        log.warning("no route from this machine toward %s (%s): advertising %s, which other machines cannot reach",
                    toward, e, host)
        return host


class Channel:
    def __init__(self, sock: zmq.Socket, max_header_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES):
        self.sock = sock
        self.max_header_bytes = max_header_bytes
        self.is_router = sock.type == zmq.ROUTER
        # post(): the same socket without zmq.asyncio's futures, and how many of its sends wait
        self._raw = zmq.Socket.shadow(sock.underlying)
        self._waiting, self._posted = 0, False
        self._backlogs: dict[bytes, Backlog] = {}  # a ROUTER's post(): each peer's at its high-water mark
        self._retrying: asyncio.TimerHandle | None = None
        self.on_stalled: Callable[[bytes], None] | None = None  # told of a peer that takes nothing
        self._stalled = False  # try_send gave up on a send and has not sent since
        self.send_wait_s = SEND_WAIT_S  # how long a peer may take nothing: try_send's wait (0: none), post()'s report
        self.peer_name = ""  # what a connecting channel's logs call its peer: the address
        self.monitor: zmq.Socket | None = None  # connect(monitor=...)'s

    @classmethod
    def _make(cls, ctx, kind: int, max_frame_bytes: int | None, identity: bytes | None, end: str):
        sock = ctx.socket(kind)
        secure(sock, ctx, end)  # CURVE when PDSERVE_CURVE_DIR is set
        sock.setsockopt(zmq.LINGER, 0)
        # A peer sending a larger frame is disconnected before the frame is buffered whole.
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes or DEFAULT_MAX_FRAME_BYTES)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises, not vanishes
        return sock

    @classmethod
    def bind(cls, ctx, kind: int, address: str, max_frame_bytes: int | None = None, end: str = "router_clients",
             **kw) -> "Channel":
        """end: what the socket is for, whose CURVE keys it admits (common/security.py's ENDS)."""
        sock = cls._make(ctx, kind, max_frame_bytes, None, end)
        sock.bind(address)
        return cls(sock, **kw)

    @classmethod
    def connect(cls, ctx, kind: int, address: str, identity: bytes | None = None,
                max_frame_bytes: int | None = None, monitor: int = 0, end: str = "client", **kw) -> "Channel":
        """monitor: socket events to watch (`.monitor`, a PAIR socket), watched from before the
        connection starts so that none is missed. end: what the socket is for, which CURVE keypair
        it shows (common/security.py's ENDS)."""
        sock = cls._make(ctx, kind, max_frame_bytes, identity, end)
        watcher = sock.get_monitor_socket(monitor) if monitor else None
        try:
            sock.connect(address)
        except zmq.ZMQError:
            if watcher is not None:
                sock.disable_monitor()
                watcher.close(linger=0)
            sock.close(linger=0)  # else the context's term() would wait for it
            raise
        chan = cls(sock, **kw)
        chan.monitor, chan.peer_name = watcher, address
        return chan

    @property
    def address(self) -> str:
        """The bound address with the real port (after binding port 0)."""
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, msg, frames=(), to: bytes | None = None):
        """Frames go without copying; the header is copied (it is small). Returns the asyncio future
        of an async socket. (A send whose frames' release matters: try_send(track=True).)"""
        return self.sock.send_multipart(self._head(msg, to) + list(frames), copy=False)

    def post(self, msg, to: bytes | None = None) -> None:
        """Send a frameless message on an asyncio channel without making a future: at once when no
        send of ours waits before it, which is nearly always (a ROUTER socket below a peer's high-
        water mark never blocks); else behind those that wait, in order: on a ROUTER, those to the
        same peer (_post_to). A future per send was a third of the router's CPU per token (bench
        router). Raises zmq.ZMQError as send does (a gone peer); a later failure is logged."""
        parts = self._head(msg, to)
        if to is not None:
            return self._post_to(to, parts)
        if not self._waiting:
            self._settle_soon()  # (also when the send raises: it may have taken the edge all the same)
            try:
                self._raw.send_multipart(parts, zmq.NOBLOCK)
            except zmq.Again:
                pass
            else:
                return
        self._waiting += 1
        self.sock.send_multipart(parts).add_done_callback(self._sent)

    def _post_to(self, peer: bytes, parts: list) -> None:
        """A ROUTER's post: a peer whose queue is full (it stopped reading) gets a backlog of its
        own, offered to it every RETRY_S, so that no other peer's messages wait behind it (they all
        did, one stalled client delaying every stream by seconds). One that takes nothing for
        send_wait_s is reported to on_stalled, once (the router ends its requests there); what
        waits for it keeps waiting, in order, until it reads again or is gone: a Done in it may be
        its request's only end."""
        backlog = self._backlogs.get(peer)
        if backlog is None:
            self._settle_soon()  # a send to a gone peer also takes the edge, before it raises
            try:
                self._raw.send_multipart(parts, zmq.NOBLOCK)  # a gone peer raises (ROUTER_MANDATORY)
                return
            except zmq.Again:
                backlog = self._backlogs[peer] = Backlog(deque(), time.monotonic())
                self._retry_soon()
        backlog.waiting.append(parts)

    def stalled(self, peer: bytes) -> bool:
        """Whether on_stalled was told of peer, and it has taken nothing since."""
        backlog = self._backlogs.get(peer)
        return backlog is not None and backlog.told

    def _retry_soon(self) -> None:
        if self._retrying is None:
            self._retrying = asyncio.get_running_loop().call_later(RETRY_S, self._retry)

    def _retry(self) -> None:
        self._retrying = None
        now = time.monotonic()
        for peer, backlog in list(self._backlogs.items()):
            waiting = backlog.waiting
            try:
                while waiting:
                    self._raw.send_multipart(waiting[0], zmq.NOBLOCK)
                    waiting.popleft()
                    backlog.since, backlog.told = now, False
            except zmq.Again:
                if not backlog.told and now - backlog.since > self.send_wait_s:
                    backlog.told = True  # once; what waits keeps waiting, in order
                    log.warning("%r has taken nothing for %.0f s: %d messages wait for it", peer, self.send_wait_s,
                                len(waiting))
                    if self.on_stalled is not None:
                        self.on_stalled(peer)
                continue
            except zmq.ZMQError as e:
                log.warning("dropped %d messages to %r: it is gone (%s)", len(waiting), peer, e)
            del self._backlogs[peer]
        self._settle_soon()
        if self._backlogs:
            self._retry_soon()

    def _settle_soon(self) -> None:
        if not self._posted:  # once per turn of the loop, however many posts
            self._posted = True
            asyncio.get_running_loop().call_soon(self.settle)

    def _sent(self, future):
        self._waiting -= 1
        if not future.cancelled() and future.exception() is not None:
            log.warning("send failed: %s", future.exception())

    def settle(self) -> None:
        """After posts, on the loop's next turn: let the asyncio socket look at its events again.
        ZeroMQ signals its file descriptor on edges, and a send made past zmq.asyncio can take the
        edge that a pending receive waits for."""
        if self._posted and not self.sock.closed:
            self._posted = False
            self.sock.get(zmq.EVENTS)  # zmq.asyncio schedules the waiting receive if a message is there

    def send_nowait(self, msg) -> bool:
        """Send a frameless message (or its bytes, encoded once for many tries) if the socket takes
        it now, else drop it; never blocks, never makes a future, callable outside the event loop's
        coroutines (a finalizer). On an asyncio socket it then looks at the socket's events, as
        settle() does. Returns whether it went."""
        if self.sock.closed:
            return False
        try:
            self._raw.send(msg if isinstance(msg, bytes) else protocol.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        if isinstance(self.sock, zmq.asyncio.Socket):
            try:
                self.sock.get(zmq.EVENTS)  # zmq.asyncio schedules a waiting receive if a message is there
            except RuntimeError:  # a finalizer's, after its event loop closed: nothing waits to receive
                pass
        return True

    def try_send(self, msg, frames=(), to: bytes | None = None, track: bool = False):
        """Send, or log and return False if the peer is gone (ROUTER) or does not take it within
        self.send_wait_s: it stopped reading (its queue is at the high-water mark), or it never
        connected (a DEALER has nowhere to queue). Once a send has been given up, the next ones fail
        at once until one goes through: a dead router must not freeze the worker that sends to it
        (its loop, and with it SIGTERM's handling, goes on). With track=True: a Released that covers
        every frame, or None if it did not go; the frames must be fresh memoryview slices (or other
        weakly referable buffers) that the caller does not keep."""
        # Frames made first: once the header is out, nothing but the socket may fail mid-message.
        parts = self._head(msg, to) + ([zmq.Frame(f, copy=False) for f in frames] if track else list(frames))
        try:
            sent = self._send_now(parts) or (
                not self._stalled and self._raw.poll(int(self.send_wait_s * 1e3), zmq.POLLOUT) != 0
                and self._send_now(parts))
        except zmq.ZMQError as e:
            log.warning("could not send %s to %r: %s", type(msg).__name__, to or self.peer_name, e)
            return None if track else False
        if not sent and not self._stalled:
            log.warning("could not send %s to %r: nothing took it for %g s; dropping what this socket sends "
                        "until its peer reads again", type(msg).__name__, to or self.peer_name, self.send_wait_s)
        elif sent and self._stalled:
            log.info("%r reads again", to or self.peer_name)
        self._stalled = not sent
        if track:
            return Released(frames) if sent else None
        return sent

    def _send_now(self, parts: list) -> bool:
        """Send without waiting; False if the socket would block."""
        try:
            self._raw.send_multipart(parts, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    @staticmethod
    def _head(msg, to: bytes | None) -> list:
        """A message's first frames: the peer's identity (a ROUTER's send), then the header."""
        return ([to] if to is not None else []) + [protocol.encode(msg)]

    def _parse(self, parts: list) -> Envelope:
        sender = None
        if self.is_router:
            sender, parts = parts[0].bytes, parts[1:]
        if not parts:
            return Envelope(sender, None, [], ProtocolError("empty message"))
        try:
            msg = protocol.decode(parts[0].buffer, self.max_header_bytes)
        except ProtocolError as e:
            return Envelope(sender, None, parts[1:], e)
        return Envelope(sender, msg, parts[1:])

    def recv(self, timeout_ms: int | None = None) -> Envelope | None:
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return self._parse(self.sock.recv_multipart(copy=False))

    async def arecv(self) -> Envelope:
        return self._parse(await self.sock.recv_multipart(copy=False))

    def close(self, linger_ms: int = 0):
        """linger_ms: how long what is still queued may take to go (0: dropped; post()'s backlogs
        are dropped either way)."""
        if self._retrying is not None:
            self._retrying.cancel()
            self._retrying = None
        self._backlogs.clear()
        self.close_monitor()
        self.sock.close(linger=linger_ms)

    def close_monitor(self):
        """Stop watching the socket's events (a monitor left open holds the context's term())."""
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None


class Released:
    """Whether zmq is done with buffers it was handed without copying. pyzmq holds each such
    buffer's object until libzmq has sent or dropped it (as the buffer protocol requires: the
    exporter lives while its memory is in use), so a weak reference to the object dies just then.
    zmq.MessageTracker tells the same for one frame of a message at the cost of an Event per
    frame, set from pyzmq's collector thread; on a 64 MB KV transfer that was a tenth of the
    sender's Python time."""
    __slots__ = ("_refs",)

    def __init__(self, buffers):
        self._refs = [weakref.ref(b) for b in buffers]

    @property
    def done(self) -> bool:
        return all(r() is None for r in self._refs)


class Waker:
    """A pipe that a zmq.Poller waits on beside its sockets, so that another thread can end the
    poll at once (a KV receive finished there) rather than the loop polling on a timer."""

    def __init__(self):
        self.fd, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()  # a wake() never writes to a descriptor close() let go of

    def wake(self) -> None:
        """Thread-safe."""
        with self._lock:
            if self._w is None:
                return
            try:
                os.write(self._w, b"\0")
            except OSError:  # full: a wake-up is pending anyway
                pass

    def wake_from_signal(self) -> None:
        """wake() for a signal handler. Python runs handlers on the main thread between two of its
        bytecodes, perhaps inside wake()'s lock (a second signal during the first's handler, or a
        wake() on the main thread): taking the lock there never returned, and the worker ignored
        every later SIGTERM. No lock is needed here: the waker's owner closes it on the main
        thread, which cannot run close() while it runs this."""
        w = self._w
        if w is not None:
            try:
                os.write(w, b"\0")
            except OSError:
                pass

    def drain(self) -> None:
        os.read(self.fd, 4096)

    def close(self) -> None:
        with self._lock:
            w, self._w = self._w, None  # a late wake() from another thread now writes nothing
        if w is None:
            return
        os.close(self.fd)
        os.close(w)
