"""The hash chain that names a prompt's full KV blocks, without torch: the block manager finds
cached prefixes by it (common/kv_cache.py), and the router's prefix_affine policy guesses by it
which worker holds a prompt's prefix (router/prefix_affinity.py). Each block's hash covers its
tokens and, through the previous hash, every token before it; the fixed seed makes the same
tokens hash the same in every process."""

from __future__ import annotations

import hashlib
from array import array

PREFIX_HASH_SEED = hashlib.blake2b(b"pdserve/prefix-cache/v1", digest_size=16).digest()


def block_hash(prev: bytes, token_ids) -> bytes:
    return hashlib.blake2b(prev + array("q", token_ids).tobytes(), digest_size=16).digest()


def prefix_hashes(token_ids: list[int], block_size: int, known: list[bytes] = ()) -> list[bytes]:
    """The chain of the full blocks a prefix cache can serve of these tokens: all but the last
    token, whose logits are needed to sample. known: the chain of a prefix of token_ids, already
    computed (it is continued, not hashed again)."""
    out = list(known)
    prev = out[-1] if out else PREFIX_HASH_SEED
    for i in range(len(out), (len(token_ids) - 1) // block_size):
        prev = block_hash(prev, token_ids[i * block_size:(i + 1) * block_size])
        out.append(prev)
    return out
