"""Which tile shapes of the batch-invariant matmul give a row the same bits, and how fast each is.

common/batch_invariant.py fixes one tile shape per weight so that a row's arithmetic never depends
on the row count. One shape cannot be fast both for a decode step (a few rows: few programs, so few
SMs read the weight) and for a prefill (thousands of rows: large tiles for the tensor cores). If
tiles that differ only in rows and columns (BLOCK_M, BLOCK_N), with the same BLOCK_K and the same
K loop, give every row the same bits, the tile may follow the row count and the promise holds.
This measures that on the device, then times every tile at every row count for each weight
shape of a model, beside torch's matmul and the weight's bytes-read floor.

    python3 -m bench.matmul_tiles [--model dummy:llama-1b]    (a CUDA device; prints tables, then JSON)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.report import print_json, print_table

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TILES = [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 16, 64, 4, 4), (64, 32, 64, 4, 4), (64, 64, 64, 4, 4),
         (64, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (16, 32, 64, 4, 4), (16, 64, 64, 4, 4),
         (32, 64, 64, 4, 4), (64, 64, 128, 4, 3), (128, 128, 128, 8, 3), (16, 64, 128, 4, 4)]
ROWS = [1, 16, 64, 256, 2048]


def tiled_linear(a: torch.Tensor, w: torch.Tensor, tile) -> torch.Tensor:
    from common.batch_invariant import _linear_kernel, triton

    bm, bn, bk, warps, stages = tile
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        a, w, w, out, m, n, a.stride(0), w.stride(0), out.stride(0), 0, K=k, SEGMENT=k, SEGMENTS=1, SPLIT=False,
        HAS_BIAS=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=False, num_warps=warps, num_stages=stages)
    return out


def weight_shapes(model: str) -> dict[str, tuple[int, int]]:
    from common.model_spec import model_config

    cfg = model_config(model)
    C, D, H, K, I = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    return {"qkv": ((H + 2 * K) * D, C), "o": (C, H * D), "up": (2 * I, C), "down": (C, I), "lm_head": (cfg.vocab_size, C)}


def main():
    import triton.testing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama-1b")
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16
    torch.cuda.set_device(device)
    shapes = weight_shapes(args.model)
    gen = torch.Generator(device=device).manual_seed(0)
    copy = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    read_bps = 2 * copy.numel() / (triton.testing.do_bench(copy.clone, return_mode="median") / 1e3)
    del copy

    same, timing = {}, {}
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype)
        rows = torch.randn(max(ROWS), k, generator=gen, device=device).to(dtype)
        ref = {m: tiled_linear(rows[:m], w, TILES[0]) for m in ROWS}
        for tile in TILES:
            key = "x".join(map(str, tile))
            outs = {m: tiled_linear(rows[:m], w, tile) for m in ROWS}
            # the same bits as the reference tile, and as its own first row alone, at every row count
            same[name, key] = all(torch.equal(outs[m], ref[m]) for m in ROWS) and all(
                torch.equal(outs[m][:1], outs[1]) for m in ROWS)
            for m in ROWS:
                timing[name, key, m] = triton.testing.do_bench(lambda: tiled_linear(rows[:m], w, tile), warmup=5,
                                                               rep=20, return_mode="median") * 1e3
        for m in ROWS:
            timing[name, "torch", m] = triton.testing.do_bench(lambda: F.linear(rows[:m], w), warmup=5, rep=20,
                                                               return_mode="median") * 1e3
        print(f"{name}: done", flush=True)

    keys = ["x".join(map(str, t)) for t in TILES]
    print_table(f"same bits as tile {keys[0]} at rows {ROWS} (BLOCK_M x BLOCK_N x BLOCK_K x warps x stages)",
                ["tile"] + list(shapes), [[key] + ["yes" if same[name, key] else "NO" for name in shapes] for key in keys])
    for name, (n, k) in shapes.items():
        floor = {m: 1e6 * 2 * (n * k + m * (n + k)) / read_bps for m in ROWS}
        print_table(f"{name} ({n} x {k}): µs per product; floor = bytes / {read_bps / 1e9:,.0f} GB/s",
                    ["tile"] + [f"M={m}" for m in ROWS],
                    [["floor"] + [f"{floor[m]:.1f}" for m in ROWS], ["torch"] + [f"{timing[name, 'torch', m]:.1f}" for m in ROWS]]
                    + [[key + ("" if same[name, key] else " (bits differ)")] + [f"{timing[name, key, m]:.1f}" for m in ROWS]
                       for key in keys])
    print_json({"bench": "matmul_tiles", "model": args.model, "read_gb_s": round(read_bps / 1e9, 1),
                "same_bits": {f"{name}/{key}": v for (name, key), v in same.items()},
                "us": {f"{name}/{key}/{m}": round(v, 2) for (name, key, m), v in timing.items()}})


if __name__ == "__main__":
    main()
