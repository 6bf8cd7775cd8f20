"""The KV block-copy kernel (block_copy.py), in a module of its own: importing Triton costs a
process 0.2 s, which only a GPU worker's copies need."""

from __future__ import annotations

from common.triton_support import jit, tl


# (the row strides stay specialized: a pool pair's never change, and their alignment lets a program
# move 16-byte vectors)
@jit(do_not_specialize_on_alignment=["SrcBlocks", "DstBlocks"])
def _copy_blocks_kernel(Src, Dst, SrcBlocks, DstBlocks, src_row, dst_row, BLOCK_WORDS: tl.constexpr,
                        CHUNK: tl.constexpr):
    """Program (b, r, c): piece c of block SrcBlocks[b] of row r (a layer's K or V) into block
    DstBlocks[b] of the same row of Dst."""
    b = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    i = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    ok = i < BLOCK_WORDS
    s = tl.load(SrcBlocks + b)
    d = tl.load(DstBlocks + b)
    tl.store(Dst + r * dst_row + d * BLOCK_WORDS + i, tl.load(Src + r * src_row + s * BLOCK_WORDS + i, mask=ok),
             mask=ok)
