"""The model runner: a scheduled batch turned into packed tensors (one host-to-device copy), the
forward (eager, or a CUDA graph's replay for a decode batch), and sampling on the device."""

from __future__ import annotations

import array
from typing import Callable

import torch

from common.attention import AttentionMetadata, PrefillChunk, decode_groups
from common.config import upload
from common.cuda_graphs import DecodeGraphs
from common.sampling import Logprob, sample, token_logprobs
from common.scheduler import ScheduledSeq
from common.sequence import Sequence

LayerHook = Callable[[int, list[ScheduledSeq]], None]


class ModelRunner:
    """Turns a scheduled batch into packed tensors, runs the forward and samples."""

    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, device: torch.device):
        self.model, self.kv_cache, self.block_size, self.device = model, kv_cache, block_size, device
        self.graphs: DecodeGraphs | None = None  # set by the engine where decode steps are captured
        self.timing = False  # on CUDA: time each step's device work (the step trace's gpu_ms)
        self.last_gpu_ms: float | None = None

    def _tensor(self, data, dtype=torch.int64):
        return torch.tensor(data, dtype=dtype, device=self.device)

    def prepare(self, batch: list[ScheduledSeq]):
        """The step's inputs, all int64, packed into one host buffer and moved to the device in one
        copy (pinned and asynchronous on a GPU), then viewed apart: a tensor per field would cost a
        copy and a launch each. The buffer is an array.array filled by list extends (C loops): a
        Python loop per value, or torch.tensor over a list, costs 2-3x as much at batch 64."""
        bs = self.block_size
        # longest first: the portable attention reads runs of similar length at their own width
        decodes = sorted((s for s in batch if s.is_decode), key=lambda s: -len(s.seq))
        prefills = [s for s in batch if not s.is_decode]
        positions = [len(s.seq) - 1 for s in decodes]
        input_ids = [s.seq.token_ids[-1] for s in decodes]
        slots = [s.seq.block_table[p // bs] * bs + p % bs for s, p in zip(decodes, positions)]
        tables = []  # prefill chunks' block tables, each a run of the buffer
        for s in prefills:
            seq, start = s.seq, s.start
            end = start + s.num_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            tables.append(table[:-(-end // bs)])
        ordered = decodes + prefills
        sample_rows, row = [], 0
        for s in ordered:
            row += s.num_tokens
            if s.samples:
                sample_rows.append(row - 1)
        lens = [len(s.seq) for s in decodes]
        width = max((len(s.seq.block_table) for s in decodes), default=0)
        buf = array.array("q", input_ids)
        for field in (positions, slots, sample_rows, lens):
            buf.extend(field)
        pad = [0] * width
        for s in decodes:  # the decode tables, padded with block 0 to one width
            buf.extend(s.seq.block_table)
            buf.extend(pad[len(s.seq.block_table):])
        for table in tables:
            buf.extend(table)
        # a copy that owns its memory: frombuffer shares buf's, which goes with this frame
        host = torch.frombuffer(buf, dtype=torch.int64).clone() if buf else torch.empty(0, dtype=torch.int64)
        packed = upload(host, self.device)
        sizes = [len(input_ids), len(positions), len(slots), len(sample_rows), len(lens), len(decodes) * width]
        views = packed.split(sizes + [len(t) for t in tables])
        input_T, positions_T, slots_T, sample_rows_S, lens_B, tables_flat = views[:6]
        decode_tables = decode_lens = decode_mask = groups = None
        if decodes:
            decode_tables, decode_lens = tables_flat.view(len(decodes), width), lens_B
            if self.model.attention.grouped_decodes:
                visible = torch.arange(width * bs, device=self.device)[None, :] < decode_lens[:, None]
                decode_mask = visible[:, None, None, :]
                groups = decode_groups(lens, bs)
        chunks, offset = [], len(decodes)
        for s, table in zip(prefills, views[6:]):
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
    def run(self, batch: list[ScheduledSeq], on_layer: LayerHook | None = None
            ) -> tuple[list[ScheduledSeq], list[int], list[Logprob | None]]:
        """Returns the batch in packed order, the tokens sampled for its `samples` entries and
        their logprobs (None where not asked for). Prompt logprobs go straight into their sequences."""
        self.last_gpu_ms = None
        ordered, input_ids, positions, meta, sample_rows = self.prepare(batch)
        events = None
        if self.timing and self.device.type == "cuda":  # from the forward's first launch, past the input copy
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            events[0].record()
        n = meta.num_decode
        if (self.graphs is not None and on_layer is None and not meta.prefills and 0 < n <= self.graphs.max_size):
            logits_SV = self.graphs.run(input_ids, positions, meta.slot_mapping, meta.decode_context_lens,
                                        meta.decode_block_tables)  # every decode row samples, in packed order
        else:
            hook = None if on_layer is None else (lambda i: on_layer(i, ordered))
            hidden_TC = self.model(input_ids, positions, self.kv_cache, meta, hook)
            prompt_rows = self.prompt_logprob_rows(ordered)
            if prompt_rows:
                logits_PV = self.model.logits(hidden_TC[self._tensor([r for _, r, _ in prompt_rows])])
                entries = token_logprobs(logits_PV, [q.token_ids[p + 1] for q, _, p in prompt_rows],
                                         [q.params.prompt_logprobs for q, _, _ in prompt_rows])
                for (q, _, p), entry in zip(prompt_rows, entries):
                    q.prompt_logprobs[p + 1] = entry
            if not sample_rows.numel():
                if events is not None:
                    events[1].record()
                    events[1].synchronize()
                    self.last_gpu_ms = events[0].elapsed_time(events[1])
                return ordered, [], []
            logits_SV = self.model.logits(hidden_TC[sample_rows])
        sampled = [s.seq for s in ordered if s.samples]
        tokens_S = sample(logits_SV, [q.params for q in sampled], [q.seed for q in sampled], [len(q) for q in sampled])
        if events is not None:
            events[1].record()
        tokens = tokens_S.tolist()  # the step's one wait for the device
        if events is not None:
            self.last_gpu_ms = events[0].elapsed_time(events[1])
        logprobs: list[Logprob | None] = [None] * len(sampled)
        wanted = [i for i, q in enumerate(sampled) if q.params.logprobs is not None]
        if wanted:
            entries = token_logprobs(logits_SV[self._tensor(wanted)], [tokens[i] for i in wanted],
                                     [sampled[i].params.logprobs for i in wanted])
            for i, entry in zip(wanted, entries):
                logprobs[i] = entry
        return ordered, tokens, logprobs
