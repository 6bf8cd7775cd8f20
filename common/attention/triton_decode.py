"""Paged decode attention in Triton: K/V are read through the block tables in place, nothing is
gathered, and a sequence's result does not depend on what else is in its batch.

Split-KV in two stages, after SGLang's Triton decode backend (itself after LightLLM), with one
change that makes it batch-invariant: the KV is split at fixed positions (every SPLIT tokens), not
into a fixed number of splits sized to the batch's longest sequence. Stage 1 gives each
(sequence, KV head, split) a program that runs an online softmax over its split's tokens, BLOCK_N
at a time, for all query heads of the KV head at once (GQA: the group's heads are the rows of one
tl.dot), and writes a partial output and its log-sum-exp. Stage 2 folds a sequence's splits in
order. A sequence's tiles, their order and every reduction are a function of its own length, so
it gets the same bits alone or beside any others, and the launch shape depends only on the batch
size and the block tables' width (what a CUDA graph needs fixed).

On CPU the kernels run in Triton's interpreter: that is how the CPU test suite checks them
against SDPA. It is far too slow to serve with, so `auto` picks this backend only on CUDA.
"""

from __future__ import annotations

import os

import torch

from common.attention.batch import AttentionMetadata
from common.attention.sdpa import SDPAAttention

try:
    import triton
    import triton.language as tl
except ImportError:  # an optional dependency: without it, `auto` keeps SDPA
    triton = tl = None

_jit = triton.jit if triton else (lambda fn: fn)

SPLIT = 256  # tokens per split: fixed, so a sequence's splits never move with its batch
BLOCK_N = 64  # tokens per tile of a split (a multiple of the page size and a divisor of SPLIT)
MIN_DOT = 16  # tl.dot's smallest tile side: a group of fewer query heads is padded to it


def available() -> bool:
    return tl is not None


@_jit
def _split_kernel(Q, KCache, VCache, Tables, Lens, OutPart, LsePart, scale,
                  stride_qb, stride_qh, stride_kn, stride_kp, stride_kh, stride_vn, stride_vp, stride_vh,
                  stride_tb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  PAGE: tl.constexpr, TILE: tl.constexpr, SPLIT_TOKENS: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(Lens + b)
    start = split * SPLIT_TOKENS
    if start < length:
        end = tl.minimum(start + SPLIT_TOKENS, length)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for tile in range(0, SPLIT_TOKENS // TILE):  # a static count: tiles past `end` read nothing
            pos = start + tile * TILE + tl.arange(0, TILE)
            n_ok = pos < end
            block = tl.load(Tables + b * stride_tb + pos // PAGE, mask=n_ok, other=0).to(tl.int64)
            offset = pos % PAGE
            kv_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(KCache + block[:, None] * stride_kn + offset[:, None] * stride_kp + kv_head * stride_kh
                        + d[None, :], mask=kv_ok, other=0.0)
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            qk = tl.where(n_ok[None, :], qk * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(VCache + block[:, None] * stride_vn + offset[:, None] * stride_vp + kv_head * stride_vh
                        + d[None, :], mask=kv_ok, other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        out = OutPart + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(out, acc / denom[:, None], mask=g_ok[:, None] & d_ok[None, :])
        tl.store(LsePart + b * stride_lb + heads * stride_lh + split, m + tl.log(denom), mask=g_ok)


@_jit
def _merge_kernel(OutPart, LsePart, Lens, Out, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                  stride_b, stride_h, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_TOKENS: tl.constexpr,
                  MAX_SPLITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    splits = tl.cdiv(tl.load(Lens + b), SPLIT_TOKENS)
    m = tl.full([], float("-inf"), tl.float32)
    denom = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, MAX_SPLITS):  # a static count (the same code for every batch), folded in order
        if s < splits:
            lse = tl.load(LsePart + b * stride_lb + h * stride_lh + s)
            part = tl.load(OutPart + b * stride_ob + h * stride_oh + s * stride_os + d, mask=d_ok, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha + part * w
            denom = denom * alpha + w
            m = m_new
    tl.store(Out + b * stride_b + h * stride_h + d, (acc / denom).to(Out.dtype.element_ty), mask=d_ok)


def interpreted() -> bool:
    """Triton's interpreter runs kernels on CPU tensors, and only when TRITON_INTERPRET=1 was set
    before triton was imported (the CPU tests set it in conftest)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_decode(q_BHD: torch.Tensor, k_cache_NPKD: torch.Tensor, v_cache_NPKD: torch.Tensor,
                 tables_BM: torch.Tensor, lens_B: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v for each row's first lens_B[b] tokens, read through tables_BM.
    The grid is (rows, KV heads, splits of the tables' full width), whatever the lengths."""
    B, H, D = q_BHD.shape
    N, P, K, _ = k_cache_NPKD.shape
    if BLOCK_N % P or SPLIT % BLOCK_N:
        raise ValueError(f"page size {P} is not supported by the Triton decode kernel; allowed: a divisor of {BLOCK_N}")
    group = H // K
    max_splits = _pow2(max(1, -(-tables_BM.shape[1] * P // SPLIT)))  # few shapes to compile
    out_part = torch.empty(B, H, max_splits, D, dtype=torch.float32, device=q_BHD.device)
    lse_part = torch.empty(B, H, max_splits, dtype=torch.float32, device=q_BHD.device)
    out = torch.empty_like(q_BHD)
    if B == 0:
        return out
    q_BHD = q_BHD.contiguous()
    if q_BHD.device.type != "cuda" and not interpreted():
        raise RuntimeError(f"the Triton decode kernel runs on CUDA, not {q_BHD.device} (or in Triton's interpreter: "
                           f"TRITON_INTERPRET=1); use --attention-backend sdpa")
    block_d = max(MIN_DOT, _pow2(D))
    _split_kernel[(B, K, max_splits)](
        q_BHD, k_cache_NPKD, v_cache_NPKD, tables_BM, lens_B, out_part, lse_part, scale,
        q_BHD.stride(0), q_BHD.stride(1), *k_cache_NPKD.stride()[:3], *v_cache_NPKD.stride()[:3],
        tables_BM.stride(0), *out_part.stride()[:3], *lse_part.stride()[:2],
        GROUP=group, BLOCK_G=max(MIN_DOT, _pow2(group)), HEAD_DIM=D, BLOCK_D=block_d, PAGE=P, TILE=BLOCK_N,
        SPLIT_TOKENS=SPLIT, IEEE=q_BHD.dtype == torch.float32)
    _merge_kernel[(B, H)](out_part, lse_part, lens_B, out, *out_part.stride()[:3], *lse_part.stride()[:2],
                         out.stride(0), out.stride(1), HEAD_DIM=D, BLOCK_D=block_d, SPLIT_TOKENS=SPLIT,
                         MAX_SPLITS=max_splits)
    return out


class TritonAttention(SDPAAttention):
    """Decodes through the paged Triton kernel; prefill chunks as the portable backend."""

    name = "triton"

    def _decode(self, q_BHD, k_cache, v_cache, meta: AttentionMetadata):
        return paged_decode(q_BHD, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale)
