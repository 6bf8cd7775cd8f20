"""Where a transport's work runs off the worker's main loop: JobThread (a thread of our own that
runs jobs in order), and, for CUDA pools, streams of the transport's own that wait on an event
recorded when a layer was handed over (written, on_stream), so that a streamed layer waits for
that layer only and decode steps never queue behind a transfer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
from typing import Callable

import torch


class JobThread:
    """One daemon thread that runs jobs in order. Not a ThreadPoolExecutor: the interpreter joins
    those at exit, so a connect stuck on a peer that never came would hold up our exit."""

    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """A future of fn(*args); cancelled at once if the thread was shut down."""
        future = concurrent.futures.Future()
        if self.closed:
            future.cancel()
        else:
            self.jobs.put((future, fn, args))
        return future

    def _loop(self):
        while (job := self.jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:
                    future.set_exception(e)

    def shutdown(self):
        """Cancel the jobs not started; the thread ends after the one running, if any."""
        self.closed = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self.jobs.put(None)


def run_now(fn: Callable) -> concurrent.futures.Future:
    """fn() run here, as a done future (of its result or its exception), for a job that needs no thread."""
    future = concurrent.futures.Future()
    try:
        future.set_result(fn())
    except Exception as e:
        future.set_exception(e)
    return future


def written(t: torch.Tensor):
    """For a CUDA tensor, an event after the work queued so far on this thread's stream (the
    forward that wrote it), for a transport's own stream to wait on; None elsewhere. Waiting on
    this and not on the whole stream lets a streamed layer go before the later layers are done."""
    if t.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event


def on_stream(stream) -> contextlib.AbstractContextManager:
    """Run on this CUDA stream, from any thread (None: as is). The thread's device is set first, so
    that leaving the context does not switch the thread to GPU 0."""
    if stream is None:
        return contextlib.nullcontext()
    torch.cuda.set_device(stream.device)
    return torch.cuda.stream(stream)


def failure(f: concurrent.futures.Future | None) -> str | None:
    """Why this future failed, or None (not done, or done well)."""
    if f is None or not f.done():
        return None
    if f.cancelled():
        return "cancelled: its pair was closed"
    return None if f.exception() is None else f"{type(f.exception()).__name__}: {f.exception()}"

