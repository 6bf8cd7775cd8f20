"""The batch-invariant matmul and norms (common/batch_invariant.py) in Triton's interpreter on CPU:
equal to torch's ops within rounding, and a row's result the same bits whatever rows are computed
with it. That the kernels compile for an H100 is checked with the attention's (tests/triton_aot.py)."""

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from common import batch_invariant as bi  # noqa: E402
from common.model import RMSNorm  # noqa: E402


# (96, 512): two segments of K, each run by programs of its own up to SPLIT_ROWS rows, summed in one above
@pytest.mark.parametrize("n, k, bias", [(96, 80, True), (200, 64, False), (5000, 40, True), (96, 512, True),
                                        (2100, 300, False)])
def test_linear_equals_torch_and_is_the_same_bits_for_any_row_count(n, k, bias):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(130, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    full = bi.linear(x, w, b)
    assert (full - torch.nn.functional.linear(x, w, b)).abs().max().item() < 1e-4
    assert bi.segments(n, k)[0] == (2 if k == 512 else 1)
    for first, rows in ((0, 1), (64, 1), (37, 5), (60, 70), (2, 128)):
        assert torch.equal(bi.linear(x[first:first + rows], w, b), full[first:first + rows]), (first, rows)


@pytest.mark.parametrize("n, k", [(96, 80), (96, 512)])
def test_linear_in_bfloat16_is_torchs_within_rounding_and_the_same_bits_for_any_row_count(n, k):
    """In bfloat16 (as the interpreter computes it like a GPU: tests/conftest.py), one K segment
    and two."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(130, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    full = bi.linear(x, w)
    want = torch.nn.functional.linear(x.float(), w.float())
    assert full.dtype == torch.bfloat16 and (full.float() - want).abs().max().item() < 3e-2
    for first, rows in ((0, 1), (64, 1), (37, 5), (2, 128)):
        assert torch.equal(bi.linear(x[first:first + rows], w), full[first:first + rows]), (first, rows)


def test_linear_keeps_leading_dimensions_and_takes_no_rows():
    w = torch.randn(8, 16)
    assert bi.linear(torch.randn(2, 3, 16), w).shape == (2, 3, 8)
    assert bi.linear(torch.randn(0, 16), w).shape == (0, 8)


def test_linear_takes_a_weight_stored_column_by_column():
    """A weight view that is not row-major (a transposed one, as a tied head's may be): the kernel
    steps along a row by one, and such a weight's products were wrong by 39 where 1e-5 is right."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 100, generator=gen), torch.randn(64, 100, generator=gen)
    by_columns = w.t().contiguous().t()
    assert by_columns.stride() == (1, 64)
    assert torch.equal(bi.linear(x, by_columns), bi.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_norms_equal_torch_and_are_the_same_bits_for_any_row_count(dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(33, 96, generator=gen) * 3 + 1).to(dtype)
    rms = RMSNorm(96, 1e-5)
    rms.weight.data = torch.randn(96, generator=gen)
    ln = nn.LayerNorm(96, eps=1e-5)
    ln.weight.data, ln.bias.data = torch.randn(96, generator=gen), torch.randn(96, generator=gen)
    rms, ln = rms.to(dtype), ln.to(dtype)
    for ours, theirs in ((bi.rms_norm(x, rms.weight, rms.eps), rms(x)),
                         (bi.layer_norm(x, ln.weight, ln.bias, ln.eps), ln(x))):
        assert (ours.float() - theirs.float()).abs().max().item() < 1e-5
    for first, rows in ((0, 1), (17, 3)):
        assert torch.equal(bi.rms_norm(x[first:first + rows], rms.weight, rms.eps),
                           bi.rms_norm(x, rms.weight, rms.eps)[first:first + rows])
        assert torch.equal(bi.layer_norm(x[first:first + rows], ln.weight, ln.bias, ln.eps),
                           bi.layer_norm(x, ln.weight, ln.bias, ln.eps)[first:first + rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_a_norm_with_the_residual_add_gives_the_bits_of_the_add_then_the_norm(dtype):
    """common/model.py's add_norm through the invariant norms' one kernel: the sum written as torch's
    add rounds it, and the norm of that sum."""
    from common.model import add_norm

    gen = torch.Generator().manual_seed(2)
    x, delta = ((torch.randn(9, 96, generator=gen) * 3).to(dtype) for _ in range(2))
    for norm in (bi.InvariantRMSNorm(96, 1e-5), bi.InvariantLayerNorm(96, eps=1e-5)):
        norm.weight.data = torch.randn(96, generator=gen)
        norm = norm.to(dtype)
        total, normed = add_norm(norm, x, delta)
        assert torch.equal(total, x + delta) and torch.equal(normed, norm(x + delta)), type(norm).__name__
        assert add_norm(norm, x, None)[0] is x


def test_install_swaps_every_linear_and_norm_and_uninstall_restores_them():
    from common.checkpoint import load_model

    model = load_model("dummy:llama-tiny", torch.device("cpu"), torch.float32, "sdpa").model
    kinds = lambda: {type(m).__name__ for m in model.modules()}  # noqa: E731
    before = kinds()
    bi.install(model)
    assert {"InvariantLinear", "InvariantRMSNorm"} <= kinds() and not {"Linear", "RMSNorm"} & kinds()
    assert bi.installed(model) and all(layer.silu_mul is bi.silu_mul for layer in model.layers)
    bi.uninstall(model)
    assert kinds() == before and not bi.installed(model)
    assert all(layer.silu_mul is not bi.silu_mul for layer in model.layers)


def test_enable_checks_the_kernels_at_start_and_says_why_it_declines(monkeypatch, caplog):
    import logging

    from common.checkpoint import load_model

    log = logging.getLogger("test")
    model = load_model("dummy:nanogpt", torch.device("cpu"), torch.float32, "sdpa").model
    monkeypatch.setattr(bi, "linear", lambda *a: (_ for _ in ()).throw(RuntimeError("PTX failed\nline 2\nline 3")))
    with caplog.at_level(logging.WARNING):
        assert not bi.enable_triton(model, torch.device("cpu"), torch.float32, log)  # (interpreted)
    assert not bi.installed(model)
    assert [r.getMessage() for r in caplog.records] == ["batch invariance off: its kernels failed on cpu "
                                                        "(RuntimeError: PTX failed)"]
    monkeypatch.undo()
    assert bi.enable_triton(model, torch.device("cpu"), torch.float32, log) and bi.installed(model)


def test_a_gpt2_on_the_invariant_kernels_generates_torchs_tokens():
    """The whole invariant path (these kernels with LayerNorm and biases, and the Triton attention,
    interpreted) through the engine; the Llama architecture's is tests/test_cuda_graphs.py's."""
    from common.engine import Engine
    from tests.test_engine import mixed_params, prompts

    ps, params = prompts(3, 1, 30, seed=8), mixed_params(3, max_tokens=3)
    want = Engine(model="dummy:nanogpt", attention_backend="sdpa").generate(ps, params)
    engine = Engine(model="dummy:nanogpt", attention_backend="triton")
    bi.install(engine.model)
    assert [o.token_ids for o in engine.generate(ps, params)] == [o.token_ids for o in want]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_partials_left_to_the_next_kernel_give_every_reader_the_linears_bits(dtype):
    """A few rows' product over four K segments left unsummed (common/linear_partials.py): the norm
    after the residual add, SiLU times the gate and the rotary kernel each add them as the matmul
    does, so each reads the bits of the plain output, which are a prefill's (its rows summed in one
    program). Four segments, so an order of adding them other than the matmul's shows."""
    from common.attention.triton_paged import rope_store
    from common.linear_partials import Partials

    gen = torch.Generator().manual_seed(5)
    n, k, rows = 128, 1024, 5
    assert bi.segments(n, k)[0] == 4
    x = torch.randn(140, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    partials = bi.linear(x[:rows], w, b, deferred=True)
    assert isinstance(partials, Partials) and partials.shape == (rows, n)
    plain = bi.linear(x, w, b)[:rows]
    assert isinstance(bi.linear(x, w, b, deferred=True), torch.Tensor)  # a prefill's rows: summed in one program
    assert torch.equal(partials.total(), plain)

    residual = torch.randn(rows, n, generator=gen).to(dtype)
    for norm in (bi.InvariantRMSNorm(n, 1e-5), bi.InvariantLayerNorm(n, eps=1e-5)):
        norm.weight.data = torch.randn(n, generator=gen)
        norm = norm.to(dtype)
        for ours, want in zip(norm.add_norm(residual, partials), norm.add_norm(residual, plain)):
            assert torch.equal(ours, want), type(norm).__name__

    assert torch.equal(bi.silu_mul(partials), bi.silu_mul(plain))

    # 5 rows of 120: 600 floats a segment, padded to 608 so that each segment starts 16-aligned
    odd = bi.linear(x[:rows], w[:120], b[:120], deferred=True)
    assert isinstance(odd, Partials) and odd.parts.stride(0) == 608
    assert torch.equal(odd.total(), bi.linear(x, w[:120], b[:120])[:rows])
    norm = bi.InvariantRMSNorm(120, 1e-5).to(dtype)
    assert torch.equal(norm.add_norm(residual[:, :120], odd)[0], norm.add_norm(residual[:, :120], odd.total())[0])

    heads, kv_heads, head_dim = 4, 2, 16  # (4 + 2 x 2) x 16 = n
    cos, sin = torch.randn(2, rows, head_dim // 2, generator=gen).to(dtype)
    caches = [torch.zeros(4, 16, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([3, 17, -1, 40, 5])
    q = [rope_store(qkv, cos, sin, caches[2 * i], caches[2 * i + 1], slots, heads)
         for i, qkv in enumerate((partials, plain))]
    assert torch.equal(q[0], q[1]) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[1].flatten(0, 1)[slots[slots >= 0]].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_silu_mul_equals_torchs_two_ops_and_gives_a_row_the_same_bits_alone(dtype):
    from common.model import silu_mul

    gen = torch.Generator().manual_seed(6)
    h = (torch.randn(7, 2 * 1100, generator=gen) * 4).to(dtype)  # two column blocks, the second partly masked
    ours = bi.silu_mul(h)
    want = silu_mul(h)
    assert ours.shape == want.shape == (7, 1100) and ours.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # the exponential's last bit, then one rounding
    assert torch.allclose(ours.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(bi.silu_mul(h[3:4]), ours[3:4])
    assert bi.silu_mul(h[:0]).shape == (0, 1100)
