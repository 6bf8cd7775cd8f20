"""Continuous batching with chunked prefill, decode first.

Each step gets a token budget. Running decodes come first (one token each); when the pool has no
block for a decode, the newest running request is preempted (its blocks freed, back to the front
of the queue, later resumed by recompute). The rest of the budget goes to prefill chunks: first
requests whose prompt is partly computed, then newly admitted ones. A request is admitted only
when the pool has blocks for its whole prompt (minus cached prefix blocks), keeping a small
watermark free for running decodes to grow into.

A prefill worker's requests end at their first token and keep their blocks until their KV has
gone to a decode worker (`held`), which grants blocks for it when it has room. A request is
admitted before its grant arrives, so the grant's round trip overlaps the prefill, but only while
the blocks of such requests (running or held) leave room for the longest request: otherwise
prefills awaiting grants could fill the pool while the decode worker's room is promised to
requests that cannot be admitted to prefill, and neither would move until a lease ran out. A
request awaiting its grant that may not be admitted is passed over for granted ones behind it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from common.kv_cache import BlockManager
from common.sequence import Sequence, Status
from common.speculative import Drafter


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens fed this step, from seq.num_computed_tokens on
    samples: bool = field(init=False)  # the step computes seq's last token: sample the next one
    start: int = field(init=False)  # seq's tokens already computed when scheduled (its KV the step reads)
    is_decode: bool = field(init=False)  # feeds its last sampled token; else a prefill (or recompute) chunk
    # a speculative decode's draft (common/speculative.py): fed after its newest token, a token sampled at every row
    draft: list[int] = field(default=(), init=False)

    def __post_init__(self):
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_tokens == len(self.seq)
        self.is_decode = self.num_tokens == 1 and self.seq.is_decoding

    @classmethod
    def decode(cls, seq: Sequence) -> "ScheduledSeq":
        """ScheduledSeq(seq, 1) of a sequence known to be decoding, without asking it again (the
        scheduler's per-step loop over every running request)."""
        s = cls.__new__(cls)
        s.seq, s.num_tokens, s.start, s.samples, s.is_decode = seq, 1, seq.num_computed_tokens, True, True
        return s

    @classmethod
    def speculative(cls, seq: Sequence, draft: list[int]) -> "ScheduledSeq":
        """A decode that feeds its newest token and then draft, as a chunk sampled at every row."""
        s = cls.__new__(cls)
        s.seq, s.num_tokens, s.start, s.samples, s.is_decode = seq, 1 + len(draft), seq.num_computed_tokens, True, False
        s.draft = draft
        return s


def step_shape(batch: list[ScheduledSeq]) -> tuple[list[tuple[int, int]], list[int]]:
    """What a step's cost depends on: (tokens, tokens computed before) of each prefill chunk, and
    each decode's sequence length (the KV it reads, its new token included)."""
    chunks, decodes = [], []
    for s in batch:
        if s.is_decode:
            decodes.append(s.start + 1)
        else:
            chunks.append((s.num_tokens, s.start))
    return chunks, decodes


REFUSED_STALE_S = 0.5  # a refused reservation not asked again this long is given up (a queue asks on every change)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, drafter: Drafter | None = None):
        self.bm = block_manager
        self.drafter = drafter
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark = max(1, block_manager.num_blocks // 100)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.held: dict[str, Sequence] = {}  # prefill-only requests done, blocks kept for their transfer
        self.max_model_len = max_model_len
        self.first_refused: tuple[str, int, float] | None = None  # (request, tokens, when) of reservable
        # what requests awaiting a KV grant may hold at most: the rest fits the longest request
        self.ungranted_room = max(0, block_manager.num_blocks - block_manager.blocks_needed(max_model_len))
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        prefilling: list[Sequence] = []  # running, in admission order, with prompt (or recompute) left
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue
            if not seq.is_decoding:
                prefilling.append(seq)  # older than any sequence preempted below: it stays running
                continue
            if seq.ends_at_last_token:
                continue
            if self.bm.needs_block(seq):
                # Preempting newest first never touches a sequence already batched (they are older).
                while self.bm.num_free_blocks == 0 and seq.status is Status.RUNNING:
                    self._preempt(self.running[-1])
                if seq.status is not Status.RUNNING:
                    continue
                self.bm.append_block(seq)
            batch.append(ScheduledSeq.decode(seq))
            budget -= 1
        if self.drafter is not None and batch:
            budget = self._add_drafts(batch, budget)
        for seq in prefilling:
            if budget == 0:
                break
            n = min(seq.num_uncomputed, budget)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        admitted: list[Sequence] = []
        ungranted = None
        for seq in self.waiting:
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.pending:  # preempted while its token is sampled: admitted once that is known
                break
            if seq.awaits_kv_grant:
                if ungranted is None:
                    ungranted = self.ungranted_blocks()
                need = 1 if ungranted >= self.ungranted_room else self.bm.blocks_needed(len(seq))
                if ungranted + need > self.ungranted_room:
                    continue  # it waits for its grant; a granted request behind it may go
                ungranted += need
            reserve = self.watermark if self.running else 0
            if not self.bm.can_allocate(seq, reserve):
                break
            self.bm.allocate(seq)
            seq.status = Status.RUNNING
            seq.scheduled_time = seq.scheduled_time or time.monotonic()
            self.running.append(seq)
            admitted.append(seq)
            n = min(seq.num_uncomputed, budget)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        if admitted and admitted[-1] is self.waiting[len(admitted) - 1]:  # none passed over
            for _ in admitted:
                self.waiting.popleft()
        else:
            for seq in admitted:
                self.waiting.remove(seq)
        return batch

    def _add_drafts(self, batch: list[ScheduledSeq], budget: int) -> int:
        """Give the batch's decodes their drafts from the budget left after every decode, before any
        prefill, and blocks for the drafts' KV while the pool keeps its watermark; returns the budget
        left. A draft leaves room for its tokens and one more within max_len."""
        bm, drafter, bs = self.bm, self.drafter, self.bm.block_size
        for i, s in enumerate(batch):
            if budget == 0:
                break
            seq = s.seq
            room = min(budget, seq.max_len - len(seq) - 1)
            if room <= 0 or seq.pending or not drafter.eligible(seq):
                continue
            draft = drafter.propose(seq, room)
            while draft and bm.blocks_needed(len(seq) + len(draft)) > len(seq.block_table):
                if bm.num_free_blocks <= self.watermark:
                    draft = draft[:len(seq.block_table) * bs - len(seq)]
                    break
                bm.append_block(seq)
            if draft:
                batch[i] = ScheduledSeq.speculative(seq, draft)
                budget -= len(draft)
        return budget

    def reservable(self, request_id: str, num_tokens: int, reserved_seqs: int, now: float) -> int | None:
        """The blocks a sequence whose KV for num_tokens arrives from elsewhere needs (with its next
        token's), or None while they or a batch slot are short (reserved_seqs: promised already).
        Requests preempted here resume first: granting their room to new arrivals kept them
        waiting out whole bursts. So does the first request refused: later ones are granted only
        what leaves its room, else a long prompt lost every race for freed blocks to short ones and
        waited out its transfer timeout. The watermark is kept as admission keeps it: beside others."""
        head = self.first_refused
        if head is not None and (head[0] == request_id or now - head[2] > REFUSED_STALE_S):
            head = self.first_refused = None  # its turn, or its prefill worker stopped asking
        need = self.bm.blocks_needed(num_tokens + 1)
        busy = len(self.running) + reserved_seqs
        keep = self.watermark if busy else 0
        if head is not None:  # leave it a batch slot and its blocks
            busy, keep = busy + 1, self.watermark + self.bm.blocks_needed(head[1] + 1)
        if self.waiting or busy >= self.max_num_seqs or need + keep > self.bm.num_free_blocks:
            if head is None:
                self.first_refused = (request_id, num_tokens, now)
            return None
        return need

    def refuses_all(self, reserved_seqs: int) -> bool:
        """Whether every reservation is refused now, whatever its size: preempted requests resume
        first, or the batch is full. A queue of reservations (the decode worker's) stops there."""
        return bool(self.waiting) or len(self.running) + reserved_seqs >= self.max_num_seqs

    def no_room(self, num_tokens: int, max_len: int) -> str | None:
        """Why a sequence of num_tokens that may grow to max_len could never be reserved or
        admitted here, or None."""
        if num_tokens >= self.max_model_len:
            return f"{num_tokens} tokens; this worker's max_model_len is {self.max_model_len}"
        grown = self.bm.blocks_needed(min(max(max_len, num_tokens + 1), self.max_model_len))
        if grown > self.bm.num_blocks:
            return f"the sequence may grow to {grown} KV blocks; this worker has {self.bm.num_blocks}"
        return None

    def ungranted_blocks(self) -> int:
        """Blocks held by admitted requests whose KV has nowhere to go yet."""
        return sum(len(s.block_table) for s in self.running if s.awaits_kv_grant) + \
            sum(len(s.block_table) for s in self.held.values() if s.awaits_kv_grant)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def admit_prefilled(self, seq: Sequence) -> None:
        """A sequence whose KV arrived from elsewhere joins the running batch directly."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str, free_blocks: bool = True) -> None:
        """Take seq out of the scheduler (finished or aborted) and, unless told to keep them for a
        KV transfer, free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            if free_blocks:
                self.bm.free_seq(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
