"""Whether a one-sided writer (shm, cuda_ipc) is inside a copy into a peer's pool, as the peer
sees it: a decode worker takes back blocks whose lease ended only at a moment when the process
they were granted to copies nothing.

A writer checks its lease as each copy starts (mapped.py), LEASE_MARGIN_S before the decode
worker's end of it, so no copy starts after that end. One that started in time may still run
past it if its process was stopped inside it (SIGSTOP, a debugger, a swap storm) for longer than
the margin, and would then write into blocks given to another request. So each writer process
counts the copies it began and ended in a 16-byte file of /dev/shm named by its pid and start
time; at a moment after the lease's end when the two are equal, no copy that began before that
end is still running, whatever the threads, and none can begin after it.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import mmap
import os
import threading

from common.kv_cache import SHM_DIR

PREFIX = "pdserve-copies"
_SIZE = 16  # two unsigned 64-bit counts: copies begun, copies ended


def _started(pid: int) -> str | None:
    """When process pid started (clock ticks since boot; /proc/PID/stat's 22nd field): with the pid,
    a name no later process of this host shares. None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _path(pid: int, started: str) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}-{pid}-{started}")


class CopyCount:
    """This process's count of copies into peers' pools, in its file, for decode workers to read
    (copies_in_flight). One per process: counted()."""

    def __init__(self):
        self.pid = os.getpid()
        self.lock = threading.Lock()  # copies run on several threads (copiers, cuda_ipc's queuing)
        self.begun = self.ended = 0
        self.path, self.view = None, None
        started = _started(self.pid)
        if started is None:
            return  # no /proc: peers cannot look either, and take blocks back at the lease's end
        _sweep()
        try:
            fd = os.open(_path(self.pid, started), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError:
            return  # likewise
        self.path = _path(self.pid, started)
        try:
            os.write(fd, bytes(_SIZE))
            self.view = memoryview(mmap.mmap(fd, _SIZE)).cast("Q")  # 8-byte aligned: each store is whole
        finally:
            os.close(fd)
        atexit.register(self.close)

    @contextlib.contextmanager
    def counted(self):
        """Around one copy, its lease check included: begun is stored before the check, so that a
        decode worker that reads no copy in flight after the lease's end knows that any copy
        begun later saw the lease ended (a store reaches other cores long before the margin's second)."""
        with self.lock:
            self.begun += 1
            if self.view is not None:
                self.view[0] = self.begun
        try:
            yield
        finally:
            with self.lock:
                self.ended += 1
                if self.view is not None:
                    self.view[1] = self.ended

    def close(self):
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.path = None


def _sweep():
    """Remove the files of writers that have exited (a killed one cannot)."""
    for path in glob.glob(_path("*", "*")):
        pid, _, started = path[len(_path("", "")) - 1:].partition("-")
        if pid.isdigit() and _started(int(pid)) != started:
            with contextlib.suppress(OSError):
                os.unlink(path)


_this_process: CopyCount | None = None
_made = threading.Lock()


def counted() -> contextlib.AbstractContextManager:
    """This process's CopyCount.counted(), the count made on first use (anew in a forked child)."""
    global _this_process
    with _made:
        if _this_process is None or _this_process.pid != os.getpid():
            _this_process = CopyCount()
    return _this_process.counted()


def copies_in_flight(pid: int) -> int:
    """How many copies process pid of this host was inside at one moment between this call's start
    and end: 0 if it counts none (not a writer, exited, or no /proc here). Ended is read before
    begun, so that copies begun and ended between the two reads never hide one still running."""
    started = _started(pid)
    if started is None:
        return 0
    try:
        fd = os.open(_path(pid, started), os.O_RDONLY)
    except OSError:
        return 0
    try:
        with mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ) as m:
            view = memoryview(m).cast("Q")
            ended = view[1]
            begun = view[0]
            view.release()
    except (OSError, ValueError):  # a file cut short: not one of ours
        return 0
    finally:
        os.close(fd)
    return begun - ended
