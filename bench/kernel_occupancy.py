"""What each compiled variant of pdserve's Triton kernels holds on the device: warps, registers a
thread, bytes spilled, shared memory, and so how many of its programs one SM runs at once.

A latency-bound kernel (a decode's attention, a norm of a few rows) is as fast as the loads it has
in flight, which is its programs per SM: registers and shared memory set that. The CPU machine
can only compile for sm_90 with the ptxas of its own Triton (tests/triton_aot.py); the GPU
machine's Triton may allocate otherwise, so `bench step-profile` prints this table there, for the
variants its steps compiled (Triton fills a kernel's counts when it loads it on the device).
"""

from __future__ import annotations

import math

KERNEL_MODULES = ("common.attention.triton_paged", "common.batch_invariant", "common.linear_partials",
                  "common.kv_transport.copy_kernel")
MAX_PROGRAMS = 32  # resident blocks an SM takes at most (sm_80 and later)
REGISTERS_PER_SM = 65536  # every NVIDIA GPU since sm_50 (torch's device properties do not say)


def programs_per_sm(warps: int, registers: int, shared: int, sm) -> int:
    """How many programs of this shape one SM holds at once: registers are given out per warp in
    units of 256, shared memory per program, threads up to the SM's maximum. sm: the device's
    properties (torch.cuda.get_device_properties, or any object with the same fields)."""
    per_warp = math.ceil(registers * 32 / 256) * 256 if registers else 0
    by_registers = getattr(sm, "regs_per_multiprocessor", REGISTERS_PER_SM) // (warps * per_warp) if per_warp \
        else MAX_PROGRAMS
    by_shared = sm.shared_memory_per_multiprocessor // shared if shared else MAX_PROGRAMS
    by_threads = sm.max_threads_per_multi_processor // (32 * warps)
    return min(by_registers, by_shared, by_threads, MAX_PROGRAMS)


def _constants(kernel, fn) -> str:
    """The variant's constexprs that name it (block shapes, segments), as `NAME=value`."""
    constants = getattr(getattr(kernel, "src", None), "constants", None) or {}
    names = []
    for key, value in constants.items():
        name = fn.arg_names[key[0]] if isinstance(key, tuple) and key else str(key)
        value = getattr(value, "value", value)  # (a tl.constexpr, in some Triton versions)
        if name.isupper() and isinstance(value, (int, bool)) and not isinstance(value, type):
            names.append(f"{name}={int(value)}")
    return " ".join(names)


def compiled_kernels(sm, modules=KERNEL_MODULES) -> list[dict]:
    """Every variant of the Triton kernels in `modules` compiled in this process, on any device,
    with its counts; those the device has not loaded yet (no registers known) are left out."""
    import importlib

    rows = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name, fn in sorted(vars(module).items()):
            caches = getattr(fn, "device_caches", None)
            if not caches or not hasattr(fn, "arg_names"):
                continue
            for cache in caches.values():  # (kernel cache, ...) per device in Triton 3.x
                for kernel in cache[0].values() if isinstance(cache, tuple) and isinstance(cache[0], dict) else ():
                    registers = getattr(kernel, "n_regs", None)
                    if not registers:
                        continue
                    warps, shared = kernel.metadata.num_warps, kernel.metadata.shared
                    rows.append({"kernel": name, "variant": _constants(kernel, fn), "warps": warps,
                                 "registers": registers, "spilled_bytes": getattr(kernel, "n_spills", 0) or 0,
                                 "shared_bytes": shared,
                                 "programs_per_sm": programs_per_sm(warps, registers, shared, sm)})
    return rows
