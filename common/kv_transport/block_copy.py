"""Copying blocks from one KV pool into another's granted blocks (the one-sided transports, shm and
cuda_ipc: mapped.py), however fragmented the two lists of block ids are.

A pool is (layers, 2, blocks, block_size, kv_heads, head_dim), so a block of one layer's K or V
is one contiguous run of bytes, and a transfer is that run for every (block, layer, K or V).
- On a CPU, one strided copy per run of ids consecutive on both sides: torch runs it as memcpys,
  several times faster than its index ops.
- On one GPU, one Triton launch for the whole transfer (copy_kernel.py), a program per (block,
  layer's K or V, piece of the block), moving integer words: torch runs a strided copy an element at a time (a
  cuda_ipc transfer moved 117 GB/s on an H100 where a plain copy of the same bytes moved 1,059),
  and a fragmented grant would be a launch per run.
- Between two GPUs, a gather on the source and a scatter on the destination (torch's copies, which
  go through the host where the devices have no peer access).
"""

from __future__ import annotations

import logging
import threading

import torch

from common.config import upload
from common.errors import first_line

log = logging.getLogger(__name__)

GATHER_RUNS = 4  # between GPUs, blocks in more runs than this move by one gather and one scatter
CHUNK_BYTES = 8192  # a program's piece of a block (8 KiB: a llama-1b block of one layer's K is 16)
_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_FAILED: set[torch.device] = set()  # devices where the copy kernel failed to compile or copy at warm-up


def block_runs(src_blocks: list[int], dst_blocks: list[int]) -> list[tuple[int, int, int]]:
    """(source block, destination block, count) of each run of ids consecutive on both sides."""
    runs, i, n = [], 0, len(src_blocks)
    while i < n:
        j = i + 1
        while j < n and src_blocks[j] == src_blocks[j - 1] + 1 and dst_blocks[j] == dst_blocks[j - 1] + 1:
            j += 1
        runs.append((src_blocks[i], dst_blocks[i], j - i))
        i = j
    return runs


def words(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """src and dst viewed alike as the widest integers their rows divide into (8-byte words for
    bfloat16 rows of 64): a copy moves bits, and a strided one moves an element a step."""
    row = src.shape[-1] * src.element_size()
    for size in (8, 4, 2, 1):
        if size >= src.element_size() and row % size == 0:
            try:
                return src.view(_INTS[size]), dst.view(_INTS[size])
            except RuntimeError:  # an offset or stride the wider words do not divide
                continue
    return src, dst


def _triton() -> bool:
    """Whether Triton is there, asked only for CUDA pools: importing it costs a CPU worker 0.2 s."""
    from common.triton_support import available

    return available()


def _indexable(pool: torch.Tensor) -> bool:
    """Whether a pool's (layers, 2) are rows of one stride and each block is contiguous: what the
    kernel indexes (a pool and its layer slices are)."""
    block = pool[0, 0, 0]
    return pool.stride(0) == 2 * pool.stride(1) and block.is_contiguous() and pool.stride(2) == block.numel()


_IDS: dict[tuple, torch.Tensor] = {}  # recent transfers' block ids on their device, least recently used first
IDS_KEPT = 1024  # more than a step's streaming requests: a layer's pieces of every request come in turn
_IDS_LOCK = threading.Lock()  # the engine's thread, a copier thread and a new peer's warm-up all copy


def _ids_on(device: torch.device, src_blocks: list[int], dst_blocks: list[int]) -> torch.Tensor:
    """[src_blocks, dst_blocks] on the device, uploaded once per transfer: a streamed transfer
    copies the same blocks of every layer in turn (an upload costs some 60 us of host time on a
    GPU's host, 16 of them a llama-1b prefill), each layer's for every request of the step in
    turn: more are kept than a step streams (with 8 kept, a step of 9 uploaded every piece). Kept
    per stream: one is only ever read on the stream it was made on, so its memory goes back to the
    allocator in that stream's order."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (device, stream, tuple(src_blocks), tuple(dst_blocks))
    with _IDS_LOCK:
        ids = _IDS.pop(key, None)
        if ids is None:
            if len(_IDS) >= IDS_KEPT:
                del _IDS[next(iter(_IDS))]
            ids = upload(torch.tensor([src_blocks, dst_blocks], dtype=torch.int64), device)
        _IDS[key] = ids  # the most recently used last
    return ids


def launch_copy(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int],
                layers: slice = slice(None)) -> None:
    """copy_blocks in one Triton launch, whatever the runs (src and dst on one GPU, or in the tests
    Triton's interpreter)."""
    src, dst = words(src[layers], dst[layers])
    if not src_blocks or src.shape[0] == 0:
        return
    if not (_indexable(src) and _indexable(dst)):
        raise ValueError(f"pools of strides {src.stride()} and {dst.stride()}: a block copy needs contiguous blocks")
    from common.kv_transport.copy_kernel import _copy_blocks_kernel

    block_words = src[0, 0, 0].numel()
    chunk = max(1, min(block_words, CHUNK_BYTES // src.element_size()))
    chunk = 1 << (chunk.bit_length() - 1)  # Triton's ranges are powers of two
    ids = _ids_on(src.device, src_blocks, dst_blocks)
    _copy_blocks_kernel[(len(src_blocks), src.shape[0] * 2, -(-block_words // chunk))](
        src, dst, ids[0], ids[1], src.stride(1), dst.stride(1), BLOCK_WORDS=block_words, CHUNK=chunk)


def gather_scatter(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int],
                   layers: slice = slice(None)) -> None:
    """copy_blocks in two of torch's kernels over all its layers, whatever the runs: a gather on the
    source's device into one buffer of the blocks, and a scatter into the destination's."""
    src, dst = words(src, dst)
    picked = src[layers].index_select(2, torch.tensor(src_blocks, device=src.device))
    dst[layers].index_copy_(2, torch.tensor(dst_blocks, device=dst.device), picked.to(dst.device))


def copy_blocks(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int],
                layers: slice = slice(None)) -> None:
    """dst's blocks dst_blocks = src's blocks src_blocks, in these layers, no staging (see above)."""
    if src.is_cuda and src.device == dst.device and src.device not in _FAILED and _triton():
        return launch_copy(src, src_blocks, dst, dst_blocks, layers)
    runs = block_runs(src_blocks, dst_blocks)
    if src.is_cuda and len(runs) > GATHER_RUNS:
        return gather_scatter(src, src_blocks, dst, dst_blocks, layers)
    src, dst = words(src, dst)
    for s, d, n in runs:
        dst[layers, :, d:d + n].copy_(src[layers, :, s:s + n])


def warm_up(like: torch.Tensor) -> None:
    """Compile the copy kernel for pools like `like`, on its device, now (at pairing), not in the
    first transfer: one block of a scratch pool copied into another. If it fails, say so once;
    copies on that device then take torch's way."""
    if not (like.is_cuda and _triton()) or like.device in _FAILED:
        return
    try:
        with torch.cuda.device(like.device):
            scratch = torch.zeros(2, *like.shape[1:2], 2, *like.shape[3:], dtype=like.dtype, device=like.device)
            scratch[:, :, 0].fill_(1)
            launch_copy(scratch, [0], scratch, [1])
            if not torch.equal(scratch[:, :, 1], scratch[:, :, 0]):
                raise RuntimeError("the copied block differs from its source")
    except Exception as e:  # Triton's compile errors are not RuntimeErrors
        _FAILED.add(like.device)
        log.warning("KV block copies on %s take torch's copies: the Triton copy kernel failed (%s)", like.device,
                    first_line(e))
