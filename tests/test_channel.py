"""Channel.post: the router's sends without zmq.asyncio's futures. Order holds when a peer's
queue fills and posts have to wait, a peer that stops reading delays no other and is given up,
and a receive pending on the same socket is never left asleep by a send that took ZeroMQ's
edge-triggered wake-up."""

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from common import protocol as P
from common.channel import Channel, reachable_host
from router.launcher import free_port


@pytest.fixture
def pair():
    actx, ctx = zmq.asyncio.Context(), zmq.Context()
    router = Channel.bind(actx, zmq.ROUTER, "tcp://127.0.0.1:0")
    router.sock.setsockopt(zmq.SNDHWM, 8)
    peer = Channel.connect(ctx, zmq.DEALER, router.address, identity=b"peer")
    peer.sock.setsockopt(zmq.RCVHWM, 8)
    yield router, peer
    peer.close()
    router.close()
    ctx.term()
    actx.term()


async def _handshake(router: Channel, peer: Channel):
    peer.send(P.Cancel("hello"))
    env = await asyncio.wait_for(router.arecv(), 5)
    assert env.sender == b"peer"


def test_posts_past_a_full_queue_wait_their_turn_and_arrive_in_order(pair):
    router, peer = pair
    pad = "x" * 2**16

    async def main():
        await _handshake(router, peer)
        for i in range(2000):  # 128 MiB: far past the high-water marks and the kernel's buffers
            router.post(P.Cancel(f"{i} {pad}"), to=b"peer")
        assert router._backlogs[b"peer"].waiting  # waiting, in the peer's own backlog
        got = []
        while (env := peer.recv(200)) is not None:  # the loop does not run: only what went at once
            got.append(int(env.msg.request_id.split()[0]))
        for i in range(2000, 2100):  # room now, but sends still wait before these
            router.post(P.Cancel(f"{i} {pad}"), to=b"peer")
        while len(got) < 2100:
            env = peer.recv(0)
            if env is None:
                await asyncio.sleep(0.001)  # let the waiting sends go as the peer reads
                continue
            got.append(int(env.msg.request_id.split()[0]))
        assert got == list(range(2100))
        for _ in range(100):  # the backlog is retried on a later turn of the loop
            if not router._backlogs:
                break
            await asyncio.sleep(0.01)
        assert not router._backlogs
    asyncio.run(main())


def test_a_peer_that_stops_reading_delays_no_other_is_reported_and_loses_nothing(pair):
    """A client that stopped reading used to hold every later post behind its full queue: other
    clients' streams stalled for seconds, and each failed send logged a line. Its own messages
    wait for it, in order, however long (a Done among them may be its request's only end)."""
    router, stalled = pair
    ctx = zmq.Context()
    reader = Channel.connect(ctx, zmq.DEALER, router.address, identity=b"reader")
    pad = "x" * 2**16
    given_up = []
    router.on_stalled = given_up.append
    router.send_wait_s = 2.0

    async def main():
        await _handshake(router, stalled)
        reader.send(P.Cancel("hello"))
        assert (await asyncio.wait_for(router.arecv(), 5)).sender == b"reader"
        for i in range(2000):  # 128 MiB to the peer that reads nothing: past its queue and the kernel's buffers
            router.post(P.Cancel(f"{i} {pad}"), to=b"peer")
            router.post(P.Cancel(f"{i}"), to=b"reader")
        assert router._backlogs[b"peer"].waiting
        t0 = time.monotonic()
        for i in range(2000):  # all of them, in order, while the other's backlog waits
            env = reader.recv(0)
            while env is None and time.monotonic() - t0 < 5:
                await asyncio.sleep(0.001)
                env = reader.recv(0)
            assert env is not None and env.msg.request_id == str(i)
        assert time.monotonic() - t0 < router.send_wait_s and not given_up
        while not given_up and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.05)
        assert given_up == [b"peer"] and router._backlogs[b"peer"].waiting  # told once, and it waits
        router.post(P.Cancel("after"), to=b"reader")  # the channel serves on
        assert reader.recv(2000).msg.request_id == "after"
        got = []
        while len(got) < 2000 and time.monotonic() - t0 < 30:  # it reads again: all of it, in order
            env = stalled.recv(0)
            if env is None:
                await asyncio.sleep(0.001)
                continue
            got.append(int(env.msg.request_id.split()[0]))
        assert got == list(range(2000)) and given_up == [b"peer"]
    try:
        asyncio.run(main())
    finally:
        reader.close()
        ctx.term()


def test_a_receive_pending_while_posts_go_out_still_wakes(pair):
    router, peer = pair

    async def main():
        await _handshake(router, peer)
        for round_ in range(200):
            pending = asyncio.ensure_future(router.arecv())
            await asyncio.sleep(0)  # the receive now waits on the socket's edge
            peer.send(P.Cancel(f"in-{round_}"))
            time.sleep(0.002)  # without yielding: ZeroMQ's I/O thread has raised the edge by now
            for i in range(3):  # sends that may take the edge the arrival raised
                router.post(P.Cancel(f"out-{round_}-{i}"), to=b"peer")
            env = await asyncio.wait_for(pending, 2)
            assert env.msg.request_id == f"in-{round_}"
            for i in range(3):
                assert peer.recv(2000).msg.request_id == f"out-{round_}-{i}"
    asyncio.run(main())


def test_a_receive_pending_while_a_post_to_a_gone_peer_fails_still_wakes(pair):
    """A post to a peer that is gone raises (ROUTER_MANDATORY) but may take the edge all the same:
    a new SDK client's request, arriving as the router found the last client gone, sat unread in
    the router's socket until something else woke it (8 s, its client's timeout)."""
    router, peer = pair
    ctx = zmq.Context()

    async def main():
        await _handshake(router, peer)
        for round_ in range(100):
            gone = Channel.connect(ctx, zmq.DEALER, router.address, identity=f"gone-{round_}".encode())
            gone.send(P.Cancel("bye"))
            assert (await asyncio.wait_for(router.arecv(), 5)).sender == f"gone-{round_}".encode()
            gone.close()
            deadline = time.monotonic() + 5
            while True:  # until the router's socket knows it is gone
                try:
                    router.post(P.Cancel("late"), to=f"gone-{round_}".encode())
                except zmq.ZMQError:
                    break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.001)
            pending = asyncio.ensure_future(router.arecv())
            await asyncio.sleep(0)  # the receive now waits on the socket's edge
            peer.send(P.Cancel(f"in-{round_}"))
            time.sleep(0.002)  # without yielding: ZeroMQ's I/O thread has raised the edge by now
            with pytest.raises(zmq.ZMQError):  # a send that fails may take the edge the arrival raised
                router.post(P.Cancel("late"), to=f"gone-{round_}".encode())
            env = await asyncio.wait_for(pending, 2)
            assert env.msg.request_id == f"in-{round_}"
    try:
        asyncio.run(main())
    finally:
        ctx.destroy(linger=0)


def test_try_send_gives_up_on_a_peer_that_never_reads_and_then_fails_at_once():
    """A worker whose router died (its queue full) or never answered (a CURVE handshake that
    fails: nothing connected) must go on looping, to handle SIGTERM: it once blocked forever."""
    ctx = zmq.Context()
    gone = Channel.connect(ctx, zmq.DEALER, f"tcp://127.0.0.1:{free_port()}")  # nothing listens there
    gone.send_wait_s = 2
    for sent in range(10_000):  # its queue takes the high-water mark's worth, then none
        t0 = time.monotonic()
        if not gone.try_send(P.Cancel("a")):
            break
    assert 0 < sent < 10_000 and 1.9 <= time.monotonic() - t0 < 6
    t0 = time.monotonic()
    assert gone.try_send(P.Cancel("b")) is False  # stalled: no second wait
    assert gone.try_send(P.Cancel("b"), [memoryview(bytearray(8))], track=True) is None  # a KV chunk's send
    assert time.monotonic() - t0 < 1
    server = Channel.bind(ctx, zmq.ROUTER, "tcp://127.0.0.1:0")
    late = Channel.connect(ctx, zmq.DEALER, server.address)
    late.send_wait_s = 5
    assert late.try_send(P.Cancel("c")) is True  # a peer that connects in time takes it
    env = server.recv(5000)
    assert env is not None and env.msg == P.Cancel("c")
    released = late.try_send(P.Cancel("d"), [memoryview(bytearray(b"frame"))], track=True)
    env = server.recv(5000)
    assert env is not None and env.msg == P.Cancel("d") and bytes(env.frames[0].buffer) == b"frame"
    deadline = time.monotonic() + 5
    while not released.done:  # zmq let go of the frame once it was sent
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for chan in (gone, late, server):
        chan.close()
    ctx.term()


def test_closing_with_a_backlog_cancels_its_retries(pair):
    """The retry timer ran after close(): it sent on the closed socket, took the peer for gone,
    and the loop logged settle()'s error."""
    router, stalled = pair
    given_up, errors = [], []
    router.on_stalled = given_up.append

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        await _handshake(router, stalled)
        for i in range(2000):
            router.post(P.Cancel(f"{i} {'x' * 2**16}"), to=b"peer")
        assert router._backlogs
        router.close()
        await asyncio.sleep(0.1)  # past several of the retries' turns
    asyncio.run(main())
    assert given_up == [] and errors == [] and not router._backlogs


def test_a_wildcard_host_is_advertised_as_this_machines_address_toward_its_peer():
    """A decode worker bound at 0.0.0.0 advertised 0.0.0.0, which no other machine can connect to
    (tests/test_multihost.py runs it across network namespaces)."""
    assert reachable_host("0.0.0.0", "tcp://127.0.0.1:7101") == "127.0.0.1"
    assert reachable_host("0.0.0.0", "tcp://localhost:7101") == "127.0.0.1"
    assert reachable_host("10.1.2.3", "tcp://127.0.0.1:7101") == "10.1.2.3"  # a host given is its own
