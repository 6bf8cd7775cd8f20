"""How busy the machine was while we measured: the CPU our own processes used and the CPU everyone
else's did, in cores, from /proc.

On a machine shared with other work, the others' CPU is contention that our figures were taken
under: `bench scaling` reports it per rate, the profile divides it out of the times it fits, and the
simulator can add it back (Placement.background_cores) to predict a measurement taken under it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (0 for one that is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def children(pid: int) -> list[int]:
    """The pids of a process's children (a router's API servers), from /proc."""
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def busy_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since boot (all processes)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / _TICK


class CpuWatch:
    """CPU used between start and stop, in cores: by each named group of processes, by this
    process ("client": the load generator), and by everyone else on the machine ("others")."""

    def __init__(self, groups: dict[str, list[int]]):
        self.groups = groups
        self.wall, self.busy, self.start = time.perf_counter(), busy_seconds(), self._now()

    def _now(self) -> dict[str, float]:
        out = {name: sum(cpu_seconds(p) for p in pids) for name, pids in self.groups.items()}
        out["client"] = time.process_time()
        return out

    def stop(self) -> dict[str, float]:
        wall = self.elapsed = max(1e-9, time.perf_counter() - self.wall)
        now = self._now()
        out = {name: (now[name] - self.start[name]) / wall for name in now}
        out["others"] = max(0.0, (busy_seconds() - self.busy) / wall - sum(out.values()))
        return out
