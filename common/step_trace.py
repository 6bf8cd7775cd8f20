"""A worker's steps, one line each, for finding where serving time goes: set PDSERVE_STEP_TRACE to a
directory and every worker started with it (a launcher's children inherit it) writes
`<worker-id>-<pid>.tsv` there. The planner's profile times steps from the client; this is the worker's
own view: how long each forward took, how long sending its tokens took, and what the step held,
in the terms of the simulator's step cost (bench/simulate.py StepCost). The planner's profile
fits a monolithic worker's step cost from these rows (bench/profile.fit_steps); the other roles'
it times from the client.

Columns: start (time.monotonic s), step_ms (Engine.step), send_ms (handing its outputs on),
gap_ms (from the previous step's end to this one's start: polling, handling messages, ticks),
gpu_ms (the device's timeline from the step's input copy to its sampled tokens, by CUDA events:
its busy time when the step is a CUDA graph's replay, and with eager launches also the time it
waited on Python; empty on a CPU; with async scheduling, that of the step before, whose tokens
this one read),
decodes (sequences decoding one token), longest (the longest of them, tokens), kv_tokens (the
KV they read: what a paged kernel reads), kv_padded (what the portable attention reads, each run of
similar lengths padded to its longest: common/attention.decode_kv_read), prefill_tokens,
prefill_token_ctx (sum over prefill chunks of tokens x (context before + tokens)).

`python -m common.step_trace DIR` summarizes a directory of traces: per worker, the median decode
step and how much of the loop's time the device was busy (issue 11: once a decode step takes a
millisecond on a GPU, the loop's own Python is what is left to overlap)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from common.attention import decode_kv_read
from common.scheduler import step_shape

ENV = "PDSERVE_STEP_TRACE"
COLUMNS = ("start", "step_ms", "send_ms", "gap_ms", "gpu_ms", "decodes", "longest", "kv_tokens", "kv_padded",
           "prefill_tokens", "prefill_token_ctx")


class StepTrace:
    def __init__(self, path: Path, block_size: int):
        self.block_size = block_size
        self.last_end: float | None = None
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "w", buffering=1)
        self.file.write("\t".join(COLUMNS) + "\n")

    @classmethod
    def from_env(cls, name: str, block_size: int) -> "StepTrace | None":
        directory = os.environ.get(ENV)
        return cls(Path(directory) / f"{name}-{os.getpid()}.tsv", block_size) if directory else None  # a restart: a new file

    def record(self, start: float, stepped: float, sent: float, batch, gpu_ms: float | None = None) -> None:
        """batch: the ScheduledSeqs of the step (empty: nothing ran, nothing written)."""
        if not batch:
            return
        chunks, decodes = step_shape(batch)
        gap = "" if self.last_end is None else f"{(start - self.last_end) * 1e3:.3f}"
        gpu = "" if gpu_ms is None else f"{gpu_ms:.3f}"
        self.file.write(f"{start:.6f}\t{(stepped - start) * 1e3:.3f}\t{(sent - stepped) * 1e3:.3f}\t{gap}\t{gpu}\t"
                        f"{len(decodes)}\t{max(decodes, default=0)}\t{sum(decodes)}\t"
                        f"{decode_kv_read(decodes, self.block_size)}\t{sum(n for n, _ in chunks)}\t"
                        f"{sum(n * (n + c) for n, c in chunks)}\n")
        self.last_end = time.monotonic()  # the next gap leaves out this row's own writing: a worker not traced does none

    def close(self) -> None:
        self.file.close()


def read(path: Path) -> list[dict]:
    """A trace's rows, numbers as floats, an empty cell as None."""
    import csv

    with open(path) as f:
        return [{k: float(v) if v else None for k, v in row.items()} for row in csv.DictReader(f, delimiter="\t")]


def decode_loop_share(rows: list[dict], min_decodes: int = 1) -> dict:
    """Over the decode-only steps of at least min_decodes sequences, each taken with the gap
    before it (a loop iteration): medians of the step and of the whole iteration, and the share of
    the iterations' time on the device's timeline (None without gpu_ms: a CPU); the rest is the
    loop's own Python, which overlapping steps would hide."""
    steps = [r for r in rows if r["decodes"] >= min_decodes and not r["prefill_tokens"] and r["gap_ms"] is not None]
    if not steps:
        return {"steps": 0}
    loop = [r["step_ms"] + r["send_ms"] + r["gap_ms"] for r in steps]
    gpu = [r["gpu_ms"] for r in steps if r["gpu_ms"] is not None]
    return {"steps": len(steps), "step_ms_p50": sorted(r["step_ms"] for r in steps)[len(steps) // 2],
            "loop_ms_p50": sorted(loop)[len(loop) // 2],
            "device_busy": round(sum(gpu) / sum(loop), 3) if len(gpu) == len(steps) else None}


if __name__ == "__main__":
    import json
    import sys

    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(os.environ.get(ENV, "."))
    min_decodes = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    for path in sorted(directory.glob("*.tsv")):
        print(json.dumps({"trace": path.name, **decode_loop_share(read(path), min_decodes)}))
