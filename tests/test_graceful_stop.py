"""A worker told to stop (SIGTERM, as Kubernetes does) leaves gracefully: the router sends it no new
work, it finishes what it holds for up to --drain-timeout, and what it still holds then moves to
other workers at once, not at the heartbeat timeout. A stopping router cancels what its workers
hold for it."""

import asyncio
import logging
import signal
import time

import pytest

from common import protocol as P
from common.signals import REPEAT_S, StopSignals
from router.client import AsyncClient, Client, RequestError
from router.launcher import free_port
from tests.cluster import cluster, http_request, scripted_worker, serving_router, stoppable_router
from tests.test_chaos import reference, wait_for
from tests.test_local_prefill import GREEDY, next_work, reply

pytestmark = pytest.mark.timeout(300)
LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}


def test_the_router_sends_a_leaving_worker_no_new_work_and_moves_its_requests_once_it_is_gone():
    """... and a move for a planned stop spends none of --max-attempts (here 1): a rolling restart
    cut streams that met a stopping worker that many times."""
    async def scenario():
        async with serving_router(heartbeat_timeout_s=60, max_attempts=1) as (router, connect):
            workers = {name: await scripted_worker(router, connect, name, role)
                       for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"))}
            client = connect(router.frontend.address)
            await client.send(P.Generate("a", list(range(1, 20)), GREEDY, False))
            _, first = await next_work(workers)
            leaving = first.decode_worker_id
            await workers[leaving].send(P.Leaving(leaving))
            assert (await asyncio.wait_for(workers[leaving].arecv(), 10)).msg == P.Leaving(leaving)  # answered
            other = ({"decode-0", "decode-1"} - {leaving}).pop()
            for rid in ("b", "c"):  # least loaded would pick the leaving one for one of them
                await client.send(P.Generate(rid, list(range(1, 20)), GREEDY, False))
                assert (await next_work(workers))[1].decode_worker_id == other
            status = {w.worker_id: w.describe(0) for w in router.registry.workers.values()}
            assert status[leaving]["leaving"] and status[leaving]["alive"] and not status[other]["leaving"]
            await workers[leaving].send(P.WorkerTokens(first.request_id, first.attempt, 0, [7, 8], None))
            await workers[leaving].send(P.Leaving(leaving, gone=True))  # "a" moves now, its two tokens kept
            _, again = await next_work(workers)
            assert (again.request_id, again.decode_worker_id, again.token_ids[-2:]) == (first.request_id, other, [7, 8])
            # with no decode worker left that takes work, the cluster says what it lacks
            await workers[other].send(P.Leaving(other))
            await asyncio.sleep(0.2)
            missing = router.placement.missing(router.registry.serving(("prefill", "decode", "mono")))
            return missing, router.metrics.render().decode()

    missing, metrics = asyncio.run(scenario())
    assert missing == ["decode"]
    assert 'pdserve:worker_deaths_total{model_name="dummy:nanogpt"} 0.0' in metrics  # it left, it did not die


def test_a_stopping_router_finishes_what_it_holds_and_admits_nothing_new(caplog):
    """As Kubernetes stops a pod: new requests are refused (503 with Retry-After over HTTP) and
    /health says 503 so a load balancer looks elsewhere, while the request held finishes; the
    router stops as soon as it has, not at its --drain-timeout."""
    async def scenario():
        port = free_port()
        async with stoppable_router(heartbeat_timeout_s=60, drain_timeout_s=60, http_port=port) as (router, connect,
                                                                                                  stop):
            worker = await scripted_worker(router, connect, "mono-0")
            client = connect(router.frontend.address)
            await client.send(P.Generate("a", list(range(1, 20)), GREEDY, False))
            work = (await asyncio.wait_for(worker.arecv(), 10)).msg
            stopping = asyncio.ensure_future(stop())
            while router.stopping is None:
                await asyncio.sleep(0.01)
            await client.send(P.Generate("b", list(range(1, 20)), GREEDY, False))
            refused = await reply(client)
            await client.send(P.StatusRequest("s"))
            status = await reply(client)
            url = f"http://127.0.0.1:{port}"
            health = await asyncio.to_thread(http_request, f"{url}/health")
            completion = await asyncio.to_thread(http_request, f"{url}/v1/completions", "POST",
                                                 {"prompt": [1, 2], "max_tokens": 2})
            assert not stopping.done()  # still draining: "a" is held
            began = time.monotonic()
            await worker.send(P.WorkerTokens(work.request_id, work.attempt, 0, [7, 8], "length"))
            done = await reply(client)
            await asyncio.wait_for(stopping, 10)
            return refused, status, health, completion, done, time.monotonic() - began

    with caplog.at_level(logging.INFO, logger="pdserve.router"):
        refused, status, health, completion, done, took = asyncio.run(scenario())
    assert (refused.request_id, refused.code) == ("b", "UNAVAILABLE") and "router is stopping" in refused.message
    assert status.stopping and status.in_flight + status.queued == 1
    assert health[0] == 503 and "stopping" in health[2]["error"]["message"] and health[1]["Retry-After"] == "1"
    assert completion[0] == 503 and "--drain-timeout" in completion[2]["error"]["message"]
    assert completion[1]["Retry-After"] == "1"
    assert (done.request_id, done.finish_reason, done.token_ids) == ("a", "length", [7, 8])
    assert took < 5  # not the 60 s --drain-timeout
    assert "the 1 requests it held ended" in caplog.text and "refused 2 new ones" in caplog.text


def test_a_stopping_router_waits_for_a_leaving_worker_to_finish_what_it_holds():
    """Worker and router told to stop together (a launcher's Ctrl-C, a systemd stop): the router
    lacks a serving worker at once, but the leaving one still finishes its request. The router ended
    the request at once, the worker's drain wasted."""
    async def scenario():
        async with stoppable_router(heartbeat_timeout_s=60, drain_timeout_s=60) as (router, connect, stop):
            worker = await scripted_worker(router, connect, "mono-0")
            client = connect(router.frontend.address)
            await client.send(P.Generate("a", list(range(1, 20)), GREEDY, False))
            work = (await asyncio.wait_for(worker.arecv(), 10)).msg
            await worker.send(P.Leaving("mono-0"))
            assert (await asyncio.wait_for(worker.arecv(), 10)).msg == P.Leaving("mono-0")  # answered
            stopping = asyncio.ensure_future(stop())
            await asyncio.sleep(0.5)
            waited = not stopping.done() and router.serving()[1] != []
            await worker.send(P.WorkerTokens(work.request_id, work.attempt, 0, [7, 8], "length"))
            done = await reply(client)
            await asyncio.wait_for(stopping, 10)
            return waited, done

    waited, done = asyncio.run(scenario())
    assert waited and (done.request_id, done.finish_reason, done.token_ids) == ("a", "length", [7, 8])


@pytest.mark.parametrize("ends", ["drain-timeout", "second-signal", "no-worker-left"])
def test_what_a_stopping_router_did_not_finish_ends_unavailable_and_its_work_is_cancelled(caplog, ends):
    """Its clients are told (an SDK client no longer waits to find the connection lost), and its
    workers free the requests' blocks, since nobody is left to take their tokens. The drain ends at
    --drain-timeout, at a second signal, or once no worker is left to serve what it holds (as when
    a launcher has stopped its workers first)."""
    async def scenario():
        timeout = 0.5 if ends == "drain-timeout" else 60
        async with stoppable_router(heartbeat_timeout_s=60, drain_timeout_s=timeout) as (router, connect, stop):
            worker = await scripted_worker(router, connect, "mono-0")
            client = connect(router.frontend.address)
            await client.send(P.Generate("a", list(range(1, 20)), GREEDY, False))
            work = (await asyncio.wait_for(worker.arecv(), 10)).msg
            began = time.monotonic()
            stopping = asyncio.ensure_future(stop())
            while router.stopping is None:
                await asyncio.sleep(0.01)
            if ends == "second-signal":
                await stop(now=True)
            elif ends == "no-worker-left":
                await worker.send(P.Leaving("mono-0", gone=True))
            await asyncio.wait_for(stopping, 10)
            failed = await reply(client)
            # a worker gone (Leaving) is sent nothing more
            cancel = (await asyncio.wait_for(worker.arecv(), 10)).msg if ends != "no-worker-left" else None
            return work, failed, cancel, time.monotonic() - began

    with caplog.at_level(logging.INFO, logger="pdserve.router"):
        work, failed, cancel, took = asyncio.run(scenario())
    why = {"drain-timeout": "its --drain-timeout, 0.5s, passed", "second-signal": "a second signal came",
           "no-worker-left": "no live prefill or decode worker was left to finish the request (the workers stopped "
                             "as told, at their --drain-timeout)"}[ends]
    assert (failed.request_id, failed.code) == ("a", "UNAVAILABLE")
    assert failed.message == f"the router stopped before this request finished: {why}"
    assert cancel == (None if ends == "no-worker-left" else P.CancelWork(work.request_id, work.attempt))
    assert took < (5 if ends == "drain-timeout" else 2)
    assert "1 of the 1 requests it held are unfinished after" in caplog.text and why in caplog.text


def test_a_router_restarted_under_load_finishes_its_streams_token_exact(tmp_path):
    """SIGTERM to a real router mid-stream (a restart to change a flag, an upgrade): the stream ends
    with the monolithic engine's tokens, a request sent meanwhile is refused UNAVAILABLE at once, and
    the router exits 0 once the stream is done."""
    prompt = [5, 6, 7, 8]
    want = reference([prompt], [LONG])[0]
    with cluster(tmp_path, prefill=0, decode=0, mono=1, router_args=["--drain-timeout", "120"]) as c, \
            Client(c.address, timeout=60) as client:
        stream = client.stream(prompt, **LONG)
        tokens = list(next(stream).token_ids)
        c.router.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: client.status().stopping, what="the router to be stopping")
        with pytest.raises(RequestError) as refused:
            client.generate([9, 10], **GREEDY)
        tokens += [t for chunk in stream for t in chunk.token_ids]
        assert c.router.proc.wait(timeout=30) == 0
    assert refused.value.code == "UNAVAILABLE" and "router is stopping" in refused.value.message
    assert tokens == want and stream.result.finish_reason == "length"


@pytest.mark.parametrize("sdk", ["Client", "AsyncClient"])
def test_an_sdk_client_behind_on_its_stream_reads_why_the_stopping_router_did_not_finish_it(tmp_path, sdk):
    """The router's last tokens and its Error wait in the client's socket when the router exits: a
    client that reads them late gets them, not "lost the connection" (the drop is seen first)."""
    prompt = [5, 6, 7, 8]
    want = reference([prompt], [dict(LONG, max_tokens=1000)])[0]
    with cluster(tmp_path, prefill=0, decode=0, mono=1, router_args=["--drain-timeout", "0.3"]) as c:
        if sdk == "Client":
            with Client(c.address, timeout=60) as client:
                stream = client.stream(prompt, **dict(LONG, max_tokens=1000))  # it outlasts the drain
                tokens = list(next(stream).token_ids)
                c.router.proc.send_signal(signal.SIGTERM)
                assert c.router.proc.wait(timeout=30) == 0
                with pytest.raises(RequestError) as ended:
                    for chunk in stream:
                        tokens += chunk.token_ids
        else:
            tokens = []

            async def read():
                async with AsyncClient(c.address, timeout=60) as client:
                    async for chunk in client.stream(prompt, **dict(LONG, max_tokens=1000)):
                        if not tokens:
                            c.router.proc.send_signal(signal.SIGTERM)
                            c.router.proc.wait(timeout=30)  # the loop held up: the drop and the replies wait together
                        tokens.extend(chunk.token_ids)

            with pytest.raises(RequestError) as ended:
                asyncio.run(read())
    assert ended.value.code == "UNAVAILABLE"
    assert ended.value.message == "the router stopped before this request finished: its --drain-timeout, 0.3s, passed"
    assert len(tokens) >= 1 and tokens == want[:len(tokens)]


def test_a_decode_worker_told_to_stop_mid_stream_finishes_it_or_at_a_second_signal_hands_it_on(tmp_path):
    """SIGTERM to the decode worker streaming a request: it finishes the request itself and exits
    0 (no migration), while a request sent meanwhile goes to another. SIGTERM twice to the next
    one: it stops at once, and its request moves at once, though the router would take 60 s to
    find a silent worker dead. The tokens are the monolithic engine's either way."""
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    want = reference(prompts, [LONG, GREEDY, LONG])
    with cluster(tmp_path, prefill=1, decode=3, worker_args=["--drain-timeout", "60"],
                 router_args=["--heartbeat-timeout", "60"]) as c, Client(c.address, timeout=30) as client:
        def stop_the_holder(stream, signals: int):
            tokens = list(next(stream).token_ids)
            holder = next(w["worker_id"] for w in client.status().workers
                          if w["role"] == "decode" and w["alive"] and w["assigned"])
            proc = next(w.proc for w in c.workers if w.name == holder)
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: any(w["leaving"] or not w["alive"] for w in client.status().workers
                                 if w["worker_id"] == holder), what=f"{holder} to leave")
            if signals == 2:  # once the first is taken (the kernel merges a signal sent while one is pending),
                # and past the time a launcher's child takes a second as the same stop, the stream held
                proc.send_signal(signal.SIGSTOP)
                time.sleep(REPEAT_S)
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)
            return tokens, proc

        stream = client.stream(prompts[0], **LONG)
        tokens, proc = stop_the_holder(stream, 1)
        other = client.generate(prompts[1], **GREEDY)
        assert other.token_ids == want[1] and other.timings["attempts"] == 1
        tokens += [t for chunk in stream for t in chunk.token_ids]
        assert (tokens, stream.result.timings["attempts"]) == (want[0], 1)  # finished where it was
        assert proc.wait(timeout=30) == 0

        stream = client.stream(prompts[2], **LONG)
        tokens, proc = stop_the_holder(stream, 2)
        tokens += [t for chunk in stream for t in chunk.token_ids]
        assert (tokens, stream.result.timings["attempts"]) == (want[2], 2)  # moved at once
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("launched", [True, False], ids=["launchers-child", "alone"])
def test_a_launchers_child_takes_a_signal_soon_after_the_first_as_the_same_stop(monkeypatch, launched):
    """A process group's SIGTERM, then its launcher's: one stop for a launcher's child (SIGINT
    ignored as it started), two for a process run alone, where a second Ctrl-C means now."""
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_IGN if launched else signal.default_int_handler)
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    stops = StopSignals()
    counts = [stops.take()]
    clock[0] += REPEAT_S / 2
    counts.append(stops.take())
    clock[0] += REPEAT_S
    counts.append(stops.take())
    assert counts == ([1, 1, 2] if launched else [1, 2, 3])
