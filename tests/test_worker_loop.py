"""The worker loop waits instead of spinning while its work cannot run (every block held, as a
prefill worker's are while their KV is in transfer), and runs it as soon as blocks come back."""

import gc
import signal
import time

import pytest

from common import protocol as P
from common.sampling_params import SamplingParams
from common.worker import IDLE_POLL_MS, STALLED_POLL_MS, WorkerBase, WorkerConfig
from common.config import EngineConfig

pytestmark = pytest.mark.timeout(120)


class LoopUnderTest(WorkerBase):
    """A worker with no router answering (its Register goes nowhere): the loop alone."""
    role = "decode"

    def __init__(self):
        super().__init__(WorkerConfig(router="tcp://127.0.0.1:9", engine=EngineConfig(
            model="dummy:llama-tiny", num_blocks=8, max_num_seqs=4)))
        self.finished = []

    def on_router(self, msg):
        pass

    def on_outputs(self, outputs):
        self.finished += [o.request_id for o in outputs if o.finished]


def test_a_worker_whose_work_waits_for_blocks_polls_instead_of_spinning():
    worker = LoopUnderTest()
    engine = worker.engine
    held = engine.reserve(6 * engine.config.block_size)  # 7 of 8 blocks, as if KV were arriving into them
    assert held is not None and engine.block_manager.num_free_blocks == 1  # the request needs 3
    engine.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=3), request_id="waits")
    timeouts, poll = [], worker.poller.poll

    frozen = []

    def watched_poll(timeout):
        frozen.append(gc.get_freeze_count())
        timeouts.append(timeout)
        if len(timeouts) == 20:  # the KV "arrived" elsewhere and the blocks came back
            engine.unreserve(held)
        if worker.finished:
            worker.stopping = True
        return poll(timeout)

    worker.poller.poll = watched_poll
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        worker.run()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert worker.finished == ["waits"]
    # what was alive once it started (its model, its pool's bookkeeping) is out of the collector's
    # sight while it serves (freeze_startup_objects), and back once it closed
    assert min(frozen) > 1000 and gc.get_freeze_count() == 0
    # the first turn steps at once; every turn until the blocks came back found nothing to run, and waited
    assert timeouts[1:20] == [STALLED_POLL_MS] * 19
    assert 0 in timeouts[20:], "once it could run, the loop stepped without waiting"
    assert worker.poll_timeout() == IDLE_POLL_MS


def test_objects_made_after_the_startup_freeze_are_still_collected():
    import weakref

    from common.engine import freeze_startup_objects

    class Node:
        pass
    freeze_startup_objects()
    try:
        node = Node()
        node.me = node  # a cycle: only the collector frees it
        gone = weakref.ref(node)
        del node
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()


def test_a_process_that_froze_its_startup_objects_exits_without_leak_reports():
    """Objects left frozen at exit are never freed: Triton's bindings (nanobind) printed some thirty
    lines of "leaked" types as `bench engine --batch-invariant` exited."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = ("from common.engine import Engine, freeze_startup_objects\n"
            "from common.sampling_params import SamplingParams\n"
            "e = Engine(model='dummy:nanogpt', batch_invariant=True)\n"
            "freeze_startup_objects()\n"
            "print(e.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.startswith("["), r.stderr[-2000:]
    assert "leaked" not in r.stderr, r.stderr[-2000:]


def test_a_signal_handled_inside_a_wake_up_returns_and_wakes_the_loop():
    """Python runs a signal handler between two bytecodes of the main thread, which may be inside
    the waker's lock (a second SIGTERM during the first's handler): the handler must not take it."""
    import select
    import threading
    import types

    from common.channel import Waker
    from common.signals import StopSignals

    waker = Waker()
    worker = types.SimpleNamespace(stops=StopSignals(), waker=waker, wake=waker.wake)

    def handled_inside_the_lock():
        with waker._lock:  # as wake() holds it when the signal comes
            WorkerBase._on_signal(worker, signal.SIGTERM, None)

    thread = threading.Thread(target=handled_inside_the_lock, daemon=True)
    thread.start()
    thread.join(timeout=5)
    try:
        assert not thread.is_alive(), "the handler waited for a lock its own thread held"
        assert worker.stops.count == 1 and select.select([waker.fd], [], [], 0)[0] == [waker.fd]
    finally:
        if not thread.is_alive():
            waker.close()


def test_a_worker_no_router_answers_says_so_every_few_seconds(monkeypatch, caplog):
    """Its --router names no router's worker port (or the router is not up yet): it keeps trying,
    and says where it is trying and since when, rather than waiting in silence."""
    from common import worker as worker_module

    monkeypatch.setattr(worker_module, "NO_ROUTER_S", 2.0)
    worker = LoopUnderTest()
    try:
        with caplog.at_level("WARNING", logger="pdserve.worker"):
            for now in (100.0, 101.0, 102.5, 103.6, 104.7):  # registrations go every 0.5 s at most
                worker._tick(now)
        said = [r.getMessage() for r in caplog.records if "no router has answered" in r.getMessage()]
        assert len(said) == 2 and "at tcp://127.0.0.1:9 for 2 s" in said[0] and "for 5 s" in said[1], said
        assert "--worker-port" in said[0]
    finally:
        worker.close()


def test_a_worker_the_router_refuses_says_so_at_once_then_every_few_seconds(monkeypatch, caplog):
    """A refused handshake (the router does not authorize this worker's CURVE key) cannot mend by
    waiting: the worker says so when its socket's monitor reports it, not NO_ROUTER_S later."""
    import zmq
    from common import worker as worker_module

    class Monitor:
        events = [zmq.EVENT_HANDSHAKE_FAILED_AUTH]

        def poll(self, timeout):
            return bool(self.events)

    monitor = Monitor()
    monkeypatch.setattr(worker_module, "recv_monitor_message", lambda sock: {"event": monitor.events.pop(0)})
    worker = LoopUnderTest()
    real_monitor, worker.router.monitor = worker.router.monitor, monitor
    try:
        with caplog.at_level("WARNING", logger="pdserve.worker"):
            for now in (100.0, 100.6):
                worker._tick(now)
            said = [r.getMessage() for r in caplog.records]
            assert len(said) == 1 and "refuses to talk: it refused this worker's CURVE key" in said[0], said
            monitor.events.append(zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # each retry fails the same way
            for now in (101.2, 101.8, 110.1):
                worker._tick(now)
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2 and "refuses to talk" in said[1], said
    finally:
        worker.router.monitor = real_monitor
        worker.close()


def test_a_heartbeat_counts_from_its_incarnations_start():
    """A worker that registers anew (the router declared it dead, or restarted) starts a new
    incarnation, whose counters the router takes from zero: they must not carry the process's
    past, which the router has counted already."""
    worker = LoopUnderTest()
    sent = []
    worker.to_router = sent.append

    def beat(kv_bytes: int, queries: int, preemptions: int):
        worker.kv_bytes["shm"], worker.engine.block_manager.prefix_queries = kv_bytes, queries
        worker.engine.scheduler.num_preemptions = preemptions
        worker.registered, worker._last_heartbeat = True, 0.0
        worker._tick(time.monotonic())
        last = [m for m in sent if isinstance(m, P.Heartbeat)][-1]
        return last.incarnation, (last.kv_bytes["shm"], last.prefix_queries, last.preemptions)

    try:
        first, counted = beat(1000, 64, 2)
        assert counted == (1000, 64, 2)  # the first incarnation's counters are the process's
        worker._connect_router()  # as the router's "re-register" has it do
        again, counted = beat(1500, 80, 7)
        assert again != first and counted == (500, 16, 5)
    finally:
        worker.close()


def test_workers_in_containers_of_one_router_take_distinct_default_ids(monkeypatch):
    """Each container's worker is often PID 1: its default id names its host (the container) too.
    (Both workers here have this process's PID, as two containers' would have 1.)"""
    ids = []
    for host in ("3f2a9c1d0b7e", "8c41d2e9aa03"):
        monkeypatch.setattr("socket.gethostname", lambda host=host: host)
        worker = LoopUnderTest()
        ids.append(worker.worker_id)
        worker.close()
    assert ids[0] != ids[1] and all(i.startswith("decode-") for i in ids), ids
