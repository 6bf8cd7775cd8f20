"""Bad input and overload: thousands of malformed, truncated, wrongly versioned and oversized
messages at the router's client and worker ports and at a decode worker's KV ingress leave every
process serving, token-exact; a burst far past the queue limit is shed with OVERLOADED while the
accepted requests complete, and memory does not grow from one burst to the next."""

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import protocol as P
from common.engine import Engine
from common.errors import InvalidArgument
from common.sampling_params import SamplingParams
from router.client import AsyncClient, Client, RequestError
from tests.cluster import cluster

pytestmark = pytest.mark.timeout(600)

leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                   st.text(max_size=20), st.binary(max_size=40))
values = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                      st.dictionaries(st.text(max_size=10), inner, max_size=5)),
                      max_leaves=12)


@st.composite
def message_like(draw):
    """Maps that look like protocol messages: a known or unknown type, right or wrong version,
    real field names with values of any type, plus unknown fields."""
    cls = draw(st.sampled_from(sorted(P.MESSAGES.values(), key=lambda c: c.__name__)))
    names = list(cls.__dataclass_fields__)
    chosen = draw(st.lists(st.sampled_from(names), max_size=len(names), unique=True)) if names else []
    body = {n: draw(values) for n in chosen}
    if draw(st.booleans()):
        body[draw(st.text(max_size=8))] = draw(values)
    body["type"] = draw(st.one_of(st.just(cls.__name__), st.text(max_size=12), values))
    body["v"] = draw(st.one_of(st.just(P.PROTOCOL_VERSION), values))
    return msgpack.packb(body, use_bin_type=True)


@st.composite
def truncated(draw):
    msg = P.Generate("r", [1, 2, 3], {"temperature": 0.5}, True)
    raw = P.encode(draw(st.sampled_from([msg, P.Cancel("x"), P.KVReserve("a", 1, 4, {"layers": 4})])))
    return raw[:draw(st.integers(0, len(raw) - 1))]


frame = st.one_of(st.binary(max_size=512), message_like(), truncated(), values.map(lambda v: msgpack.packb(v)))
multipart = st.lists(frame, min_size=1, max_size=4)


def serves_exactly(address):
    want = Engine(model="dummy:nanogpt").generate([[3, 1, 4, 1, 5]], SamplingParams(temperature=0, max_tokens=6,
                                                                                     ignore_eos=True))[0].token_ids
    with Client(address, timeout=60) as client:
        assert client.generate([3, 1, 4, 1, 5], temperature=0, max_tokens=6, ignore_eos=True).token_ids == want
        workers = client.status().workers
    assert len(workers) == 2 and all(w["alive"] for w in workers)


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory):
    with cluster(tmp_path_factory.mktemp("fuzz"), router_args=["--max-message-bytes", str(2**20)]) as c:
        with Client(c.address) as client:
            c.kv_address = next(w["kv_address"] for w in client.status().workers if w["role"] == "decode")
        yield c


@pytest.fixture(scope="module")
def fuzzed_messages() -> list[list[bytes]]:
    """1,000 multipart messages, drawn once for every target: drawing takes 8 s."""
    drawn = []

    @settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(multipart)
    def draw(parts):
        drawn.append(parts)

    draw()
    return drawn


@pytest.mark.parametrize("target", ["frontend", "backend", "kv_ingress"])
def test_fuzzed_frames_leave_every_process_serving(fuzz_cluster, fuzzed_messages, target):
    c = fuzz_cluster
    address = {"frontend": c.address, "backend": f"tcp://127.0.0.1:{c.worker_port}", "kv_ingress": c.kv_address}[target]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100000)
    sock.connect(address)
    try:
        for parts in fuzzed_messages:
            sock.send_multipart(parts)
            while sock.poll(0):
                sock.recv_multipart()  # replies (errors) are fine; just do not let them pile up
        time.sleep(1.0)  # sent in well under a second: let every target read them all
        assert len(fuzzed_messages) >= 700  # hypothesis drew enough
        for child in c.children:
            assert child.proc.poll() is None, f"{child.name} died"
        serves_exactly(c.address)
    finally:
        sock.close()
        ctx.term()
    for child in c.children:
        log = Path(child.log_path).read_text()
        assert "Traceback" not in log, f"{child.name} logged a traceback:\n{log[-3000:]}"


def test_oversized_message_is_refused_with_its_size(fuzz_cluster):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fuzz_cluster.address)
    try:
        sock.send(P.encode(P.Generate("big", [1000] * 700_000, {}, True)))  # ~2 MB > the 1 MiB limit
        assert sock.poll(10_000)
        reply = P.decode(sock.recv())
        # named by its request id, read from the message's first bytes: the SDK fails that request at once
        assert isinstance(reply, P.Error) and (reply.code, reply.request_id) == ("TOO_LARGE", "big")
        assert "over the limit of 1048576" in reply.message
        sock.send(b"\x00" * (5 * 2**20))  # past the hard cap: the router drops this peer, serves others
    finally:
        sock.close()
        ctx.term()
    serves_exactly(fuzz_cluster.address)
    with Client(fuzz_cluster.address, timeout=60) as client:
        t0 = time.monotonic()
        with pytest.raises(RequestError) as e:
            client.generate("x" * 1_500_000, max_tokens=2)
        assert e.value.code == "TOO_LARGE" and time.monotonic() - t0 < 10  # not the call's timeout
        with pytest.raises(InvalidArgument, match="request_id=12345 is invalid; allowed: a string"):
            client.submit([1, 2], request_id=12345)  # the router could not name it: the call would wait its timeout


def test_an_sdk_client_misused_says_so_and_loses_nothing(fuzz_cluster):
    """What an application may do by mistake fails at once, by name: a second thread on a
    Client's socket (replies were lost: calls waited out their timeout, or forever), an id already
    in flight (the router's refusal ended the first request too), a bad prompt in generate_many (those
    before it ran on), a stream read after its client closed (a raw ZMQError; async, a hang) and a Client used in a forked child (it spun a core)."""
    import os
    import threading

    with Client(fuzz_cluster.address, timeout=120) as client:
        long = client.submit([1, 2, 3], stream=False, max_tokens=1000, ignore_eos=True)  # seconds on a CPU
        refused = []

        def other_thread():
            time.sleep(0.3)  # this thread waits on the socket for the long request meanwhile
            for call in (lambda: client.generate([4, 5], max_tokens=2), lambda: client.cancel(long)):
                try:
                    call()
                except RuntimeError as e:
                    refused.append(str(e))
        t = threading.Thread(target=other_thread)
        t.start()
        assert len(client.wait(long).token_ids) == 1000
        t.join(30)
        assert len(refused) == 2 and all("in use by another thread" in r for r in refused), refused
        first = client.submit([1, 2], request_id="job-1", max_tokens=50, ignore_eos=True)
        with pytest.raises(RequestError, match="request_id='job-1' is already in flight on this client"):
            client.submit([3, 4], request_id="job-1", max_tokens=2)
        assert len(client.wait(first).token_ids) == 50  # the first is not lost
        # an id that is not in flight (never submitted, or its result read): refused at once, not waited for
        for unknown in ("never-submitted", first):
            with pytest.raises(RequestError, match=f"request_id='{unknown}' is not in flight on this client"):
                client.wait(unknown, timeout=None)

        async def wait_async():
            async with AsyncClient(fuzz_cluster.address, timeout=None) as ac:
                rid = await ac.submit([1, 2], stream=False, max_tokens=2)
                assert len((await ac.wait(rid)).token_ids) == 2
                for unknown in ("never-submitted", rid):
                    with pytest.raises(RequestError, match=f"request_id='{unknown}' is not in flight"):
                        await ac.wait(unknown)
                # closed by one task while another waits: that wait fails at once (it waited for good)
                waiting = asyncio.ensure_future(ac.generate([1, 2, 3], max_tokens=1000, ignore_eos=True))
                await asyncio.sleep(0.3)
                await ac.close()
                with pytest.raises(RequestError, match="UNAVAILABLE: its AsyncClient was closed meanwhile"):
                    await asyncio.wait_for(waiting, 10)
        asyncio.run(asyncio.wait_for(wait_async(), 60))
        with pytest.raises(InvalidArgument, match="exactly one of prompt"):  # and what was sent before it is cancelled
            client.generate_many([[1, 2, 3], None], max_tokens=1000, ignore_eos=True)
        assert not client._open and client.status().in_flight == 0
        pid = os.fork()
        if pid == 0:  # a copy of this test's process: it must end here, whatever the client does
            said = ""
            try:
                client.generate([1], max_tokens=1, timeout=5)
            except BaseException as e:
                said = str(e)
            os._exit(0 if "before a fork; make one in this process" in said else 1)
        assert os.waitpid(pid, 0)[1] == 0
        stream = client.stream([1, 2], max_tokens=50)
    with pytest.raises(RuntimeError, match="this Client is closed"):
        next(stream)


def test_requests_cancelled_and_never_waited_for_are_not_kept_for_good(fuzz_cluster, monkeypatch):
    """submit, then cancel, with no wait(): the usual way to drop a request. Their ends were kept
    for a wait() that never came, one each for the client's life (soak audit: 300 of 300 after 300
    such). The newest CANCELLED_ENDS_KEPT are kept, for a wait() after the cancel; older ones go."""
    import router.client_requests

    monkeypatch.setattr(router.client_requests, "CANCELLED_ENDS_KEPT", 2)

    async def async_client():
        async with AsyncClient(fuzz_cluster.address, timeout=60) as ac:
            ids = [await ac.submit([1, 2, 3 + i], stream=False, max_tokens=1000, ignore_eos=True) for i in range(4)]
            for rid in ids:
                await ac.cancel(rid)
            while (await ac.status()).in_flight or len(ac._open) > 2:
                await asyncio.sleep(0.05)
            for rid in ids[:2]:
                with pytest.raises(RequestError, match="is not in flight on this client"):
                    await ac.wait(rid)
            assert [(await ac.wait(rid)).finish_reason for rid in ids[2:]] == ["cancelled"] * 2
            return ac._open, ac._replies
    assert asyncio.run(asyncio.wait_for(async_client(), 60)) == (set(), {})

    with Client(fuzz_cluster.address, timeout=60) as client:
        ids = [client.submit([1, 2, 3 + i], stream=False, max_tokens=1000, ignore_eos=True) for i in range(4)]
        for rid in ids:
            client.cancel(rid)
        deadline = time.monotonic() + 30
        while client.status().in_flight:  # (a call reads what came meanwhile)
            assert time.monotonic() < deadline
        client.status()
        assert set(client._replies) <= set(ids[2:]) and client._open == set(ids[2:])
        assert [client.wait(rid).finish_reason for rid in ids[2:]] == ["cancelled"] * 2
        assert not client._open and not client._replies


def test_a_client_that_stops_reading_has_its_requests_stopped_and_reads_their_ends_when_it_reads_again(
        fuzz_cluster):
    """A client that read nothing for the router's 5 s with its queue full has its requests ended
    with UNAVAILABLE and their work stopped; what the router had for it waits, so that when it
    reads again every request ends, by its Done or that error (an API server's HTTP requests
    waited forever when it was dropped)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(fuzz_cluster.address)
    n = 32
    said_before = fuzz_cluster.router.log_path.read_text().count("read nothing for")  # (the module's cluster)
    try:
        for i in range(n):
            sock.send(P.encode(P.Generate(f"s{i}", [1 + i, 2, 3], {"max_tokens": 1000, "ignore_eos": True,
                                                                   "logprobs": 20}, True)))
        deadline = time.monotonic() + 120  # reads nothing until the router gives up on it: 5 s after its queue filled
        while fuzz_cluster.router.log_path.read_text().count("read nothing for") == said_before \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        late = [f"l{i}" for i in range(4)]  # sent while it still reads nothing: refused, not run for nobody
        for rid in late:
            sock.send(P.encode(P.Generate(rid, [5, 6, 7], {"max_tokens": 1000, "ignore_eos": True}, True)))
        ended = {}
        deadline = time.monotonic() + 60
        while len(ended) < n + len(late) and time.monotonic() < deadline:
            if sock.poll(1000):
                msg = P.decode(sock.recv())
                if isinstance(msg, (P.Done, P.Error)):
                    ended[msg.request_id] = msg
        assert sorted(ended) == sorted([f"s{i}" for i in range(n)] + late)  # every request ended
        assert all(isinstance(ended[rid], P.Error) and ended[rid].code == "UNAVAILABLE" and "has read nothing for 5 s"
                   in ended[rid].message for rid in late), [ended[rid] for rid in late]
        gave_up = [m for rid, m in ended.items() if isinstance(m, P.Error) and rid not in late]
        assert gave_up and all(m.code == "UNAVAILABLE" and "read nothing for 5 s" in m.message for m in gave_up)
    finally:
        sock.close()
        ctx.term()
    log = fuzz_cluster.router.log_path.read_text()  # one line for them all, naming the client, not one each
    said = re.findall(rf"client [0-9a-f]+ read nothing for 5 s: its {len(gave_up)} requests end with UNAVAILABLE: s\d+",
                      log)
    assert len(said) == 1 and not re.search(r"request s\d+ \(#[0-9a-f]{6}-\d+\) failed", log), log[-3000:]
    with Client(fuzz_cluster.address, timeout=60) as client:
        for _ in range(100):
            status = client.status()
            if status.in_flight == 0 and all(w["free_blocks"] == w["total_blocks"] for w in status.workers):
                break
            time.sleep(0.1)
        assert status.in_flight == 0 and all(w["free_blocks"] == w["total_blocks"] for w in status.workers)
    serves_exactly(fuzz_cluster.address)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_burst_far_past_capacity_is_shed_and_memory_settles(tmp_path):
    async def burst(address, n):
        async with AsyncClient(address, timeout=120) as client:
            async def one(i):
                try:
                    return len((await client.generate([i % 200 + 1] * 20, max_tokens=16, ignore_eos=True)).token_ids)
                except RequestError as e:
                    return e.code
            return await asyncio.gather(*(one(i) for i in range(n)))

    with cluster(tmp_path, router_args=["--max-queue", "16"]) as c:
        asyncio.run(burst(c.address, 20))  # warm-up: allocator and caches at their working size
        before = {ch.name: rss_mb(ch.proc.pid) for ch in c.children}
        sizes = []
        for _ in range(3):
            outcomes = asyncio.run(burst(c.address, 600))
            assert set(outcomes) <= {"OVERLOADED", 16}, set(outcomes)
            assert outcomes.count("OVERLOADED") >= 400 and outcomes.count(16) >= 16
            sizes.append({ch.name: rss_mb(ch.proc.pid) for ch in c.children})
        for name in before:
            # Growth stops after the first burst: the second and third leave memory where it was.
            assert sizes[2][name] - sizes[0][name] < 16, (name, before[name], [s[name] for s in sizes])
            assert sizes[2][name] - before[name] < 64, (name, before[name], [s[name] for s in sizes])
        serves_exactly(c.address)


def test_a_client_or_worker_given_the_wrong_port_is_told_which_at_once(fuzz_cluster):
    """A client at the router's worker port or a decode worker's KV ingress, or a worker at the
    router's client port, would otherwise wait for an answer that never comes."""
    c = fuzz_cluster
    for address, says in ((f"tcp://127.0.0.1:{c.worker_port}", "this is the router's worker port"),
                          (c.kv_address, "this is a decode worker's KV ingress")):
        with Client(address, timeout=30) as client:
            t0 = time.monotonic()
            with pytest.raises(RequestError) as e:
                client.generate([1, 2, 3], max_tokens=2)
            assert e.value.code == "INVALID_ARGUMENT" and says in e.value.message, e.value
            assert time.monotonic() - t0 < 10
            with pytest.raises(RequestError) as e:
                client.status()
            assert e.value.code == "INVALID_ARGUMENT" and says in e.value.message
    r = subprocess.run([sys.executable, "-m", "common.cli", "decode", "--router", c.address, "--threads", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Register is not a client message: this is the router's client port" in r.stderr
    serves_exactly(c.address)


def test_a_request_the_router_fails_on_is_answered_not_dropped(monkeypatch):
    """A fault of the router's own while it admits a request (a library raising what nobody
    expected) was logged, and the ZeroMQ client waited for an answer that never came."""
    from tests.cluster import serving_router

    async def scenario():
        async with serving_router() as (router, connect):
            def broken(*args, **kwargs):
                raise RecursionError("maximum recursion depth exceeded")
            monkeypatch.setattr(router.prompts, "validate", broken)
            chan = connect(router.frontend.address)
            await chan.send(P.Generate("r1", [7, 8], {"max_tokens": 2}, True))
            reply = (await asyncio.wait_for(chan.arecv(), 10)).msg
            assert isinstance(reply, P.Error) and reply.request_id == "r1" and reply.code == "INTERNAL"
            assert "RecursionError" in reply.message
            await chan.send(P.StatusRequest("s1"))  # and it serves on
            assert isinstance((await asyncio.wait_for(chan.arecv(), 10)).msg, P.StatusReply)
    asyncio.run(scenario())


def test_a_registration_naming_a_live_workers_incarnation_from_another_connection_is_refused():
    """A peer that read a live worker's id and incarnation from `pdserve status` and registered
    them took its place: the worker's messages came from a connection the router no longer knew,
    and its requests waited out their deadlines."""
    from common.model_spec import model_config
    from tests.cluster import scripted_worker, serving_router

    async def scenario():
        async with serving_router() as (router, connect):
            await scripted_worker(router, connect, "decode-0", role="decode")
            spoof = connect(router.backend.address, b"spoof")
            await spoof.send(P.Register("decode", "decode-0", "1", "cpu", 64, 16, "tcp://127.0.0.1:2",
                                        model_config(router.cfg.model).fingerprint, []))
            await asyncio.sleep(0.5)
            worker = router.registry.workers["decode-0"]
            assert (worker.identity, worker.kv_address) == (b"decode-0/1", "tcp://127.0.0.1:1")
    asyncio.run(scenario())


def test_a_worker_registering_again_before_its_answer_keeps_the_requests_it_holds():
    """A worker asks to register every 0.5 s until answered, so a router slow to answer hears it
    twice or more (12 times in 16 ms from one started before its router). The second replaced the
    worker's record, and with it the list of requests it held: at its death they were not
    re-dispatched, and waited out their deadline (here 30 s)."""
    from common.model_spec import model_config
    from tests.cluster import scripted_worker, serving_router

    async def scenario():
        async with serving_router(heartbeat_timeout_s=0.5, prefill_timeout_s=30.0) as (router, connect):
            a = await scripted_worker(router, connect, "mono-a")
            client = connect(router.frontend.address)
            await client.send(P.Generate("r", [1, 2, 3], {"max_tokens": 1}, False))
            while not isinstance((await asyncio.wait_for(a.arecv(), 5)).msg, P.PrefillWork):
                pass
            await a.send(P.Register("mono", "mono-a", "1", "cpu", 64, 16, "tcp://127.0.0.1:1",
                                    model_config(router.cfg.model).fingerprint, []))
            assert isinstance((await asyncio.wait_for(a.arecv(), 5)).msg, P.Registered)  # answered again
            b = await scripted_worker(router, connect, "mono-b")  # mono-a now goes silent: it died

            async def beat():
                while True:
                    await b.send(P.Heartbeat("mono-b", "1", 0, 0, 64, 64))
                    await asyncio.sleep(0.1)

            async def serve():
                while True:
                    work = (await b.arecv()).msg
                    if isinstance(work, P.PrefillWork):
                        await b.send(P.WorkerTokens(work.request_id, work.attempt, 0, [7], "length"))
            tasks, t0 = [asyncio.ensure_future(beat()), asyncio.ensure_future(serve())], time.monotonic()
            try:
                while isinstance(reply := (await asyncio.wait_for(client.arecv(), 40)).msg, P.Probe):
                    pass
            finally:
                for task in tasks:
                    task.cancel()
            assert isinstance(reply, P.Done) and reply.token_ids == [7], reply
            assert time.monotonic() - t0 < 10, "re-dispatched only at the request's deadline"
    asyncio.run(scenario())
