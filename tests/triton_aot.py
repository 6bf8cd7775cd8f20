"""Compile every Triton kernel variant pdserve launches for an H100 (sm_90), with no GPU: Triton's
ahead-of-time path lowers a kernel to PTX and runs its bundled ptxas for a named target. A kernel
that would not compile on the GPU machine fails here first.

Run as `python -m tests.triton_aot` without TRITON_INTERPRET (the interpreter replaces Triton's
own library functions, which compiling needs); prints one JSON line of what compiled.
"""

from __future__ import annotations

import json
import os
import sys

# (query heads, KV heads, head size): nanogpt, llama-tiny, llama-1b and SmolLM2-135M.
SHAPES = [(4, 4, 16), (4, 2, 32), (32, 8, 64), (9, 3, 64)]
DTYPES = {"bf16": False, "fp16": False, "fp32": True}  # fp32 takes IEEE dots, not TF32


def compile_all(arch: int = 90) -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from common.attention import triton_paged as tp

    def build(fn, types: dict, constexprs: dict):
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
        triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", arch, 32))

    done = []
    for dt, ieee in DTYPES.items():
        for heads, kv_heads, head_dim in SHAPES:
            group = heads // kv_heads
            block_q, block_m = tp.tile_shape(group)
            block_d = max(16, tp._pow2(head_dim))
            build(tp._split_kernel,
                  {"Q": f"*{dt}", "KCache": f"*{dt}", "VCache": f"*{dt}", "Tables": "*i64", "TileSeq": "*i64",
                   "TileStart": "*i64", "TileLen": "*i64", "TilePos": "*i64", "SplitBase": "*i64", "OutPart": "*fp32", "LsePart": "*fp32",
                   "scale": "fp32"},
                  dict(GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=16,
                       TILE=tp.BLOCK_N, SPLIT_KEYS=tp.SPLIT, MAX_SPLITS=32, LANES=tp.LANES, IEEE=ieee))
            build(tp._merge_kernel, {"OutPart": "*fp32", "LsePart": "*fp32", "Positions": "*i64", "SplitBase": "*i64",
                                     "Out": f"*{dt}"},
                  dict(HEADS=heads, BLOCK_H=tp._pow2(heads), HEAD_DIM=head_dim, BLOCK_D=block_d, SPLIT_KEYS=tp.SPLIT,
                       MAX_SPLITS=8))
            build(tp._store_kv_kernel, {"K": f"*{dt}", "V": f"*{dt}", "KCache": f"*{dt}", "VCache": f"*{dt}",
                                        "Slots": "*i64"}, dict(ROW=kv_heads * head_dim, BLOCK=tp._pow2(kv_heads * head_dim)))
            done.append(f"{dt}/h{heads}/kv{kv_heads}/d{head_dim}")
    return done


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter cannot compile")
    print(json.dumps({"arch": "sm_90", "compiled": compile_all()}))
