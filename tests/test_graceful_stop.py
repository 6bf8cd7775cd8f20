"""A worker told to stop (SIGTERM, as Kubernetes does) leaves gracefully: the router sends it no new
work, it finishes what it holds for up to --drain-timeout, and what it still holds then moves to
other workers at once, not at the heartbeat timeout. A stopping router cancels what its workers
hold for it."""

import asyncio
import signal

import pytest

from common import protocol as P
from router.client import Client
from tests.cluster import cluster, scripted_worker, serving_router, stoppable_router
from tests.test_chaos import reference, wait_for
from tests.test_local_prefill import GREEDY, next_work

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


def test_a_stopping_router_cancels_what_its_workers_hold():
    """Nobody is left to take those requests' tokens: the workers free them rather than decode on."""
    async def scenario():
        async with stoppable_router(heartbeat_timeout_s=60) as (router, connect, stop):
            worker = await scripted_worker(router, connect, "mono-0")
            client = connect(router.frontend.address)
            await client.send(P.Generate("a", list(range(1, 20)), GREEDY, False))
            work = (await asyncio.wait_for(worker.arecv(), 10)).msg
            await stop()
            cancel = (await asyncio.wait_for(worker.arecv(), 10)).msg
            return work, cancel

    work, cancel = asyncio.run(scenario())
    assert cancel == P.CancelWork(work.request_id, work.attempt)


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
            if signals == 2:  # once the first is taken: the kernel merges a signal sent while one is pending
                proc.send_signal(signal.SIGTERM)
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
