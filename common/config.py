"""The engine's configuration (EngineConfig) and the devices and dtypes it accepts. It checks its
invariants in __post_init__ so that a bad value fails when the engine starts, with a message naming
the value and what is allowed. A model's own shape is common/model_spec.py's ModelConfig."""

from __future__ import annotations

import re
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING

from common.errors import InvalidArgument
from common.protocol import ATTENTION_BACKENDS, KV_TRANSPORTS
from common.speculative import SpeculativeConfig

if TYPE_CHECKING:
    import torch

# torch is imported where a config is built to run (a launcher checks its workers' flags without
# it: importing it is 2.4 s of a 2-core machine's CPU, more than a small cluster takes to start)
DTYPE_NAMES = ("bfloat16", "float16", "float32")
KV_TRANSPORT_DEVICE = {"shm": "cpu", "cuda_ipc": "cuda", "nccl": "cuda"}  # the others work with any pool


def default_dtype(device_type: str) -> str:
    """float32 on a CPU, bfloat16 on a GPU."""
    return "float32" if device_type == "cpu" else "bfloat16"


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of one of DTYPE_NAMES (KeyError for another)."""
    import torch

    if name not in DTYPE_NAMES:
        raise KeyError(name)
    return getattr(torch, name)


def device_type(device: str | int | torch.device) -> str:
    """'cpu' or 'cuda', of a device as resolve_device takes it, without asking whether this host has
    it (nor importing torch)."""
    if (isinstance(device, int) and not isinstance(device, bool) and device >= 0) or \
            (isinstance(device, str) and device.isdigit()):
        return "cuda"
    text = device if isinstance(device, str) else str(getattr(device, "type", ""))  # a torch.device's
    found = re.fullmatch(r"([a-z_]+)(:\d{1,9})?", text)
    if found is None:
        raise InvalidArgument(f"device={device!r} is not a device; allowed: 'cpu', 'cuda:N', N")
    if found[1] not in ("cpu", "cuda"):
        raise InvalidArgument(f"device={device!r} is not supported; allowed: 'cpu', 'cuda:N'")
    return found[1]


def resolve_device(device: str | int | torch.device) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or a bare CUDA index, one this host has."""
    import torch

    if device_type(device) == "cuda" and str(device).isdigit():
        device = f"cuda:{int(device)}"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgument(f"device={device!r} asks for CUDA but no CUDA device is available")
        index = dev.index or 0
        if index >= torch.cuda.device_count():
            raise InvalidArgument(f"device={device!r}: only {torch.cuda.device_count()} CUDA devices")
        dev = torch.device("cuda", index)
    return dev


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to the device without making the host wait: on CUDA through pinned
    memory, asynchronously (a copy from pageable memory first waits for the stream's queued work)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass
class EngineConfig:
    """What one engine (one process's model replica and KV pool) is built with."""

    model: str = "dummy:nanogpt"
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPU
    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_cache_gb, capped at what max_num_seqs can use
    kv_cache_gb: float | None = None  # None: 1 GiB on CPU, from gpu_memory_utilization on GPU
    gpu_memory_utilization: float | None = None  # of a GPU's total memory, all included (common/memory.py); None: 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs of the decode step (vLLM's name): every step launched from Python
    # schedule and launch step N while N - 1 runs (common/engine.py); None: on CUDA (a batch-64 step of
    # llama-1b on an H100 1.27x faster), off on a CPU (whose ops run before they return: it only delays tokens)
    async_scheduling: bool | None = None
    # kernels whose rounding does not depend on the batch (common/batch_invariant.py); None: on CUDA,
    # off on a CPU (where it costs 1.6-2.5x a decode step, 2x or more a prefill: common/attention/tiled.py)
    batch_invariant: bool | None = None
    kv_transport: str = "auto"  # how KV crosses between workers; auto: the fastest both ends support
    kv_shared: bool = False  # the KV pool in a named shared-memory segment (CPU): what shm writes into
    # n-gram speculative decoding, vLLM's speculative_config (a dict or its JSON; common/speculative.py)
    speculative_config: str | dict | None = None
    # False: a check only, without torch, of a device this host need not have (a launcher's of its workers' flags)
    device_present: InitVar[bool] = True
    speculative: SpeculativeConfig | None = field(init=False)
    torch_dtype: torch.dtype = field(init=False)  # these two unless device_present=False (a check only)
    torch_device: torch.device = field(init=False)

    def __post_init__(self, device_present: bool):
        kind = device_type(self.device)
        if self.dtype is None:
            self.dtype = default_dtype(kind)
        self.speculative = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative is not None and self.async_scheduling:
            raise InvalidArgument("async_scheduling=True with speculative_config: a draft is looked up from the "
                                  "newest token, which async scheduling has not read yet; allowed: one of them")
        if self.async_scheduling is None:
            self.async_scheduling = kind == "cuda" and self.speculative is None
        if self.dtype not in DTYPE_NAMES:
            raise InvalidArgument(f"dtype={self.dtype!r} is not supported; allowed: {list(DTYPE_NAMES)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidArgument(f"block_size={self.block_size} must be a power of two >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidArgument(f"num_blocks={self.num_blocks} must be >= 1")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise InvalidArgument(f"kv_cache_gb={self.kv_cache_gb} must be > 0")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidArgument(f"gpu_memory_utilization={self.gpu_memory_utilization}; allowed: a fraction in "
                                  "(0, 1] of the GPU's total memory (a CPU pool ignores it: see kv_cache_gb)")
        if self.max_num_seqs < 1:
            raise InvalidArgument(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidArgument(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs} so that every running request can decode each step")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidArgument(f"max_model_len={self.max_model_len} must be >= 2")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidArgument(f"attention_backend={self.attention_backend!r} is not supported; "
                                  f"allowed: {list(ATTENTION_BACKENDS)}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise InvalidArgument(f"kv_transport={self.kv_transport!r} is not supported; "
                                  f"allowed: {list(KV_TRANSPORTS)}")
        if KV_TRANSPORT_DEVICE.get(self.kv_transport, kind) != kind:
            allowed = [t for t in KV_TRANSPORTS if KV_TRANSPORT_DEVICE.get(t, kind) == kind]
            raise InvalidArgument(f"kv_transport={self.kv_transport!r} does not work with device={self.device!r}; "
                                  f"allowed there: {allowed}")
        if self.kv_shared and kind != "cpu":
            raise InvalidArgument(f"kv_shared=True needs device='cpu', got device={self.device!r} "
                                  "(a CUDA pool is shared by CUDA IPC instead)")
        if device_present:  # what the engine runs with: torch's, on a device this host has
            self.torch_device = resolve_device(self.device)
            self.torch_dtype = dtype_of(self.dtype)
