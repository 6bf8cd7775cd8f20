"""Whether a one-sided writer (shm, cuda_ipc) may still be inside a copy into a peer's pool that
began before a lease ended, as the peer sees it: a decode worker takes back blocks whose lease
ended without word from their writer only once every such copy has ended.

A writer checks its lease as each copy starts (mapped.py), LEASE_MARGIN_S before the decode
worker's end of it, so no copy starts after that end. One that started in time may still run
past it if its process was stopped inside it (SIGSTOP, a debugger, a swap storm) for longer than
the margin, and would then write into blocks given to another request. So each writer process
counts the copies each of its threads began and ended, in a file of /dev/shm named by its pid
and start time (a slot of two counts per thread). Past a lease, the decode worker notes, for
each slot with a copy in flight, the count begun, and waits until as many have ended there: no
idle moment of the whole writer is needed, so a busy writer holds nothing up.

A copy is counted from before its lease check, so one the decode worker does not see began
after the lease's end (a store reaches other cores long before the margin's second), and found
the lease ended. Ended is read before begun, so that copies begun and ended between the two
reads never hide one that was running. A cuda_ipc copy queued on the GPU (to a peer on the same
device) is counted while it is queued: the device runs it a step or so later, which the margin
covers for steps under a second.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import itertools
import mmap
import os
import threading

from common.kv_cache import SHM_DIR

PREFIX = "pdserve-copies"
SLOTS = 64  # threads past this many share slots, and take turns copying
_SIZE = SLOTS * 16  # per slot, two unsigned 64-bit counts: copies begun, copies ended


def _started(pid: int) -> str | None:
    """When process pid started (clock ticks since boot; /proc/PID/stat's 22nd field): with the pid,
    a name no later process of this host shares. None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _path(pid, started) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}-{pid}-{started}")


class CopyCount:
    """This process's counts of copies into peers' pools, per thread, in its file, for decode
    workers to read (counts_of). One per process: counted()."""

    def __init__(self):
        self.pid = os.getpid()
        self.locks = [threading.Lock() for _ in range(SLOTS)]  # held through a copy: a slot's never overlap
        self.thread_slot = threading.local()
        self.slots_given = itertools.count()
        self.path, self.view = None, None  # the file, and its counts: view[2 * slot] begun, view[2 * slot + 1] ended
        started = _started(self.pid)
        if started is None:
            return  # no /proc: peers cannot look either, and take blocks back at the lease's end
        sweep()
        path = _path(self.pid, started)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError:
            return  # likewise
        try:
            os.write(fd, bytes(_SIZE))
            self.view = memoryview(mmap.mmap(fd, _SIZE)).cast("Q")  # 8-byte aligned: each store is whole
        finally:
            os.close(fd)
        self.path = path
        atexit.register(self.close)

    @contextlib.contextmanager
    def counted(self):
        """Around one copy, its lease check included (see the module's docstring)."""
        view = self.view
        if view is None:
            yield
            return
        slot = getattr(self.thread_slot, "slot", None)
        if slot is None:
            slot = self.thread_slot.slot = next(self.slots_given) % SLOTS
        with self.locks[slot]:
            view[2 * slot] += 1
            try:
                yield
            finally:
                view[2 * slot + 1] += 1

    def close(self):
        """Remove the file at exit, unless a copy is still running (a daemon copier thread runs on
        while the interpreter shuts down) or this is a forked child: sweep() removes it later."""
        if self.path is not None and os.getpid() == self.pid and not in_flight(_pairs(self.view)):
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.path = None


def sweep():
    """Remove the files of writers that have exited (a killed one cannot)."""
    for path in glob.glob(_path("*", "*")):
        pid, _, started = os.path.basename(path)[len(PREFIX) + 1:].partition("-")
        if pid.isdigit() and _started(int(pid)) != started:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _pairs(view: memoryview) -> list[tuple[int, int]]:
    """(begun, ended) per slot of a counts file's view, ended read first: copies begun and ended
    between the two reads never hide one that was running."""
    ended = view[1::2].tolist()
    begun = view[0::2].tolist()
    return list(zip(begun, ended))


_this_process: CopyCount | None = None
_made = threading.Lock()


def counted() -> contextlib.AbstractContextManager:
    """This process's CopyCount.counted(), the count made on first use (anew in a forked child)."""
    global _this_process
    with _made:
        if _this_process is None or _this_process.pid != os.getpid():
            _this_process = CopyCount()
    return _this_process.counted()


def close() -> None:
    """At this process's end: its file goes (CopyCount.close), also where the end skips atexit
    (a worker's os._exit)."""
    if _this_process is not None:
        _this_process.close()


def counts_of(pid: int) -> list[tuple[int, int]]:
    """Process pid's (begun, ended) per slot (_pairs); [] if it counts nothing (not a writer,
    exited, or no /proc here)."""
    started = _started(pid)
    if started is None:
        return []
    try:
        fd = os.open(_path(pid, started), os.O_RDONLY)
    except OSError:
        return []
    try:
        with mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ) as m:
            view = memoryview(m).cast("Q")
            pairs = _pairs(view)
            view.release()
    except (OSError, ValueError):  # a file cut short: not one of ours
        return []
    finally:
        os.close(fd)
    return pairs


def in_flight(counts: list[tuple[int, int]]) -> dict[int, int]:
    """The slots of counts_of() with a copy in flight: slot -> the copies begun there by then."""
    return {slot: begun for slot, (begun, ended) in enumerate(counts) if begun > ended}


def ended_since(counts: list[tuple[int, int]], waited: dict[int, int]) -> bool:
    """Whether every copy in flight when `waited` (in_flight()) was read has ended, by counts_of() now."""
    return all(slot >= len(counts) or counts[slot][1] >= begun for slot, begun in waited.items())
