"""Batch invariance on a CPU (--batch-invariant: common/batch_invariant.py's install_cpu and
common/attention/tiled.py): a request's logprobs are the same bits alone, in a batch, in prompt
chunks of any size, after a preemption's recompute and after a migration's re-prefill. torch's own
ops round a position computed as a decode and in a prefill differently (README, Determinism)."""

import pytest
import torch

from common import batch_invariant as bi
from common.attention import SDPAAttention, _step_difference
from common.attention.tiled import TiledAttention
from common.errors import InvalidArgument
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
        assert out.token_ids == a.token_ids and out.logprobs[:10] == [None] * 10  # given, not sampled here
        assert [lp[0] for lp in out.logprobs[10:]] == logprobs([a])[0][10:]


@pytest.fixture
def threads():
    """torch.set_num_threads for the test, restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("k, n", [(96, 200), (1024, 1024)])  # wide: MKL threads inside a lone tile
def test_row_tiled_linear_equals_torch_and_is_the_same_bits_for_any_row_count_and_threads(k, n, threads):
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(70, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    threads(1)
    full = bi.row_tiled_linear(x, w, b)
    assert (full - torch.nn.functional.linear(x, w, b)).abs().max().item() < 1e-3
    for count in (1, 2):
        threads(count)
        for first, rows in ((0, 1), (5, 1), (17, 33), (60, 10), (0, 70)):
            assert torch.equal(bi.row_tiled_linear(x[first:first + rows], w, b), full[first:first + rows]), \
                (count, first, rows)
    assert bi.row_tiled_linear(torch.randn(2, 3, k), w).shape == (2, 3, n)


def _one_sequence_pool(H, K, D, page, length, seed=0):
    """A shuffled pool holding one sequence's K/V at `length` positions, and its q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-length // page) + 2
    table = torch.randperm(2 * blocks, generator=gen)[:blocks] + 1
    k_cache, v_cache = (torch.randn(2 * blocks + 1, page, K, D, generator=gen) for _ in range(2))
    q, k, v = (torch.randn(length, n, D, generator=gen) for n in (H, K, K))
    slots = torch.tensor([int(table[p // page]) * page + p % page for p in range(length)])
    k_cache.view(-1, K, D)[slots], v_cache.view(-1, K, D)[slots] = k, v
    return k_cache, v_cache, q, k, v, table, slots


@pytest.mark.parametrize("H, K, D", [(4, 4, 16), (9, 3, 64), (16, 8, 128)])
def test_tiled_attention_gives_a_token_the_same_bits_as_a_decode_alone_batched_or_in_any_prefill_chunk(
        H, K, D, threads):
    """Position p as a decode alone, beside other decodes, and in prefill chunks of every kind (one
    token, several, the whole prefix, from a split's start): one result, on one thread or two.
    (head_dim 128 once rounded apart: its keys reached MKL transposed in one path only.)"""
    from common.attention import AttentionMetadata, PrefillChunk

    page, length = 16, 540
    k_cache, v_cache, q, k, v, table, slots = _one_sequence_pool(H, K, D, page, length)
    attention = TiledAttention(H, K, D)

    def as_decode(p, others):
        n = 1 + others
        lens = [p + 1] + [1 + 97 * (j + 1) for j in range(others)]  # the others read this sequence's blocks too
        tables = table[None].expand(n, -1).contiguous()
        meta = AttentionMetadata(torch.tensor([int(slots[p])] + [int(slots[m - 1]) for m in lens[1:]]), n, tables,
                                 torch.tensor(lens), None, [], None, torch.tensor([m - 1 for m in lens]),
                                 [m - 1 for m in lens])
        new = [p] + [m - 1 for m in lens[1:]]
        return attention(q[new], k[new], v[new], k_cache.clone(), v_cache.clone(), meta)[0]

    def in_chunk(p, start, count):
        pos = list(range(start, start + count))
        meta = AttentionMetadata(slots[start:start + count], 0, None, None, None,
                                 [PrefillChunk(0, count, start, table[:-(-(start + count) // page)])], None,
                                 torch.tensor(pos), pos)
        out = attention(q[start:start + count], k[start:start + count], v[start:start + count], k_cache.clone(),
                        v_cache.clone(), meta)
        return out[p - start]

    for p in (0, 255, 256, 530):
        want = None
        for count in (1, 2):
            threads(count)
            got = [as_decode(p, 0), as_decode(p, 5), in_chunk(p, p, 1), in_chunk(p, max(0, p - 3), min(p, 3) + 1),
                   in_chunk(p, 0, p + 1), in_chunk(p, p - p % 256, p % 256 + 1)]
            want = got[0] if want is None else want
            assert all(torch.equal(g, want) for g in got), (p, count, [torch.equal(g, want) for g in got])


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
    with pytest.raises(InvalidArgument, match="needs the attention backend sdpa"):  # flex's rounding is the batch's
        Engine(model="dummy:llama-tiny", attention_backend="flex", batch_invariant=True)


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
