"""Dequantization of GGUF tensor data (llama.cpp's block formats) with torch, on any device.

A quantized row is a run of fixed-size blocks; each block holds its scales (float16) and packed
integers. Every function here takes the raw blocks as a uint8 tensor (N, bytes per block) and
returns float32 (N, values per block), with the arithmetic of `gguf.quants` (the reference that
llama.cpp maintains, in numpy) written as whole-tensor torch ops: the same products and sums in
the same order, so the values are bit-identical, only faster (and on the GPU when the weights go
there). The tests check each type against `gguf.quants.dequantize`.
"""

from __future__ import annotations

import torch

QK_K = 256  # values per K-quant super-block

# name -> (values per block, bytes per block), as ggml defines them
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
}
SUPPORTED = tuple(BLOCK_SIZES)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(N, 2) bytes -> (N, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _ints(b: torch.Tensor) -> torch.Tensor:
    # Bit twiddling runs on int32: torch's uint8 shifts and masks are ~50x slower on CPU.
    return b.to(torch.int32)


def _shifts(*values: int, shape=(1, 1, -1, 1), device=None) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device).view(shape)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(N, 16) packed bytes -> (N, 32) int32: the low nibbles, then the high ones."""
    q = _ints(qs)
    return torch.cat((q & 0x0F, q >> 4), dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """(N, 4) little-endian uint32 -> (N, 32) int32 of its bits, bit j at column j."""
    bits = _ints(qh).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32, device=qh.device)
    return (bits & 1).reshape(qh.shape[0], 32)


def _q4_0(b):
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]) - 8).float()


def _q4_1(b):
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4)
    return _f16(b[:, :2]) * (q - 16).float()


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q2_k(b):
    n = b.shape[0]
    scales, qs, d, dmin = _ints(b[:, :16]), _ints(b[:, 16:80]), _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = ((qs.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, device=b.device)) & 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b):
    n, dev = b.shape[0], b.device
    hmask, qs, scales, d = _ints(b[:, :32]), _ints(b[:, 32:96]), _ints(b[:, 96:108]), _f16(b[:, 108:110])
    low = (scales[:, :8].reshape(n, 1, 8) >> _shifts(0, 4, shape=(1, 2, 1), device=dev)).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6, shape=(1, 4, 1), device=dev)).reshape(n, 16)
    sc = (((low & 0x0F) | ((high & 3) << 4)) - 32).float()
    dl = (d * sc).view(n, 16, 1)
    ql = ((qs.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, device=dev)) & 3).reshape(n, 16, 16)
    qh = ((hmask.reshape(n, 1, 1, 32) >> _shifts(*range(8), device=dev)) & 1).reshape(n, 16, 16) ^ 1
    q = (ql - (qh << 2)).float()  # the offset is 4 where the mask bit is 0
    return (dl * q).reshape(n, QK_K)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: twelve bytes -> eight 6-bit scales and eight 6-bit mins per super-block."""
    s = _ints(b).reshape(b.shape[0], 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _q4_k(b):
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.float()).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).view(n, 8, 1)
    q = ((_ints(b[:, 16:]).reshape(n, 4, 1, 32) >> _shifts(0, 4, device=b.device)) & 0x0F).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(b):
    n, dev = b.shape[0], b.device
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.float()).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).view(n, 8, 1)
    ql = ((_ints(b[:, 48:]).reshape(n, 4, 1, 32) >> _shifts(0, 4, device=dev)) & 0x0F).reshape(n, 8, 32)
    qh = ((_ints(b[:, 16:48]).reshape(n, 1, 1, 32) >> _shifts(*range(8), device=dev)) & 1).reshape(n, 8, 32)
    return (d * (ql | (qh << 4)).float() - dm).reshape(n, QK_K)


def _q6_k(b):
    n, dev = b.shape[0], b.device
    ql, qh = _ints(b[:, :128]), _ints(b[:, 128:192])
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).view(n, 16, 1)
    low = ((ql.reshape(n, 2, 1, 64) >> _shifts(0, 4, device=dev)) & 0x0F).reshape(n, 8, 32)
    high = ((qh.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, device=dev)) & 3).reshape(n, 8, 32)
    q = ((low | (high << 4)) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


_BLOCK_FNS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
              "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def dequantize(raw_RB: torch.Tensor, qtype: str) -> torch.Tensor:
    """Rows of raw GGUF tensor data, uint8 (rows, bytes per row), to float32 (rows, values per row)."""
    if qtype in _FLOATS:
        return raw_RB.view(_FLOATS[qtype]).float()
    size = BLOCK_SIZES[qtype][1]
    rows = raw_RB.shape[0]
    blocks = raw_RB.reshape(-1, size)
    return _BLOCK_FNS[qtype](blocks).reshape(rows, -1)
