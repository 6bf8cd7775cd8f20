"""The hash chain that names a prompt's full KV blocks, without torch: the block manager finds
cached prefixes by it (common/kv_cache.py), and the router's prefix_affine policy guesses by it
which worker holds a prompt's prefix (router/prefix_affinity.py). Each block's hash covers its
tokens and, through the previous hash, every token before it; the fixed seed makes the same
tokens hash the same in every process."""

from __future__ import annotations

import hashlib
from array import array

PREFIX_HASH_SEED = hashlib.blake2b(b"pdserve/prefix-cache/v1", digest_size=16).digest()


def _digest(prev: bytes, tokens_int64) -> bytes:
    return hashlib.blake2b(prev + tokens_int64, digest_size=16).digest()


def block_hash(prev: bytes, token_ids) -> bytes:
    """The hash of a block of these tokens after the block hashed `prev`."""
    return _digest(prev, array("q", token_ids).tobytes())


def extend_chain(chain: list[bytes], token_ids: list[int], block_size: int, blocks: int) -> list[bytes]:
    """chain (the hashes of token_ids' first len(chain) blocks) continued, in place, to their first
    `blocks` blocks, which must be full: block_hash's, their tokens converted to int64 at once
    (block_hash a block at a time takes 1.5x as long)."""
    have = len(chain)
    if blocks > have:
        step = 8 * block_size
        raw = memoryview(array("q", token_ids[have * block_size:blocks * block_size])).cast("B")
        prev = chain[-1] if chain else PREFIX_HASH_SEED
        for offset in range(0, len(raw), step):
            prev = _digest(prev, raw[offset:offset + step])
            chain.append(prev)
    return chain


def prefix_hashes(token_ids: list[int], block_size: int, known: list[bytes] = ()) -> list[bytes]:
    """The chain of the full blocks a prefix cache can serve of these tokens: all but the last
    token, whose logits are needed to sample. known: the chain of a prefix of token_ids, already
    computed (it is continued, not hashed again)."""
    return extend_chain(list(known), token_ids, block_size, (len(token_ids) - 1) // block_size)
