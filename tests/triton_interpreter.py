"""Triton's interpreter, patched once per launch instead of once per call of a jitted function,
and patched to compute in bfloat16 as a GPU does (bfloat16_as_a_gpu_does, below).

The interpreter swaps triton.language's builtins for numpy versions when a kernel is launched, and
again whenever the kernel calls a jitted function: tl.zeros, tl.sum and tl.max are such functions
(the standard library's), and so are ours that kernels call (finished, _dot_segment). Each swap
walks the language's modules, some 2 ms, and a kernel makes one per row it reduces: the CPU suite
spent more time swapping than computing in its interpreted whole-model tests. The swaps of one
launch are all alike (the modules patched are the ones the functions' globals hold, and a device
call's swaps are never undone before the launch ends), so a device call skips the modules this
launch has already patched. Kernels compute what they did; only the swaps are skipped.
"""

from __future__ import annotations

import functools
import inspect


def _interpreter():
    """(triton.language, Triton's interpreter module) where this Triton's interpreter is one these
    patches were written for (3.3 to 3.9: a later one may undo a device call's patches, which
    patch_once_per_launch skips), else None."""
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return None
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    return (tl, interpreter) if (3, 3) <= version < (3, 10) else None


def patch_once_per_launch() -> bool:
    """Install the skip; False where this Triton's interpreter is not the one it was written for
    (GridExecutor.__call__ and InterpretedFunction.__call__ patching through _patch_lang)."""
    if (found := _interpreter()) is None:
        return False
    tl, interpreter = found
    run, call = getattr(interpreter, "GridExecutor", None), getattr(interpreter, "InterpretedFunction", None)
    if run is None or call is None or not hasattr(interpreter, "_patch_lang") or not hasattr(call, "rewrite"):
        return False
    patched: set[frozenset] = set()  # the module sets this launch's device calls have patched

    def modules(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    launch = run.__call__

    @functools.wraps(launch)
    def launch_anew(self, *args, **kwargs):
        patched.clear()
        patched.add(modules(self.fn))  # GridExecutor patches these itself
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    def device_call(self, *args, **kwargs):
        key = modules(self.fn)
        if key not in patched:
            interpreter._patch_lang(self.fn)
            patched.add(key)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    run.__call__ = launch_anew
    call.__call__ = device_call
    return True


def bfloat16_as_a_gpu_does() -> bool:
    """Triton 3.9's interpreter runs tl.dot over bfloat16 operands as numpy's matmul of their raw
    16-bit patterns (1e10 off), and casts float32 to bfloat16 by cutting the low bits, where a GPU
    and torch round to the nearest even: no bfloat16 kernel could be checked on CPU. Widen the
    operands to float32 first (exactly: a GPU's products accumulate in float32), and round as torch
    does. False where this Triton's interpreter is not the one it was written for."""
    if (found := _interpreter()) is None:
        return False
    import numpy as np
    import torch

    tl, interpreter = found
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if not all(hasattr(builder, f) for f in ("create_dot", "cast_impl")):
        return False
    dot, cast = builder.create_dot, builder.cast_impl

    def widened(x):
        if x.dtype.scalar != tl.bfloat16:
            return x.data.astype(np.float32)
        return (x.data.astype(np.uint32) << 16).view(np.float32)  # a bfloat16 is a float32's upper half

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        return interpreter.TensorHandle(np.matmul(widened(a), widened(b), dtype=d.data.dtype) + d.data, d.dtype.scalar)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast(self, src, dst_type)
        rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
        return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl
    return True
