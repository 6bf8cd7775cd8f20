"""The router's log of requests (router/request_log.py): each line names the request by the id its
client knows. A failed request is logged whether or not --log-requests is given; with it, each
request as it is admitted, refused and finished."""

import asyncio
import logging
import re

import pytest

from common import protocol as P
from tests.cluster import scripted_worker, serving_router
from tests.test_local_prefill import reply

pytestmark = pytest.mark.timeout(60)
SAMPLING = {"max_tokens": 2, "ignore_eos": True}


def router_lines(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "pdserve.router"
            and r.getMessage().startswith(("request ", "client ", "dropped "))]


def test_failures_are_logged_by_the_clients_ids_and_the_rest_only_with_log_requests(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.router")

    async def scenario(log_requests: bool):
        async with serving_router(log_requests=log_requests) as (router, connect):
            worker = await scripted_worker(router, connect, "mono-0")
            client = connect(router.frontend.address)
            await client.send(P.Generate("fine-1", [7, 8], SAMPLING, False))
            work = await reply(worker)
            await worker.send(P.WorkerTokens(work.request_id, work.attempt, 0, [5, 6], "length"))
            assert isinstance(await reply(client), P.Done)
            await client.send(P.Generate("bad-2", [7, 8], SAMPLING, False))
            work = await reply(worker)
            await worker.send(P.WorkerError(work.request_id, work.attempt, "INVALID_ARGUMENT", "no such thing"))
            assert isinstance(await reply(client), P.Error)
            # a client that goes away with two requests in flight: one line, naming both
            gone = connect(router.frontend.address)
            for rid in ("left-3", "left-4"):
                await gone.send(P.Generate(rid, [7, 8], {"max_tokens": 1000, "ignore_eos": True}, True))
                work = await reply(worker)
            gone.close()
            await worker.send(P.WorkerTokens(work.request_id, work.attempt, 0, [5], None))  # finds it gone
            while not isinstance(await reply(worker), P.CancelWork):
                pass
            await asyncio.sleep(0.1)

    asyncio.run(scenario(False))
    quiet = router_lines(caplog)
    assert [level for level, _ in quiet] == ["WARNING", "WARNING"], quiet
    first = re.fullmatch(r"request bad-2 \(#([0-9a-f]{6})-1\) failed after 0 tokens: INVALID_ARGUMENT: no such thing",
                         quiet[0][1])
    assert first, quiet[0]
    # found by the worker's token, or by the router's probe of a client whose requests send it nothing
    assert re.fullmatch(r"client [0-9a-f]+ is gone \((Token of left-4|Probe) not delivered\): its 2 requests "
                        r"cancelled: left-3, left-4", quiet[1][1]), quiet[1]

    caplog.clear()
    asyncio.run(scenario(True))
    said = [text for _, text in router_lines(caplog)]
    tag = next((m for t in said if (m := re.match(r"request fine-1 \(#([0-9a-f]{6})-0\)", t))), None)
    assert tag and tag[1] != first[1], said  # a router's ids are not the one's before it (a worker may hold those)
    assert any(t.startswith(f"request fine-1 (#{tag[1]}-0) admitted from ") and "2 prompt tokens, max_tokens 2" in t
               for t in said), said
    assert any(t.startswith(f"request fine-1 (#{tag[1]}-0) finished (length): 2 tokens in ") for t in said), said
    assert any(t.startswith(f"request left-3 (#{tag[1]}-2) cancelled by its client: 0 tokens") for t in said), said


def test_a_refused_request_is_logged_with_log_requests(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.router")

    async def scenario():
        async with serving_router(log_requests=True) as (router, connect):
            await scripted_worker(router, connect, "mono-0")
            client = connect(router.frontend.address)
            await client.send(P.Generate("twice", [7, 8], SAMPLING, False))
            await client.send(P.Generate("twice", [7, 8], SAMPLING, False))
            assert isinstance(await reply(client), P.Error)

    asyncio.run(scenario())
    assert any(text.startswith("request twice from ") and
               text.endswith("refused: INVALID_ARGUMENT: request_id='twice' is already in flight")
               for _, text in router_lines(caplog)), router_lines(caplog)


def test_a_client_gone_before_its_answer_and_an_id_that_would_write_lines_of_its_own(caplog):
    """A client gone once its one request ended: its Done, not delivered, is said (no request is
    left to name). An SDK's request_id with a newline is quoted in the line, not written as two."""
    caplog.set_level(logging.INFO, logger="pdserve.router")
    forged = "x\n2026-11-29 14:00:00,000 pdserve.router WARNING worker decode-9 lost"

    async def scenario():
        async with serving_router(log_requests=True) as (router, connect):
            worker = await scripted_worker(router, connect, "mono-0")
            gone = connect(router.frontend.address)
            await gone.send(P.Generate("only-1", [7, 8], SAMPLING, False))
            work = await reply(worker)
            gone.close()
            await asyncio.sleep(0.2)
            await worker.send(P.WorkerTokens(work.request_id, work.attempt, 0, [5, 6], "length"))
            client = connect(router.frontend.address)
            await client.send(P.Generate(forged, [7, 8], SAMPLING, False))
            work = await reply(worker)
            await worker.send(P.WorkerError(work.request_id, work.attempt, "INVALID_ARGUMENT", "no"))
            assert isinstance(await reply(client), P.Error)

    asyncio.run(scenario())
    lines = [text for _, text in router_lines(caplog)]
    assert any(t.startswith("client ") and t.endswith(" is gone (Done of only-1 not delivered)") for t in lines), lines
    assert not any("\n" in t for t in lines)
    assert any(re.fullmatch(rf"request {re.escape(repr(forged))} \(#[0-9a-f]{{6}}-1\) failed after 0 tokens: "
                            "INVALID_ARGUMENT: no", t) for t in lines), lines
