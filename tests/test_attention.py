"""Every attention backend equals the portable SDPA one: on a paged decode batch directly, and on
whole generations through the engine."""

import pytest
import torch

from common.attention import SDPAAttention, _step_difference
from common.engine import Engine
from common.sampling_params import SamplingParams
from tests.test_engine import mixed_params, prompts

pytestmark = pytest.mark.slow  # the first FlexAttention call compiles (tens of seconds on CPU)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_flex_decode_equals_sdpa(heads, kv_heads):
    from common.attention.flex import FlexAttention

    err = _step_difference(FlexAttention(heads, kv_heads, 16), SDPAAttention(heads, kv_heads, 16),
                           torch.device("cpu"))
    assert err < 1e-5


def test_flex_engine_generates_sdpa_tokens():
    """By name only now (it does not compile for 16-token pages on an H100): one model suffices."""
    ps, params = prompts(8, 1, 60, seed=11), mixed_params(8, max_tokens=10)
    sdpa = Engine(model="dummy:llama-tiny", attention_backend="sdpa").generate(ps, params)
    flex = Engine(model="dummy:llama-tiny", attention_backend="flex").generate(ps, params)
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


def _triton_decode(q, k, v, tables, lens, scale):
    from common.attention.triton_paged import decode_tiles, paged_attention

    return paged_attention(q, k, v, tables, decode_tiles(lens), lens - 1, scale)


# Lengths around a page (16), a step of a split (64) and a split (256), one token, and several splits.
LENGTHS = [1, 16, 17, 64, 255, 256, 257, 700, 40]


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 16), (32, 8, 64), (6, 1, 24)])
def test_triton_decode_equals_sdpa(heads, kv_heads, head_dim):
    """The paged Triton kernel (in Triton's interpreter on CPU) against SDPA over gathered blocks:
    GQA groups of 1, 4 (llama-1b's) and 6 (not a power of two, nor is the head size), fragmented
    tables and pages shared by two rows."""
    pytest.importorskip("triton")
    q, k, v, tables, lens = _paged_batch(LENGTHS, heads, kv_heads, head_dim, torch.float32, seed=heads,
                                         shared_prefix_blocks=1)
    got = _triton_decode(q, k, v, tables, lens, head_dim ** -0.5)
    want = _sdpa_decode(q, k, v, tables, lens, heads, kv_heads, head_dim)
    assert (got - want).abs().max().item() < 1e-5


def test_triton_decode_is_batch_invariant(monkeypatch):
    """A row's output is the same bits alone, in any batch, however wide the batch's tables are, and
    however many programs share its splits: they sit at fixed positions and fold in a fixed order."""
    pytest.importorskip("triton")
    from common.attention import triton_paged

    heads, kv_heads, head_dim = 8, 2, 32
    q, k, v, tables, lens = _paged_batch(LENGTHS, heads, kv_heads, head_dim, torch.float32, seed=5)
    batched = _triton_decode(q, k, v, tables, lens, head_dim ** -0.5)
    monkeypatch.setattr(triton_paged, "LANES", 1)  # one program takes all of a row's splits in turn
    assert torch.equal(_triton_decode(q, k, v, tables, lens, head_dim ** -0.5), batched)
    monkeypatch.undo()
    for i, n in enumerate(LENGTHS):
        own = tables[i:i + 1, :-(-n // 16)]
        alone = _triton_decode(q[i:i + 1], k, v, own, lens[i:i + 1], head_dim ** -0.5)
        wide = _triton_decode(q[i:i + 1], k, v, torch.cat([own, own.new_zeros(1, 80)], 1), lens[i:i + 1],
                              head_dim ** -0.5)
        assert torch.equal(alone[0], batched[i]) and torch.equal(wide[0], batched[i]), (i, n)


def test_triton_warm_up_compiles_a_decodes_tiles_and_a_prefills_where_they_differ(monkeypatch):
    """An engine on CUDA compiles the attention at start, so that no serving step waits on a
    compile: launches in a decode's tiles and, where a prefill's differ, in those; each tile in its
    two variants, a lane a split and lanes that loop over their splits. The kernels loop over a
    tile's own splits, so these serve every context."""
    pytest.importorskip("triton")
    from common.attention import triton_paged as tp

    launched, variants = [], []
    launch, kernel = tp.paged_attention, tp._split_kernel
    monkeypatch.setattr(tp, "paged_attention", lambda *args, decode_tiles, **kw: (
        launched.append(decode_tiles), launch(*args, decode_tiles=decode_tiles, **kw))[1])

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: (variants.append(kw["ONE_SPLIT"]), kernel[grid](*args, **kw))
    monkeypatch.setattr(tp, "_split_kernel", Spy())
    k = torch.randn(4, 16, 2, 32)
    # a prefill's tiles as a decode's (one launch), or apart (two): by name (PREFILL_ROWS) or the engine's own
    # (a tile of a decode's rows on other warps launches apart too)
    for named, own, apart in ((tp.MIN_ROWS, None, False), (64, None, True), (tp.MIN_ROWS, (64, 2), True),
                              (64, (tp.MIN_ROWS, 0), False), (tp.MIN_ROWS, (tp.MIN_ROWS, 2), True)):
        monkeypatch.setattr(tp, "PREFILL_ROWS", named)
        launched.clear()
        variants.clear()
        assert tp.warm_up(torch.randn(1, 8, 32), k, k.clone(), 0.2, own) == (["decode", "prefill"] if apart else
                                                                             ["decode"])
        assert launched == ([1, 1, 0, 0] if apart else [1, 1])
        assert variants == [True, False] * (len(launched) // 2)


def test_triton_lanes_follow_the_splits_a_launch_has_and_a_decode_batch_fills_the_device():
    """Programs per (tile, KV head): a lane per split up to LANES; a decode launch no more than
    keep it near PROGRAMS programs, a prefill's a lane per split, and never none."""
    from common.attention import triton_paged as tp

    assert tp.split_lanes(1, 8, 512, decodes=True) == tp.LANES  # batch 1, a long context: every lane
    assert tp.split_lanes(1, 8, 3, decodes=True) == 3  # as many as its splits
    assert tp.split_lanes(64, 8, 512, decodes=True) == tp.PROGRAMS // (64 * 8)
    assert tp.split_lanes(1024, 8, 512, decodes=True) == 1
    assert tp.split_lanes(256, 8, 8, decodes=False) == 8  # a 2,048-token chunk: a lane per split
    assert tp.split_lanes(256, 8, 40, decodes=False) == tp.LANES


def test_triton_attention_writes_a_tokens_own_splits_whatever_its_tables_width(monkeypatch):
    """The kernels loop over the splits a tile has, not those its table could hold: a token's own
    splits are written, the rest of a CUDA graph's rows for it stay unwritten, and a table wider
    than its keys changes no output."""
    pytest.importorskip("triton")
    from common.attention import triton_paged as tp

    heads, kv_heads, head_dim = 4, 2, 16
    q, k, v, tables, lens = _paged_batch([300, 20], heads, kv_heads, head_dim, torch.float32, seed=3)
    written = []
    empty = torch.empty

    def tracked(*shape, **kw):  # the partials, filled with NaN: what no program writes stays NaN
        t = empty(*shape, **kw)
        if kw.get("dtype") == torch.float32 and len(written) < 2:
            t.fill_(float("nan"))
            written.append(t)
        return t
    monkeypatch.setattr(tp.torch, "empty", tracked)
    out = _triton_decode(q, k, v, torch.cat([tables, tables.new_zeros(2, 60)], 1), lens, head_dim ** -0.5)
    monkeypatch.undo()
    assert not out.isnan().any()
    part = written[0]  # a graph's layout (no host positions): a row per split the tables hold, per token
    per_token = part.shape[0] // 2
    assert per_token == tp.max_splits_for(tables.shape[1] + 60, 16)
    assert not part[:2].isnan().any() and part[2:per_token].isnan().all()  # 300 tokens: 2 splits
    assert not part[per_token].isnan().any() and part[per_token + 1:].isnan().all()  # 20 tokens: 1
    want = _sdpa_decode(q, k, v, tables, lens, heads, kv_heads, head_dim)
    assert (out - want).abs().max().item() < 1e-5


def test_auto_takes_the_fastest_prefill_tile_that_keeps_a_decode_tiles_bits(monkeypatch):
    """A prefill's tiles of more rows read its keys fewer times, but on a GPU may give its rows other
    bits than a decode's one-token tiles (on an H100, tiles that take Hopper's warpgroup products). The
    chooser keeps the tiles whose rows come out the same, tiled from 0 and after a cached prefix,
    and, timed (on CUDA by events), takes the fastest of them and of a decode's own tile, a near tie
    going to a decode's own tile, else to the first listed (so that engines choose alike); untimed,
    the first kept. In the interpreter every tile
    keeps the bits. With a stand-in kernel whose tiles of more than 32 rows are off by a little (of
    more than 64 on 2 warps), and a stand-in timer: a tile that fails to run, or gives other bits, is
    passed over, said why.
    The choice is the engine's own (TritonAttention.prefill_tile): PREFILL_ROWS, a named backend's, stays."""
    pytest.importorskip("triton")
    from common.attention import triton_paged as tp
    from common.attention.triton_choice import choose_prefill_tile

    cpu = torch.device("cpu")
    assert choose_prefill_tile(4, 1, 16, cpu, torch.float32, 16, tokens=24) == (tp.PREFILL_CANDIDATES[0], [])

    tried = []

    def stand_in(q, k, v, tables, tiles, positions, scale, host=None, splits=None, decode_tiles=None,
                 prefill_tile=None):
        tile = prefill_tile if decode_tiles == 0 else (tp.MIN_ROWS, 0)
        tried.append(tile)
        assert tiles.shape[0] == 4 and int(tiles[2].sum()) == q.shape[0]  # every token in one tile
        if decode_tiles == 0:  # tiled from 0, and as a chunk after a cached prefix of SPLIT + 5 tokens
            assert {0, tp.SPLIT + 5} <= set(tiles[3].tolist())
        if tile == (64, 0) and broken:
            raise RuntimeError("out of shared memory")
        rows, warps = tile
        return q + (1e-3 if rows > (64 if warps == 2 else 32) else 0.0)
    monkeypatch.setattr(tp, "paged_attention", stand_in)
    broken = False
    assert choose_prefill_tile(8, 2, 16, cpu, torch.bfloat16, 16) == ((64, 2), [])
    assert tried == [(tp.MIN_ROWS, 0), (64, 2)]

    broken = True
    us = {(64, 2): 3.0, (32, 0): 2.0, (tp.MIN_ROWS, 0): 5.0}
    tile, notes = choose_prefill_tile(8, 2, 16, cpu, torch.bfloat16, 16,
                                      timer=lambda run: (run(), us[tried[-1]] / 1e6)[1])
    assert tile == (32, 0)
    assert notes == ["128 rows: other bits", "64 rows: RuntimeError: out of shared memory", "64 rows on 2 warps 3 us",
                     "32 rows 2 us", "16 rows 5 us"]
    us[(64, 2)] = 2.1  # within TIE of the fastest: timing noise, so the first listed of them
    assert choose_prefill_tile(8, 2, 16, cpu, torch.bfloat16, 16,
                               timer=lambda run: (run(), us[tried[-1]] / 1e6)[1])[0] == (64, 2)
    us[(tp.MIN_ROWS, 0)] = 2.15  # a decode's own tile among them: that one, whatever the order
    assert choose_prefill_tile(8, 2, 16, cpu, torch.bfloat16, 16,
                               timer=lambda run: (run(), us[tried[-1]] / 1e6)[1])[0] == (tp.MIN_ROWS, 0)
    us[(tp.MIN_ROWS, 0)] = 1.0  # none faster than a decode's own tile: that one
    assert choose_prefill_tile(8, 2, 16, cpu, torch.bfloat16, 16,
                               timer=lambda run: (run(), us[tried[-1]] / 1e6)[1])[0] == (tp.MIN_ROWS, 0)
    assert tp.PREFILL_ROWS == tp.MIN_ROWS


def test_auto_takes_the_fastest_decode_launch_that_keeps_the_bits(monkeypatch):
    """A cap on a decode tile's registers changes no arithmetic: the chooser checks that, times each
    launch (a stand-in timer), and takes the fastest, unless Triton's own is within TIE of it;
    untimed, the first. In the interpreter every
    launch gives the same bits; with a stand-in kernel, one that fails and one that differs are
    passed over, each said why. The backend launches its decode tiles with the choice."""
    pytest.importorskip("triton")
    from common.attention import triton_paged as tp
    from common.attention.triton_choice import choose_decode_launch

    cpu = torch.device("cpu")
    assert choose_decode_launch(4, 2, 16, cpu, torch.float32, 16, batch=3, context=40) == (tp.DECODE_LAUNCHES[0], [])
    tried, launch = [], tp.paged_attention

    def stand_in(q, *args, decode_launch=None, **kw):
        tried.append(decode_launch)
        if decode_launch == {"maxnreg": 80}:
            raise ValueError("unknown option maxnreg")
        return launch(q, *args, decode_launch=decode_launch, **kw) + (0.5 if decode_launch == {"maxnreg": 64} else 0)
    monkeypatch.setattr(tp, "paged_attention", stand_in)
    monkeypatch.setattr(tp, "DECODE_LAUNCHES", ({}, {"maxnreg": 80}, {"maxnreg": 64}, {"num_warps": 2}))
    us = {None: 0.0, "{}": 5.0, "{'num_warps': 2}": 3.0}
    chosen, notes = choose_decode_launch(4, 2, 16, cpu, torch.float32, 16, batch=3, context=40,
                                         timer=lambda run: (run(), us[str(tried[-1])] / 1e6)[1])
    assert chosen == {"num_warps": 2}
    assert notes == ["maxnreg 80: ValueError: unknown option maxnreg", "maxnreg 64: other bits", "uncapped 5 us",
                     "num_warps 2 3 us"]
    us["{'num_warps': 2}"] = 4.8  # not more than TIE faster than Triton's own launch: that one
    assert choose_decode_launch(4, 2, 16, cpu, torch.float32, 16, batch=3, context=40,
                                timer=lambda run: (run(), us[str(tried[-1])] / 1e6)[1])[0] == {}
    monkeypatch.undo()

    attention = tp.TritonAttention(4, 2, 16)
    attention.decode_launch = {"num_warps": 2}
    seen = []
    monkeypatch.setattr(tp, "paged_attention", lambda *a, decode_launch=None, **kw: seen.append(decode_launch))
    from common.attention import AttentionMetadata
    lens = torch.tensor([5])
    meta = AttentionMetadata(torch.tensor([4]), 1, torch.tensor([[0]]), lens, None, [], None, lens - 1, None)
    attention._attend(torch.zeros(1, 4, 16), torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16), meta)
    assert seen == [{"num_warps": 2}]


class _Sequences:
    """Sequences with random per-position q/k/v over a shuffled pool, and packed steps over them:
    `step(rows)` runs one backend call where each row is (sequence, first position, tokens), the
    one-token rows first as decodes, and returns each (sequence, position)'s output."""

    def __init__(self, lengths, heads, kv_heads, head_dim, seed, page=16):
        gen = torch.Generator().manual_seed(seed)
        self.page, self.heads, self.kv_heads, self.head_dim = page, heads, kv_heads, head_dim
        widths = [-(-n // page) for n in lengths]
        order = torch.randperm(sum(widths) + 2, generator=gen).tolist()
        self.tables, at = [], 0
        for w in widths:
            self.tables.append(order[at:at + w])
            at += w
        self.pool = len(order)
        self.q = [torch.randn(n, heads, head_dim, generator=gen) for n in lengths]
        self.k = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lengths]
        self.v = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lengths]

    def new_cache(self):
        shape = (self.pool, self.page, self.kv_heads, self.head_dim)
        return torch.zeros(shape), torch.zeros(shape)

    def step(self, backend, caches, rows):
        from common.attention import AttentionMetadata, PrefillChunk

        P = self.page
        rows = sorted(rows, key=lambda r: r[2] != 1)  # decodes first, as the engine packs them
        nd = sum(1 for r in rows if r[2] == 1)
        q, k, v, slots, positions, chunks, offset = [], [], [], [], [], [], 0
        for i, (s, first, n) in enumerate(rows):
            q.append(self.q[s][first:first + n])
            k.append(self.k[s][first:first + n])
            v.append(self.v[s][first:first + n])
            positions += range(first, first + n)
            slots += [self.tables[s][p // P] * P + p % P for p in range(first, first + n)]
            if i >= nd:
                chunks.append(PrefillChunk(offset, offset + n, first, torch.tensor(self.tables[s][:-(-(first + n) // P)])))
            offset += n
        decode = rows[:nd]
        width = max([-(-(f + 1) // P) for _, f, _ in decode], default=0)
        tables = torch.tensor([self.tables[s][:width] + [0] * (width - len(self.tables[s][:width])) for s, _, _ in decode],
                              dtype=torch.int64).view(nd, width)
        lens = torch.tensor([f + 1 for _, f, _ in decode], dtype=torch.int64)
        mask = (torch.arange(width * P)[None, :] < lens[:, None])[:, None, None, :]
        meta = AttentionMetadata(torch.tensor(slots), nd, tables if nd else None, lens if nd else None,
                                 mask if nd else None, chunks, None, torch.tensor(positions), positions)
        out = backend(torch.cat(q), torch.cat(k), torch.cat(v), *caches, meta)
        return {(s, first + j): out[o + j] for (s, first, n), o in
                zip(rows, [0] + list(torch.tensor([r[2] for r in rows]).cumsum(0)[:-1].tolist())) for j in range(n)}


def _chunked(seqs, lengths, chunk, ones_from=None):
    """Every sequence prefilled in chunks of `chunk` (one token at a time from position
    `ones_from` on: decodes), sequences side by side in each step; outputs per (sequence, position)."""
    from common.attention.triton_paged import TritonAttention

    backend = TritonAttention(seqs.heads, seqs.kv_heads, seqs.head_dim)
    caches, got, first = seqs.new_cache(), {}, [0] * len(lengths)

    def size(pos, n):
        if ones_from is not None:
            return 1 if pos >= ones_from else min(ones_from - pos, n - pos)
        return min(chunk, n - pos)

    while any(f < n for f, n in zip(first, lengths)):
        rows = [(s, first[s], size(first[s], n)) for s, n in enumerate(lengths) if first[s] < n]
        got.update(seqs.step(backend, caches, rows))
        for s, _, n in rows:
            first[s] += n
    return got


def test_triton_prefill_chunks_and_decodes_equal_sdpa():
    """A mixed step (decodes beside prefill chunks with cached prefixes, and a whole prompt) through
    the Triton backend equals the SDPA backend on the same step."""
    pytest.importorskip("triton")
    from common.attention.triton_paged import TritonAttention

    lengths = [300, 40, 90, 20, 270]
    seqs = _Sequences(lengths, 8, 2, 32, seed=4)
    prefix = [(0, 0, 280), (1, 0, 39), (2, 0, 50), (4, 0, 1)]  # cached before the step
    rows = [(0, 280, 1), (1, 39, 1), (2, 50, 40), (3, 0, 20), (4, 1, 269)]
    outs = []
    for backend in (TritonAttention(8, 2, 32), SDPAAttention(8, 2, 32)):
        caches = seqs.new_cache()
        seqs.step(SDPAAttention(8, 2, 32), caches, prefix)
        outs.append(seqs.step(backend, caches, rows))
    assert outs[0].keys() == outs[1].keys()
    assert max((outs[0][key] - outs[1][key]).abs().max().item() for key in outs[0]) < 1e-5


def test_triton_attention_is_the_same_bits_however_a_prompt_is_chunked():
    """Each position's output is identical whether its prompt went in whole, in chunks of 29, or
    token by token as decodes across a split's edge (256): a prefill token and a decode token take
    one code path."""
    pytest.importorskip("triton")
    lengths = [262, 30, 5]
    seqs = _Sequences(lengths, 4, 1, 32, seed=6)
    whole = _chunked(seqs, lengths, max(lengths))
    for chunk, ones_from in ((29, None), (None, 253)):
        got = _chunked(seqs, lengths, chunk, ones_from)
        assert got.keys() == whole.keys()
        different = [key for key in whole if not torch.equal(whole[key], got[key])]
        assert not different, (chunk, ones_from, different[:5])


def test_triton_passes_the_start_up_check_auto_runs():
    """What `auto` runs before it picks the Triton attention on CUDA: a mixed step against SDPA, here
    with 32-token blocks (every other test reads 16-token ones)."""
    pytest.importorskip("triton")
    from common.attention.triton_paged import TritonAttention

    err = _step_difference(TritonAttention(32, 8, 64), SDPAAttention(32, 8, 64), torch.device("cpu"), torch.float32,
                           32)
    assert err < 1e-5


def test_triton_attention_answers_in_rows_of_head_dim_whatever_the_layout_of_its_query():
    """A query whose head_dim is not its innermost dimension: the output was laid out like it, and
    the merge, writing rows of head_dim, scrambled it (1e38 off)."""
    pytest.importorskip("triton")
    heads, kv_heads, head_dim = 4, 2, 32
    q, k, v, tables, lens = _paged_batch([5, 16, 9], heads, kv_heads, head_dim, torch.float32, seed=3)
    want = _triton_decode(q, k, v, tables, lens, head_dim ** -0.5)
    d_outermost = q.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    assert d_outermost.stride(2) != 1
    assert torch.equal(_triton_decode(d_outermost, k, v, tables, lens, head_dim ** -0.5), want)


def test_triton_decode_half_precision_is_close_to_sdpa():
    pytest.importorskip("triton")
    heads, kv_heads, head_dim = 8, 2, 32
    q, k, v, tables, lens = _paged_batch(LENGTHS, heads, kv_heads, head_dim, torch.float16, seed=7)
    got = _triton_decode(q, k, v, tables, lens, head_dim ** -0.5).float()
    want = _sdpa_decode(q.float(), k.float(), v.float(), tables, lens, heads, kv_heads, head_dim)
    assert (got - want).abs().max().item() < 1e-2


def test_triton_decode_in_bfloat16_is_close_to_sdpa_and_the_same_bits_in_any_batch():
    """bfloat16, the GPU's default, as the interpreter computes it like a GPU (tests/conftest.py:
    bfloat16_as_a_gpu_does): the outputs within bfloat16's rounding of SDPA's in float32, and each
    row's bits alone what they are in the batch."""
    pytest.importorskip("triton")
    heads, kv_heads, head_dim = 8, 2, 32
    q, k, v, tables, lens = _paged_batch(LENGTHS, heads, kv_heads, head_dim, torch.bfloat16, seed=8,
                                         shared_prefix_blocks=1)
    batched = _triton_decode(q, k, v, tables, lens, head_dim ** -0.5)
    want = _sdpa_decode(q.float(), k.float(), v.float(), tables, lens, heads, kv_heads, head_dim)
    assert batched.dtype == torch.bfloat16 and (batched.float() - want).abs().max().item() < 2e-2
    for i, n in enumerate(LENGTHS):
        alone = _triton_decode(q[i:i + 1], k, v, tables[i:i + 1, :-(-n // 16)], lens[i:i + 1], head_dim ** -0.5)
        assert torch.equal(alone[0], batched[i]), (i, n)


def test_triton_backend_refuses_a_block_size_it_cannot_tile():
    pytest.importorskip("triton")
    q, k, v, tables, lens = _paged_batch([30], 4, 4, 16, torch.float32, seed=1, page=24)
    with pytest.raises(ValueError, match="block size 24"):
        _triton_decode(q, k, v, tables, lens, 0.25)


def test_triton_kernels_compile_for_an_h100():
    """Every kernel variant compiles to an sm_90 binary here, with no GPU (tests/triton_aot.py), the
    split kernel gathers K and V 16 bytes a load in every tile, not 2 (an int64 table entry is 8),
    and a decode step's matmul partials are written and read 16 bytes an access, not 4."""
    pytest.importorskip("triton.backends.nvidia")
    import json
    import os
    import subprocess
    import sys

    from common.attention import triton_paged as tp

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.triton_aot"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = json.loads(run.stdout.splitlines()[-1])["compiled"]
    # bf16: 4 attention shapes, 3 matmuls, SiLU's product, 3 norms; fp32: one of each kind; 2 block copies
    assert len(compiled) == (4 + 3 + 1 + 3) + (1 + 1 + 1 + 1) + 2 and {"bf16/h32/kv8/d64", "bf16/linear/2048x8192",
                                                                    "bf16/silu_mul", "fp32/h32/kv8/d64"} <= set(compiled)
    loads = json.loads(run.stdout.splitlines()[-1])["split_kernel_loads"]
    assert len(loads) == 2 * (1 + len(tp.PREFILL_CANDIDATES))  # each tile a lane a split, and looping
    for tile, widths in loads.items():
        assert min(map(int, widths)) >= 8 and widths.get("16", 0) >= 16, (tile, widths)
    partials = json.loads(run.stdout.splitlines()[-1])["partials_accesses"]
    assert len(partials) == 2 + 4  # two split matmuls, four readers
    for kernel, widths in partials.items():
        assert min(map(int, widths["load"])) >= 8 and set(widths["store"]) == {"16"}, (kernel, widths)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 32), (32, 8, 64), (9, 3, 20)])
def test_fused_rope_and_kv_store_give_the_unfused_bits(dtype, heads, kv_heads, head_dim):
    """rope_store (one kernel) against apply_rope then store_kv: the same query bits, the same K/V
    in the pool, and nothing written for a padding row's slot -1."""
    from common.attention.triton_paged import rope_store, store_kv
    from common.model import apply_rope, rope_inv_freq
    from common.model_spec import model_config

    cfg = model_config("dummy:llama-tiny")
    cfg.head_dim = head_dim
    gen = torch.Generator().manual_seed(heads)
    T, x = 6, (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(T, x, generator=gen) * 3).to(dtype)
    positions = torch.tensor([0, 5, 17, 100, 3000, 7])
    freqs = torch.outer(torch.arange(4096).float(), rope_inv_freq(cfg))
    cos, sin = freqs.cos()[positions].to(dtype), freqs.sin()[positions].to(dtype)
    slots = torch.tensor([3, 40, -1, 9, 0, 63])
    caches = [torch.zeros(4, 16, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q = apply_rope(q.view(T, heads, head_dim), cos, sin)
    k_roped = apply_rope(k.view(T, kv_heads, head_dim), cos, sin)
    real = slots >= 0
    store_kv(k_roped[real], v.reshape(T, kv_heads, head_dim)[real], caches[0], caches[1], slots[real])
    got_q = rope_store(qkv, cos, sin, caches[2], caches[3], slots, heads)
    assert torch.equal(got_q, want_q)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert caches[2].flatten(0, 1)[slots[real]].abs().sum() > 0
