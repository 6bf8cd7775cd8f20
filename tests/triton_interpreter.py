"""Triton's interpreter, patched once per launch instead of once per call of a jitted function.

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


def patch_once_per_launch() -> bool:
    """Install the skip; False where this Triton's interpreter is not the one it was written for
    (3.3 to 3.9: GridExecutor.__call__ and InterpretedFunction.__call__ patching through _patch_lang)."""
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if not (3, 3) <= version < (3, 10):  # a later one may undo a device call's patches, which this skips
        return False
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
