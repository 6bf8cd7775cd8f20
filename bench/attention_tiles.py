"""How fast the paged Triton attention is for each keys-per-step (BLOCK_N), keys-per-split (SPLIT)
and launch shape.

BLOCK_N sets the order of a row's online softmax, so it is one constant for every call (a row's
bits must not depend on its batch); the launch's warps, stages, register cap and lanes, and a
tile's rows, should change no arithmetic, which the prefill half checks. This times, in CUDA
graphs (as decode steps run: launched eagerly, a small point times the host), the attention of
llama-1b's shapes (32 query heads on 8 KV heads of 64, 16-token pages, tables as wide as a
4,096-token context, as a CUDA graph captures them) for decode batches and a prefill chunk, each
variant against the KV bytes it must read.

    python3 -m bench.attention_tiles     (a CUDA device; prints a table, then JSON)
"""

from __future__ import annotations

import torch

from bench.report import print_json, print_table
from common.attention import triton_paged as tp

# (BLOCK_N keys a step, SPLIT keys a split, launch, PROGRAMS): SPLIT also fixes a row's arithmetic (its
# splits), and sets how many programs share a short context's keys (at batch 1 a split is a chain of
# steps). PROGRAMS caps a decode launch's lanes (split_lanes); 1 << 30 gives every tile LANES of them
# whatever the batch, as before 2026-11-28 (those past a short context's splits start and end at once)
# The register caps are those `auto` times at start (tp.DECODE_LAUNCHES).
DECODE = [(64, 256, {}, tp.PROGRAMS), (64, 256, {}, 1 << 30), (64, 256, {"num_warps": 4, "num_stages": 1}, tp.PROGRAMS),
          *[(64, 256, launch, tp.PROGRAMS) for launch in tp.DECODE_LAUNCHES if launch],
          (128, 256, {}, tp.PROGRAMS), (64, 128, {}, tp.PROGRAMS), (128, 512, {}, tp.PROGRAMS)]
# (rows, launch). On an H100 (2026-11-27) 64 and 128 rows on 4 or 8 warps gave other bits than a
# decode's 16-row tile: those shapes take Hopper's warpgroup products (wgmma), a 16-row tile the
# older mma. Fewer warps than 4 keep the older mma at any row count, which may keep the bits.
PREFILL = [(16, {}), (32, {}), (64, {"num_warps": 4}), (128, {"num_warps": 4}), (128, {"num_warps": 8}),
           (32, {"num_warps": 2}), (64, {"num_warps": 2}), (128, {"num_warps": 2})]
POINTS = [(1, 512), (64, 512), (1, 2048), (64, 2048), (256, 512)]  # (decode batch, KV)


def main():
    import triton.testing

    device, H, K, D, P, width = torch.device("cuda:0"), 32, 8, 64, 16, 256
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = 256 * 2048 // P + 8
    k_cache = torch.randn(blocks, P, K, D, generator=gen, device=device).bfloat16()
    v_cache = torch.randn(blocks, P, K, D, generator=gen, device=device).bfloat16()
    perm = torch.randperm(blocks, generator=gen, device=device)
    read_bps = 2 * k_cache.numel() * 2 / (triton.testing.do_bench(lambda: k_cache.clone(), return_mode="median") / 1e3)
    results = {}
    split_keys = tp.SPLIT  # the served one, for the prefill half

    def time_us(key, fn):
        try:
            fn()  # compiles outside the graph
            us = triton.testing.do_bench_cudagraph(fn, rep=25, return_mode="median") * 1e3
        except Exception as e:  # a variant that does not compile: say so, time the others
            print(f"{key}: {str(e).splitlines()[0][:200]}", flush=True)
            us = float("nan")
        results[key] = round(us, 2)
        return f"{us:.1f}"

    rows = []
    for b, kv in POINTS:
        tables = torch.zeros(b, width, dtype=torch.int64, device=device)
        tables[:, :kv // P] = perm[:b * kv // P].view(b, kv // P)
        lens = torch.full((b,), kv, device=device)
        q = torch.randn(b, H, D, generator=gen, device=device).bfloat16()
        row = [f"b{b} kv{kv}", f"{1e6 * 2 * b * kv * K * D * 2 / read_bps:.1f}"]
        for tile, split, launch, programs in DECODE:
            tp.BLOCK_N, tp.SPLIT, tp.SPLIT_LAUNCH, tp.PROGRAMS = tile, split, launch, programs
            row.append(time_us(f"b{b}_kv{kv}/N{tile}/S{split}/{launch}/P{programs}", lambda: tp.paged_attention(
                q, k_cache, v_cache, tables, tp.decode_tiles(lens), lens - 1, D ** -0.5)))
        tp.SPLIT, tp.PROGRAMS = split_keys, DECODE[0][3]
        rows.append(row)
        print(row, flush=True)
    names = [f"N{t} S{s} {l}" + ("" if p == tp.PROGRAMS else " every lane") for t, s, l, p in DECODE]
    print_table(f"decode attention per layer (llama-1b heads, bf16, CUDA graphs), µs; floor = K/V bytes / "
                f"{read_bps / 1e9:,.0f} GB/s", ["point", "floor"] + names, rows)

    # one 2,048-token prompt's chunk, its keys in the pool: each prefill tile shape's time, and
    # whether its rows have the bits of one-token decode tiles (the batch-invariance promise)
    T = 2048
    tables = perm[:T // P][None, :].contiguous()
    positions = torch.arange(T, device=device)
    host = list(range(T))
    q = torch.randn(T, H, D, generator=gen, device=device).bfloat16()
    singles = torch.stack([torch.zeros_like(positions), positions, torch.ones_like(positions), positions])
    rows = []
    for tile in (64, 128):
        tp.BLOCK_N, tp.SPLIT_LAUNCH = tile, {}
        alone = tp.paged_attention(q, k_cache, v_cache, tables, singles, positions, D ** -0.5, host)
        for prefill_rows, launch in PREFILL:
            block_q, _ = tp.tile_shape(H // K, prefill_rows)
            tiles = torch.tensor([(0, j, min(block_q, T - j), j) for j in range(0, T, block_q)],
                                 device=device).T.contiguous()
            tp.PREFILL_ROWS, tp.PREFILL_LAUNCH = prefill_rows, launch
            fn = lambda: tp.paged_attention(q, k_cache, v_cache, tables, tiles, positions, D ** -0.5, host,  # noqa
                                            decode_tiles=0)
            us = time_us(f"prefill{T}/N{tile}/rows{prefill_rows}/{launch}", fn)
            try:
                same = torch.equal(fn(), alone)
            except Exception:  # (time_us said why)
                same = False
            results[f"prefill{T}/N{tile}/rows{prefill_rows}/{launch}/same_bits"] = same
            rows.append([tile, prefill_rows, str(launch), us, "yes" if same else "NO"])
            print(rows[-1], flush=True)
    print_table(f"a {T}-token prefill chunk's attention per layer, µs, and whether its rows have a one-token "
                f"tile's bits", ["keys/step", "rows/tile", "launch", "µs", "same bits"], rows)
    print_json({"bench": "attention_tiles", "read_gb_s": round(read_bps / 1e9, 1), "us": results})


if __name__ == "__main__":
    main()
