"""Every attention backend equals the portable SDPA one: on a paged decode batch directly, and on
whole generations through the engine."""

import pytest
import torch

from common.attention import SDPAAttention, _decode_difference
from common.engine import Engine
from common.sampling import SamplingParams
from tests.test_engine import mixed_params, prompts

pytestmark = pytest.mark.slow  # the first FlexAttention call compiles (tens of seconds on CPU)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_flex_decode_equals_sdpa(heads, kv_heads):
    from common.attention.flex import FlexAttention

    err = _decode_difference(FlexAttention(heads, kv_heads, 16), SDPAAttention(heads, kv_heads, 16),
                             torch.device("cpu"))
    assert err < 1e-5


@pytest.mark.parametrize("model", ["dummy:nanogpt", "dummy:llama-tiny"])
def test_flex_engine_generates_sdpa_tokens(model):
    ps, params = prompts(8, 1, 60, seed=11), mixed_params(8, max_tokens=10)
    sdpa = Engine(model=model, attention_backend="sdpa").generate(ps, params)
    flex = Engine(model=model, attention_backend="flex").generate(ps, params)
    assert [o.token_ids for o in flex] == [o.token_ids for o in sdpa]


def test_auto_is_sdpa_on_cpu():
    engine = Engine(model="dummy:nanogpt", attention_backend="auto")
    assert engine.model.layers[0].attention.name == "sdpa"
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2


def _paged_batch(lengths, heads, kv_heads, head_dim, dtype, seed, shared_prefix_blocks=0, page=16):
    """A decode batch over a pool whose blocks are handed out shuffled (fragmented tables); rows 0
    and 1 share their first `shared_prefix_blocks` blocks, as after a prefix-cache hit."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // page) for n in lengths]
    pool = sum(widths) + 3
    order = torch.randperm(pool, generator=gen).tolist()
    tables, taken = [], 0
    for i, w in enumerate(widths):
        own = w - (shared_prefix_blocks if i == 1 else 0)
        row = (tables[0][:shared_prefix_blocks] if i == 1 else []) + order[taken:taken + own]
        taken += own
        tables.append(row)
    M = max(widths)
    tables_BM = torch.tensor([row + [0] * (M - len(row)) for row in tables])
    k = torch.randn(pool, page, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(pool, page, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype)
    return q, k, v, tables_BM, torch.tensor(lengths)


def _sdpa_decode(q, k, v, tables, lens, heads, kv_heads, head_dim):
    from common.attention import AttentionMetadata

    mask = (torch.arange(tables.shape[1] * k.shape[1], device=lens.device)[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64, device=lens.device), len(lens), tables, lens, mask, [])
    return SDPAAttention(heads, kv_heads, head_dim)._decode(q, k, v, meta)


# Lengths around a page (16), a tile (64) and a split (256), one token, and several splits.
LENGTHS = [1, 16, 17, 64, 255, 256, 257, 700, 40]


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 16), (8, 2, 32), (32, 8, 64), (6, 1, 24)])
def test_triton_decode_equals_sdpa(heads, kv_heads, head_dim):
    """The paged Triton kernel (in Triton's interpreter on CPU) against SDPA over gathered blocks:
    GQA groups of 1 to 6, a head size that is not a power of two, fragmented tables and pages
    shared by two rows."""
    pytest.importorskip("triton")
    from common.attention.triton_decode import paged_decode

    q, k, v, tables, lens = _paged_batch(LENGTHS, heads, kv_heads, head_dim, torch.float32, seed=heads,
                                         shared_prefix_blocks=1)
    got = paged_decode(q, k, v, tables, lens, head_dim ** -0.5)
    want = _sdpa_decode(q, k, v, tables, lens, heads, kv_heads, head_dim)
    assert (got - want).abs().max().item() < 1e-5


def test_triton_decode_is_batch_invariant():
    """A row's output is the same bits alone, in any batch, and however wide the batch's tables are:
    its splits sit at fixed positions and fold in a fixed order."""
    pytest.importorskip("triton")
    from common.attention.triton_decode import paged_decode

    heads, kv_heads, head_dim = 8, 2, 32
    q, k, v, tables, lens = _paged_batch(LENGTHS, heads, kv_heads, head_dim, torch.float32, seed=5)
    batched = paged_decode(q, k, v, tables, lens, head_dim ** -0.5)
    for i, n in enumerate(LENGTHS):
        own = tables[i:i + 1, :-(-n // 16)]
        alone = paged_decode(q[i:i + 1], k, v, own, lens[i:i + 1], head_dim ** -0.5)
        wide = paged_decode(q[i:i + 1], k, v, torch.cat([own, own.new_zeros(1, 80)], 1), lens[i:i + 1],
                            head_dim ** -0.5)
        assert torch.equal(alone[0], batched[i]) and torch.equal(wide[0], batched[i]), (i, n)


def test_triton_decode_half_precision_is_close_to_sdpa():
    pytest.importorskip("triton")
    from common.attention.triton_decode import paged_decode

    heads, kv_heads, head_dim = 8, 2, 32
    q, k, v, tables, lens = _paged_batch(LENGTHS, heads, kv_heads, head_dim, torch.float16, seed=7)
    got = paged_decode(q, k, v, tables, lens, head_dim ** -0.5).float()
    want = _sdpa_decode(q.float(), k.float(), v.float(), tables, lens, heads, kv_heads, head_dim)
    assert (got - want).abs().max().item() < 1e-2


def test_triton_backend_refuses_a_page_size_it_cannot_tile():
    pytest.importorskip("triton")
    from common.attention.triton_decode import paged_decode

    q, k, v, tables, lens = _paged_batch([30], 4, 4, 16, torch.float32, seed=1, page=24)
    with pytest.raises(ValueError, match="page size 24"):
        paged_decode(q, k, v, tables, lens, 0.25)


@pytest.mark.parametrize("model", ["dummy:nanogpt", "dummy:llama-tiny"])
def test_triton_engine_generates_sdpa_tokens(model):
    """Through the engine (interpreted on CPU, so few tokens): greedy and seeded rows, mixed lengths."""
    pytest.importorskip("triton")
    ps, params = prompts(4, 1, 60, seed=11), mixed_params(4, max_tokens=4)
    sdpa = Engine(model=model, attention_backend="sdpa").generate(ps, params)
    fast = Engine(model=model, attention_backend="triton")
    assert fast.model.layers[0].attention.name == "triton"
    assert [o.token_ids for o in fast.generate(ps, params)] == [o.token_ids for o in sdpa]


def test_triton_kernels_compile_for_an_h100():
    """Every kernel variant compiles to an sm_90 binary here, with no GPU (tests/triton_aot.py)."""
    pytest.importorskip("triton.backends.nvidia")
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.triton_aot"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = json.loads(run.stdout.splitlines()[-1])["compiled"]
    assert len(compiled) == 15 and "split/bf16/g4/d64" in compiled
