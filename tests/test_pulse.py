"""Long steps are not failures: a step that outlasts the router's heartbeat timeout is not a dead
worker (the worker's pulse beats for it: common/pulse.py) up to --step-timeout, after which it
counts as hung; and a prefill that outlasts the decode worker's KV lease keeps its blocks, its
prefill worker renewing the lease while it runs."""

import asyncio
import time

import pytest

from router.client import AsyncClient, RequestError
from tests.cluster import SLOWED_STEPS, hand_made_cluster

pytestmark = pytest.mark.timeout(120)

HEARTBEAT_TIMEOUT_S = 0.5
ROUTER = ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]


def incarnation(client) -> str:
    (worker,) = client.status().workers
    return worker["incarnation"]


def test_a_step_longer_than_the_heartbeat_timeout_is_no_death(tmp_path):
    slow = SLOWED_STEPS.format(delay=4 * HEARTBEAT_TIMEOUT_S, first_only=True)
    with hand_made_cluster(tmp_path, ROUTER, [("mono", [], slow)]) as (client, (log,)):
        before = incarnation(client)
        result = client.generate([5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True)
        assert len(result.token_ids) == 4
        assert incarnation(client) == before, "the router counted the worker dead during its long step"
        assert "re-register" not in log.read_text()


def test_a_step_past_step_timeout_counts_as_hung_and_its_request_is_recovered(tmp_path):
    slow = SLOWED_STEPS.format(delay=6 * HEARTBEAT_TIMEOUT_S, first_only=True)
    with hand_made_cluster(tmp_path, ROUTER, [("mono", ["--step-timeout", "0.5"], slow)]) as (client, (log,)):
        before = incarnation(client)
        result = client.generate([5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True)
        assert len(result.token_ids) == 4  # re-dispatched to the worker once it registered anew
        assert incarnation(client) != before
        assert "one step has run for" in log.read_text() and "counted hung" in log.read_text()


def test_a_prefill_longer_than_the_kv_lease_keeps_its_blocks(tmp_path):
    """6 chunks of 16 tokens at 1.2 s a step: 7 s of prefill against a 3 s lease granted at its
    start, each step longer than the third of a lease at which it is renewed (so renewals and
    their answers must be handled during a step, between layers). The decode worker's lease must
    not expire, nor the transfer be retried."""
    from common.engine import Engine
    from common.sampling_params import SamplingParams

    prompt = [(7 * i) % 250 + 1 for i in range(90)]
    (want,) = Engine(model="dummy:nanogpt").generate([prompt], SamplingParams(temperature=0, max_tokens=5,
                                                                              ignore_eos=True))
    slow = SLOWED_STEPS.format(delay=1.2, first_only=False)
    with hand_made_cluster(tmp_path, [], [("prefill", ["--max-num-batched-tokens", "16", "--max-num-seqs", "16"], slow),
                                          ("decode", ["--kv-lease", "3"], None)]) as (client, (prefill, decode)):
        result = client.generate(prompt, max_tokens=5, temperature=0, ignore_eos=True)
        assert result.token_ids == want.token_ids
    assert "expired" not in decode.read_text(), decode.read_text()[-2000:]
    assert "failed" not in prefill.read_text(), prefill.read_text()[-2000:]


def test_a_streams_timeout_is_for_each_chunk_and_a_waits_for_the_whole_answer(tmp_path):
    """Steps of 0.1 s: a 20-token stream takes 2 s, longer than its 0.8 s timeout, and still ends
    whole in both clients, as a slow answer that keeps coming should (the sync client's stream once
    failed TIMEOUT at 0.8 s; `pdserve client` gave up on long answers at 120 s). A stream whose
    next chunk takes longer than the timeout fails TIMEOUT, and so does a wait() for the whole answer."""
    slow = SLOWED_STEPS.format(delay=0.1, first_only=False)
    params = dict(max_tokens=20, temperature=0, ignore_eos=True)
    with hand_made_cluster(tmp_path, [], [("mono", [], slow)]) as (client, _):
        started = time.monotonic()
        chunks = list(stream := client.stream([5, 6, 7], timeout=0.8, **params))
        assert time.monotonic() - started > 1.6 and len(stream.result.token_ids) == 20 == len(chunks)

        async def streamed():
            async with AsyncClient(client.address, timeout=0.8) as aclient:
                return [c async for c in aclient.stream([5, 6, 7], **params)]
        assert len(asyncio.run(streamed())) == 20
        with pytest.raises(RequestError) as e:
            list(client.stream([5, 6, 7], timeout=0.05, **params))
        assert e.value.code == "TIMEOUT"

        # a wait's timeout is for the whole answer, its stream's tokens skipped (AsyncClient's once
        # began again at each token, as a stream's)
        async def waited():
            async with AsyncClient(client.address) as aclient:
                await aclient.wait(await aclient.submit([5, 6, 7], stream=True, **params), timeout=0.8)
        for wait in (lambda: asyncio.run(waited()), lambda: client.wait(client.submit([5, 6, 7], **params), 0.8)):
            started = time.monotonic()
            with pytest.raises(RequestError) as e:
                wait()
            assert e.value.code == "TIMEOUT" and time.monotonic() - started < 1.6
