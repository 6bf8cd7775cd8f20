"""Compile every Triton kernel variant pdserve launches for an H100 (sm_90), with no GPU (the paged
attention, the KV store and rotary kernel, and the batch-invariant matmul, norms and SiLU product at
llama-1b's shapes, each reading a matmul's partials where it can, and the KV block copy): Triton's
ahead-of-time path lowers a kernel to PTX and runs its bundled ptxas for a named target. A kernel
that would not compile on the GPU machine fails here first.

It also reads the paged attention's split kernel back from its sm_90 binary, compiled with the
alignment the JIT specializes a real launch on: the width of each of its global loads. Its K/V
gathers must be 16-byte cp.async copies. On 2026-11-28 a rewrite of how their offsets were built
left Triton 3.9 (this machine's) vectorizing them and made Triton 3.6 (the GPU machine's) gather 2
bytes a load, and the attention ran 4-7x slower on an H200; only a GPU run showed it. To check
another Triton, put it first on PYTHONPATH.

Run as `python -m tests.triton_aot` without TRITON_INTERPRET (the interpreter replaces Triton's
own library functions, which compiling needs); prints one JSON line of what compiled, and the
split kernel's loads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

# (query heads, KV heads, head size): nanogpt, llama-tiny, llama-1b and SmolLM2-135M.
SHAPES = [(4, 4, 16), (4, 2, 32), (32, 8, 64), (9, 3, 64)]
DTYPES = {"bf16": False, "fp32": True}  # fp32 takes IEEE dots, not TF32 (fp16 compiles as bf16 does)
# llama-1b's qkv (narrow tiles), up (wide tiles) and down (a longer K); o and the head share their configurations
LLAMA_1B_MATMULS = [(3072, 2048), (16384, 2048), (2048, 8192)]
NORMS = [(2048, True), (2048, False), (64, True)]  # (size, RMS): the hidden size (GPT-2: LayerNorm), a head (q/k norm)


def variants(dt: str):
    """bf16 (the GPU default): every shape; fp32 (its IEEE dots): one of each kernel."""
    if dt == "bf16":
        return SHAPES, LLAMA_1B_MATMULS, NORMS
    return SHAPES[2:3], LLAMA_1B_MATMULS[:1], NORMS[:1]


def split_types(dt: str) -> dict[str, str]:
    """The paged attention's split kernel's typed arguments, K/V and queries in dt (its ints: i32)."""
    return {"Q": f"*{dt}", "KCache": f"*{dt}", "VCache": f"*{dt}", "Tables": "*i64", "TileSeq": "*i64",
            "TileStart": "*i64", "TileLen": "*i64", "TilePos": "*i64", "SplitBase": "*i64", "OutPart": "*fp32",
            "LsePart": "*fp32", "scale": "fp32"}


# the pointers of the kernels a layer's matmul partials pass through: all in the model's dtype but the
# one holding float32 partials (common/linear_partials.py) where it does, and their other typed arguments
_POINTERS = {"linear": (("A", "W", "Bias", "C"), "C", {}),
             "norm": (("X", "Weight", "Bias", "Y", "Delta", "DeltaBias", "Sum"), "Delta", {"eps": "fp32"}),
             "rope_store": (("QKV", "Bias", "Cos", "Sin", "Q", "KCache", "VCache"), "QKV", {"Slots": "*i64"}),
             "silu_mul": (("H", "Bias", "Out"), "H", {}),
             "sum_segments": (("Parts", "Bias", "C"), "Parts", {})}


def partial_types(kernel: str, dt: str, partials: bool) -> dict[str, str]:
    """One of those kernels' typed arguments (its ints: i32), with or without float32 partials."""
    names, fp32, others = _POINTERS[kernel]
    return {n: f"*{dt}" for n in names} | ({fp32: "*fp32"} if partials else {}) | others


def _signature(fn, types: dict, constexprs: dict) -> dict[str, str]:
    return {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}


_JOBS: list = []  # (kernel, signature, constexprs, options) of each variant, for the compiling processes


def _compile(i: int) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, sig, constexprs, arch, options = _JOBS[i]
    triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", arch, 32), options=options)


def compile_all(arch: int = 90) -> list[str]:
    """Every variant, compiled by as many processes as there are cores (forked: they inherit the list)."""
    import multiprocessing

    from common import batch_invariant as bi
    from common import linear_partials as lp
    from common.kv_transport import copy_kernel as ck
    from common.attention import triton_paged as tp
    from common.triton_support import pow2

    def build(fn, types: dict, constexprs: dict, **options):
        _JOBS.append((fn, _signature(fn, types, constexprs), constexprs, arch, options))

    done = []
    for dt, ieee in DTYPES.items():
        shapes, matmuls, norms = variants(dt)
        for heads, kv_heads, head_dim in shapes:
            group = heads // kv_heads
            block_d = max(16, pow2(head_dim))
            tiles = {(tp.MIN_ROWS, str(tp.SPLIT_LAUNCH)): tp.SPLIT_LAUNCH,
                     (tp.PREFILL_ROWS, str(tp.PREFILL_LAUNCH)): tp.PREFILL_LAUNCH}
            if (dt, heads) == ("bf16", 32):  # llama-1b's prefill tiles and decode launches `auto` tries at start
                for tile in tp.PREFILL_CANDIDATES:  # (triton_choice; elsewhere one that fails is passed over, and said)
                    rows, launch = tp.prefill_shape(tile)
                    tiles[(rows, str(launch))] = launch
                for launch in tp.DECODE_LAUNCHES:
                    tiles[(tp.MIN_ROWS, str(launch))] = launch
            for (rows, _), launch in tiles.items():
                block_q, block_m = tp.tile_shape(group, rows)
                for one_split in (True, False):  # a lane a split, or lanes that loop over their splits
                    build(tp._split_kernel, split_types(dt),
                          dict(GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_D=block_d,
                               PAGE=16, TILE=tp.BLOCK_N, SPLIT_KEYS=tp.SPLIT, IEEE=ieee, ONE_SPLIT=one_split),
                          **launch)
            build(tp._merge_kernel, {"OutPart": "*fp32", "LsePart": "*fp32", "Positions": "*i64", "SplitBase": "*i64",
                                     "Out": f"*{dt}"},
                  dict(HEADS=heads, BLOCK_H=pow2(heads), HEAD_DIM=head_dim, BLOCK_D=block_d, SPLIT_KEYS=tp.SPLIT))
            build(tp._store_kv_kernel, {"K": f"*{dt}", "V": f"*{dt}", "KCache": f"*{dt}", "VCache": f"*{dt}",
                                        "Slots": "*i64"}, dict(ROW=kv_heads * head_dim, BLOCK=pow2(kv_heads * head_dim)))
            for segments in (0, 2):  # the qkv product itself, or its partials (llama-1b's decode)
                build(tp._rope_store_kernel, partial_types("rope_store", dt, segments > 0),
                      dict(HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=pow2(max(heads, kv_heads)),
                           BLOCK_F=pow2(head_dim // 2), SEGMENTS=segments, HAS_BIAS=bool(segments)),
                      enable_fp_fusion=False)
            done.append(f"{dt}/h{heads}/kv{kv_heads}/d{head_dim}")
        for n, k in matmuls:
            count, length = bi.segments(n, k)
            for m in (1, bi.SPLIT_ROWS, 4096):  # each row count's tile, split into segments where they are
                bm, bn, bk, warps, stages = bi.tile_config(m, n, count)
                split = count > 1 and m <= bi.SPLIT_ROWS
                build(bi._linear_kernel, partial_types("linear", dt, split),
                      dict(K=k, SEGMENT=length, SEGMENTS=count, SPLIT=split, HAS_BIAS=n == 3072, BLOCK_M=bm,
                           BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee), num_warps=warps, num_stages=stages)  # Qwen2's qkv bias
            if count > 1:
                build(lp._sum_segments, partial_types("sum_segments", dt, True),
                      dict(SEGMENTS=count, HAS_BIAS=n == 3072, BLOCK=lp.SUM_BLOCK))
            done.append(f"{dt}/linear/{n}x{k}")
        for segments in (0, 2):  # SiLU times the gate of the up product, or of its partials
            build(bi._silu_mul_kernel, partial_types("silu_mul", dt, segments > 0),
                  dict(SEGMENTS=segments, HAS_BIAS=False, BLOCK=bi.GLU_BLOCK))
        done.append(f"{dt}/silu_mul")
        for c, rms in norms:
            for residual, segments in ((False, 0), (True, 0), (True, 2)):  # the residual's delta may be partials
                build(bi._norm_kernel, partial_types("norm", dt, segments > 0),
                      dict(C=c, BLOCK=pow2(c), RMS=rms, HAS_BIAS=not rms, RESIDUAL=residual, SEGMENTS=segments,
                           DELTA_BIAS=not rms))
            done.append(f"{dt}/{'rms' if rms else 'layer'}_norm/{c}")
    for word in ("i64", "i16"):  # block copies between pools: llama-1b's rows as 8-byte words, odd rows as 2
        build(ck._copy_blocks_kernel, {"Src": f"*{word}", "Dst": f"*{word}", "SrcBlocks": "*i64", "DstBlocks": "*i64"},
              dict(BLOCK_WORDS=2048, CHUNK=1024))
        done.append(f"copy_blocks/{word}")
    with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1) as pool:
        pool.map(_compile, range(len(_JOBS)), chunksize=1)  # a failure raises here, naming its kernel
    return done


# a global access's SASS and its bytes: LDG.E.64 (an int64 table entry), LDGSTS.E.BYPASS.128 (cp.async of 16)
_ACCESS = re.compile(r"\b(LDG|LDGSTS|STG)\.E((?:\.[A-Z0-9]+)*)")
_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def access_widths(cubin: bytes) -> dict[str, dict[int, int]]:
    """{"load"/"store": {bytes an access: how many such global accesses}} in a compiled kernel's
    SASS (the cuobjdump that Triton's NVIDIA backend bundles)."""
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    widths: dict[str, dict[int, int]] = {"load": {}, "store": {}}
    for op, suffixes in _ACCESS.findall(sass):
        size = next((_WIDTH[s] for s in suffixes.split(".") if s in _WIDTH), 4)
        kind = widths["store" if op == "STG" else "load"]
        kind[size] = kind.get(size, 0) + 1
    return widths


def load_widths(cubin: bytes) -> dict[int, int]:
    return access_widths(cubin)["load"]


def jit_compiled(fn, types: dict, constexprs: dict, aligned_ints: tuple = (), arch: int = 90, **options):
    """fn compiled as the JIT compiles a real launch: pointers 16-byte aligned, and the strides and
    the integers named in aligned_ints multiples of 16 (llama-1b's all are), but for the arguments
    the kernel excludes from that."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    loose = set(fn.do_not_specialize) | set(fn.do_not_specialize_on_alignment)
    loose = {fn.arg_names[i] if isinstance(i, int) else i for i in loose}
    sig = _signature(fn, types, constexprs)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n not in constexprs
               and n not in loose and (sig[n].startswith("*") or n.startswith("stride") or n in aligned_ints)}
    return triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=aligned), target=GPUTarget("cuda", arch, 32),
                          options=options)


def split_kernel_loads(arch: int = 90) -> dict[str, dict[int, int]]:
    """{tile: load_widths} of llama-1b's split kernel in bf16, for a decode's tile and each prefill
    tile `auto` may choose, a lane a split and looping, compiled as the JIT compiles a real launch."""
    from common.attention import triton_paged as tp

    out = {}
    for tile in [(tp.MIN_ROWS, 0), *tp.PREFILL_CANDIDATES]:
        rows, launch = tp.prefill_shape(tile)
        block_q, block_m = tp.tile_shape(4, rows)
        for one_split in (True, False):
            constexprs = dict(GROUP=4, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=64, BLOCK_D=64, PAGE=16,
                              TILE=tp.BLOCK_N, SPLIT_KEYS=tp.SPLIT, IEEE=False, ONE_SPLIT=one_split)
            kernel = jit_compiled(tp._split_kernel, split_types("bf16"), constexprs, arch=arch, **launch)
            out[tp.tile_name(tile) + ("" if one_split else ", looping")] = load_widths(kernel.asm["cubin"])
    return out


def partials_accesses(arch: int = 90) -> dict[str, dict[str, dict[int, int]]]:
    """{kernel: access_widths} of a llama-1b decode step's split matmul, which writes its K
    segments' float32 partials, and of each kernel that reads them (common/linear_partials.py), in
    bf16 as the JIT compiles them. The partials' segment stride is a multiple of 16 floats
    (empty_partials), so these should move 16 bytes an access; 4 is what an unknown stride gives."""
    from common import batch_invariant as bi
    from common import linear_partials as lp
    from common.attention import triton_paged as tp

    dt, out = "bf16", {}
    for n, k in LLAMA_1B_MATMULS[::2]:  # qkv (4 segments) and down (8)
        count, length = bi.segments(n, k)
        bm, bn, bk, warps, stages = bi.tile_config(1, n, count)
        kernel = jit_compiled(bi._linear_kernel, partial_types("linear", dt, True),
                              dict(K=k, SEGMENT=length, SEGMENTS=count, SPLIT=True, HAS_BIAS=False, BLOCK_M=bm,
                                   BLOCK_N=bn, BLOCK_K=bk, IEEE=False), ("N",), arch, num_warps=warps,
                              num_stages=stages)
        out[f"linear {n}x{k}, {count} segments"] = access_widths(kernel.asm["cubin"])
    norm = jit_compiled(bi._norm_kernel, partial_types("norm", dt, True),
                        dict(C=2048, BLOCK=2048, RMS=True, HAS_BIAS=False, RESIDUAL=True, SEGMENTS=8,
                             DELTA_BIAS=False), arch=arch)
    rope = jit_compiled(tp._rope_store_kernel, partial_types("rope_store", dt, True),
                        dict(HEADS=32, KV_HEADS=8, HEAD_DIM=64, BLOCK_H=32, BLOCK_F=32, SEGMENTS=4, HAS_BIAS=False),
                        arch=arch, enable_fp_fusion=False)
    silu = jit_compiled(bi._silu_mul_kernel, partial_types("silu_mul", dt, True),
                        dict(SEGMENTS=4, HAS_BIAS=False, BLOCK=bi.GLU_BLOCK), ("I",), arch)
    total = jit_compiled(lp._sum_segments, partial_types("sum_segments", dt, True),
                         dict(SEGMENTS=4, HAS_BIAS=False, BLOCK=lp.SUM_BLOCK), ("size", "N"), arch)
    for name, kernel in (("norm", norm), ("rope_store", rope), ("silu_mul", silu), ("sum_segments", total)):
        out[name] = access_widths(kernel.asm["cubin"])
    return out


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter cannot compile")
    print(json.dumps({"arch": "sm_90", "compiled": compile_all(), "split_kernel_loads": split_kernel_loads(),
                      "partials_accesses": partials_accesses()}))
