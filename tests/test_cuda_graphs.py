"""The decode step's CUDA-graph runner, on CPU: everything but the capture itself (its static
buffers, the padding to captured sizes, the rows that write nowhere) through the same forward,
with the Triton attention in Triton's interpreter. The capture runs in tests/test_gpu.py."""

import pytest
import torch

from common.cuda_graphs import PAD_SLOT, DecodeGraphs, capture_sizes
from common.engine import Engine
from tests.test_engine import mixed_params, prompts


def test_capture_sizes_follow_the_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def _with_uncaptured_graphs(engine: Engine) -> DecodeGraphs:
    cfg = engine.config
    graphs = DecodeGraphs(engine.model, engine.kv_cache, cfg.max_num_seqs, -(-engine.max_model_len // cfg.block_size),
                          cfg.torch_device, capture=False)
    engine.runner.graphs = graphs
    return graphs


def test_decode_through_the_graph_buffers_gives_the_eager_tokens(monkeypatch):
    """5 then fewer running requests (greedy and seeded, mixed lengths) decode through the padded
    static buffers (sizes 1, 2, 4, 8), on the GPU path's kernels (the Triton attention and the
    batch-invariant matmuls and norms, interpreted), and give the portable engine's tokens. Every
    matmul cuts K in two, as llama-1b's do, so a few rows' products reach the rotary kernel, the
    norms and SiLU times the gate as unsummed partials (common/linear_partials.py)."""
    pytest.importorskip("triton")
    from common import batch_invariant
    from common.attention import triton_paged

    monkeypatch.setattr(batch_invariant, "segments", lambda n, k: (2, -(-k // 2)))
    read = []
    rope_store = triton_paged.rope_store
    monkeypatch.setattr(triton_paged, "rope_store", lambda qkv, *a: read.append(type(qkv).__name__) or rope_store(qkv, *a))

    ps, params = prompts(5, 3, 20, seed=21), mixed_params(5, max_tokens=5)
    for p, n in zip(params, (5, 3, 4, 2, 5)):
        p.max_tokens = n
    want = Engine(model="dummy:llama-tiny", attention_backend="sdpa", max_num_seqs=8).generate(ps, params)
    engine = Engine(model="dummy:llama-tiny", attention_backend="triton", max_num_seqs=8)
    batch_invariant.install(engine.model)
    for layer in engine.model.layers:
        layer.silu_mul = lambda h, silu_mul=layer.silu_mul: read.append(type(h).__name__) or silu_mul(h)
    graphs = _with_uncaptured_graphs(engine)
    padded = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda *a: padded.append((a[0].shape[0], graphs.size_for(a[0].shape[0]))) or run(*a))
    got = engine.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert (5, 8) in padded and any(n < size for n, size in padded) and all(size in graphs.sizes for _, size in padded)
    assert set(read) == {"Partials"}, read


def test_the_graphs_sampler_of_each_mode_gives_the_eager_samplers_tokens():
    """Greedy, plain and filtered batches, each padded to a captured size after a larger batch left
    its parameters in the static buffers: the tokens of common/sampling.sample on the same logits."""
    from common.sampling import FILTERED, GREEDY, PLAIN, sample, sampling_mode
    from common.sampling_params import SamplingParams

    engine = Engine(model="dummy:llama-tiny", max_num_seqs=8)
    graphs = _with_uncaptured_graphs(engine)
    V = engine.model_config.vocab_size
    torch.manual_seed(0)
    logits = torch.randn(8, V) * 3
    batches = {FILTERED: [SamplingParams(temperature=0.8, top_k=5 * i, top_p=0.9, seed=i) for i in range(8)],
               PLAIN: [SamplingParams(temperature=1.5, seed=i) if i % 2 else SamplingParams(temperature=0)
                       for i in range(5)],
               GREEDY: [SamplingParams(temperature=0)] * 3}
    for mode, params in batches.items():  # 8 rows, then 5 and 3 padded to 8 over the rows left before
        assert sampling_mode(params) == mode
        n, seeds, positions = len(params), list(range(100, 100 + len(params))), list(range(7, 7 + len(params)))
        got = graphs.sample(logits[:n], params, seeds, positions)
        assert got.tolist() == sample(logits[:n], params, seeds, positions).tolist()
    assert graphs.sample_ints[1, 5:].tolist() == [1, 1, 1]  # the padding rows are greedy again


def test_padding_rows_write_no_kv():
    """A batch of 3 replayed at size 4: the pool changes at the 3 rows' slots and nowhere else,
    even where an earlier, larger batch left real slots in the padding rows."""
    pytest.importorskip("triton")
    engine = Engine(model="dummy:nanogpt", attention_backend="triton", max_num_seqs=4, num_blocks=8)
    graphs = _with_uncaptured_graphs(engine)
    graphs.slots[3] = 5 * 16 + 2  # what a batch of 4 would have left behind
    pool = engine.kv_cache
    before = pool.clone()
    slots = torch.tensor([1 * 16 + 0, 2 * 16 + 7, 6 * 16 + 15])
    tables = torch.tensor([[0, 1], [3, 2], [4, 6]])
    graphs.run(torch.tensor([5, 6, 7]), torch.tensor([16, 23, 31]), slots, torch.tensor([17, 24, 32]), tables)
    changed = (pool != before).flatten(4).any(-1)  # (layers, k/v, blocks, offset)
    where = {(b.item(), o.item()) for b, o in changed.any(0).any(0).nonzero()}
    assert where == {(1, 0), (2, 7), (6, 15)}
    assert graphs.slots[3].item() == PAD_SLOT and graphs.lens[3].item() == 1


def test_graphs_are_off_on_cpu_and_with_enforce_eager():
    assert Engine(model="dummy:nanogpt").runner.graphs is None
    assert Engine(model="dummy:nanogpt", enforce_eager=True).runner.graphs is None
