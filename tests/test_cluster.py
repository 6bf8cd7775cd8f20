"""Disaggregated clusters (real processes on loopback) give exactly the monolithic engine's tokens,
stream them in order, refuse bad requests with coded errors while serving on, shed load with
OVERLOADED, and return every KV block on cancellation."""

import asyncio
import importlib.util
import random
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from common import protocol as P
from common.channel import Channel
from common.engine import Engine
from common.sampling_params import SamplingParams
from router.client import AsyncClient, Client, RequestError
from tests.checkpoints import VOCAB, write_checkpoint
from tests.cluster import cluster, hand_made_cluster, scripted_worker, serving_router, stop, wait_blocks_free

pytestmark = pytest.mark.timeout(600)


HAVE_LLGUIDANCE = importlib.util.find_spec("llguidance") is not None
STRUCTURED = [{"regex": "[a-z]{2,8}( [a-z]{2,8}){1,3}"}, {"choice": ["yes", "no", "maybe"]},
              {"json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                        "required": ["n"], "additionalProperties": False}}]


def workload(n=50, seed=0, vocab=256):
    """Mixed prompt lengths and sampling: greedy and seeded with filters, some with penalties,
    logit bias and min_p (their counts cross from the prefill to the decode worker), some held off
    a favoured stop token by min_tokens (the prefill worker samples the first token), and some held
    to a structured output (the decode worker replays the prefill's token into its grammar)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.choice([1, 5, 20, 60, 150]))] for _ in range(n)]
    sampling = []
    for i in range(n):
        s = dict(max_tokens=rng.randint(1, 24), ignore_eos=True)
        if i % 2:
            s.update(temperature=0.8, top_p=0.95, top_k=40, seed=100 + i)
        else:
            s.update(temperature=0.0)
        if i % 3 == 0:
            s.update(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3, min_p=0.05)
        elif i % 3 == 1:
            s.update(logit_bias={rng.randrange(vocab): 3.0, rng.randrange(vocab): -50})
            if i % 6 == 4:  # held back while it may begin: the stream's text must still end as the result's
                s.update(stop=["\x00\x01"])
        elif i % 6 == 2:
            stop = rng.randrange(vocab)
            s.update(logit_bias={stop: 100.0}, stop_token_ids=[stop], min_tokens=min(3, s["max_tokens"]))
        elif i % 6 == 5 and HAVE_LLGUIDANCE:  # a dependency; the GPU machine's image may not take its wheel
            s.update(structured_outputs=STRUCTURED[i // 6 % len(STRUCTURED)])
        sampling.append(s)
    return prompts, sampling


def monolithic(model, prompts, sampling):
    engine = Engine(model=model)
    return [o.token_ids for o in engine.generate(prompts, [SamplingParams(**s) for s in sampling])]


async def run_concurrently(address, prompts, sampling):
    """All requests in flight at once, streamed; returns (final tokens, streamed chunks) per request."""
    async with AsyncClient(address, timeout=300) as client:
        async def one(p, s):
            stream = client.stream(p, **s)
            chunks = [chunk async for chunk in stream]
            return stream.result, chunks
        return await asyncio.gather(*(one(p, s) for p, s in zip(prompts, sampling)))


def check_cluster_matches(address, model, n=50, seed=0, vocab=256):
    prompts, sampling = workload(n, seed, vocab)
    expected = monolithic(model, prompts, sampling)
    results = asyncio.run(run_concurrently(address, prompts, sampling))
    for (result, chunks), want, s in zip(results, expected, sampling):
        if s.get("min_tokens"):  # the favoured stop token comes just after them, or the length ends it first
            assert len(want) == min(s["min_tokens"] + 1, s["max_tokens"]) and s["stop_token_ids"][0] not in want[:-1]
        assert result.token_ids == want
        streamed = [t for c in chunks for t in c.token_ids]
        assert streamed == want
        assert [c.index for c in chunks] == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
        assert "".join(c.text for c in chunks) == (result.text or "")


def test_cluster_of_two_of_each_role_matches_monolithic_nanogpt(tmp_path):
    """(1P1D, on each KV transport: tests/test_kv_transport.py)"""
    with cluster(tmp_path, prefill=2, decode=2) as c:
        check_cluster_matches(c.address, "dummy:nanogpt")
        with Client(c.address) as client:
            workers = wait_blocks_free(client)
            assert sorted(w["role"] for w in workers) == ["decode", "decode", "prefill", "prefill"]
            assert all(w["free_blocks"] == w["total_blocks"] for w in workers)
            assert all(w["alive"] for w in workers)
            # each prefill worker took work (a decode worker's status says nothing of what it served)
            assert all(sum(w["kv_sent"].values()) > 0 for w in workers if w["role"] == "prefill"), workers


def test_cluster_matches_monolithic_llama_checkpoint(tmp_path):
    ckpt = tmp_path / "llama"
    write_checkpoint(ckpt, "llama-gqa")
    with cluster(tmp_path, model=str(ckpt), prefill=1, decode=1) as c:
        check_cluster_matches(c.address, str(ckpt), vocab=VOCAB)
        with Client(c.address) as client:  # text goes through the checkpoint's tokenizer.json
            r = client.generate("the quick brown fox", max_tokens=5, temperature=0, ignore_eos=True)
            want = Engine(model=str(ckpt)).generate("the quick brown fox",
                                                    SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
            assert (r.prompt_token_ids, r.token_ids, r.text) == (want.prompt_token_ids, want.token_ids, want.text)


def test_bad_requests_get_coded_errors_and_cluster_serves_on(tmp_path):
    with cluster(tmp_path, router_args=["--max-queue", "4"]) as c, Client(c.address, timeout=60) as client:
        cases = [
            (dict(prompt="hi", nonsense=1), "unknown sampling fields ['nonsense']"),
            (dict(prompt="hi", temperature=-1), "temperature=-1"),
            (dict(prompt="hi", top_p=0), "top_p=0"),
            (dict(prompt="hi", max_tokens=0), "max_tokens=0"),
            (dict(prompt=[1, 999]), "[999]"),
            (dict(prompt=[1] * 1024), "prompt has 1024 tokens but the model's maximum context length is 1024 tokens; "
                                      "allowed: at most 1023"),
            (dict(prompt=""), "prompt is empty"),
            (dict(prompt="hi", logit_bias={"1" * 5000: 1}), "logit_bias entry '111"),
        ]
        for kwargs, text in cases:
            with pytest.raises(RequestError) as e:
                client.generate(**kwargs)
            assert e.value.code == "INVALID_ARGUMENT" and text in e.value.message, e.value
        # an SDK client's max_tokens past the context is cut to fit (HTTP's is refused, as vLLM's)
        r = client.generate([1] * 1000, max_tokens=50, ignore_eos=True)
        assert (len(r.token_ids), r.finish_reason) == (24, "length")
        # Frames that do not decode at all, sent raw, get an error reply, not silence.
        raw = Channel.connect(client.ctx, zmq.DEALER, c.address)
        try:  # closed whatever fails: an open socket would hang the client's close
            # (one cut short still names the id it begins with: a Generate's then fails at once)
            for junk, named in ((b"\x00\x01garbage", None), (P.encode(P.Generate("x", [1], {}, True))[:-3], "x"),
                                (b"", None)):
                raw.sock.send(junk)
                reply = raw.recv(5000)
                assert isinstance(reply.msg, P.Error) and reply.msg.code == "INVALID_ARGUMENT"
                assert reply.msg.request_id == named
            raw.sock.send_multipart([P.encode(P.Generate("w", {"not": "a prompt"}, {}, True))])  # wrong type
            reply = raw.recv(5000).msg
            assert (reply.code, reply.request_id) == ("INVALID_ARGUMENT", "w")  # that request fails at once
            # a field this router does not know (a newer client's): named, with the request it refuses
            raw.sock.send(msgpack.packb({"v": P.PROTOCOL_VERSION, "type": "Generate", "request_id": "n", "prompt": [1],
                                         "future_field": 1}))
            reply = raw.recv(5000).msg
            assert reply.request_id == "n" and "unknown fields ['future_field']" in reply.message, reply
        finally:
            raw.close()
        # Still serving, and the queue limit sheds load at once.
        assert len(client.generate([1, 2, 3], max_tokens=3, temperature=0).token_ids) == 3
        ids = [client.submit([1, 2, 3], stream=False, max_tokens=200, ignore_eos=True) for _ in range(8)]
        outcomes = []
        for rid in ids:
            try:
                outcomes.append(len(client.wait(rid).token_ids))
            except RequestError as e:
                outcomes.append(e.code)
        assert outcomes.count("OVERLOADED") >= 4 and outcomes.count(200) >= 1, outcomes
        assert set(outcomes) <= {"OVERLOADED", 200}


def test_cancel_mid_stream_frees_every_block(tmp_path):
    with cluster(tmp_path) as c, Client(c.address, timeout=60) as client:
        streams = [client.stream([i + 1] * 40, max_tokens=500, ignore_eos=True, temperature=0) for i in range(4)]
        for s in streams:
            next(s)  # decoding has started
        deadline = time.monotonic() + 10  # free block counts arrive with heartbeats
        while all(w["free_blocks"] == w["total_blocks"] for w in client.status().workers):
            assert time.monotonic() < deadline, "no worker ever reported blocks in use"
            time.sleep(0.05)
        for s in streams:
            client.cancel(s.request_id)
        for s in streams:
            for _ in s:
                pass
            assert s.result.finish_reason == "cancelled" and len(s.result.token_ids) < 500
        workers = wait_blocks_free(client)
        assert all(w["free_blocks"] == w["total_blocks"] for w in workers), workers


def test_a_full_prefill_pool_and_a_full_decode_batch_do_not_wait_on_each_other(tmp_path):
    """A burst on small pools: while requests wait for the decode worker's room, others it
    granted room to must still get into the prefill worker's pool (see common/scheduler.py).
    Before that, prefills awaiting grants filled the pool, the decode worker's slots went to
    requests that could not start their prefill, and the cluster stood still until the 30 s
    lease and transfer timeouts: a transfer gave up and the request was served again."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 60) for _ in range(rng.randrange(60, 100))] for _ in range(40)]
    with cluster(tmp_path, worker_args=["--num-blocks", "24", "--max-num-seqs", "2"]) as c, \
            Client(c.address, timeout=20) as client:
        results = client.generate_many(prompts, max_tokens=32, ignore_eos=True, temperature=0)
        assert [len(r.token_ids) for r in results] == [32] * 40
        workers = wait_blocks_free(client)
        assert all(w["free_blocks"] == w["total_blocks"] for w in workers), workers
    assert "failed" not in (tmp_path / "logs" / "prefill-0.log").read_text()


def test_a_request_its_caller_stops_waiting_for_is_cancelled(tmp_path):
    """Leaving a stream before its end (sync or async), or cancelling an async generate (as
    asyncio.wait_for does), cancels the request on the router, as vLLM's AsyncLLM does: its KV
    blocks come back while the client stays open. Before, they ran to max_tokens."""
    def in_flight(client):
        return client.status().in_flight

    async def abandon_async(address):
        async with AsyncClient(address, timeout=60) as client:
            stream = client.stream([7] * 30, max_tokens=1000, ignore_eos=True)
            async for _ in stream:
                break
            del stream
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.generate([8] * 30, max_tokens=1000, ignore_eos=True), 0.3)
            with Client(address) as watcher:
                deadline = time.monotonic() + 10
                while in_flight(watcher) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert in_flight(watcher) == 0  # while this client is still open
            result = await client.generate([9] * 10, max_tokens=4, ignore_eos=True)  # its replies still come
            assert len(result.token_ids) == 4
            assert not client._replies  # the abandoned requests' late replies were not kept for nobody
            with pytest.raises(RequestError) as refused:  # the first failure cancels the others, as Client's does
                await client.generate_many([[7] * 30, [10 ** 6]], max_tokens=1000, ignore_eos=True)
            assert refused.value.code == "INVALID_ARGUMENT" and not client._open  # (before: the first ran on)
            with Client(address) as watcher:
                deadline = time.monotonic() + 10
                while in_flight(watcher) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert in_flight(watcher) == 0
            rid = await client.submit([9] * 10, stream=False, max_tokens=3, ignore_eos=True)
            assert len((await client.wait(rid)).token_ids) == 3
            assert "pdserve:generation_tokens_total" in (await client.metrics()).decode()
            assert (await client.status()).in_flight == 0

    with cluster(tmp_path) as c, Client(c.address, timeout=60) as client:
        for chunk in client.stream([5] * 30, max_tokens=1000, ignore_eos=True):
            break
        with client.stream([6] * 30, max_tokens=1000, ignore_eos=True) as stream:
            next(stream)
        deadline = time.monotonic() + 10
        while in_flight(client) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert in_flight(client) == 0
        assert len(client.generate([9] * 10, max_tokens=4, ignore_eos=True).token_ids) == 4
        assert not client._replies  # the abandoned streams' late tokens and Done were dropped as they came
        asyncio.run(abandon_async(c.address))
        workers = wait_blocks_free(client)
        assert all(w["free_blocks"] == w["total_blocks"] for w in workers), workers


def test_requests_queued_for_decode_room_are_waiting_not_lost(tmp_path):
    """A busy cluster is a queue. Its decode worker holds 2 requests at a time and the router's
    deadlines are 1.2 s; 16 requests of 300 tokens wait for decode room for seconds. Their workers
    say they hold them (Holding), so none is timed out and prefilled again: every one is served on
    its first attempt, with the monolithic engine's tokens. Before, each wait past a deadline was a
    retry, and past --max-attempts a 503 from a healthy cluster."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 200) for _ in range(rng.randrange(8, 40))] for _ in range(16)]
    params = dict(max_tokens=300, ignore_eos=True, temperature=0)
    with cluster(tmp_path, worker_args=["--max-num-seqs", "2"],
                 router_args=["--prefill-timeout", "1.2", "--decode-stall-timeout", "1.2"]) as c, \
            Client(c.address, timeout=120) as client:
        held, done = [], threading.Event()

        def watch():  # the prefill worker says it holds the prefilled requests that wait for decode room
            with Client(c.address, timeout=10) as watcher:
                while not done.wait(0.2):
                    held.append(next(w["held"] for w in watcher.status().workers if w["role"] == "prefill"))

        watching = threading.Thread(target=watch)
        watching.start()
        started = time.monotonic()
        try:
            results = client.generate_many(prompts, **params)
        finally:
            done.set()
            watching.join()
        waited = time.monotonic() - started
        assert [r.timings["attempts"] for r in results] == [1] * len(prompts), waited
        assert max(held) > 2, held
    expected = Engine(model="dummy:nanogpt").generate(prompts, SamplingParams(**params))
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert waited > 2.4  # long enough that the last ones waited past both deadlines


def test_a_long_prompt_is_not_starved_by_short_ones_for_decode_room(tmp_path):
    """Short requests keep a small decode pool busy; a 420-token prompt needs most of it. Once
    refused, it keeps its room from later requests (common/scheduler.py reservable): before, the
    short ones won every race for freed blocks and it waited about 24 s."""
    async def scenario(address):
        async with AsyncClient(address, timeout=10) as client:
            stop = False

            async def short_requests(k):
                rng = random.Random(k)
                while not stop:
                    await client.generate([rng.randrange(1, 200) for _ in range(20)], max_tokens=30, ignore_eos=True)

            loops = [asyncio.ensure_future(short_requests(k)) for k in range(6)]
            await asyncio.sleep(1.0)
            try:
                return await client.generate([7] * 420, max_tokens=8, ignore_eos=True)
            finally:
                stop = True
                await asyncio.gather(*loops)

    with cluster(tmp_path, worker_args=["--num-blocks", "32", "--max-num-seqs", "8"]) as c:
        assert len(asyncio.run(scenario(c.address)).token_ids) == 8


def test_unavailable_without_workers(tmp_path):
    with cluster(tmp_path, prefill=1, decode=1, router_args=["--queue-timeout", "1", "--heartbeat-timeout", "0.5"]) as c, \
            Client(c.address, timeout=30) as client:
        c.workers[1].proc.kill()  # the only decode worker
        c.workers[1].proc.wait()
        deadline = time.monotonic() + 10
        while any(w["alive"] and w["role"] == "decode" for w in client.status().workers):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # It may come back (a launcher restarts workers), so the request waits, then fails clearly.
        with pytest.raises(RequestError) as e:
            client.generate([1, 2, 3], max_tokens=2)
        assert e.value.code == "UNAVAILABLE" and "no live decode worker for 1.0s" in e.value.message
        from click.testing import CliRunner

        from common.cli import main

        rows = CliRunner().invoke(main, ["status", "--router", c.address]).output.splitlines()[3:]
        dead = next(row.split() for row in rows if row.split()[:1] == ["decode-0"])
        assert dead[3:8] == ["False", "-", "-", "-", "-"], dead  # not its last figures, as if it held them


def test_unavailable_when_no_worker_ever_registered(tmp_path):
    import subprocess
    import sys

    from router.launcher import free_port

    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "common.cli", "router", "--port", str(port),
                               "--worker-port", str(free_port())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=30) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.generate([1, 2, 3], max_tokens=2, timeout=2)
                except RequestError as e:
                    if (e.code == "TIMEOUT" or "no router answers" in e.message) and time.monotonic() < deadline:
                        continue  # the router is still starting
                    assert e.code == "UNAVAILABLE" and e.message == "no worker has registered"
                    break
    finally:
        stop(router)


def test_a_fresh_routers_first_requests_wait_for_the_workers_rejoining_it(caplog):
    """A router restarted under load: the workers of the one before register anew within ~50 ms of
    its start, each told once (their messages from the outage arrive by the hundred). Requests that
    came first wait for them; they were refused, 'no worker has registered'. Past the
    --heartbeat-timeout, a role nobody has registered for is refused, queued requests included."""
    import logging

    from tests.test_local_prefill import reply

    caplog.set_level(logging.INFO, logger="pdserve.router")
    sampling = {"max_tokens": 2, "ignore_eos": True}

    async def scenario():
        async with serving_router(heartbeat_timeout_s=1.0) as (router, connect):
            client = connect(router.frontend.address)
            await client.send(P.Generate("early", [7, 8], sampling, False))
            stale = connect(router.backend.address, b"mono-0/old")  # the last router's incarnation
            for _ in range(50):
                await stale.send(P.Heartbeat("mono-0", "old", 0, 0, 64, 64))
            await asyncio.sleep(0.2)
            worker = await scripted_worker(router, connect, "mono-0")
            work = (await asyncio.wait_for(worker.arecv(), 10)).msg
            await worker.send(P.WorkerTokens(work.request_id, work.attempt, 0, [5, 6], "length"))
            served = await reply(client)
        async with serving_router(heartbeat_timeout_s=0.5) as (router, connect):
            await scripted_worker(router, connect, "prefill-0", role="prefill")
            client = connect(router.frontend.address)
            await client.send(P.Generate("queued", [7, 8], sampling, False))  # in the rejoin window
            queued = await reply(client)
            await client.send(P.Generate("late", [7, 8], sampling, False))  # past it: at once
            late = await reply(client)
        return served, queued, late

    served, queued, late = asyncio.run(scenario())
    assert isinstance(served, P.Done) and served.token_ids == [5, 6]
    for refused in (queued, late):
        assert isinstance(refused, P.Error) and refused.message == "no decode worker has registered", refused
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("told mono-0/old")]
    assert told == ["told mono-0/old, which this router does not know, to register anew"], told
    assert not [r for r in caplog.records if "dropped Shutdown" in r.getMessage()]


def test_a_client_with_no_router_to_reach_says_so_instead_of_waiting_out_its_timeout(monkeypatch):
    import router.connection
    from common.errors import InvalidArgument
    from router.launcher import free_port

    monkeypatch.setattr(router.connection, "CONNECT_TIMEOUT_S", 0.5)
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    with Client(address, timeout=60) as client:
        started = time.monotonic()
        with pytest.raises(RequestError) as e:
            client.generate([1, 2, 3], max_tokens=2)
        assert e.value.code == "UNAVAILABLE" and f"no router answers at {address}" in e.value.message
        assert time.monotonic() - started < 5 and not client._open

    async def async_client():
        async with AsyncClient(address, timeout=60) as client:
            with pytest.raises(RequestError) as e:
                await client.status()
            return e.value
    assert asyncio.run(async_client()).code == "UNAVAILABLE"
    with pytest.raises(InvalidArgument, match="router address '127.0.0.1:7100' is invalid.*allowed: tcp://HOST:PORT"):
        Client("127.0.0.1:7100")


def test_a_client_idle_past_the_connect_timeout_or_across_a_router_restart_serves_on(monkeypatch):
    """The connect timeout counts a call's own wait: a client made long before its first call, or
    idle while its router restarted, is not failed for the connection it already has again."""
    import subprocess
    import sys

    import router.connection
    from router.launcher import free_port

    monkeypatch.setattr(router.connection, "CONNECT_TIMEOUT_S", 0.5)
    port, worker_port = free_port(), free_port()
    argv = [sys.executable, "-m", "common.cli", "router", "--port", str(port), "--worker-port", str(worker_port)]

    def status_when_up(client):
        deadline = time.monotonic() + 60
        while True:
            try:
                return client.status(timeout=5)
            except RequestError as e:  # the router still starting: fails once a call has waited 0.5 s
                assert e.code == "UNAVAILABLE" and time.monotonic() < deadline, e

    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=30) as client:
            status_when_up(client)
            time.sleep(1.0)  # idle past the connect timeout
            assert client.status().in_flight == 0
            with pytest.raises(RequestError, match="no reply within 0s"):
                client.status(timeout=0)
            time.sleep(0.3)  # its reply came meanwhile: it answers no later call
            assert client.metrics().startswith(b"# HELP") and client.status().in_flight == 0
            proc.terminate()
            proc.wait(10)
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with Client(f"tcp://127.0.0.1:{port}", timeout=30) as probe:
                status_when_up(probe)
            assert client.status().in_flight == 0  # its first call since the restart
            time.sleep(1.0)
            assert client.status().in_flight == 0

            async def idle_async_client():
                async with AsyncClient(f"tcp://127.0.0.1:{port}", timeout=30) as late:
                    await asyncio.sleep(1.0)  # made long before its first call
                    return (await late.status()).in_flight
            assert asyncio.run(idle_async_client()) == 0

            # An AsyncClient whose loop runs only during its calls (run_until_complete, a notebook's
            # cells) learns of a restart at its next call: that call is not failed for the old connection.
            loop = asyncio.new_event_loop()
            between = AsyncClient(f"tcp://127.0.0.1:{port}", timeout=30)
            assert loop.run_until_complete(between.status()).in_flight == 0
            stop(proc)
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with Client(f"tcp://127.0.0.1:{port}", timeout=30) as probe:
                status_when_up(probe)
            assert loop.run_until_complete(between.status()).in_flight == 0
            loop.run_until_complete(between.close())
            loop.close()
    finally:
        stop(proc)


def test_round_robin_takes_turns_within_each_role():
    """One turn counter per role: with two of each, consecutive requests alternate decode workers too."""
    from router.registry import DECODE_ROLES, PREFILL_ROLES, Registry, Worker

    registry = Registry("round_robin")
    for role in ("prefill", "decode"):
        for i in range(2):
            registry.workers[f"{role}-{i}"] = Worker(f"{role}-{i}", role, "x", b"", "cpu", 8, 16, "")
    picks = [(registry.pick(PREFILL_ROLES).worker_id, registry.pick(DECODE_ROLES).worker_id) for _ in range(4)]
    assert picks == [("prefill-0", "decode-0"), ("prefill-1", "decode-1")] * 2


def test_pairs_skips_failed_pairs_and_a_decode_worker_that_cannot_take_the_request():
    from router.registry import Worker
    from router.placement import pairs
    from router.server import Request

    def worker(name, transports):
        return Worker(name, name.split("-")[0], "x", b"", "cpu", 8, 16, "", transports)
    p0, p1 = worker("prefill-0", ["shm", "zmq"]), worker("prefill-1", [])
    d0, d1 = worker("decode-0", ["zmq"]), worker("decode-1", ["gloo"])
    req = Request("r", b"c", "c", [1], SamplingParams(), 0, False)
    assert [pairs(req, p, d) for p in (p0, p1) for d in (d0, d1)] == [True, False, True, True]  # [] = any
    req.failed_pairs.add(("prefill-0", "decode-0"))  # a failure between these two only
    assert not pairs(req, p0, d0) and pairs(req, p1, d0)
    req.failed_pairs.add(("*", "decode-1"))  # decode-1's own fault: NO_ROOM, LAYOUT_MISMATCH
    assert not pairs(req, p0, d1) and not pairs(req, p1, d1)


@pytest.mark.parametrize("shape", [(1, 1, 0), (0, 0, 1)], ids=["1p1d", "mono"])
def test_workers_report_their_prefill_time(tmp_path, shape):
    """Both the prefill worker and a monolithic one report work received -> first token sampled
    (`plan`'s profile times a mono worker's prefill by it): positive, and inside the router's TTFT."""
    with cluster(tmp_path, prefill=shape[0], decode=shape[1], mono=shape[2]) as c, Client(c.address) as client:
        for n in (16, 300):
            t = client.generate([1 + i % 200 for i in range(n)], max_tokens=3, temperature=0).timings
            assert 0 < t["prefill_s"] < t["ttft_s"], t


def test_pairs_needs_the_same_kv_dtype_and_block_size():
    from router.registry import Worker
    from router.placement import pairs
    from router.server import Request

    def worker(name, dtype, block_size=16):
        return Worker(name, name.split("-")[0], "x", b"", "cpu", 8, block_size, "", [], kv_dtype=dtype)
    p = worker("prefill-0", "float32")
    req = Request("r", b"c", "c", [1], SamplingParams(), 0, False)
    assert pairs(req, p, worker("decode-0", "float32")) and pairs(req, p, worker("decode-1", ""))  # "": not said
    assert not pairs(req, p, worker("decode-2", "bfloat16")) and not pairs(req, p, worker("decode-3", "float32", 32))


def test_workers_that_disagree_on_batch_invariance_are_named_at_registration(caplog):
    """A worker says in its Register whether it runs the batch-invariant kernels; the router names
    the workers on each side once they disagree, and `status` shows each one's mode."""
    async def scenario():
        async with serving_router() as (router, connect):
            for name, role, invariant in (("prefill-0", "prefill", True), ("decode-0", "decode", True),
                                          ("decode-1", "decode", None), ("decode-2", "decode", False)):
                await scripted_worker(router, connect, name, role, "cuda:0", "bfloat16", invariant)
                warned = [r.getMessage() for r in caplog.records if "batch invariance" in r.getMessage()]
                assert bool(warned) == (name == "decode-2"), (name, warned)  # None: an older worker, not said
            assert warned == ["workers disagree on batch invariance (on: decode-0, prefill-0; off: decode-2): a "
                              "request's tokens then depend on the workers it meets. Start every worker with the "
                              "same --batch-invariant or --no-batch-invariant"]
            modes = {w.worker_id: w.describe(time.monotonic())["batch_invariant"]
                     for w in router.registry.workers.values()}
            assert modes == {"prefill-0": True, "decode-0": True, "decode-1": None, "decode-2": False}

    with caplog.at_level("WARNING", logger="pdserve.router"):
        asyncio.run(scenario())


def test_a_worker_of_another_dtype_or_block_size_is_refused_by_name(tmp_path):
    """A worker started with another --dtype than the live workers' would give a request other
    tokens (it served them, nothing said, between mono workers), and a decode worker with another
    --block-size fails every handoff: the router refuses both when they register, naming the flag
    and its value; the cluster serves on token-exact."""
    from router.launcher import Cluster

    c = Cluster("dummy:nanogpt", 1, 1, 0, ["cpu"], "127.0.0.1", 0, 0, tmp_path / "logs", "round_robin", [],
                threads=1, restart=False)
    try:
        c.start()
        for flags, says in ((["--dtype", "bfloat16"], "it computes in bfloat16, live worker "),
                            (["--block-size", "32"], "its KV comes in 32-token blocks, prefill worker prefill-0's "
                                                     "in 16: KV cannot move between them; allowed: --block-size 16")):
            odd = subprocess.run([sys.executable, "-m", "common.cli", "decode", "--router",
                                  f"tcp://127.0.0.1:{c.worker_port}", "--worker-id", "decode-odd", "--threads", "1",
                                  *flags], capture_output=True, text=True, timeout=120)
            assert odd.returncode == 1 and says in odd.stderr, odd.stderr[-2000:]
        assert "allowed: --dtype float32" in (tmp_path / "logs" / "router.log").read_text()
        check_cluster_matches(c.address, "dummy:nanogpt", n=8)
    finally:
        c.stop()


def test_a_closed_client_says_so_and_an_async_client_keeps_to_its_event_loop(tmp_path):
    """Closing twice is nothing; a call on a closed client, or on an AsyncClient from a second
    asyncio.run (its reader is the first loop's: the call waited out its timeout), is a clear error."""
    with hand_made_cluster(tmp_path, [], []) as (client, _):
        with Client(client.address) as c:
            assert c.status().in_flight == 0
            c.close()
            with pytest.raises(RuntimeError, match="this Client is closed"):
                c.generate([1, 2], max_tokens=2)
        aclient = AsyncClient(client.address, timeout=30)
        assert asyncio.run(aclient.status()).in_flight == 0
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="serves the event loop of its first call"):
            asyncio.run(aclient.status())
        assert time.monotonic() - started < 5
        asyncio.run(aclient.close())
        asyncio.run(aclient.close())
        with pytest.raises(RuntimeError, match="this AsyncClient is closed"):
            asyncio.run(aclient.status())


def test_a_prefill_worker_with_a_small_pool_takes_what_fits_and_leaves_the_rest_to_others(tmp_path):
    """A prefill worker holds a prompt's KV, not its output's: a pool of 5 blocks takes 60-token
    prompts whatever their max_tokens (it refused them as INVALID_ARGUMENT, a final error, sizing
    them by prompt + max_tokens), and a prompt it cannot hold goes to the other prefill worker."""
    workers = [("prefill", ["--num-blocks", "5", "--worker-id", "small"], None), ("prefill", [], None),
               ("decode", [], None)]
    with hand_made_cluster(tmp_path, ["--policy", "round_robin"], workers) as (client, _):
        prompts = [[3 + i] * n for i, n in enumerate([60, 100, 60, 100, 60, 100])]
        sampling = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
        results = [client.generate(p, **sampling) for p in prompts]
        assert [r.token_ids for r in results] == monolithic("dummy:nanogpt", prompts, [sampling] * len(prompts))
    router_log = (tmp_path / "router.log").read_text()
    assert "PREFILL_NO_ROOM from small: request needs 7 KV blocks for 101 tokens" in router_log
