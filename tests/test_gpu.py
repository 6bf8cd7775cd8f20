"""GPU checks, skipped without CUDA: the same engine on a GPU gives the CPU's tokens, the
backend `auto` picks there equals SDPA, and a 1P1D cluster on one GPU started with no memory flag
splits it and serves token-exact."""

import gc

import pytest
import torch

from common.engine import Engine
from router.client import Client
from tests.cluster import cluster
from tests.test_cluster import check_cluster_matches
from tests.test_engine import mixed_params, prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model", ["dummy:nanogpt", "dummy:llama-tiny"])
def test_cuda_float32_matches_cpu(model):
    ps, params = prompts(8, 1, 60, seed=12), mixed_params(8)
    cpu = Engine(model=model, device="cpu").generate(ps, params)
    gpu = Engine(model=model, device="cuda:0", dtype="float32", attention_backend="sdpa").generate(ps, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_weights_are_drawn_alike_on_the_gpu(dtype):
    from common.checkpoint import load_model

    cpu = dict(load_model("dummy:llama-tiny", torch.device("cpu"), dtype).model.named_parameters())
    gpu = dict(load_model("dummy:llama-tiny", torch.device("cuda:0"), dtype).model.named_parameters())
    assert all(torch.equal(cpu[k], gpu[k].cpu()) for k in cpu)


@pytest.mark.parametrize("model", ["dummy:nanogpt", "dummy:llama-tiny"])
def test_cuda_auto_backend_equals_sdpa(model):
    ps, params = prompts(8, 1, 60, seed=13), mixed_params(8)
    auto = Engine(model=model, device="cuda:0", dtype="float32", attention_backend="auto")
    assert auto.model.layers[0].attention.name == "triton"
    sdpa = Engine(model=model, device="cuda:0", dtype="float32", attention_backend="sdpa")
    assert [o.token_ids for o in auto.generate(ps, params)] == [o.token_ids for o in sdpa.generate(ps, params)]


def test_auto_checks_the_triton_attention_in_the_serving_dtype_and_block_size():
    from common.attention import make_attention

    from common.attention import triton_paged as tp

    auto = make_attention("auto", torch.device("cuda:0"), 32, 8, 64, torch.bfloat16, 16)
    assert auto.name == "triton" and auto.prefill_tile in (*tp.PREFILL_CANDIDATES, (tp.MIN_ROWS, 0))  # timed, kept
    assert auto.decode_launch in tp.DECODE_LAUNCHES
    assert make_attention("auto", torch.device("cuda:0"), 32, 8, 64, torch.bfloat16, 32).name == "triton"
    assert make_attention("auto", torch.device("cuda:0"), 32, 8, 64, torch.bfloat16, 128).name == "sdpa"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_decode_on_the_gpu_equals_sdpa_and_is_batch_invariant(dtype, monkeypatch):
    """llama-1b's attention shapes (32 query heads on 8 KV heads of 64), fragmented tables, shared
    pages, lengths across pages, tiles and splits; and the same bits from the kernel's variant whose
    lanes loop over a row's splits (tables wider than LANES splits, as a CUDA graph's are at a long
    --max-model-len, or one lane), which no other GPU test compiles."""
    from common.attention import triton_paged
    from tests.test_attention import LENGTHS, _paged_batch, _sdpa_decode, _triton_decode

    q, k, v, tables, lens = (t.cuda() for t in _paged_batch(LENGTHS, 32, 8, 64, dtype, seed=3, shared_prefix_blocks=2))
    got = _triton_decode(q, k, v, tables, lens, 64 ** -0.5)
    want = _sdpa_decode(q.float(), k.float(), v.float(), tables, lens, 32, 8, 64)
    assert (got.float() - want).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 1e-4)
    for i, n in enumerate(LENGTHS):
        alone = _triton_decode(q[i:i + 1], k, v, tables[i:i + 1, :-(-n // 16)], lens[i:i + 1], 64 ** -0.5)
        assert torch.equal(alone[0], got[i]), (i, n)
    wide = torch.cat([tables, tables.new_zeros(tables.shape[0], 272)], 1)  # 20 splits: past LANES
    assert triton_paged.max_splits_for(wide.shape[1], 16) > triton_paged.LANES
    assert torch.equal(_triton_decode(q, k, v, wide, lens, 64 ** -0.5), got)
    monkeypatch.setattr(triton_paged, "LANES", 1)
    assert torch.equal(_triton_decode(q, k, v, tables, lens, 64 ** -0.5), got)


@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 8192), (16384, 2048)])
def test_invariant_linear_gives_a_row_the_same_bits_at_every_row_count_tile_and_split(n, k):
    """llama-1b's qkv and down (K in segments run apart up to SPLIT_ROWS rows, summed in one
    program above) and up (one segment): every row count's tile and path give a row the same bits,
    and torch's product within bfloat16 rounding."""
    from common import batch_invariant as bi

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).bfloat16()
    x = torch.randn(2048, k, generator=gen, device="cuda").bfloat16()
    full = bi.linear(x, w)
    assert ((full.float() - torch.nn.functional.linear(x, w).float()).abs().max() < 0.05).item()
    for first, rows in ((0, 1), (5, 7), (16, 16), (3, 17), (0, 64), (100, bi.SPLIT_ROWS), (7, 129), (1000, 300)):
        assert torch.equal(bi.linear(x[first:first + rows], w), full[first:first + rows]), (first, rows)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_gives_the_eager_tokens(dtype):
    """The decode step captured for batch sizes 1..16 and replayed, padded, gives the tokens of the
    same engine launching every kernel eagerly."""
    ps, params = prompts(11, 1, 300, seed=14), mixed_params(11, max_tokens=24)
    kwargs = dict(model="dummy:llama-tiny", device="cuda:0", dtype=dtype, attention_backend="triton", max_num_seqs=16)
    graphed = Engine(**kwargs)
    assert sorted(graphed.runner.graphs.graphs) == [1, 2, 4, 8, 16]
    assert len(graphed.runner.graphs.samplers) == 5 * 3  # a sampler per size and mode
    eager = Engine(**kwargs, enforce_eager=True)
    assert eager.runner.graphs is None
    assert [o.token_ids for o in graphed.generate(ps, params)] == [o.token_ids for o in eager.generate(ps, params)]


def test_bfloat16_llama_1b_gives_each_request_its_tokens_in_any_batch_and_chunking():
    """Batch invariance, on by default: 16 mixed requests (greedy and seeded) give the same tokens
    alone with whole prompts, all batched, alone in 1-token chunks, and 7 at a time in 7-token chunks."""
    ps, params = prompts(16, 5, 120, seed=15), mixed_params(16, max_tokens=24)  # 1-token chunks: ~1,000 eager steps
    base = dict(model="dummy:llama-1b", device="cuda:0", max_model_len=512)

    def run(max_num_seqs, budget, together):
        engine = Engine(**base, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
        assert engine.batch_invariant and engine.model.layers[0].attention.name == "triton"
        if together:
            return [o.token_ids for o in engine.generate(ps, params)]
        return [engine.generate([p], [q])[0].token_ids for p, q in zip(ps, params)]

    alone = run(1, 2048, together=False)
    assert run(16, 2048, together=True) == alone
    assert run(1, 1, together=False) == alone
    assert run(7, 7, together=True) == alone


def test_speculative_decoding_on_the_gpu_gives_the_tokens_and_logprobs_of_plain_decoding():
    """bfloat16 llama-1b, batch-invariant: a draft's rows, computed as a chunk by the prefill
    kernel, give the bits of the decode graphs' rows. The drafts are plain decoding's tokens, some
    made wrong: a random llama-1b's tokens, of a 128,256-token vocabulary, seldom repeat for n-grams
    to find (1 draft in this workload on an H100)."""
    from tests.test_speculative import NGRAM, oracle_drafts, run, workload

    ps, params = workload()  # 12 requests: graphs up to 16 rows are captured, not up to 64 (start-up time)
    base = dict(model="dummy:llama-1b", device="cuda:0", max_model_len=512, max_num_seqs=16)
    plain = run(Engine(**base), ps, params)
    engine = Engine(**base, speculative_config=NGRAM)
    assert engine.batch_invariant and engine.runner.graphs is not None
    oracle_drafts(engine, ps, plain)
    assert run(engine, ps, params) == plain
    drafts, drafted, accepted = engine.drafter.counters()
    assert drafts > 10 and 0 < accepted < drafted


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_scheduling_on_the_gpu_gives_the_synchronous_tokens(dtype):
    """Through the captured graphs, stop tokens, logprobs and a preempting pool: each step's
    decodes take the tokens of the step before on the device, and give the synchronous tokens."""
    from tests.test_async_scheduling import assert_same_results, varied_params

    ps = prompts(12, 2, 200, seed=16)
    kwargs = dict(model="dummy:llama-tiny", device="cuda:0", dtype=dtype, max_num_seqs=8, block_size=16,
                  num_blocks=40)
    params = varied_params(ps, **kwargs)
    runs, chosen = {}, {}
    for on in (False, True):
        engine = Engine(**kwargs, async_scheduling=on)
        assert engine.runner.graphs is not None
        runs[on] = engine.generate(ps, params)
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_free_blocks == engine.num_blocks
        attention = engine.model.attention
        chosen[on] = (getattr(attention, "prefill_tile", None), getattr(attention, "decode_launch", None))
    print("each engine's attention choices (prefill tile, decode launch), sync then async:", chosen)  # on failure
    assert_same_results(runs[True], runs[False])


def test_bench_engine_on_the_gpu_reports_both_modes():
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "common.cli", "bench", "engine", "--device", "cuda:0", "--model",
                        "dummy:llama-tiny", "--num-requests", "4", "--batch-sizes", "1,16", "--kv-lens", "64",
                        "--steps", "4", "--prefill-len", "256"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert list(result["modes"]) == ["batch_invariant", "torch_ops"]
    assert all(0 < p["of_floor"] < 1 for run in result["modes"].values() for p in run["decode"].values())


def test_bfloat16_default_on_gpu_runs_llama_1b_shapes():
    engine = Engine(model="dummy:llama-1b", device="cuda:0", max_num_seqs=4, max_model_len=512)
    assert engine.kv_cache.dtype == torch.bfloat16
    out = engine.generate([[1, 2, 3]] * 2, mixed_params(2, max_tokens=8))
    assert all(len(o.token_ids) == 8 for o in out)


def test_1p1d_on_one_gpu_without_a_memory_flag_splits_it_and_serves_token_exact(tmp_path):
    """Prompts of up to 16 tokens are prefilled by the decode worker itself (its mixed steps eager
    beside its decode graphs), the longer ones handed off by cuda_ipc: both token-exact."""
    gc.collect()
    torch.cuda.empty_cache()  # what this process's earlier engines cached is not the workers'
    with cluster(tmp_path, model="dummy:llama-tiny", worker_args=["--dtype", "float32"], devices=["cuda:0"],
                 router_args=["--max-local-prefill-length", "16"]) as c:
        with Client(c.address) as client:
            blocks = {w["role"]: w["total_blocks"] for w in client.status().workers}
        share = {w.name.split("-")[0]: float(w.argv[w.argv.index("--gpu-memory-utilization") + 1]) for w in c.workers}
        assert share["decode"] > share["prefill"] > 0  # the launcher split the GPU, the decode worker the larger
        # both got a pool (a tiny model's pools may both reach their max_num_seqs cap, so not compared)
        assert blocks["decode"] >= blocks["prefill"] > 0
        check_cluster_matches(c.address, "dummy:llama-tiny", n=30)  # float32 on a GPU gives the CPU's tokens


def test_penalties_bias_and_min_p_on_the_gpu_give_the_cpus_tokens_through_graphs_and_async():
    """Logit adjustments sample eagerly after the graph's forward, their counts built on the
    device (the newest token from the step's input, pending under async scheduling): float32 with
    SDPA on the GPU gives the CPU's tokens, the graphs give them alike with async scheduling and
    without, and bfloat16 gives each request its tokens alone or batched."""
    from tests.test_async_scheduling import assert_same_results
    from tests.test_logits_processing import mixed_adjustments

    ps = prompts(8, 2, 60, seed=21)
    params = mixed_adjustments(len(ps))
    cpu = Engine(model="dummy:llama-tiny").generate(ps, params)
    sdpa = Engine(model="dummy:llama-tiny", device="cuda:0", dtype="float32", attention_backend="sdpa")
    assert [o.token_ids for o in sdpa.generate(ps, params)] == [o.token_ids for o in cpu]
    runs = []
    for on in (False, True):
        gpu = Engine(model="dummy:llama-tiny", device="cuda:0", dtype="float32", async_scheduling=on)
        assert gpu.runner.graphs is not None
        runs.append(gpu.generate(ps, params))
    assert_same_results(runs[1], runs[0])
    bf16 = dict(model="dummy:llama-tiny", device="cuda:0", dtype="bfloat16", async_scheduling=True)
    alone = [Engine(**bf16).generate([p], sp)[0] for p, sp in zip(ps[:3], params[:3])]
    assert_same_results(Engine(**bf16).generate(ps[:3], params[:3]), alone)


def test_a_structured_output_after_its_run_on_the_gpu_gives_the_cpus_tokens_through_graphs_and_async():
    """A request whose structured output waits for its run (reasoning, then JSON): under async
    scheduling the token after the run is masked on the device where the pending token ends it,
    alone and batched."""
    from tests.test_structured_output import after_a_run

    prompt, params = after_a_run()
    cpu = [o.token_ids for o in Engine(model="dummy:nanogpt").generate([prompt] * len(params), params)]
    for on in (False, True):
        gpu = Engine(model="dummy:nanogpt", device="cuda:0", dtype="float32", async_scheduling=on)
        assert [o.token_ids for o in gpu.generate([prompt] * len(params), params)] == cpu, on
        assert [gpu.generate(prompt, p)[0].token_ids for p in params] == cpu, on
