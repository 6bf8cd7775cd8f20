"""A request's state inside one engine: its tokens, where its KV lives, how far it has been
computed, and why it finished."""

from __future__ import annotations

import array
import enum
import logging
import time

from common.prefix_hash import extend_chain
from common.sampling_params import SamplingParams
from common.structured_output import first_lines
from common.text import TextStream

log = logging.getLogger("pdserve.engine")


PREFILLED = "prefilled"  # finish reason of a prefill-only request: KV computed, more to generate
PENDING = -1  # in token_ids: a token a launched step is still sampling (async scheduling; common/engine.py)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 eos_token_ids: tuple[int, ...], max_model_len: int, output_token_ids: list[int] = (),
                 prefill_only: bool = False):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)  # each output shares it (not a copy a step)
        self.token_ids = self.prompt_token_ids + list(output_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Stop after the next token and keep the KV blocks: a prefill worker's request.
        self.prefill_only = prefill_only
        # Its KV has no decode worker's blocks to go to yet (common/scheduler.py, admission).
        self.awaits_kv_grant = prefill_only
        self.params = params
        self.seed = seed
        self.stop_ids = params.stop_ids(eos_token_ids)
        # any logit adjustment (common/logits_processing.py), min_tokens included while unmet
        self.adjusts_logits = params.adjusts_logits or params.min_tokens > 0
        self.max_len = min(self.num_prompt_tokens + params.max_tokens, max_model_len)
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self._table_array: tuple[list[int], array.array] | None = None  # (the list it copies, the copy)
        self._settled = array.array("q")  # token_ids but the newest, as int64 (settled_tokens)
        self._chain: list[bytes] = []  # hash_chain's: its full blocks' prefix-cache hashes so far
        self.num_published_blocks = 0  # its leading blocks whose KV is computed and hash published (kv_cache.py)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, found by prefix caching at admission
        self.num_preemptions = 0
        # Logprobs of the output's tokens (None for those given, sampled elsewhere), and of the
        # prompt's tokens (the first has none).
        self.logprobs: list | None = [None] * len(output_token_ids) if params.logprobs is not None else None
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else [None] * self.num_prompt_tokens
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None  # first admitted to the running batch
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.text: TextStream | None = None  # the output's text, while stop strings are to be found in it
        self.matcher = None  # params.structured_outputs' state, set by the engine (common/structured_output.py)
        # ... or held until the output ends its free part with params.structured_outputs_after
        self.held_matcher = None
        self.first_mask = None  # held_matcher's mask before any token, on the device (logits_processing.py)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Everything but the newest token is in the cache: the next step feeds one token."""
        n = len(self.token_ids)
        return n - self.num_computed_tokens == 1 and n > self.num_prompt_tokens

    def block_table_array(self) -> array.array:
        """block_table as an int64 array, kept in step with it: the blocks appended since are
        added, a new list is copied anew (the table only ever grows or is replaced). A step's inputs
        take it at memcpy speed, where a list is converted an int at a time."""
        table, cached = self.block_table, self._table_array
        if cached is not None and cached[0] is table:  # (asked for every decode every step)
            copy = cached[1]
            have = len(copy)
            if have == len(table):
                return copy
            if have < len(table):
                copy.extend(table[have:])
                return copy
        self._table_array = (table, array.array("q", table))
        return self._table_array[1]

    def hash_chain(self, blocks: int, block_size: int) -> list[bytes]:
        """The prefix-cache hashes of its first `blocks` blocks, which must be full and settled (or
        more of them), each computed once: admission looks them up twice, and the KV computed
        publishes them again (common/kv_cache.py). Its tokens are only ever appended."""
        return extend_chain(self._chain, self.token_ids, block_size, blocks)

    def settled_tokens(self) -> array.array:
        """token_ids but the newest, as an int64 array kept in step with them: those never change
        (the newest may be PENDING). Logit adjustments take a sequence's tokens from it each step
        at memcpy speed, where a list is converted an int at a time."""
        settled, end = self._settled, len(self.token_ids) - 1
        if len(settled) > end:  # not expected: tokens are only ever appended
            settled = self._settled = array.array("q")
        if len(settled) < end:
            settled.extend(self.token_ids[len(settled):end])
        return settled

    @property
    def adjusted_now(self) -> bool:
        """Its next token's logits are adjusted on the host (common/logits_processing.py): always
        for penalties, bias, min_p and structured outputs; min_tokens only until it is met."""
        return self.adjusts_logits and (self.params.adjusts_logits or
                                        len(self.token_ids) - self.num_prompt_tokens < self.params.min_tokens)

    @property
    def pending(self) -> bool:
        """Its newest token is still being sampled on the device (async scheduling)."""
        return self.token_ids[-1] == PENDING

    @property
    def ends_at_last_token(self) -> bool:
        """Its newest token is still being sampled and will end it whichever token it turns out to
        be (its length, or a prefill-only request's one token): async scheduling must not schedule
        it again. (A real token that ends it has finished it already.)"""
        n = len(self.token_ids)
        return self.pending and (n >= self.max_len or (self.prefill_only and n > self.num_prompt_tokens))

    def _grammar_takes(self, token: int) -> bool:
        """Whether its structured output, if any, takes the newest token. A held one sees none of the
        free text, and begins once the run (params.structured_outputs_after) that ends it is out."""
        if self.held_matcher is not None:
            after = self.params.structured_outputs_after
            if self.token_ids[-len(after):] == after:
                self.matcher, self.held_matcher = self.held_matcher, None
            return True
        if self.matcher is None or self.matcher.consume_token(token):
            return True
        # its mask allowed the token, but llguidance gave up on the grammar (too many items or
        # expressions for it): the output ends where it is, said in the log
        log.warning("request %s: its structured output ends after %d tokens, llguidance could not follow it (%s)",
                    self.request_id, len(self.token_ids) - self.num_prompt_tokens,
                    first_lines(self.matcher.get_error(), 1))
        return False

    def append_token(self, token: int, logprob=None) -> None:
        self.token_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        ends_text = self.text is not None and self.text.add(token)  # the text sees every token
        if not self._grammar_takes(token):
            self.finish_reason = "abort"
        elif token in self.stop_ids or ends_text or (self.matcher is not None and self.matcher.is_stopped()):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_len:
            self.finish_reason = "length"
        elif self.prefill_only:
            self.finish_reason = PREFILLED
