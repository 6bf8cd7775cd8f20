"""A worker's steps, one line each, for finding where serving time goes: set PDSERVE_STEP_TRACE to a
directory and every worker started with it (a launcher's children inherit it) writes
`<worker-id>-<pid>.tsv` there. The planner's profile times steps from the client; this is the worker's
own view: how long each forward took, how long sending its tokens took, and what the step held,
in the terms of the simulator's step cost (bench/simulate.py StepCost).

Columns: start (time.monotonic s), step_ms (Engine.step), send_ms (handing its outputs on),
decodes (sequences decoding one token), longest (the longest of them, tokens), kv_tokens (the
KV they read: what a paged kernel reads), kv_padded (what the portable attention reads, each run of
similar lengths padded to its longest: common/attention.decode_kv_read), prefill_tokens,
prefill_token_ctx (sum over prefill chunks of tokens x (context before + tokens))."""

from __future__ import annotations

import os
from pathlib import Path

from common.attention import decode_kv_read
from common.scheduler import step_shape

ENV = "PDSERVE_STEP_TRACE"
COLUMNS = ("start", "step_ms", "send_ms", "decodes", "longest", "kv_tokens", "kv_padded", "prefill_tokens",
           "prefill_token_ctx")


class StepTrace:
    def __init__(self, path: Path, block_size: int):
        self.block_size = block_size
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "w", buffering=1)
        self.file.write("\t".join(COLUMNS) + "\n")

    @classmethod
    def from_env(cls, name: str, block_size: int) -> "StepTrace | None":
        directory = os.environ.get(ENV)
        return cls(Path(directory) / f"{name}-{os.getpid()}.tsv", block_size) if directory else None  # a restart: a new file

    def record(self, start: float, stepped: float, sent: float, batch) -> None:
        """batch: the ScheduledSeqs of the step (empty: nothing ran, nothing written)."""
        if not batch:
            return
        chunks, decodes = step_shape(batch)
        self.file.write(f"{start:.6f}\t{(stepped - start) * 1e3:.3f}\t{(sent - stepped) * 1e3:.3f}\t{len(decodes)}\t"
                        f"{max(decodes, default=0)}\t{sum(decodes)}\t{decode_kv_read(decodes, self.block_size)}\t"
                        f"{sum(n for n, _ in chunks)}\t{sum(n * (n + c) for n, c in chunks)}\n")

    def close(self) -> None:
        self.file.close()
