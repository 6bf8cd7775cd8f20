"""A batch-invariant linear's output left as its K segments' float32 sums, for the kernel that
reads it next to add them.

For a decode step's few rows the invariant matmul (common/batch_invariant.py) runs each segment
of K in programs of its own, so the weight is read by enough SMs; someone must then add the
segments in order. A kernel of its own for that costs a launch a matmul (three a layer, 7% of
llama-1b's batch-1 step on an H100). Every reader of a layer's matmuls is one of our kernels (the
norm after the residual add, the rotary embedding, SiLU times the gate), so each reads the
partials through `finished`, which adds them exactly as the unsplit matmul does: the same bits,
one launch fewer. Anything else asks `Partials.total` for the plain tensor.

Each segment starts a multiple of 16 floats after the one before (padded where rows x n is not):
Triton specializes an integer argument that 16 divides, so the segment stride's alignment is known
at compile time and the partials move as 16-byte vectors, written and read; a stride it could not
count on (the row count varies by step) made them 4-byte accesses, four instructions for one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.triton_support import jit, tl

SUM_BLOCK = 1024
ALIGN = 16  # floats: a segment's start, so that its accesses can be 16-byte vectors


def empty_partials(segments: int, rows: int, n: int, device: torch.device) -> torch.Tensor:
    """(segments, rows, n) float32 whose segments start ALIGN floats apart (see above)."""
    stride = -(-rows * n // ALIGN) * ALIGN
    return torch.empty(segments * stride, dtype=torch.float32, device=device).as_strided(
        (segments, rows, n), (stride, n, 1))


@dataclass(frozen=True)
class Partials:
    """parts: (segments, rows, n) float32, each segment's sum from zero; bias: (n,) or None; dtype:
    the output's, which the sum is rounded to."""

    parts: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def total(self) -> torch.Tensor:
        """The plain output: the partials added (one launch)."""
        parts, bias, n, stride_seg, count, has_bias = self.args()
        size = self.shape.numel()
        out = torch.empty(self.shape, dtype=self.dtype, device=parts.device)
        if size:
            _sum_segments[(-(-size // SUM_BLOCK),)](parts, bias, out, size, n, stride_seg, SEGMENTS=count,
                                                    HAS_BIAS=has_bias, BLOCK=SUM_BLOCK)
        return out

    def args(self) -> tuple[torch.Tensor, torch.Tensor, int, int, int, bool]:
        """(source, bias, row stride, segment stride, segments, has bias): what a kernel reading
        through `finished` takes (the bias pointer is the source when there is none)."""
        s, m, n = self.parts.shape
        return self.parts, self.parts if self.bias is None else self.bias, n, self.parts.stride(0), s, \
            self.bias is not None


def reading(x: torch.Tensor | Partials) -> tuple[torch.Tensor, torch.Tensor, int, int, int, bool]:
    """Partials.args for partials; for a plain (rows, n) tensor the same with no segments, the
    tensor read as it is (rows made contiguous where they are not)."""
    if isinstance(x, Partials):
        return x.args()
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, x, x.stride(0), 0, 0, False


@jit
def finished(Src, Bias, offset, column, mask, stride_seg, SEGMENTS: tl.constexpr, HAS_BIAS: tl.constexpr,
             DTYPE: tl.constexpr):
    """A linear's outputs at `offset` (row stride times row, plus column): with SEGMENTS, Src holds
    its segments' float32 sums, added here in order from zero, plus the bias, and rounded to DTYPE,
    as the unsplit matmul adds and rounds them; without, Src is the output and is loaded as it is."""
    if SEGMENTS == 0:
        value = tl.load(Src + offset, mask=mask, other=0.0)
    else:
        total = tl.zeros(offset.shape, tl.float32)
        for s in range(0, SEGMENTS):
            total += tl.load(Src + s * stride_seg + offset, mask=mask, other=0.0)
        if HAS_BIAS:
            total += tl.load(Bias + column, mask=mask, other=0.0).to(tl.float32)
        value = total.to(DTYPE)
    return value


@jit  # (size: 16 divides it or not, two variants at most; vectors where it does)
def _sum_segments(Parts, Bias, C, size, N, stride_seg, SEGMENTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """C = the partials finished (a flat run of rows x N)."""
    i = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    ok = i < size
    tl.store(C + i, finished(Parts, Bias, i, i % N, ok, stride_seg, SEGMENTS, HAS_BIAS, C.dtype.element_ty),
             mask=ok)
