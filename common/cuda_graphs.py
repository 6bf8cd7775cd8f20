"""CUDA graphs of the decode step: one launch replays a whole forward.

An eager decode step of a 1B model launches some 540 kernels from Python and spends most of its
time doing so (../shared/GPU.md: 3.9 ms of GPU work in a 55 ms step). At start, the forward and
the output projection are captured for a ladder of batch sizes (nano-vllm's: 1, 2, 4, 8, then
every 16 up to max_num_seqs) over static input buffers: token ids, positions, KV slots, block
tables and context lengths. A decode batch is copied into them, padded to the next captured size
with rows that write nowhere (slot -1, which the Triton attention skips) and read one key, and
the graph is replayed; the real rows' logits are returned. The graphs share one memory pool,
captured largest first.

Sampling is captured too, apart from the forward: for each size, one small graph per sampling
mode (greedy, plain, filtered: common/sampling.py) over the forward graph's logits and static
parameter buffers, so a sampled step launches two graphs where it launched some 40 kernels. A
mode's graph runs the same ops the eager sampler runs for that mode: the same tokens.

Only the Triton attention can be captured: its launch shape depends on the batch size and the
tables' width alone, while the portable SDPA backend's depends on the lengths in the batch. Steps
with prefill chunks, batches above the largest size, a per-layer hook (layer-wise KV streaming)
and `--enforce-eager` run eagerly.

On CPU, or with `capture=False`, `run` calls the same forward on the same padded buffers without
a graph: how the CPU tests check everything here but the capture itself.
"""

from __future__ import annotations

import logging
import time

import torch

from common.attention import AttentionMetadata
from common.config import upload
from common.errors import first_line
from common.sampling import FILTERED, GREEDY, PLAIN, sample_rows, sampling_inputs, sampling_mode

log = logging.getLogger(__name__)

PAD_SLOT = -1  # the KV slot of a padding row: written nowhere


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16, up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, max_num_seqs: int, max_blocks: int, device: torch.device,
                 capture: bool = True):
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slots = torch.full((n,), PAD_SLOT, **i64)
        self.lens = torch.ones(n, **i64)
        self.tables = torch.zeros(n, max_blocks, **i64)
        # sampling parameters (common/sampling.sampling_inputs); padding rows: greedy
        vocab = model.cfg.vocab_size
        self.sample_ints = torch.tensor([[vocab] * n, [1] * n, [0] * n, [0] * n], **i64)
        self.sample_floats = torch.ones(2, n, dtype=torch.float32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.samplers: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (size, mode)
        self.capture_s, self.capture_bytes = 0.0, 0
        if capture:
            self._capture_all()

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def _forward(self, n: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slots[:n], n, self.tables[:n], self.lens[:n], None, [], None, self.positions[:n])
        hidden_BC = self.model(self.input_ids[:n], self.positions[:n], self.kv_cache, meta)
        return self.model.logits(hidden_BC)

    def _sample(self, logits: torch.Tensor, mode: str) -> torch.Tensor:
        n = logits.shape[0]
        return sample_rows(logits, mode, self.sample_ints[:, :n], self.sample_floats[:, :n])

    def _capture_samplers(self):
        pool = None  # the samplers' own pool: the forward's holds its live logits
        for n in reversed(self.sizes):
            for mode in (FILTERED, PLAIN, GREEDY):
                logits = self.graphs[n][1]
                self._sample(logits, mode)  # warm-up
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    tokens = self._sample(logits, mode)
                pool = graph.pool()
                self.samplers[n, mode] = (graph, tokens)

    @torch.inference_mode()
    def _capture_all(self):
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        pool = None
        for n in reversed(self.sizes):  # the largest first: the smaller ones fit in its pool
            self._forward(n)  # warm-up: Triton compiles, the allocator settles
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(n)
            pool = graph.pool()
            self.graphs[n] = (graph, logits)
        try:
            self._capture_samplers()
        except Exception as e:  # the forward's graphs still serve; sampling then launches eagerly
            self.samplers.clear()
            log.warning("CUDA graphs: capturing the sampler failed (%s); sampling eagerly after each replay",
                        first_line(e))
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        self.capture_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("CUDA graphs: captured the decode step%s for %d batch sizes (%s) in %.1f s, using %.0f MiB",
                 " and its samplers (greedy, plain, filtered)" if self.samplers else "", len(self.sizes),
                 ", ".join(map(str, self.sizes)), self.capture_s, self.capture_bytes / 2**20)

    def size_for(self, n: int) -> int | None:
        """The smallest captured size that holds n rows, or None above the largest."""
        return next((s for s in self.sizes if s >= n), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
            tables: torch.Tensor) -> torch.Tensor:
        """Logits (n, vocab) of a decode batch of n <= max_size rows (device tensors, tables (n, w)).
        Read them (sample, logprobs, the next step's inputs) before the next run: the graphs share
        one pool, so a larger size's replay may write its scratch over a smaller size's logits."""
        n, w = tables.shape
        size = self.size_for(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.lens[:n].copy_(lens)
        self.tables[:n, :w].copy_(tables)
        if size > n:  # rows a larger batch left: make them padding again
            self.slots[n:size].fill_(PAD_SLOT)
            self.lens[n:size].fill_(1)
            self.positions[n:size].zero_()
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
        else:
            logits = self._forward(size)
        return logits[:n]

    def sample(self, logits_SV: torch.Tensor, params: list, seeds: list[int], positions: list[int]) -> torch.Tensor:
        """The tokens of the batch `run` just returned logits_SV for, as common/sampling.sample takes
        them: by the captured sampler of their mode, which reads the replayed graph's own logits."""
        n, mode = len(params), sampling_mode(params)
        size = self.size_for(n)
        if mode != GREEDY:
            ints, floats = sampling_inputs(params, seeds, positions, logits_SV.shape[1])
            self.sample_ints[:, :n].copy_(upload(ints, self.device))
            self.sample_floats[:, :n].copy_(upload(floats, self.device))
            if size > n:  # rows a larger batch left: greedy padding again
                self.sample_ints[1, n:size].fill_(1)
        if (size, mode) not in self.samplers:
            return self._sample(logits_SV, mode)
        graph, tokens = self.samplers[size, mode]
        graph.replay()
        return tokens[:n]
