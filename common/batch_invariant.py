"""Batch-invariant matmuls and norms in Triton: a row's result does not depend on how many rows
are computed with it.

cuBLAS picks its algorithm (tile shape, split-K) by the matrix sizes, so a token's projections
come out with different rounding in a batch of 1 and of 16; torch's row reductions pick their
thread layout by the number of rows as well. In bfloat16 on a GPU that changes greedy tokens
within a few steps (../shared/GPU.md: 0 of 16 requests kept their tokens alone and batched).
The kernels here fix every choice that touches a row's arithmetic by the weight's shape alone,
never the row count, after Thinking Machines' batch_invariant_ops and SGLang's deterministic
mode:

- `linear`: K cut into segments fixed by the weight's shape (`segments`), each summed in order
  from zero by the tensor cores, the segments' sums added in order. Which programs do that work
  follows the row count: for a decode step's few rows each segment runs in programs of its own
  (split-K, so enough SMs read the weight) and the kernel that reads the product adds them
  (common/linear_partials.py: the norms, the rotary kernel, `silu_mul`); for a prefill one program
  adds its tile's segments. Every tile shape gives a row the same tensor-core chain (measured on
  an H100: bench/matmul_tiles.py), so the tile follows the row count too (`tile_config`);
- `rms_norm`, `layer_norm`: a program per row, the whole row reduced in one fixed-width block,
  optionally after the residual add before it (`add_norm`: the add's rounding kept);
- `silu_mul`: a gated MLP's SiLU times the gate in one launch (row-local, as every elementwise op).

With the Triton attention (common/attention/triton_paged.py) a request's tokens are then the same
in any batch. `install(model)` swaps a model's linear layers and norms for these; it is what
`--batch-invariant` (the default on CUDA) does. On a CPU the Triton kernels run only in Triton's
interpreter (their tests); `--batch-invariant` there (`install_cpu`) keeps torch's ops in shapes
that never change: matmuls over fixed tiles of rows (row_tiled_linear: MKL then computes every
tile alike), attention a token at a time over keys split at fixed positions
(common/attention/tiled.py); torch's CPU norms already reduce each row alone.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from common.attention import tiled
from common.attention.sdpa import SDPAAttention
from common.errors import InvalidArgument, first_line
from common.linear_partials import Partials, empty_partials, finished, reading
from common.model import RMSNorm, silu_mul as torch_silu_mul
from common.triton_support import available, interpreted, jit, pow2, tl


@jit
def _dot_segment(A, W, rows, cols, row_ok, col_ok, k_start, k_end, stride_am, stride_wn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """The rows x cols tile of A @ W.T over k_start <= k < k_end, from zero, BLOCK_K at a time in
    order: every tile shape gives each element the same chain of tensor-core steps (measured:
    bench/matmul_tiles.py)."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + ks) < k_end
        a = tl.load(A + rows[:, None] * stride_am + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(W + cols[None, :] * stride_wn + (k0 + ks)[:, None], mask=col_ok[None, :] & k_ok[:, None],
                    other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    return acc


@jit(do_not_specialize=["M"])  # a step's row count: one variant for every batch (stride_cs: see empty_partials)
def _linear_kernel(A, W, Bias, C, M, N, stride_am, stride_wn, stride_cm, stride_cs, K: tl.constexpr,
                   SEGMENT: tl.constexpr, SEGMENTS: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """K is cut into SEGMENTS runs of SEGMENT. With SPLIT, program (i, j, s) writes segment s's
    float32 partial to C[s], for the reader's `finished` (common/linear_partials.py); else a program
    sums its tile's segments in order and writes the result: the same additions either way."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # rows x stride may pass 2**31
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < M
    col_ok = cols < N
    out = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        s = tl.program_id(2)
        acc = _dot_segment(A, W, rows, cols, row_ok, col_ok, s * SEGMENT, tl.minimum(K, (s + 1) * SEGMENT),
                           stride_am, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        tl.store(C + s * stride_cs + rows[:, None] * stride_cm + cols[None, :], acc, mask=out)
    else:
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in range(0, SEGMENTS):
            total += _dot_segment(A, W, rows, cols, row_ok, col_ok, s * SEGMENT, tl.minimum(K, (s + 1) * SEGMENT),
                                  stride_am, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        if HAS_BIAS:
            total += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(C + rows[:, None] * stride_cm + cols[None, :], total.to(C.dtype.element_ty), mask=out)


@jit
def _norm_kernel(X, Weight, Bias, Y, Delta, DeltaBias, Sum, stride_x, stride_y, stride_d, stride_dseg, stride_s, eps,
                 C: tl.constexpr, BLOCK: tl.constexpr, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 RESIDUAL: tl.constexpr, SEGMENTS: tl.constexpr, DELTA_BIAS: tl.constexpr):
    """Y = the norm of a row of X; with RESIDUAL, of X + Delta, rounded to the dtype as torch's add
    rounds it, which is also written to Sum (the residual stream's next value). Delta may be a
    linear's partials (SEGMENTS of them: common/linear_partials.py), finished here."""
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    ok = i < C
    x = tl.load(X + row * stride_x + i, mask=ok, other=0.0)
    if RESIDUAL:
        delta = finished(Delta, DeltaBias, row * stride_d + i, i, ok, stride_dseg, SEGMENTS, DELTA_BIAS, x.dtype)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
        tl.store(Sum + row * stride_s + i, x, mask=ok)
    x = x.to(tl.float32)
    if RMS:  # Hugging Face's: normalise in float32, round to the model's dtype, then scale
        normed = (x * tl.rsqrt(tl.sum(x * x, 0) / C + eps)).to(Y.dtype.element_ty)
        y = normed.to(tl.float32) * tl.load(Weight + i, mask=ok, other=0.0).to(tl.float32)
    else:
        mean = tl.sum(x, 0) / C
        centred = tl.where(ok, x - mean, 0.0)
        y = centred * tl.rsqrt(tl.sum(centred * centred, 0) / C + eps)
        y = y * tl.load(Weight + i, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(Bias + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + i, y.to(Y.dtype.element_ty), mask=ok)


@jit
def _silu_mul_kernel(H, Bias, Out, stride_h, stride_hseg, stride_o, I, SEGMENTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Out = silu(gate) * up for a row of H = [gate, up] (or of a linear's partials, finished
    here), rounded to the dtype after each op as torch's two ops round (their float32 may differ
    in its last bit: Triton's exponential and division are the GPU's fast ones)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    dt = Out.dtype.element_ty
    gate = finished(H, Bias, row * stride_h + c, c, ok, stride_hseg, SEGMENTS, HAS_BIAS, dt).to(tl.float32)
    up = finished(H, Bias, row * stride_h + I + c, I + c, ok, stride_hseg, SEGMENTS, HAS_BIAS, dt).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(Out + row * stride_o + c, (silu * up).to(dt), mask=ok)


SPLIT_ROWS = 128  # at most this many rows: K's segments run in programs of their own


@functools.lru_cache(maxsize=None)  # a model's few weight shapes, asked every step
def segments(n: int, k: int) -> tuple[int, int]:
    """(segments, keys per segment) of K for a weight of n outputs and k inputs: a function of the
    weight alone, so every row count gets the same arithmetic. Enough that a few rows' product runs
    some 256 programs (n / 64 column tiles times the segments), each segment 256 keys at least and
    a multiple of 128 (whole steps of every tile's BLOCK_K)."""
    count = 1
    while count * 2 * -(-n // 64) <= 256 and k // (count * 2) >= 256:
        count *= 2
    length = -(-k // count // 128) * 128
    return -(-k // length), length


def tile_config(m: int, n: int, count: int = 1) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for m rows. Any of them gives a row the same bits
    (bench/matmul_tiles.py, on an H100: 14 shapes from 16x32x64 to 128x256x128 alike), so the tile
    follows the row count: narrow for a decode step, whose time is reading the weight, wide for a
    prefill, whose time is the tensor cores'. The fastest of those measured at each size (with one
    segment); a prefill's tile over `count` > 1 segments holds two float32 accumulators (the sum
    and the segment's), which on 128 x 256 would spill, so it takes 128 x 128. Triton's interpreter
    runs a BLOCK_K step as one numpy product, rounded by the step's length: there BLOCK_K is 128 alike."""
    if m <= 16:
        tile = 16, 64, 128, 4, 4
    elif m <= SPLIT_ROWS or n < 2048:
        tile = 64, 64, 128, 4, 3
    else:
        tile = (128, 256, 64, 8, 3) if count == 1 else (128, 128, 64, 8, 3)
    return (*tile[:2], 128, *tile[3:]) if interpreted() else tile


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a matrix of rows, each contiguous (what the kernels index)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, deferred: bool = False
           ) -> torch.Tensor | Partials:
    """x @ weight.T + bias over x's last dimension, batch-invariantly. deferred: where K's segments
    run apart (a few rows), leave their sums as Partials for the next kernel to add (x a matrix)."""
    if x.device.type != "cuda" and not interpreted():
        return F.linear(x, weight, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    a = _rows(x)
    if weight.stride(1) != 1:  # the kernel steps along a row of the weight by one (a loader's are so)
        weight = weight.contiguous()
    m, n = a.shape[0], weight.shape[0]
    count, length = segments(n, k)
    split = count > 1 and 0 < m <= SPLIT_ROWS
    out = empty_partials(count, m, n, x.device) if split else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm, bn, bk, warps, stages = tile_config(m, n, count)
        _linear_kernel[(-(-m // bm), -(-n // bn), count if split else 1)](
            a, weight, weight if bias is None else bias, out, m, n, a.stride(0), weight.stride(0), n,
            out.stride(0) if split else 0, K=k,
            SEGMENT=length, SEGMENTS=count, SPLIT=split, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=bk, IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    if split:
        out = Partials(out, bias, x.dtype)
        if deferred and len(lead) == 1:
            return out
        out = out.total()
    return out.view(*lead, n)


def _norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, rms: bool,
          delta: torch.Tensor | Partials | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows normed, and with delta the sum x + delta they were normed from, else x)."""
    c = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    total = rows if delta is None else torch.empty_like(rows)
    if isinstance(delta, Partials) and delta.dtype != x.dtype:
        raise ValueError(f"a residual of {x.dtype} and a delta of {delta.dtype}: the sum is rounded to one dtype")
    source = rows if delta is None else delta
    deltas = reading(source if isinstance(source, Partials) else _rows(source))
    if rows.shape[0]:
        _norm_kernel[(rows.shape[0],)](rows, weight, bias if bias is not None else weight, out, *deltas[:2], total,
                                       rows.stride(0), out.stride(0), *deltas[2:4], total.stride(0), eps, C=c,
                                       BLOCK=pow2(c), RMS=rms, HAS_BIAS=bias is not None, RESIDUAL=delta is not None,
                                       SEGMENTS=deltas[4], DELTA_BIAS=deltas[5])
    return out.view(x.shape), total.view(x.shape)


GLU_BLOCK = 1024


def silu_mul(h_TX: torch.Tensor | Partials) -> torch.Tensor:
    """silu(gate) * up of a gated MLP's fused product [gate, up] (T, 2I), in one launch where torch
    takes two over strided halves: its bits are a row's alone, as every elementwise op's are."""
    src, bias, stride_h, stride_seg, count, has_bias = reading(h_TX)
    T, I = h_TX.shape[0], h_TX.shape[1] // 2
    out = torch.empty(T, I, dtype=h_TX.dtype, device=src.device)
    if T:
        _silu_mul_kernel[(T, -(-I // GLU_BLOCK))](src, bias, out, stride_h, stride_seg, out.stride(0), I,
                                                         SEGMENTS=count, HAS_BIAS=has_bias, BLOCK=GLU_BLOCK)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, weight, None, eps, rms=True)[0]


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _norm(x, weight, bias, eps, rms=False)[0]


class InvariantLinear(nn.Linear):
    def forward(self, x):
        return linear(x, self.weight, self.bias)

    def deferred(self, x):
        """The product, or for a few rows its K segments' sums left to the next kernel (common/model.py's deferred)."""
        return linear(x, self.weight, self.bias, deferred=True)


class InvariantLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return layer_norm(x, self.weight, self.bias, self.eps)

    def add_norm(self, x, delta):
        """(x + delta, its norm) in one kernel (common/model.py's add_norm)."""
        normed, total = _norm(x, self.weight, self.bias, self.eps, rms=False, delta=delta)
        return total, normed


class InvariantRMSNorm(RMSNorm):
    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)

    def add_norm(self, x, delta):
        normed, total = _norm(x, self.weight, None, self.eps, rms=True, delta=delta)
        return total, normed


_SWAPS = {nn.Linear: InvariantLinear, nn.LayerNorm: InvariantLayerNorm, RMSNorm: InvariantRMSNorm}


def install(model: nn.Module) -> None:
    """Swap the model's linear layers and norms for the batch-invariant ones, in place (weights
    untouched), and its output projection (model.project) and gated MLPs' product (layer.silu_mul)."""
    for module in model.modules():
        if type(module) in _SWAPS:
            module.__class__ = _SWAPS[type(module)]
    model.project = linear
    for layer in model.layers:
        layer.silu_mul = silu_mul


CPU_ROWS = 16  # rows per product of row_tiled_linear: a decode step's handful costs what one does


def row_tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias on a CPU, batch-invariantly: the rows go through one batched product in
    tiles of CPU_ROWS (the last padded with zeros; two tiles at least), each tile the same MKL call
    whatever the row count. About 2x torch's matmul for a long prefill's rows."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m, n, R = rows.shape[0], weight.shape[0], CPU_ROWS
    tiles = max(2, -(-m // R))  # one tile alone, MKL threads inside it and rounds otherwise (K >= ~900)
    padded = rows.new_zeros(tiles * R, k)
    padded[:m] = rows
    out = torch.bmm(padded.view(tiles, R, k), weight.t().expand(tiles, k, n)).view(tiles * R, n)[:m]
    if bias is not None:
        out = out + bias
    return out.view(*lead, n)


class RowTiledLinear(nn.Linear):
    def forward(self, x):
        return row_tiled_linear(x, self.weight, self.bias)


def _set_attention(model: nn.Module, attention) -> None:
    model.attention = attention
    for layer in model.layers:
        layer.attention = attention


def install_cpu(model: nn.Module) -> None:
    """The CPU's batch invariance, in place: row-tiled matmuls and the tiled attention in place of
    SDPA (Triton's, in its interpreter, stays: the tests' GPU path; flex is refused)."""
    a = model.attention
    if a.name == "flex":
        raise InvalidArgument("--batch-invariant on a CPU needs the attention backend sdpa (or auto), whose "
                              "place the tiled attention takes; flex's rounding depends on the batch")
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowTiledLinear
    model.project = row_tiled_linear
    if type(a) is SDPAAttention:
        _set_attention(model, tiled.TiledAttention(a.num_heads, a.num_kv_heads, a.head_dim))


def uninstall(model: nn.Module) -> None:
    """Back to torch's own ops (bench engine's second mode), from install or install_cpu."""
    back = {v: k for k, v in _SWAPS.items()} | {RowTiledLinear: nn.Linear}
    for module in model.modules():
        if type(module) in back:
            module.__class__ = back[type(module)]
    model.project = F.linear
    for layer in model.layers:
        layer.silu_mul = torch_silu_mul
    a = model.attention
    if type(a) is tiled.TiledAttention:
        _set_attention(model, SDPAAttention(a.num_heads, a.num_kv_heads, a.head_dim))


def installed(model: nn.Module) -> bool:
    return model.project in (linear, row_tiled_linear)


def _start_up_difference(device: torch.device, dtype: torch.dtype) -> float:
    """Largest relative difference from torch's ops on small random products and a norm, at row
    counts that compile each path a step can take: one row (the 16-row tile, K's two segments run
    apart and summed), 37 (the 64-row tile, split) and 200 (a prefill's tile summing its segments),
    and the kernels that read a few rows' partials (the norm after a residual add, SiLU times the gate)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 512, generator=gen).to(device, dtype)
    w = (torch.randn(2100, 512, generator=gen) / 512 ** 0.5).to(device, dtype)
    scale, wide = (torch.randn(n, generator=gen).to(device, dtype) for n in (512, 2100))
    theirs = F.linear(x, w)
    pairs = [(linear(x[:m], w), theirs[:m]) for m in (1, 37, 200)]
    pairs.append((rms_norm(x, scale, 1e-5), scale * F.rms_norm(x.float(), (512,), eps=1e-5).to(dtype)))
    partials, want = linear(x[:1], w, deferred=True), theirs[:1]  # (a row count changes no variant of theirs)
    pairs.append((silu_mul(partials), torch_silu_mul(want)))
    pairs.append((_norm(want, wide, None, 1e-5, rms=True, delta=partials)[0],
                  wide * F.rms_norm((want + want).float(), (2100,), eps=1e-5).to(dtype)))
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in pairs)


def enable(model: nn.Module, device: torch.device, dtype: torch.dtype, log) -> bool:
    """Batch invariance for a model on this device: on a CPU install_cpu (torch's ops, nothing to
    compile or check), elsewhere enable_triton. Returns whether it is installed."""
    if device.type == "cpu":
        install_cpu(model)
        return True
    return enable_triton(model, device, dtype, log)


def enable_triton(model: nn.Module, device: torch.device, dtype: torch.dtype, log) -> bool:
    """Install the Triton kernels if Triton is there and they agree with torch at start; else say
    why in one line and leave torch's ops. Returns whether they are installed."""
    if not available():
        log.warning("batch invariance off: triton is not installed, so a request's tokens may depend on its batch")
        return False
    try:
        err = _start_up_difference(device, dtype)
    except Exception as e:  # a compiler or kernel failure: torch's ops still serve
        log.warning("batch invariance off: its kernels failed on %s (%s)", device, first_line(e))
        return False
    if err > (1e-4 if dtype == torch.float32 else 3e-2):
        log.warning("batch invariance off: its kernels differ from torch's by %.3g on %s", err, device)
        return False
    install(model)
    return True
