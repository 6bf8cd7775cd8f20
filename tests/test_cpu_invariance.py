"""Batch invariance on a CPU (--batch-invariant: common/batch_invariant.py's install_cpu and
common/attention/tiled.py): a request's logprobs are the same bits alone, in a batch, in prompt
chunks of any size, after a preemption's recompute and after a migration's re-prefill. torch's own
ops round a position computed as a decode and in a prefill differently (README, Determinism)."""

import pytest
import torch

from common import batch_invariant as bi
from common.attention import SDPAAttention, _step_difference
from common.attention.tiled import TiledAttention
from common.engine import Engine
from common.sampling_params import SamplingParams
from tests.test_engine import assert_all_blocks_free, prompts


def logprobs(outs) -> list[list[float]]:
    return [[lp[0] for lp in o.logprobs] for o in outs]


@pytest.mark.parametrize("model", ["dummy:nanogpt", "dummy:llama-tiny"])
def test_a_requests_logprobs_are_the_same_bits_in_any_batch_chunking_and_after_a_migration(model):
    ps = prompts(6, 5, 300, seed=4)  # past a 256-key split
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True, logprobs=1)
    params = [greedy if i % 2 else seeded for i in range(len(ps))]

    def engine(**kw):
        e = Engine(model=model, batch_invariant=True, **kw)
        assert e.batch_invariant and e.model.layers[0].attention.name == "tiled"
        return e

    alone = [engine().generate([p], [sp])[0] for p, sp in zip(ps, params)]
    want = logprobs(alone)
    assert logprobs(engine().generate(ps, params)) == want
    assert logprobs(engine(max_num_batched_tokens=7, max_num_seqs=4).generate(ps, params)) == want
    small = engine(block_size=4, num_blocks=120, max_num_seqs=6)  # too small for all: preempts, recomputes
    assert logprobs(small.generate(ps, params)) == want and small.scheduler.num_preemptions > 0
    assert_all_blocks_free(small)
    # a migration: prompt + the first 10 tokens prefilled anew elsewhere, the rest decoded there
    for p, sp, a in zip(ps, params, alone):
        e = engine()
        e.add_sequence("m", p + a.token_ids[:10], len(p), sp, sp.seed if sp.seed is not None else 0)
        out = None
        while e.has_unfinished():
            out = next((o for o in e.step() if o.finished), out)
        assert out.token_ids == a.token_ids and logprobs([out])[0] == logprobs([a])[0][10:]  # the new ones


def test_row_tiled_linear_equals_torch_and_is_the_same_bits_for_any_row_count():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(70, 96, generator=gen), torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    full = bi.row_tiled_linear(x, w, b)
    assert (full - torch.nn.functional.linear(x, w, b)).abs().max().item() < 1e-4
    for first, rows in ((0, 1), (5, 1), (17, 33), (60, 10)):
        assert torch.equal(bi.row_tiled_linear(x[first:first + rows], w, b), full[first:first + rows]), (first, rows)
    assert bi.row_tiled_linear(torch.randn(2, 3, 96), w).shape == (2, 3, 200)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (9, 3)])
def test_tiled_attention_equals_sdpa(heads, kv_heads):
    err = _step_difference(TiledAttention(heads, kv_heads, 32), SDPAAttention(heads, kv_heads, 32),
                           torch.device("cpu"))
    assert err < 1e-5


def test_install_cpu_and_uninstall_swap_the_matmuls_and_attention_both_ways():
    e = Engine(model="dummy:llama-tiny", batch_invariant=True)
    kinds = lambda: {type(m).__name__ for m in e.model.modules()}  # noqa: E731
    assert "RowTiledLinear" in kinds() and "Linear" not in kinds() and bi.installed(e.model)
    e.set_batch_invariant(False)
    assert "Linear" in kinds() and "RowTiledLinear" not in kinds() and not bi.installed(e.model)
    assert {layer.attention.name for layer in e.model.layers} == {"sdpa"}
    e.set_batch_invariant(True)
    assert {layer.attention.name for layer in e.model.layers} == {"tiled"}
    assert not Engine(model="dummy:llama-tiny").batch_invariant  # off by default on a CPU


def test_a_migrated_request_keeps_its_logprobs_to_the_bit_in_a_cluster(tmp_path):
    """1P2D with --batch-invariant, decode-0 SIGKILLed mid-stream: the migrated requests (prompt and
    the tokens already streamed prefilled anew, decoded on decode-1) end with the monolithic
    engine's tokens and logprobs, the same bits, though the workers run one torch thread and the
    engine here two, and the re-prefill computes as a prefill what decode-0 computed as decodes."""
    from router.client import Client
    from tests.cluster import cluster
    from tests.test_chaos import FAST_FAILOVER, collect, stream_all, workload

    prompts, sampling = workload(6, max_tokens=60)
    for s in sampling:
        s["logprobs"] = 1
    engine = Engine(model="dummy:nanogpt", batch_invariant=True)
    want = engine.generate(prompts, [SamplingParams(**s) for s in sampling])
    with cluster(tmp_path, prefill=1, decode=2, router_args=FAST_FAILOVER, worker_args=["--batch-invariant"]) as c, \
            Client(c.address, timeout=120) as client:
        streams = stream_all(client, prompts, sampling)
        first = [next(s) for s in streams]  # every request is decoding
        c.workers[1].proc.kill()  # decode-0
        results = collect(streams, first)
        assert any(attempts > 1 for _, _, attempts in results), "no request was migrated"
        assert [tokens for tokens, _, _ in results] == [o.token_ids for o in want]
        assert [[lp[0] for lp in s.result.logprobs] for s in streams] == logprobs(want)
