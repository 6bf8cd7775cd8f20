"""Local prefill on decode workers (Dynamo's conditional disaggregation): which worker the router
sends a prompt to, and that a cluster doing so serves the monolithic engine's tokens, recovers a
request prefilled on a decode worker that dies, and keeps serving on its decode workers alone when
every prefill worker is down."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request

import pytest

from common import protocol as P
from router.client import Client, RequestError
from tests.cluster import cluster, scripted_worker, serving_router, wait_blocks_free
from tests.test_cluster import check_cluster_matches, monolithic, run_concurrently

pytestmark = pytest.mark.timeout(300)
GREEDY = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}


async def next_work(chans: dict) -> tuple[str, P.PrefillWork]:
    """(the worker that got it, the PrefillWork) of the next PrefillWork any of chans receives
    (past CancelWork: a re-dispatch cancels the attempt it replaces)."""
    while True:
        tasks = {asyncio.ensure_future(chan.arecv()): name for name, chan in chans.items()}
        done, pending = await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        assert done, "no worker got work"
        got = [(tasks[t], t.result().msg) for t in done]
        work = [(name, msg) for name, msg in got if not isinstance(msg, P.CancelWork)]
        assert len(work) <= 1 and all(isinstance(msg, P.PrefillWork) for _, msg in work), got
        if work:
            return work[0]


async def reply(chan):
    """The next message the router sends a client, past its probes (it checks on clients that wait)."""
    while True:
        msg = (await asyncio.wait_for(chan.arecv(), 10)).msg
        if not isinstance(msg, P.Probe):
            return msg


def test_a_prompt_short_enough_is_prefilled_by_its_decode_worker():
    """Up to --max-local-prefill-length tokens (a migrated request's count its output too) go to a
    decode worker, naming itself; longer ones to a prefill worker; metrics count the local ones."""
    async def scenario():
        async with serving_router(max_local_prefill_length=32, heartbeat_timeout_s=60) as (router, connect):
            workers = {name: await scripted_worker(router, connect, name, role)
                       for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"))}
            client = connect(router.frontend.address)
            works = {}
            for rid, length in (("short", 32), ("long", 33)):
                await client.send(P.Generate(rid, list(range(1, length + 1)), GREEDY, False))
                name, works[rid] = await next_work(workers)
                assert (name, works[rid].decode_worker_id) == ("prefill-0" if rid == "long" else "decode-0",
                                                               "decode-0"), rid
            # "short" decodes 8 tokens, then its decode worker dies: prompt + output is 40 tokens, past the limit
            short = works["short"]
            await workers["decode-0"].send(P.WorkerTokens(short.request_id, short.attempt, 0, list(range(8)), None))
            await scripted_worker(router, connect, "decode-1", "decode")
            router.worker_lost(router.registry.workers["decode-0"], "killed by the test")
            again = {}
            for _ in range(2):  # both, re-dispatched: neither is short enough now
                name, work = await next_work({"prefill-0": workers["prefill-0"]})
                again[work.request_id] = work
            assert len(again[short.request_id].token_ids) == 40 and again[short.request_id].decode_worker_id == "decode-1"
            return router.metrics.render().decode()

    metrics = asyncio.run(scenario())
    assert 'pdserve:local_prefills_total{model_name="dummy:nanogpt"} 1.0' in metrics


def test_new_requests_avoid_a_pair_whose_handoff_failed_while_another_serves():
    """A decode worker the prefill worker cannot reach (an address it cannot connect to, a
    firewall) was given every other new request, each waiting out the transfer timeout before its
    retry elsewhere: the pair is now left out of new placements for a while, unless it alone serves."""
    async def scenario():
        async with serving_router(heartbeat_timeout_s=60) as (router, connect):
            workers = {name: await scripted_worker(router, connect, name, role)
                       for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"))}
            prefill, client = {"prefill-0": workers["prefill-0"]}, connect(router.frontend.address)
            await client.send(P.Generate("first", [1, 2, 3], GREEDY, False))
            _, work = await next_work(prefill)
            bad, good = work.decode_worker_id, {"decode-0": "decode-1", "decode-1": "decode-0"}[work.decode_worker_id]
            await workers["prefill-0"].send(P.WorkerError(work.request_id, work.attempt, "TIMEOUT",
                                                          "no acknowledgement within 30.0s"))
            _, retried = await next_work(prefill)
            assert (retried.request_id, retried.decode_worker_id) == (work.request_id, good)
            for i in range(4):  # least_loaded would send some to the idle one
                await client.send(P.Generate(f"next-{i}", [1, 2, 3], GREEDY, False))
                _, work = await next_work(prefill)
                assert work.decode_worker_id == good, i
            # the failing pair alone serves: the four moved off the lost worker and a new one go to it
            router.worker_lost(router.registry.workers[good], "killed by the test")
            await client.send(P.Generate("alone", [1, 2, 3], GREEDY, False))
            for _ in range(5):
                assert (await next_work(prefill))[1].decode_worker_id == bad
            assert set(router.placement.failing) == {("prefill-0", bad)}
            router.worker_lost(router.registry.workers[bad], "killed by the test")  # and restarted:
            again = connect(router.backend.address, f"{bad}/2".encode())
            await again.send(P.Register("decode", bad, "2", "cpu", 64, 16, "tcp://127.0.0.1:1",
                                        router.prompts.model_config.fingerprint, []))
            assert isinstance((await again.arecv()).msg, P.Registered)
            assert not router.placement.failing  # its last incarnation's failures are forgotten

    asyncio.run(scenario())


def test_while_every_prefill_worker_holds_its_queue_limit_a_decode_worker_prefills():
    """--max-prefill-queue 2: the third of three long prompts at once goes to the decode worker;
    once the first has reached its decode worker (its first decode token), the prefill worker
    takes prompts again."""
    async def scenario():
        async with serving_router(max_prefill_queue=2, heartbeat_timeout_s=60) as (router, connect):
            workers = {name: await scripted_worker(router, connect, name, role)
                       for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"))}
            client = connect(router.frontend.address)
            got = []
            for rid in ("a", "b", "c"):
                await client.send(P.Generate(rid, list(range(1, 200)), GREEDY, False))
                got.append(await next_work(workers))
            assert [name for name, _ in got] == ["prefill-0", "prefill-0", "decode-0"]
            first = got[0][1]  # its KV reached decode-0, which streams it: prefill-0 holds one request now
            await workers["decode-0"].send(P.WorkerTokens(first.request_id, first.attempt, 0, [5, 6], None))
            await client.send(P.Generate("d", list(range(1, 200)), GREEDY, False))
            assert (await next_work(workers))[0] == "prefill-0"

    asyncio.run(scenario())


@pytest.mark.parametrize("enforce", [False, True], ids=["fallback", "enforce-disagg"])
def test_with_no_prefill_worker_alive_a_decode_worker_prefills_unless_disaggregation_is_enforced(enforce):
    async def scenario():
        async with serving_router(enforce_disagg=enforce, queue_timeout_s=0.5, heartbeat_timeout_s=60) as (router, connect):
            decode = await scripted_worker(router, connect, "decode-0", "decode")
            client = connect(router.frontend.address)
            await client.send(P.Generate("never", [1, 2, 3], GREEDY, False))  # no prefill worker ever registered
            if enforce:
                refused = await reply(client)
                assert isinstance(refused, P.Error) and "no prefill worker has registered" in refused.message
            else:
                assert (await next_work({"decode-0": decode}))[1].decode_worker_id == "decode-0"
            prefill = await scripted_worker(router, connect, "prefill-0", "prefill")
            await client.send(P.Generate("both", list(range(1, 100)), GREEDY, False))
            assert (await next_work({"prefill-0": prefill, "decode-0": decode}))[0] == "prefill-0"
            router.worker_lost(router.registry.workers["prefill-0"], "killed by the test")  # "both" is re-dispatched
            if not enforce:
                name, work = await next_work({"decode-0": decode})
                assert len(work.token_ids) == 99 and work.decode_worker_id == "decode-0"
                return router.placement.missing(router.registry.alive(("prefill", "decode")))
            msg = await reply(client)  # it waits for a prefill worker, then fails naming the one missing
            assert isinstance(msg, P.Error) and msg.code == "UNAVAILABLE" and "no live prefill worker" in msg.message
            return router.placement.missing(router.registry.alive(("prefill", "decode")))

    assert asyncio.run(scenario()) == (["prefill"] if enforce else [])


def test_a_request_older_than_the_queue_timeout_whose_worker_dies_waits_the_queue_timeout_for_another():
    """Back in the queue after its worker died, a request waits --queue-timeout from then: before,
    the wait counted from its arrival, and one decoding for longer failed at once while its only
    worker restarted, its message saying it had waited the whole timeout."""
    async def scenario():
        async with serving_router(queue_timeout_s=2.0, heartbeat_timeout_s=60) as (router, connect):
            first = await scripted_worker(router, connect, "mono-0")
            client = connect(router.frontend.address)
            await client.send(P.Generate("old", [1, 2, 3], {**GREEDY, "max_tokens": 100}, True))
            _, work = await next_work({"mono-0": first})
            await first.send(P.WorkerTokens(work.request_id, work.attempt, 0, [5], None))
            assert (await reply(client)).token_ids == [5]
            router.requests[work.request_id].arrival -= 60  # decoding for a minute
            router.worker_lost(router.registry.workers["mono-0"], "killed by the test")
            await asyncio.sleep(0.5)  # some monitor ticks: it is still queued, waiting for a worker
            assert router.requests[work.request_id].state == "queued"
            second = await scripted_worker(router, connect, "mono-1")
            _, moved = await next_work({"mono-1": second})
            assert moved.token_ids == [1, 2, 3, 5] and moved.request_id == work.request_id
    asyncio.run(scenario())


def test_prefix_affine_prefills_a_conversation_s_next_turn_where_its_decode_worker_holds_it():
    """A decode worker's prefix cache holds the prompts it was sent and the outputs it decoded: the
    next turn (the conversation so far and a new message) goes to it, with its 22 uncached tokens
    under the limit of 32, though the whole prompt is 150 and the prompt alone would leave 54."""
    async def scenario():
        async with serving_router(policy="prefix_affine", max_local_prefill_length=32, heartbeat_timeout_s=60) as (router, connect):
            workers = {name: await scripted_worker(router, connect, name, role)
                       for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"))}
            client = connect(router.frontend.address)
            turn = list(range(1, 101))
            await client.send(P.Generate("turn-1", turn, {**GREEDY, "max_tokens": 40}, False))
            name, work = await next_work(workers)
            assert name == "prefill-0"
            holder = work.decode_worker_id
            output = list(range(200, 240))
            await workers[holder].send(P.WorkerTokens(work.request_id, work.attempt, 0, output, "length"))
            assert isinstance(await reply(client), P.Done)
            await client.send(P.Generate("turn-2", turn + output + list(range(50, 60)), GREEDY, False))
            name, work = await next_work(workers)
            assert name == holder and work.decode_worker_id == holder
            await client.send(P.Generate("other", list(range(250, 150, -1)), GREEDY, False))  # nothing cached: prefilled
            assert (await next_work(workers))[0] == "prefill-0"

    asyncio.run(scenario())


def metric(c, name: str) -> float:
    text = urllib.request.urlopen(c.http_url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"pdserve:{name}{{"))


def test_a_cluster_prefilling_short_prompts_on_its_decode_workers_serves_the_monolithic_tokens(tmp_path):
    """1P2D, prompts up to 24 tokens prefilled by the decode workers: the tokens of the monolithic
    engine, streamed in order; a decode worker killed mid-stream has its requests (prefilled there
    or not) migrated with the same tokens; every block comes back."""
    args = ["--max-local-prefill-length", "24", "--heartbeat-timeout", "0.6", "--max-attempts", "10"]
    with cluster(tmp_path, prefill=1, decode=2, router_args=args, http=True) as c:
        check_cluster_matches(c.address, "dummy:nanogpt", n=24)
        local = metric(c, "local_prefills_total")
        assert 0 < local < 24  # the workload's prompts of 1, 5 and 20 tokens; not those of 60 and 150
        prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((8, 12, 40, 90))]
        sampling = [dict(max_tokens=160, ignore_eos=True, temperature=0.8, seed=i) for i in range(4)]
        want = monolithic("dummy:nanogpt", prompts, sampling)

        async def killed_mid_stream(client):
            """SIGKILL a decode worker while it streams: the first by name once both run requests, or
            after 5 s whichever does (a busy machine may route them all to one: a heartbeat missed,
            a worker slow to start)."""
            run = asyncio.ensure_future(run_concurrently(c.address, prompts, sampling))
            deadline = time.monotonic() + 30
            while True:
                running = [w["worker_id"] for w in client.status().workers if w["role"] == "decode" and w["running"]]
                if len(running) == 2 or (running and time.monotonic() > deadline - 25):
                    break
                assert time.monotonic() < deadline, "no decode worker ran a request"
                await asyncio.sleep(0.05)
            next(w.proc for w in c.workers if w.name == sorted(running)[0]).send_signal(signal.SIGKILL)
            return await run

        with Client(c.address) as client:
            results = asyncio.run(killed_mid_stream(client))
        for (result, chunks), expected in zip(results, want):
            assert result.token_ids == expected
            assert [t for chunk in chunks for t in chunk.token_ids] == expected
        assert metric(c, "request_migrations_total") >= 1 and metric(c, "local_prefills_total") >= local + 2
        with Client(c.address) as client:
            alive = [w for w in wait_blocks_free(client) if w["alive"]]
            assert all(w["free_blocks"] == w["total_blocks"] for w in alive)


@pytest.mark.parametrize("enforce", [False, True], ids=["fallback", "enforce-disagg"])
def test_with_its_prefill_worker_dead_a_cluster_serves_on_its_decode_worker_unless_told_not_to(tmp_path, enforce):
    """/health: from the router's own HTTP front (enforce-disagg), from API servers, which ask the
    router what the cluster lacks (fallback)."""
    args = ["--heartbeat-timeout", "0.6", "--queue-timeout", "1"] + (["--enforce-disagg"] if enforce else [])
    with cluster(tmp_path, prefill=1, decode=1, router_args=args, http=True, api_servers=1 if enforce else 2) as c, \
            Client(c.address, timeout=60) as client:
        c.workers[0].proc.kill()  # prefill-0, not restarted
        c.workers[0].proc.wait()
        deadline = time.monotonic() + 10
        while any(w["alive"] for w in client.status().workers if w["role"] == "prefill"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        try:
            health = urllib.request.urlopen(c.http_url + "/health", timeout=10).status
        except urllib.error.HTTPError as e:
            health = e.code
        from click.testing import CliRunner

        from common.cli import main
        status = CliRunner().invoke(main, ["status", "--router", c.address])
        title = status.output.splitlines()[0]
        assert ("cannot serve: no live prefill worker;" if enforce else ": serving;") in title, title
        assert status.exit_code == (1 if enforce else 0)  # for scripts and health checks
        assert CliRunner().invoke(main, ["status", "--router", c.address, "--json"]).exit_code == status.exit_code
        prompt, sampling = list(range(1, 60)), dict(max_tokens=12, ignore_eos=True, temperature=0)
        if enforce:
            with pytest.raises(RequestError) as e:
                client.generate(prompt, **sampling)
            assert e.value.code == "UNAVAILABLE" and "no live prefill worker for 1.0s" in e.value.message
            assert health == 503
        else:
            assert client.generate(prompt, **sampling).token_ids == monolithic("dummy:nanogpt", [prompt], [sampling])[0]
            assert health == 200 and metric(c, "local_prefills_total") == 1
            status = json.loads(urllib.request.urlopen(c.http_url + "/health", timeout=10).read())
            assert status == {"status": "ok", "workers": 1}


def test_a_cluster_of_decode_workers_alone_serves(tmp_path):
    """launch --prefill 0 --decode 2: each decode worker prefills its own requests (until prefill
    workers join: from other hosts, say), with the monolithic engine's tokens."""
    prompts, sampling = [[(3 * i + j) % 250 + 1 for j in range(10 + 20 * i)] for i in range(4)], \
        [dict(max_tokens=16, ignore_eos=True, temperature=0.8, seed=i) for i in range(4)]
    with cluster(tmp_path, prefill=0, decode=2) as c:
        results = asyncio.run(run_concurrently(c.address, prompts, sampling))
        assert [r.token_ids for r, _ in results] == monolithic("dummy:nanogpt", prompts, sampling)
        with Client(c.address) as client:
            assert sorted(w["role"] for w in client.status().workers) == ["decode", "decode"]


def test_bench_serve_compares_local_prefill_on_conversations():
    """multi_turn: each turn's prompt is the conversation so far; prefilled where its decode worker
    holds it, more of each prompt is found cached (the outputs too, not the prompts alone)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "common.cli", "bench", "serve", "--topologies", "1p1d,1p1d+local128",
                        "--policies", "prefix_affine", "--scenarios", "multi_turn"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["topology"]: row for row in json.loads(r.stdout.strip().splitlines()[-1])["results"]}
    assert set(rows) == {"1p1d", "1p1d+local128"}
    assert all((row["requests"], row["failed"]) == (128, 0) for row in rows.values()), rows  # 32 talks of 4 turns
    assert rows["1p1d+local128"]["prompt_cached_pct"] > rows["1p1d"]["prompt_cached_pct"], rows
    # a later turn leaves at most 15 + 48 + 48 tokens uncached: all of them are local (75% of the
    # requests), and first turns (128-384 tokens, nothing cached) only where 128 tokens long
    assert rows["1p1d"]["local_prefill_pct"] == 0 and 75 <= rows["1p1d+local128"]["local_prefill_pct"] < 90, rows
    bad = subprocess.run([sys.executable, "-m", "common.cli", "bench", "serve", "--scenarios", "multi_turn",
                          "--frontends", "zmq,http"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "scenario 'multi_turn' sends each turn's output back as token ids" in bad.stderr
