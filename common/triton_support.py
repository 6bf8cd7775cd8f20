"""Triton, where it is installed, and what every kernel module of ours needs from it: the jit that
keeps step-to-step arguments from compiling new variants, and whether the kernels run interpreted.

Triton is an optional dependency: without it the modules that define kernels still import (their
kernels are plain functions then, never launched), and `auto` keeps torch's ops and SDPA.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def jit(fn=None, **options):
    """triton.jit (bare, or with options), or the plain function where triton is missing.

    Triton compiles a variant of a kernel for each pattern of its integer arguments (1, a multiple
    of 16, other) and pointer alignments it meets. Arguments that vary from step to step (a row
    count, a table's width, views into a step's packed metadata) are named in the options, so a
    server does not compile new variants mid-stream, between the steps of its first requests."""
    if triton is None:
        return fn if fn is not None else (lambda f: f)
    return triton.jit(fn, **options) if fn is not None else triton.jit(**options)


def available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """Triton's interpreter runs kernels on CPU tensors, and only when TRITON_INTERPRET=1 was set
    before triton was imported (the CPU tests set it in conftest)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pow2(n: int) -> int:
    """The least power of two >= n (a block's side: Triton's ranges are powers of two)."""
    return 1 << max(0, (n - 1).bit_length())
