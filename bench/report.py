"""The one output format of every benchmark: an aligned table, then a last line of JSON; and
where a bench's clusters keep their logs."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import sys
import tempfile
import threading
import time


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    """An aligned table; a cell with no value (None, or NaN: the latency of a run whose requests all
    failed) shows "-"."""
    cells = [header] + [[cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(title)
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    print()


def cell(c) -> str:
    if c is None or (isinstance(c, float) and math.isnan(c)):
        return "-"
    return f"{c:,.1f}" if isinstance(c, float) else str(c)


def print_json(result: dict) -> None:
    """The bench's last line: strict JSON, a NaN (a percentile of nothing: every request failed) as null."""
    print(json.dumps(finite(result), allow_nan=False), flush=True)


def finite(value):
    """value with every NaN or infinity in it as None: what strict JSON can hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def pct(values: list[float], q: float) -> float:
    """The q-th percentile by nearest rank: the smallest value that q% of them are at or under (NaN
    for none)."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


@contextlib.contextmanager
def cluster_logs():
    """A directory for a bench's cluster logs, removed when the bench ends well or is stopped (Ctrl-C
    or SIGTERM, which leaves through the bench's finally blocks, as Ctrl-C does), and kept when it
    fails, whose error points into it (a temporary directory was gone by then)."""
    logs = tempfile.mkdtemp(prefix="pdserve-bench-")
    main = threading.current_thread() is threading.main_thread()  # (where a handler can be set)
    told = signal.signal(signal.SIGTERM, _leave) if main else None
    try:
        yield logs
    except Exception:
        print(f"[bench] the clusters' logs are kept in {logs}", file=sys.stderr, flush=True)
        raise
    except BaseException:  # Ctrl-C, SIGTERM
        shutil.rmtree(logs, ignore_errors=True)
        raise
    finally:
        if main:  # (None: a handler not set from Python, which cannot be put back; the default then)
            signal.signal(signal.SIGTERM, signal.SIG_DFL if told is None else told)
    shutil.rmtree(logs, ignore_errors=True)


def _leave(signum, frame):
    raise SystemExit(128 + signum)


class Progress:
    """A long bench's progress lines on stderr (its table and JSON go to stdout), timed from its start."""

    def __init__(self, name: str):
        self.name, self.started = name, time.monotonic()

    def __call__(self, text: str) -> None:
        print(f"[{self.name} {time.monotonic() - self.started:6.1f}s] {text}", file=sys.stderr, flush=True)
