"""Paged attention in Triton, one kernel for decodes and prefill chunks: K/V are read through the
block tables in place, nothing is gathered, and a query's result is the same bits whatever else
is in its batch, however its prompt was chunked, and whether it was a decode or a prefill token.

Split-KV in two stages, after SGLang's Triton decode backend and vLLM's unified Triton attention,
with the KV split at fixed positions (every SPLIT tokens) rather than into a number of splits
sized to the batch. The new tokens' K/V are written into the pool first, so every query reads
all its keys, its own chunk's included, from the pool.

- Stage 1: a program per (query tile, KV head, lane), a lane taking every lanes-th split of its
  tile's (split_lanes: a few per tile, so the launch does not grow with the context a CUDA graph
  is captured for). A tile is up to BLOCK_Q consecutive tokens of one sequence (a decode is a tile
  of one), and its rows are those tokens times the query heads sharing the KV head (GQA), BLOCK_M
  rows in all, so one tl.dot serves them. It runs an online softmax over its split BLOCK_N tokens
  at a time, each row masked to the keys at or before its position, and writes a partial output
  and its log-sum-exp.
- Stage 2: a program per token folds its splits in order, every head at once.
Both loop over what a tile has (its splits, a split's steps that hold keys), not over what the
widest table could: one compiled variant serves every context.

A row's arithmetic depends only on its position and the fixed constants: its splits, tiles,
masks and dot shapes are the same in any tile, batch or launch. That is the batch invariance
issue 11 asks for (Thinking Machines' "batch_invariant_ops", SGLang's deterministic mode); the
matmuls around attention need the same for bfloat16 on a GPU.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, as the tests set), far too
slowly to serve with: `auto` picks this backend only on CUDA.
"""

from __future__ import annotations

import torch

from common.attention.batch import AttentionMetadata
from common.config import upload
from common.linear_partials import Partials, finished, reading
from common.attention.sdpa import SDPAAttention
from common.triton_support import interpreted, jit, pow2, tl

_NO_FP_FUSION = {} if interpreted() else {"enable_fp_fusion": False}  # (the interpreter takes no such option)

SPLIT = 256  # keys per split: fixed, so a query's splits never move with its batch
BLOCK_N = 64  # keys per step of a split (a multiple of the page size and a divisor of SPLIT)
MIN_ROWS = 16  # tl.dot's smallest tile side: a tile's rows (tokens x grouped heads) are padded to it
# A prefill chunk's tiles: as many tokens as fill this many rows, so its keys are read once per that
# many queries (a decode's tile is one token, MIN_ROWS rows). A 2,048-token chunk of llama-1b takes
# 350 us a layer on an H100 with 16-row tiles, which re-read its keys 512 times. A tile of more rows
# may chain the tensor cores' products, or lay a row's softmax sum across the warps, differently,
# which would give its rows other bits than a decode's tile (the batch-invariance promise). On an
# H100, Triton gives a tile of 64 or more rows on 4 or more warps Hopper's warpgroup products
# (wgmma), which gave other bits; on fewer warps, and at 32 rows or fewer, it keeps the older mma of a
# decode's tile. So a prefill tile is (rows, warps; 0: Triton's default), and `auto` gives its engine
# the fastest of PREFILL_CANDIDATES whose rows keep a one-token tile's bits on the device at hand
# (triton_choice.choose_prefill_tile, at start; TritonAttention.prefill_tile). PREFILL_ROWS and PREFILL_LAUNCH are
# the tile of a backend asked for by name. Not a candidate: 128 rows on 2 warps, which spills some 7 KB a
# thread (Triton 3.6 and 3.9, sm_90) and took 2-3x any other tile's time on an H200 (bench.attention_tiles).
PREFILL_ROWS = MIN_ROWS
PREFILL_LAUNCH: dict = {}
PREFILL_CANDIDATES = ((64, 2), (128, 0), (64, 0), (32, 0))  # largest first: the choice where none is timed
LANES = 16  # at most this many programs per (tile, KV head), each taking every lanes-th split
PROGRAMS = 4096  # a decode launch's programs, about (split_lanes): an H100's 132 SMs a few times over
SPLIT_LAUNCH: dict = {}  # a decode tile's launch options (num_warps, num_stages, maxnreg), where not Triton's defaults
# A decode tile's launch options `auto` times at start (triton_choice.choose_decode_launch): a cap on a
# thread's registers, for more programs an SM (96 uncapped in Triton 3.9's sm_90 code, 5 programs;
# 80 spills 12 bytes, 6; 64 spills 60, 8). Options change no arithmetic.
DECODE_LAUNCHES = ({}, {"maxnreg": 80}, {"maxnreg": 64})


@jit(do_not_specialize=["stride_tb", "lanes"],
      do_not_specialize_on_alignment=["Tables", "TileSeq", "TileStart", "TileLen", "TilePos", "SplitBase"])
def _split_kernel(Q, KCache, VCache, Tables, TileSeq, TileStart, TileLen, TilePos, SplitBase, OutPart, LsePart, scale,
                  stride_qt, stride_qh, stride_n, stride_p, stride_h, stride_tb, stride_or, stride_oh, stride_lr, lanes,
                  GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr, SPLIT_KEYS: tl.constexpr,
                  IEEE: tl.constexpr, ONE_SPLIT: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    lane = tl.program_id(2)
    first = tl.load(TileStart + tile)
    count = tl.load(TileLen + tile)
    pos0 = tl.load(TilePos + tile)
    end = pos0 + count  # the tile sees keys 0..end - 1, each row those up to its own position
    r = tl.arange(0, BLOCK_M)
    token = r // GROUP
    heads = kv_head * GROUP + r % GROUP
    row_ok = (token < count) & (r < BLOCK_Q * GROUP)
    q_pos = pos0 + token
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # This lane's splits (lane, lane + lanes, ...) of those the tile sees, each a loop's pass (a lane
    # past them loads nothing more), and in a split only the steps that hold keys: a step past them
    # was a pass of no effect (nothing seen, alpha 1), so a row's bits do not depend on its tile.
    # ONE_SPLIT (a launch whose lanes cover every split): a loop of one pass, which compiles away; a
    # loop around the pipelined steps holds more registers (Triton 3.6, sm_90: the 32-row prefill
    # tile 191 a thread, 127 without, so twice the programs an SM).
    splits = (end - 1) // SPLIT_KEYS + 1
    for split in range(lane, lane + 1 if ONE_SPLIT else splits, 1 if ONE_SPLIT else lanes):
        if split < splits:
            seq = tl.load(TileSeq + tile)
            start = split * SPLIT_KEYS
            q = tl.load(Q + (first + token)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            denom = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for step in range(0, tl.cdiv(tl.minimum(end - start, SPLIT_KEYS), TILE)):
                pos = start + step * TILE + tl.arange(0, TILE)
                kv_ok = (pos < end)[:, None] & d_ok[None, :]
                # K and V share a layout (the pool's halves): one offset per element serves both. It is
                # built from a table entry per key, in the [keys, head] layout of the loads: built a page
                # at a time and reshaped, Triton 3.6 gathers 2 bytes a load, not 16 (4-7x slower on an H200)
                block = tl.load(Tables + seq * stride_tb + pos // PAGE, mask=pos < end, other=0).to(tl.int64)
                kv = block[:, None] * stride_n + (pos % PAGE)[:, None] * stride_p + kv_head * stride_h + d[None, :]
                k = tl.load(KCache + kv, mask=kv_ok, other=0.0)
                if IEEE:
                    qk = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    qk = tl.dot(q, tl.trans(k))
                qk = tl.where(pos[None, :] <= q_pos[:, None], qk * scale, float("-inf"))
                m_new = tl.maximum(m, tl.max(qk, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key here yet
                p = tl.exp(qk - m_safe[:, None])
                alpha = tl.exp(m - m_safe)
                denom = denom * alpha + tl.sum(p, 1)
                v = tl.load(VCache + kv, mask=kv_ok, other=0.0)
                if IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m = m_new
            # A row whose position lies before this split saw no key: it has no row of partials for
            # it (split_rows), and stores nothing.
            sees = row_ok & (start <= q_pos)
            denom = tl.where(sees, denom, 1.0)
            row = tl.load(SplitBase + first + token, mask=row_ok, other=0) + split  # its token's rows of partials
            tl.store(OutPart + row[:, None] * stride_or + heads[:, None] * stride_oh + d[None, :], acc / denom[:, None],
                     mask=sees[:, None] & d_ok[None, :])
            tl.store(LsePart + row * stride_lr + heads, m + tl.log(denom), mask=sees)


@jit(do_not_specialize_on_alignment=["Positions", "SplitBase"])
def _merge_kernel(OutPart, LsePart, Positions, SplitBase, Out, stride_or, stride_oh, stride_lr, stride_t, stride_h,
                  HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  SPLIT_KEYS: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < HEADS
    ok = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    base = tl.load(SplitBase + t)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(0, tl.load(Positions + t) // SPLIT_KEYS + 1):  # the token's splits, folded in order
        lse = tl.load(LsePart + (base + s) * stride_lr + h, mask=h_ok, other=0.0)
        part = tl.load(OutPart + (base + s) * stride_or + h[:, None] * stride_oh + d[None, :], mask=ok, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)
        acc = acc * alpha[:, None] + part * w[:, None]
        denom = denom * alpha + w
        m = m_new
    tl.store(Out + t * stride_t + h[:, None] * stride_h + d[None, :], (acc / denom[:, None]).to(Out.dtype.element_ty),
             mask=ok)


@jit(do_not_specialize_on_alignment=["Slots"])
def _store_kv_kernel(K, V, KCache, VCache, Slots, stride_kt, stride_vt, stride_cs, stride_ds,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Token t's K and V rows into the pool at slot Slots[t]; a negative slot (a CUDA graph's
    padding row) writes nothing."""
    t = tl.program_id(0)
    slot = tl.load(Slots + t)
    if slot >= 0:
        i = tl.arange(0, BLOCK)
        ok = i < ROW
        tl.store(KCache + slot * stride_cs + i, tl.load(K + t * stride_kt + i, mask=ok), mask=ok)
        tl.store(VCache + slot * stride_ds + i, tl.load(V + t * stride_vt + i, mask=ok), mask=ok)


def store_kv(k_TKD: torch.Tensor, v_TKD: torch.Tensor, k_cache_NPKD: torch.Tensor, v_cache_NPKD: torch.Tensor,
             slots_T: torch.Tensor) -> None:
    """The step's new K/V into the pool in one launch; rows with slot -1 are skipped."""
    T, K, D = k_TKD.shape
    if T == 0:
        return
    k_TKD, v_TKD = k_TKD.contiguous(), v_TKD.contiguous()
    _store_kv_kernel[(T,)](k_TKD, v_TKD, k_cache_NPKD, v_cache_NPKD, slots_T, k_TKD.stride(0), v_TKD.stride(0),
                           k_cache_NPKD.stride(1), v_cache_NPKD.stride(1), ROW=K * D, BLOCK=pow2(K * D))


@jit(do_not_specialize_on_alignment=["Slots"])
def _rope_store_kernel(QKV, Bias, Cos, Sin, Q, KCache, VCache, Slots, stride_t, stride_seg, stride_c, stride_qt,
                       stride_cs, stride_ds, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, SEGMENTS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Token t's row of the qkv product (or of its partials, finished here: common/linear_partials.py):
    its query heads rotated into Q, its key heads rotated and its values into the pool at slot
    Slots[t] (none for a negative slot). Each product, sum and difference is rounded to the model's
    dtype as torch's ops round them apart (common/model.py's apply_rope), and nothing is fused into a
    multiply-add: the same bits as the unfused path."""
    t = tl.program_id(0).to(tl.int64)
    half = HEAD_DIM // 2
    f = tl.arange(0, BLOCK_F)
    f_ok = f < half
    dt = Q.dtype.element_ty
    cos = tl.load(Cos + t * stride_c + f, mask=f_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + t * stride_c + f, mask=f_ok, other=0.0).to(tl.float32)[None, :]
    h = tl.arange(0, BLOCK_H)
    slot = tl.load(Slots + t)
    for part in tl.static_range(3):  # the query heads, the key heads, the values
        count = HEADS if part == 0 else KV_HEADS
        first = 0 if part == 0 else (HEADS if part == 1 else HEADS + KV_HEADS)
        ok = (h < count)[:, None] & f_ok[None, :]
        column = (first + h)[:, None] * HEAD_DIM + f[None, :]
        x1 = finished(QKV, Bias, t * stride_t + column, column, ok, stride_seg, SEGMENTS, HAS_BIAS, dt)
        x2 = finished(QKV, Bias, t * stride_t + column + half, column + half, ok, stride_seg, SEGMENTS, HAS_BIAS, dt)
        if part < 2:
            a1 = x1.to(tl.float32)
            a2 = x2.to(tl.float32)
            y1 = ((a1 * cos).to(dt).to(tl.float32) - (a2 * sin).to(dt).to(tl.float32)).to(dt)
            y2 = ((a2 * cos).to(dt).to(tl.float32) + (a1 * sin).to(dt).to(tl.float32)).to(dt)
        else:
            y1, y2 = x1, x2
        if part == 0:
            dst = Q + t * stride_qt + h[:, None] * HEAD_DIM + f[None, :]
            tl.store(dst, y1, mask=ok)
            tl.store(dst + half, y2, mask=ok)
        elif slot >= 0:
            dst = (KCache + slot * stride_cs if part == 1 else VCache + slot * stride_ds) + h[:, None] * HEAD_DIM \
                + f[None, :]
            tl.store(dst, y1, mask=ok)
            tl.store(dst + half, y2, mask=ok)


def rope_store(qkv_TX: torch.Tensor | Partials, cos_TF: torch.Tensor, sin_TF: torch.Tensor,
               k_cache_NPKD: torch.Tensor, v_cache_NPKD: torch.Tensor, slots_T: torch.Tensor, heads: int) -> torch.Tensor:
    """The rotary embedding of a step's packed qkv rows and the store of its K/V, in one launch in
    place of some 20 (common/model.py's apply_rope, then store_kv); the rows may be a linear's
    partials. Returns the rotated queries."""
    T = qkv_TX.shape[0]
    _, _, K, D = k_cache_NPKD.shape
    q_THD = torch.empty(T, heads, D, dtype=qkv_TX.dtype, device=cos_TF.device)
    if T:
        src, bias, stride_t, stride_seg, segments, has_bias = reading(qkv_TX)
        cos_TF, sin_TF = cos_TF.contiguous(), sin_TF.contiguous()
        _rope_store_kernel[(T,)](src, bias, cos_TF, sin_TF, q_THD, k_cache_NPKD, v_cache_NPKD, slots_T, stride_t,
                                 stride_seg, cos_TF.stride(0), q_THD.stride(0), k_cache_NPKD.stride(1),
                                 v_cache_NPKD.stride(1), HEADS=heads, KV_HEADS=K, HEAD_DIM=D,
                                 BLOCK_H=pow2(max(heads, K)), BLOCK_F=pow2(D // 2), SEGMENTS=segments,
                                 HAS_BIAS=has_bias, **_NO_FP_FUSION)
    return q_THD


def tiles(block_size: int) -> bool:
    """Whether a step of a split (BLOCK_N keys) covers whole blocks of this size."""
    return BLOCK_N % block_size == 0


def tile_shape(group: int, rows: int = MIN_ROWS) -> tuple[int, int]:
    """(BLOCK_Q tokens, BLOCK_M rows) of a query tile for `group` query heads per KV head: a
    decode's (at least MIN_ROWS rows), or with rows=PREFILL_ROWS a prefill chunk's."""
    rows = max(rows, pow2(group))
    return rows // group, rows


def split_rows(positions_T: torch.Tensor, host_positions: list[int] | None, max_splits: int
               ) -> tuple[torch.Tensor, int, int]:
    """(first row of each token's partial results, rows in all, the most splits a token has). A
    token at position p has p // SPLIT + 1 splits. Packed by the host's positions when it has
    them, so a long decode beside a long prefill chunk costs rows for the splits each token has;
    else (a CUDA graph's static buffers) max_splits rows per token, as many as its tables hold."""
    if host_positions is None:
        T = positions_T.shape[0]
        return torch.arange(T, device=positions_T.device) * max_splits, T * max_splits, max_splits
    counts_T = positions_T // SPLIT + 1
    splits = [p // SPLIT for p in host_positions]
    return counts_T.cumsum(0) - counts_T, sum(splits) + len(splits), max(splits, default=0) + 1


def max_splits_for(width: int, page: int) -> int:
    """The splits block tables `width` blocks wide hold."""
    return max(1, -(-width * page // SPLIT))


def split_lanes(tiles: int, kv_heads: int, most: int, decodes: bool) -> int:
    """Programs per (query tile, KV head) of a launch whose tiles have at most `most` splits: that
    many, up to LANES, each taking every lanes-th split of its tile. A launch of decode tiles takes
    no more than keep it near PROGRAMS programs: a large batch fills the device with its tiles
    alone, and the lanes past a short context's splits would only start and end (a CUDA graph's
    launch is sized for its tables' width). A prefill's tiles keep a lane per split, so that its
    longest tiles end as soon as its shortest. A split's arithmetic is the same in any program."""
    lanes = min(LANES, most)
    return max(1, min(lanes, PROGRAMS // (tiles * kv_heads))) if decodes else lanes


def prefill_shape(tile: tuple[int, int] | None = None) -> tuple[int, dict]:
    """(rows, launch options) of a prefill tile (rows, warps); None: a named backend's tile,
    (PREFILL_ROWS, PREFILL_LAUNCH)."""
    if tile is None:
        return PREFILL_ROWS, PREFILL_LAUNCH
    rows, warps = tile
    return rows, {"num_warps": warps} if warps else {}


def prefill_apart(tile: tuple[int, int] | None = None, decode_launch: dict | None = None) -> bool:
    """Whether a prefill's tiles (prefill_shape) differ from a decode's, launched with decode_launch
    (None: SPLIT_LAUNCH), and so launch apart."""
    return prefill_shape(tile) != (MIN_ROWS, SPLIT_LAUNCH if decode_launch is None else decode_launch)


class StepSplits:
    """What every layer of a step shares in the split kernel's launches: each token's first row of
    partial results, their count and the most splits a token has (split_rows), the partials' buffers
    (each layer's merge reads them before the next layer's split writes them, in stream order), and
    each launch's tiles and lanes. A layer then allocates nothing but its output, and slices nothing."""

    def __init__(self, base_T: torch.Tensor, rows: int, most: int):
        self.base_T, self.rows, self.most = base_T, rows, most
        self.parts: tuple[torch.Tensor, torch.Tensor] | None = None
        self.launches: list[tuple] | None = None


def paged_attention(q_THD: torch.Tensor, k_cache_NPKD: torch.Tensor, v_cache_NPKD: torch.Tensor,
                    tables_SM: torch.Tensor, tiles_4X: torch.Tensor, positions_T: torch.Tensor, scale: float,
                    host_positions: list[int] | None = None, splits: StepSplits | None = None,
                    decode_tiles: int | None = None, prefill_tile: tuple[int, int] | None = None,
                    decode_launch: dict | None = None) -> torch.Tensor:
    """Causal attention of each packed query token to its sequence's keys in the pool.

    tables_SM: one block table per sequence of the step. tiles_4X: for each query tile, its
    sequence (row of tables_SM), first packed token, token count (<= BLOCK_Q) and first token's
    position. positions_T: each token's position (it sees keys 0..position), and host_positions
    the same on the host if known (see split_rows). Without them (a CUDA graph's step) the launch
    shape depends only on the tile count and the tables' width. splits: where the caller keeps one
    for every layer of a step (StepSplits of split_rows' answer), the layers share their layout.
    decode_tiles: how many tiles, first, are decode-shaped (tile_shape(group)); the rest are a
    prefill's (tile_shape(group, rows) of prefill_shape(prefill_tile), as step_layout builds them),
    each launched apart. None: every tile is decode-shaped (decode_tiles(), or tiles of
    tile_shape(group)). decode_launch: the decode tiles' launch options (None: SPLIT_LAUNCH)."""
    T, H, D = q_THD.shape
    N, P, K, _ = k_cache_NPKD.shape
    out = q_THD.new_empty((T, H, D))  # rows of head_dim contiguous, as the merge writes them (not q's layout)
    if T == 0:
        return out
    if not tiles(P):
        raise ValueError(f"block size {P} is not supported by the Triton attention; allowed: a divisor of {BLOCK_N}")
    if k_cache_NPKD.stride() != v_cache_NPKD.stride() or k_cache_NPKD.stride(3) != 1:
        raise ValueError(f"the K and V pools must share one layout, rows of head_dim contiguous: strides "
                         f"{k_cache_NPKD.stride()} and {v_cache_NPKD.stride()}")
    if q_THD.device.type != "cuda" and not interpreted():
        raise RuntimeError(f"the Triton attention runs on CUDA, not {q_THD.device} (or in Triton's interpreter: "
                           f"TRITON_INTERPRET=1); use --attention-backend sdpa")
    if splits is None:
        splits = StepSplits(*split_rows(positions_T, host_positions, max_splits_for(tables_SM.shape[1], P)))
    if splits.parts is None:
        splits.parts = (torch.empty(splits.rows, H, D, dtype=torch.float32, device=q_THD.device),
                        torch.empty(splits.rows, H, dtype=torch.float32, device=q_THD.device))
    if splits.launches is None:
        splits.launches = _launches(tiles_4X, H // K, K, splits.most, decode_tiles, prefill_tile, decode_launch)
    out_part, lse_part = splits.parts
    q_THD = q_THD.contiguous()
    block_d = max(16, pow2(D))
    for tiles_X, block_q, block_m, lanes, launch in splits.launches:
        _split_kernel[(tiles_X[0].shape[0], K, lanes)](
            q_THD, k_cache_NPKD, v_cache_NPKD, tables_SM, *tiles_X, splits.base_T, out_part, lse_part,
            scale, q_THD.stride(0), q_THD.stride(1), *k_cache_NPKD.stride()[:3], tables_SM.stride(0),
            *out_part.stride()[:2], lse_part.stride(0), lanes,
            GROUP=H // K, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=D, BLOCK_D=block_d, PAGE=P, TILE=BLOCK_N,
            SPLIT_KEYS=SPLIT, IEEE=q_THD.dtype == torch.float32, ONE_SPLIT=lanes >= splits.most, **launch)
    _merge_kernel[(T,)](out_part, lse_part, positions_T, splits.base_T, out, *out_part.stride()[:2],
                        lse_part.stride(0), out.stride(0), out.stride(1), HEADS=H, BLOCK_H=pow2(H), HEAD_DIM=D,
                        BLOCK_D=block_d, SPLIT_KEYS=SPLIT)
    return out


def _launches(tiles_4X: torch.Tensor, group: int, kv_heads: int, most: int, decode_tiles: int | None,
              prefill_tile: tuple[int, int] | None, decode_launch: dict | None) -> list[tuple]:
    """The split kernel's launches of a step: ((its tiles' sequences, first tokens, token counts and
    first positions), BLOCK_Q, BLOCK_M, lanes, launch options) for its decode-shaped tiles, and
    apart for a prefill's where they differ (paged_attention's decode_tiles)."""
    X = tiles_4X.shape[1]
    prefill_rows, prefill_launch = prefill_shape(prefill_tile)
    decode_launch = SPLIT_LAUNCH if decode_launch is None else decode_launch
    small = decode_tiles if decode_tiles is not None and prefill_apart(prefill_tile, decode_launch) else X
    out = []
    for first, end, rows, launch in ((0, small, MIN_ROWS, decode_launch), (small, X, prefill_rows, prefill_launch)):
        if end > first:
            block_q, block_m = tile_shape(group, rows)
            lanes = split_lanes(end - first, kv_heads, most, decodes=decode_tiles is None or end <= decode_tiles)
            out.append((tuple(tiles_4X[:, first:end]), block_q, block_m, lanes, launch))
    return out


def warm_up(q_THD: torch.Tensor, k_cache_NPKD: torch.Tensor, v_cache_NPKD: torch.Tensor, scale: float,
            prefill_tile: tuple[int, int] | None = None, decode_launch: dict | None = None) -> list[str]:
    """Launch the attention in a decode's tiles and, where they differ, in a prefill's (a decode at
    position 0 reading block 0; nothing is written), so that each kernel compiles at start and not
    in a serving step: each tile's two variants, a lane a split (a table of one block) and lanes
    that loop over their splits (a table of more splits than LANES). Any context runs in one of
    them. Returns which tiles compiled ("decode", "prefill")."""
    zero = torch.zeros(1, dtype=torch.int64, device=q_THD.device)
    compiled = []
    for decodes in (1, 0) if prefill_apart(prefill_tile, decode_launch) else (1,):
        for width in (1, -(-(LANES + 1) * SPLIT // k_cache_NPKD.shape[1])):
            tables = torch.zeros(1, width, dtype=torch.int64, device=q_THD.device)
            paged_attention(q_THD[:1], k_cache_NPKD, v_cache_NPKD, tables, decode_tiles(zero + 1), zero, scale,
                            decode_tiles=decodes, prefill_tile=prefill_tile, decode_launch=decode_launch)
        compiled.append("decode" if decodes else "prefill")
    return compiled


def tile_name(tile: tuple[int, int]) -> str:
    rows, warps = tile
    return f"{rows} rows" + (f" on {warps} warps" if warps else "")


def decode_tiles(lens_B: torch.Tensor) -> torch.Tensor:
    """Tiles of a decode-only batch, built on the device: row b is a tile of one token at position
    lens_B[b] - 1 (what a CUDA graph can rebuild from its static context lengths)."""
    rows_B = torch.arange(lens_B.shape[0], device=lens_B.device, dtype=lens_B.dtype)
    return torch.stack([rows_B, rows_B, torch.ones_like(rows_B), lens_B - 1])


def step_layout(meta: AttentionMetadata, group: int, prefill_tile: tuple[int, int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tables_SM, tiles_4X) of a packed step: the decodes' tables then each prefill chunk's, and
    a tile per decode then a prefill's BLOCK_Q-token tiles of each chunk."""
    nd = meta.num_decode
    if not meta.prefills:
        return meta.decode_block_tables, decode_tiles(meta.decode_context_lens)
    block_q, _ = tile_shape(group, prefill_shape(prefill_tile)[0])
    device = meta.slot_mapping.device
    width = max([c.block_table.shape[0] for c in meta.prefills]
                + ([meta.decode_block_tables.shape[1]] if nd else []))
    tables_SM = torch.zeros(nd + len(meta.prefills), width, dtype=torch.int64, device=device)
    if nd:
        tables_SM[:nd, :meta.decode_block_tables.shape[1]] = meta.decode_block_tables
    chunk_tiles = []
    for i, c in enumerate(meta.prefills):
        tables_SM[nd + i, :c.block_table.shape[0]] = c.block_table
        n = c.end - c.start
        chunk_tiles += [(nd + i, c.start + j, min(block_q, n - j), c.context_start + j) for j in range(0, n, block_q)]
    tiles_X4 = upload(torch.tensor(chunk_tiles, dtype=torch.int64), device)  # pinned: pageable waits for the stream
    if nd:
        return tables_SM, torch.cat([decode_tiles(meta.decode_context_lens), tiles_X4.T], 1)
    return tables_SM, tiles_X4.T.contiguous()


class TritonAttention(SDPAAttention):
    """Every token of a step, decode or prefill, through the one paged Triton kernel."""

    name = "triton"
    grouped_decodes = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.prefill_tile: tuple[int, int] | None = None  # (rows, warps): choose_prefill_tile's; None: PREFILL_ROWS
        self.decode_launch: dict | None = None  # choose_decode_launch's; None: SPLIT_LAUNCH
        self._layout_meta = None  # the step the cached layout was built for (every layer shares it)
        self._layout = None

    def warm_up(self, k_cache_NBKD: torch.Tensor, v_cache_NBKD: torch.Tensor) -> list[str]:
        q = torch.zeros(1, self.num_heads, self.head_dim, dtype=k_cache_NBKD.dtype, device=k_cache_NBKD.device)
        return warm_up(q, k_cache_NBKD, v_cache_NBKD, self.scale, self.prefill_tile, self.decode_launch)

    def forget_layout(self) -> None:
        """Drop the cached step layout (it may hold a CUDA graph's static buffers)."""
        self._layout_meta = self._layout = None

    def __call__(self, q_THD, k_TKD, v_TKD, k_cache_NBKD, v_cache_NBKD, meta: AttentionMetadata):
        store_kv(k_TKD, v_TKD, k_cache_NBKD, v_cache_NBKD, meta.slot_mapping)
        return self._attend(q_THD, k_cache_NBKD, v_cache_NBKD, meta)

    def rope_attend(self, qkv_TX, rope, k_cache_NBKD, v_cache_NBKD, meta: AttentionMetadata):
        """The attention of a step's packed qkv rows (or the qkv product's partials), rotated (rope: cos and
        sin per token) and their K/V stored by one kernel: what __call__ does after apply_rope, in one
        launch where that takes some 20."""
        q_THD = rope_store(qkv_TX, *rope, k_cache_NBKD, v_cache_NBKD, meta.slot_mapping, self.num_heads)
        return self._attend(q_THD, k_cache_NBKD, v_cache_NBKD, meta)

    def _attend(self, q_THD, k_cache_NBKD, v_cache_NBKD, meta: AttentionMetadata):
        if self._layout_meta is not meta:  # the step's first layer: every layer's layout
            tables_SM, tiles_4X = step_layout(meta, self.group, self.prefill_tile)
            splits = StepSplits(*split_rows(meta.positions, meta.host_positions,
                                            max_splits_for(tables_SM.shape[1], k_cache_NBKD.shape[1])))
            self._layout, self._layout_meta = (tables_SM, tiles_4X, splits), meta
        tables_SM, tiles_4X, splits = self._layout
        return paged_attention(q_THD, k_cache_NBKD, v_cache_NBKD, tables_SM, tiles_4X, meta.positions, self.scale,
                               meta.host_positions, splits, decode_tiles=meta.num_decode,
                               prefill_tile=self.prefill_tile, decode_launch=self.decode_launch)
