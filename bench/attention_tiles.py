"""How fast the paged Triton attention is for each keys-per-step (BLOCK_N) and launch shape.

BLOCK_N sets the order of a row's online softmax, so it is one constant for every call (a row's
bits must not depend on its batch); the launch's warps and stages change no arithmetic. This
times, in CUDA graphs (as decode steps run: launched eagerly, a small point times the host), the attention of llama-1b's shapes (32 query heads on 8 KV heads of 64, 16-token pages,
tables as wide as a 4,096-token context, as a CUDA graph captures them) for decode batches and a
prefill chunk, each variant against the KV bytes it must read.

    python3 -m bench.attention_tiles     (a CUDA device; prints a table, then JSON)
"""

from __future__ import annotations

import torch

from bench.report import print_json, print_table
from common.attention import triton_paged as tp

VARIANTS = [(64, {}), (64, {"num_warps": 4, "num_stages": 1}), (64, {"num_warps": 8, "num_stages": 2}),
            (128, {}), (128, {"num_warps": 8, "num_stages": 2}), (256, {}), (256, {"num_warps": 8, "num_stages": 1})]
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
    rows, results = [], {}
    for b, kv in POINTS + [("prefill", 2048)]:
        if b == "prefill":  # one 2,048-token prompt's chunk, its keys in the pool
            T = kv
            tables = perm[:kv // P][None, :].contiguous()
            positions = torch.arange(kv, device=device)
            block_q, _ = tp.tile_shape(H // K)
            tiles = torch.tensor([(0, j, min(block_q, kv - j), j) for j in range(0, kv, block_q)],
                                 device=device).T.contiguous()
            host = list(range(kv))
            bytes_ = 2 * kv * K * D * 2
        else:
            T = b
            tables = torch.zeros(b, width, dtype=torch.int64, device=device)
            tables[:, :kv // P] = perm[:b * kv // P].view(b, kv // P)
            lens = torch.full((b,), kv, device=device)
            positions, tiles, host = lens - 1, tp.decode_tiles(lens), None
            bytes_ = 2 * b * kv * K * D * 2
        q = torch.randn(T, H, D, generator=gen, device=device).bfloat16()
        floor = 1e6 * bytes_ / read_bps
        row = [f"b{b} kv{kv}" if b != "prefill" else f"prefill {kv}", f"{floor:.1f}"]
        for tile, launch in VARIANTS:
            tp.BLOCK_N, tp.SPLIT_LAUNCH = tile, launch
            fn = lambda: tp.paged_attention(q, k_cache, v_cache, tables, tiles, positions, D ** -0.5, host)  # noqa
            try:
                fn()  # compiles outside the graph
                us = triton.testing.do_bench_cudagraph(fn, rep=25, return_mode="median") * 1e3
            except Exception as e:  # a variant that does not compile: say so, time the others
                print(f"N{tile} {launch}: {str(e).splitlines()[0][:200]}", flush=True)
                us = float("nan")
            results[f"{row[0]}/{tile}/{launch}"] = round(us, 2)
            row.append(f"{us:.1f}")
        rows.append(row)
        print(row, flush=True)
    print_table(f"paged attention per layer (llama-1b heads, bf16), µs; floor = K/V bytes / {read_bps / 1e9:,.0f} GB/s",
                ["point", "floor"] + [f"N{t} {l.get('num_warps', '')}/{l.get('num_stages', '')}" for t, l in VARIANTS],
                rows)
    print_json({"bench": "attention_tiles", "read_gb_s": round(read_bps / 1e9, 1), "us": results})


if __name__ == "__main__":
    main()
