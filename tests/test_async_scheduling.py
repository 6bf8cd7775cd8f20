"""Async scheduling (common/engine.py): step N is scheduled and launched before step N - 1's tokens
are read, which N's decodes take on the device. The tokens, logprobs and finish reasons must be
the synchronous engine's, through stop tokens, stop strings, length limits, preemption and prefix
hits; and no block may be handed out while a launched step can still write it."""

import random

import pytest

from common.engine import Engine
from common.sampling_params import SamplingParams
from common.sequence import PENDING
from tests.test_engine import assert_all_blocks_free, prompts


def varied_params(ps, seed=0, **engine_kwargs):
    """Greedy and seeded requests of 1 to 30 tokens, some asking for logprobs, and every third
    stopped by a token it would generate halfway (found by a run without stop tokens)."""
    rng = random.Random(seed)
    out = [SamplingParams(temperature=0 if i % 2 else 0.9, top_k=20 * (i % 3), seed=100 + i,
                          max_tokens=rng.randint(1, 30), ignore_eos=True, logprobs=2 if i % 5 == 0 else None)
           for i in range(len(ps))]
    free = Engine(**engine_kwargs).generate(ps, out)
    for i in range(0, len(ps), 3):
        out[i].stop_token_ids = [free[i].token_ids[len(free[i].token_ids) // 2]]
    return out


def assert_same_results(got, want):
    """Tokens and finish reasons exactly; logprobs' ids exactly and their values to float32's
    noise (a batch of another shape may round them differently)."""
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g.logprobs is None) == (w.logprobs is None)
        for j, (eg, ew) in enumerate(zip(g.logprobs or [], w.logprobs or [])):  # (request, token) if they differ
            assert eg[1] == ew[1] and [eg[0]] + eg[2] == pytest.approx([ew[0]] + ew[2], abs=1e-4), (i, j)


@pytest.mark.parametrize("model", ["dummy:nanogpt", "dummy:llama-tiny"])
@pytest.mark.parametrize("pool", [None, dict(block_size=4, num_blocks=40)], ids=["roomy", "preempting"])
def test_async_scheduling_gives_the_synchronous_tokens(model, pool):
    ps = prompts(12, 2, 40, seed=7)
    ps[3] = ps[2][:32] + [1, 2]  # a prefix hit
    params = varied_params(ps, model=model)
    runs = {}
    for on in (False, True):
        engine = Engine(model=model, max_num_seqs=8, async_scheduling=on, **(pool or {}))
        runs[on] = engine.generate(ps, params)
        assert_all_blocks_free(engine)
        assert not engine.has_unfinished()
        if pool:
            assert engine.scheduler.num_preemptions > 0
    assert_same_results(runs[True], runs[False])
    assert {o.finish_reason for o in runs[True]} == {"stop", "length"}
    assert any(o.logprobs for o in runs[True])


def test_generate_returns_with_nothing_in_flight_after_a_stop_token():
    """The last request ends by a stop token read while its next decode was already launched:
    generate() returns with that step collected and every block free."""
    p = prompts(1, 10, 10, seed=3)[0]
    free = Engine(model="dummy:nanogpt").generate(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    stop = free.token_ids[3]
    engine = Engine(model="dummy:nanogpt", async_scheduling=True)
    out = engine.generate(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    assert engine.inflight is None and not engine.has_unfinished()
    assert_all_blocks_free(engine)


def test_async_decodes_through_the_graph_buffers_give_the_synchronous_tokens():
    """The GPU path on CPU (tests/test_cuda_graphs.py): the Triton attention interpreted, decodes
    through the graphs' static buffers, whose input ids the step before fills on the device."""
    pytest.importorskip("triton")
    from tests.test_cuda_graphs import _with_uncaptured_graphs

    ps = prompts(4, 3, 12, seed=8)
    kwargs = dict(model="dummy:llama-tiny", attention_backend="triton", max_num_seqs=4)
    params = varied_params(ps, model="dummy:llama-tiny")  # its stop tokens from SDPA's tokens: the same
    for p in params:
        p.max_tokens = min(p.max_tokens, 4)
    params[1].repetition_penalty, params[2].logit_bias = 2.0, {7: 100.0}  # sampled eagerly after the replay
    runs, replays = {}, []
    for on in (False, True):
        engine = Engine(**kwargs, async_scheduling=on)
        graphs = _with_uncaptured_graphs(engine)
        run = graphs.run
        graphs.run = lambda *a: replays.append(on) or run(*a)
        runs[on] = engine.generate(ps, params)
    assert_same_results(runs[True], runs[False])
    assert replays.count(True) > 2 and replays.count(False) > 2
    assert set(runs[True][2].token_ids) == {7}  # the bias took, after the graph's forward


def test_a_step_returns_the_tokens_of_the_step_before():
    engine = Engine(model="dummy:nanogpt", async_scheduling=True)
    rid = engine.add_request(prompts(1, 5, 5)[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    seq = engine.requests[rid]
    assert engine.step() == []  # the prefill is launched; its token is not read yet
    assert seq.token_ids[-1] == PENDING and engine.has_unfinished()
    got = []
    while engine.has_unfinished():
        outs = engine.step()
        got += [t for o in outs for t in o.new_token_ids]
        assert PENDING not in [t for o in outs for t in o.token_ids]
    assert got == Engine(model="dummy:nanogpt").generate([seq.prompt_token_ids], seq.params)[0].token_ids
    assert_all_blocks_free(engine)


def test_blocks_of_a_request_ended_in_flight_wait_for_its_step():
    """Aborted while a launched step still writes its KV: its blocks stay taken until that step
    is collected, so a KV transfer granted them meanwhile cannot be overwritten."""
    for on in (False, True):
        engine = Engine(model="dummy:nanogpt", async_scheduling=on)
        rid = engine.add_request(prompts(1, 40, 40)[0], SamplingParams(max_tokens=20, ignore_eos=True))
        engine.step()
        engine.step()
        assert engine.abort_request(rid)
        bm = engine.block_manager
        if on:
            assert bm.num_free_blocks == bm.num_blocks - 3  # 41 tokens in 16-token blocks, still written
            assert engine.has_unfinished() and engine.step() == []
        assert_all_blocks_free(engine)
        assert not engine.has_unfinished()


def test_a_request_ending_by_length_is_not_scheduled_past_its_end():
    engine = Engine(model="dummy:nanogpt", max_model_len=24, async_scheduling=True)
    rows = []
    launch = engine.runner.launch
    engine.runner.launch = lambda batch, *a: (rows.append(len(batch)), launch(batch, *a))[1]
    out = engine.generate([prompts(1, 20, 20)[0]], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert rows == [1] * 4  # a prefill and three decodes: none past max_model_len


def test_a_cluster_scheduling_async_serves_the_monolithic_tokens_and_frees_cancelled_work(tmp_path):
    from router.client import Client
    from tests.cluster import cluster, wait_blocks_free
    from tests.test_cluster import check_cluster_matches

    with cluster(tmp_path, worker_args=["--async-scheduling"]) as c:
        check_cluster_matches(c.address, "dummy:nanogpt", n=30)
        with Client(c.address, timeout=60) as client:
            streams = [client.stream([i + 1] * 40, max_tokens=500, ignore_eos=True, temperature=0) for i in range(3)]
            for s in streams:
                next(s)  # decoding has started
            for s in streams:
                client.cancel(s.request_id)
                for _ in s:
                    pass
                assert s.result.finish_reason == "cancelled"
            workers = wait_blocks_free(client)
            assert all(w["free_blocks"] == w["total_blocks"] for w in workers), workers
    logs = [p.read_text() for p in (tmp_path / "logs").glob("*.log")]
    assert sum("KV blocks, async scheduling" in text for text in logs) == 2, [p.name for p in (tmp_path / "logs").iterdir()]


def test_the_flag_reaches_the_workers_launch_starts():
    """`pdserve launch --async-scheduling` hands its engine flags to each worker (engine_argv)."""
    from common.cli_options import engine_argv, engine_kwargs_from

    given = engine_kwargs_from(["--async-scheduling", "--enforce-eager", "--no-batch-invariant", "--max-num-seqs", "8"])
    assert given["async_scheduling"] and given["enforce_eager"] and not given["batch_invariant"]
    assert engine_kwargs_from(engine_argv(given)) == given
    assert engine_kwargs_from([])["async_scheduling"] is None  # the device decides: on on CUDA
    assert not engine_kwargs_from(engine_argv({"async_scheduling": False}))["async_scheduling"]
    from common.config import EngineConfig

    assert not EngineConfig().async_scheduling and EngineConfig(device="cpu", async_scheduling=True).async_scheduling


def test_logprobs_are_read_when_the_step_is_collected_not_at_launch():
    """A step asking for token and prompt logprobs computes them on the device at launch and reads
    them with its tokens, so async scheduling overlaps it too; the values are the synchronous ones."""
    ps = prompts(2, 20, 30, seed=9)
    params = [SamplingParams(temperature=0.7, seed=3, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)]
    engine = Engine(model="dummy:nanogpt", async_scheduling=True, max_num_batched_tokens=16, max_num_seqs=4)  # chunked
    for p, sp in zip(ps, params):
        engine.add_request(p, sp)
    first = engine.requests["req-0"]
    engine.step()
    assert engine.inflight.prompt_logprobs is not None  # computed, not yet read:
    assert all(e is None for e in first.prompt_logprobs)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
            if engine.inflight is not None and engine.inflight.token_logprobs is not None:
                assert engine.inflight.tokens is None  # launched with logprobs, nothing read yet
    want = Engine(model="dummy:nanogpt", max_num_batched_tokens=16, max_num_seqs=4).generate(ps, params)
    got = [outs["req-0"], outs["req-1"]]
    assert_same_results(got, want)
    assert len(got[0].prompt_logprobs) == len(ps[0]) and got[0].prompt_logprobs[0] is None
    for g, w in zip(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:]):
        assert g[1] == w[1] and [g[0]] + g[2] == pytest.approx([w[0]] + w[2], abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prefill_only_request_with_output_tokens_whose_last_chunk_is_one_token_finishes(async_scheduling):
    """A prefill worker's retry of a request that had generated tokens: its prompt and those
    tokens are prefilled, the last chunk a single token. Only a token still being sampled may keep
    a request from being scheduled: this one must be, and must end prefilled with its blocks held."""
    engine = Engine(model="dummy:nanogpt", max_num_batched_tokens=16, max_num_seqs=4,
                    async_scheduling=async_scheduling)
    engine.add_sequence("r", list(range(1, 18)), 16, SamplingParams(temperature=0, max_tokens=8), 0,
                        prefill_only=True)
    outs = []
    for _ in range(6):
        outs += engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r", "prefilled")]
    assert "r" in engine.held and not engine.has_unfinished()
