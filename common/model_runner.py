"""The model runner: a scheduled batch turned into packed tensors (one host-to-device copy), the
forward (eager, or a CUDA graph's replay for a decode batch), any logit adjustments, and sampling
on the device."""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Callable

import torch

from common.attention import AttentionMetadata, PrefillChunk, decode_groups
from common.config import upload
from common.cuda_graphs import DecodeGraphs
from common.logits_processing import adjust, adjusted_rows
from common.sampling import Logprob, logprob_entries, logprobs_on_device, sample
from common.scheduler import ScheduledSeq
from common.sequence import Sequence

LayerHook = Callable[[int, list[ScheduledSeq]], None]


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; `collect` waits for its tokens.
    Until then the next step may be scheduled and launched (async scheduling): its decodes of these
    sequences feed these tokens on the device (`rows`), and the host sees PENDING in their place."""
    ordered: list[ScheduledSeq]  # the batch in packed order
    sampled: list[Sequence]  # those that sample, in the order of their tokens (a speculative decode's at each row)
    rows: dict[Sequence, int]  # each sampling sequence's (last) row in tokens_S
    members: set[Sequence]  # every sequence whose KV the step writes
    positions: list[int] = field(default_factory=list)  # of the tokens sampled, in their order (the noise's key)
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)  # speculative decodes' drafts
    tokens_S: torch.Tensor | None = None  # on the device
    host_S: torch.Tensor | None = None  # their copy on the host, complete once `ready` is (tokens_S on CPU)
    ready: torch.cuda.Event | None = None
    tokens: list[int] | None = None  # read from host_S (or tokens_S) by collect
    logprobs: list[Logprob | None] = field(default_factory=list)  # of the sampled tokens, where asked: set by collect
    token_logprobs: tuple | None = None  # (rows of tokens_S, logprobs_on_device's tensors on the host, top counts)
    prompt_logprobs: tuple | None = None  # (prompt_logprob_rows, the same, top counts)
    timing: list | None = None  # CUDA events around the device work
    free_after: list[Sequence] = field(default_factory=list)  # ended while in this step: their blocks wait for it
    # launched with its sampling deferred (ModelRunner.sample_step): (logits, graphed, input ids, decodes)
    deferred: tuple | None = None


def chunk_slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The KV slots of positions start..end - 1 of a sequence with this block table: each block's
    run of slots, trimmed (3x as fast as a slot a position for a 2,048-token chunk)."""
    out: list[int] = []
    for block in table[start // block_size:(end - 1) // block_size + 1]:
        out += range(block * block_size, (block + 1) * block_size)
    skip = start % block_size
    return out[skip:skip + end - start]


class ModelRunner:
    """Turns a scheduled batch into packed tensors, runs the forward and samples."""

    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, device: torch.device):
        self.model, self.kv_cache, self.block_size, self.device = model, kv_cache, block_size, device
        self.graphs: DecodeGraphs | None = None  # set by the engine where decode steps are captured
        self.timing = False  # on CUDA: time each step's device work (the step trace's gpu_ms)
        self.last_gpu_ms: float | None = None

    def _tensor(self, data, dtype=torch.int64):
        return torch.tensor(data, dtype=dtype, device=self.device)

    def prepare(self, batch: list[ScheduledSeq], prev: LaunchedStep | None = None):
        """The step's inputs, all int64, packed into one host buffer and moved to the device in one
        copy (pinned and asynchronous on a GPU), then viewed apart: a tensor per field would cost a
        copy and a launch each. The buffer is an array.array filled by extends (C loops; the block
        tables from each sequence's int64 copy, at memcpy speed): a Python loop per value, or
        torch.tensor over a list, costs 2-3x as much at batch 64.

        A decode whose token the step `prev` is still sampling takes it from prev's tokens on the
        device, by one gather and scatter: the host never waits for it."""
        bs = self.block_size
        decodes = [s for s in batch if s.is_decode]
        if self.model.attention.grouped_decodes:  # longest first: SDPA reads runs of similar length at their own width
            decodes.sort(key=lambda s: -len(s.seq))
        prefills = [s for s in batch if not s.is_decode]
        lens = [len(s.seq) for s in decodes]  # each decode's KV length, its new token included
        positions = [n - 1 for n in lens]
        input_ids = [s.seq.token_ids[-1] for s in decodes]
        slots = [s.seq.block_table[p // bs] * bs + p % bs for s, p in zip(decodes, positions)]
        tables = []  # prefill chunks' block tables, each a run of the buffer
        for s in prefills:
            seq, start = s.seq, s.start
            end = start + s.num_tokens
            input_ids += seq.token_ids[start:end]
            input_ids += s.draft  # a speculative decode's: past its tokens
            positions += range(start, end)
            slots += chunk_slots(seq.block_table, start, end, bs)
            tables.append(seq.block_table_array()[:-(-end // bs)])
        ordered = decodes + prefills
        sample_rows, row = [], 0
        for s in ordered:
            row += s.num_tokens
            if s.samples:  # the last row, or a speculative decode's every row
                sample_rows += range(row - 1 - len(s.draft), row)
        feed_rows, feed_src = [], []
        if prev is not None:
            for i, s in enumerate(decodes):
                src = prev.rows.get(s.seq)
                if src is not None:
                    feed_rows.append(i)
                    feed_src.append(src)
        width = max((len(s.seq.block_table) for s in decodes), default=0)
        buf = array.array("q", input_ids)
        for part in (positions, slots, sample_rows, lens, feed_rows, feed_src):
            buf.extend(part)
        pad = array.array("q", bytes(8 * width))
        for s in decodes:  # the decode tables, padded with block 0 to one width
            table = s.seq.block_table_array()
            buf += table
            buf += pad[len(table):]
        for table in tables:
            buf += table
        # a copy that owns its memory: frombuffer shares buf's, which goes with this frame
        host = torch.frombuffer(buf, dtype=torch.int64).clone() if buf else torch.empty(0, dtype=torch.int64)
        packed = upload(host, self.device)
        sizes = [len(input_ids), len(positions), len(slots), len(sample_rows), len(lens), len(feed_rows),
                 len(feed_src), len(decodes) * width]
        views = packed.split(sizes + [len(t) for t in tables])
        input_T, positions_T, slots_T, sample_rows_S, lens_B, feed_rows_F, feed_src_F, tables_flat = views[:8]
        if feed_rows:
            input_T[feed_rows_F] = prev.tokens_S[feed_src_F]
        decode_tables = decode_lens = decode_mask = groups = None
        if decodes:
            decode_tables, decode_lens = tables_flat.view(len(decodes), width), lens_B
            if self.model.attention.grouped_decodes:
                visible = torch.arange(width * bs, device=self.device)[None, :] < decode_lens[:, None]
                decode_mask = visible[:, None, None, :]
                groups = decode_groups(lens, bs)
        chunks, offset = [], len(decodes)
        for s, table in zip(prefills, views[8:]):
            chunks.append(PrefillChunk(offset, offset + s.num_tokens, s.start, table))
            offset += s.num_tokens
        meta = AttentionMetadata(slots_T, len(decodes), decode_tables, decode_lens, decode_mask, chunks, groups,
                                 positions_T, positions)
        return ordered, input_T, positions_T, meta, sample_rows_S

    @staticmethod
    def prompt_logprob_rows(ordered: list[ScheduledSeq]) -> list[tuple[Sequence, int, int]]:
        """(seq, packed row, position) of every row that predicts a prompt token of a sequence
        asking for prompt logprobs (row at position p predicts token p + 1)."""
        out, row = [], 0
        for s in ordered:
            seq, start = s.seq, s.start
            if seq.prompt_logprobs is not None:
                end = min(start + s.num_tokens, seq.num_prompt_tokens - 1)
                out += [(seq, row + p - start, p) for p in range(start, end)]
            row += s.num_tokens
        return out

    @torch.inference_mode()
    def launch(self, batch: list[ScheduledSeq], on_layer: LayerHook | None = None,
               prev: LaunchedStep | None = None, defer_sampling: bool = False) -> LaunchedStep:
        """Queue the step's forward, sampling and any logprobs; on a GPU the host goes on while
        they run, and collect() reads them. With defer_sampling, the forward alone: sample_step() queues
        the rest once the host knows what it needs (a structured output's mask wants the token
        `prev` is still sampling), while the device runs the forward."""
        ordered, input_ids, positions, meta, sample_rows = self.prepare(batch, prev)
        sampled, keys, drafts = [], [], {}  # a row each (a speculative decode's every row), in one pass
        for s in ordered:  # (comprehensions with a range per sequence cost 5x this at batch 64)
            if not s.samples:
                continue
            at = len(s.seq)  # the position of its next token: its noise key
            if s.draft:
                drafts[s.seq] = s.draft
                sampled += [s.seq] * (1 + len(s.draft))
                keys += range(at, at + 1 + len(s.draft))
            else:
                sampled.append(s.seq)
                keys.append(at)
        step = LaunchedStep(ordered, sampled, {q: i for i, q in enumerate(sampled)}, {s.seq for s in ordered},
                            keys, drafts)
        if self.timing and self.device.type == "cuda":  # from the forward's first launch, past the input copy
            step.timing = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            step.timing[0].record()
        n = meta.num_decode
        graphed = self.graphs is not None and on_layer is None and not meta.prefills and 0 < n <= self.graphs.max_size
        if graphed:
            logits_SV = self.graphs.run(input_ids, positions, meta.slot_mapping, meta.decode_context_lens,
                                        meta.decode_block_tables)  # every decode row samples, in packed order
        else:
            hook = None if on_layer is None else (lambda i: on_layer(i, ordered))
            hidden_TC = self.model(input_ids, positions, self.kv_cache, meta, hook)
            prompt_rows = self.prompt_logprob_rows(ordered)
            if prompt_rows:
                rows_ids = upload(torch.tensor([r for _, r, _ in prompt_rows] + [q.token_ids[p + 1] for q, _, p in
                                                                                 prompt_rows]), self.device)
                rows_P, ids_P = rows_ids.split(len(prompt_rows))
                num_top = [q.params.prompt_logprobs for q, _, _ in prompt_rows]
                parts = logprobs_on_device(self.model.logits(hidden_TC[rows_P]), ids_P, max(num_top))
                step.prompt_logprobs = (prompt_rows, tuple(map(self._to_host, parts)), num_top)
            if not sampled:
                step.tokens = []
                if step.timing is not None:
                    step.timing[1].record()
                return self._ready(step)
            logits_SV = self.model.logits(hidden_TC[sample_rows])
        step.deferred = (logits_SV, graphed, input_ids, n)
        return step if defer_sampling else self.sample_step(step)

    @torch.inference_mode()
    def sample_step(self, step: LaunchedStep) -> LaunchedStep:
        """Queue a launched step's sampling and logprobs over its logits, and the tokens' copy to
        the host."""
        (logits_SV, graphed, input_ids, n), step.deferred = step.deferred, None
        sampled = step.sampled
        rows = [q.params for q in sampled], [q.seed for q in sampled], step.positions
        adjusted = adjusted_rows(sampled)
        if adjusted:  # penalties and the like: eagerly, over a float copy (logprobs stay the raw logits')
            adjusted_SV, logits_SV = adjust(logits_SV, sampled, adjusted, n, input_ids)
            step.tokens_S = sample(adjusted_SV, *rows)
        else:
            step.tokens_S = (self.graphs.sample if graphed else sample)(logits_SV, *rows)
        if step.timing is not None:
            step.timing[1].record()
        wanted = [i for i, q in enumerate(sampled) if q.params.logprobs is not None]
        if wanted:  # computed now, while logits_SV holds this step's (a graph's buffer is rewritten by the next)
            wanted_W = upload(torch.tensor(wanted), self.device)
            num_top = [sampled[i].params.logprobs for i in wanted]
            parts = logprobs_on_device(logits_SV[wanted_W], step.tokens_S[wanted_W], max(num_top))
            step.token_logprobs = (wanted, tuple(map(self._to_host, parts)), num_top)
        step.host_S = self._to_host(step.tokens_S)
        return self._ready(step)

    def _to_host(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """On CUDA, a pinned host copy of t, arriving asynchronously (complete once the step is
        ready); elsewhere t itself."""
        if t is None or self.device.type != "cuda":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def _ready(self, step: LaunchedStep) -> LaunchedStep:
        """Mark the end of the step's device work, its copies to the host included: collect waits
        for this alone. A blocking read would wait for every step queued after it too."""
        if self.device.type == "cuda":
            step.ready = torch.cuda.Event()
            step.ready.record()
        return step

    def collect(self, step: LaunchedStep) -> list[int]:
        """The step's sampled tokens, in the order of step.sampled: the host's one wait for the
        device. Their logprobs go into step.logprobs, the prompt's into their sequences."""
        if step.ready is not None:  # also for a step that samples nothing: its blocks may be freed next
            step.ready.synchronize()
        if step.tokens is None:
            step.tokens = step.host_S.tolist()
        if step.prompt_logprobs is not None:
            rows, parts, num_top = step.prompt_logprobs
            for (q, _, p), entry in zip(rows, logprob_entries(parts, num_top)):
                q.prompt_logprobs[p + 1] = entry
        step.logprobs = [None] * len(step.tokens)
        if step.token_logprobs is not None:
            wanted, parts, num_top = step.token_logprobs
            for i, entry in zip(wanted, logprob_entries(parts, num_top)):
                step.logprobs[i] = entry
        self.last_gpu_ms = None
        if step.timing is not None:
            step.timing[1].synchronize()
            self.last_gpu_ms = step.timing[0].elapsed_time(step.timing[1])
        return step.tokens
