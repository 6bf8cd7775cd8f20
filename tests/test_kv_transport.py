"""KV transports (common/kv_transport/), CPU ones: each moves KV bit for bit between two real
processes; a 1P1D cluster on each gives exactly the monolithic engine's tokens; a decode worker
refuses a mismatched layout, an unoffered transport and a malformed chunk with clear errors; a
forced transport the peer lacks is refused naming both; and a decode worker killed mid-transfer
leaves the prefill worker no blocks held and no shared-memory segment behind."""

import contextlib
import glob
import os
import random
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
import zmq

import bench.transfer as B
from common import protocol as P
from common.channel import Channel
from common.config import EngineConfig
from common.engine import Engine
from common.kv_cache import SharedSegment
import common.kv_transport.frames as K
from common.kv_transport import (Inbox, Outgoing, ShmReceiver, ShmSender, TransportError,
                                 ZmqSender, choose, unit_bytes, unit_view)
from common.kv_transport.copy_count import counts_of, ended_since, in_flight
from common.kv_transport.frames import piece_frames as _piece
from common.kv_transport.mapped import HOSTNAME
from common.sampling_params import SamplingParams
from common.worker import WorkerConfig
from prefill_worker.worker import PrefillWorker
from router.client import Client, RequestError
from router.launcher import Cluster
from tests.cluster import cluster, tokens_of, wait_blocks_free
from tests.test_cluster import check_cluster_matches

pytestmark = pytest.mark.timeout(300)

CPU_TRANSPORTS = ["zmq", "shm", "gloo"]


def leaked_segments(before: set[str]) -> set[str]:
    """New /dev/shm/pdserve-kv-PID-* segments whose creator is gone."""
    return {p for p in set(glob.glob("/dev/shm/pdserve-kv-*")) - before
            if not os.path.exists(f"/proc/{SharedSegment.creator(os.path.basename(p))}")}


@pytest.fixture(autouse=True)
def no_shm_leaks():
    before = set(glob.glob("/dev/shm/pdserve-kv-*"))
    yield
    deadline = time.monotonic() + 10  # a killed creator's resource tracker unlinks its segment
    while leaked_segments(before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leaked_segments(before)


# ----------------------------------------------------------------------------- two processes, one transport

@pytest.mark.parametrize("fragmented", [False, True], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_transport_delivers_bit_identical_kv(transport, fragmented):
    shape, dtype, device, n = B.kv_shape("dummy:llama-tiny", 300, 16, None, None, transport)
    run = B.TransportRun(transport, shape, dtype, device, n, fragmented)  # its warm-up compares every bit
    try:
        for _ in range(3):
            run.one()
        run.one(check=True)
    finally:
        run.close()


def test_bench_transfer_splits_a_one_sided_senders_host_time_by_phase_and_profiles_it(capsys):
    """bench transfer on shm: the host's part until the header, by phase (open, copies, finish,
    header), each within that part; --profile lists the sender's own functions, not the wait for
    the acknowledgement."""
    result = B.run_transfer_bench("shm", "dummy:llama-tiny", 64, 3, layer_groups=2, profile=40)
    phases = result["host_us"]
    assert list(phases) == list(B.PHASES) and all(us > 0 for us in phases.values())
    assert sum(phases.values()) <= 1e3 * result["header_sent_p99_ms"] * len(phases)
    functions = [f["function"] for f in result["host_functions"]]
    assert any(f.startswith("send (mapped.py") for f in functions) and any(f.startswith("open (") for f in functions)
    assert not any(f.startswith("recv (channel.py") for f in functions)  # the wait for the KVAck is not the host's
    out = capsys.readouterr().out
    assert "by phase" in out and "by their own time" in out


def test_bfloat16_kv_crosses_zmq_bit_identical():
    shape, dtype, device, n = B.kv_shape("dummy:nanogpt", 100, 8, "bfloat16", None, "zmq")
    B.TransportRun("zmq", shape, dtype, device, n, fragmented=True).close()


def test_the_bit_check_catches_wrong_kv():
    shape, dtype, device, n = B.kv_shape("dummy:llama-tiny", 64, 16, None, None, "zmq")
    run = B.TransportRun("zmq", shape, dtype, device, n)
    try:
        run.src = run.src[1:] + run.src[:1]  # the sender now sends other blocks than the receiver expects
        with pytest.raises(RuntimeError, match="the received KV differs from the sent KV"):
            run.one(check=True)
    finally:
        run.close()


def test_a_tracked_send_is_released_only_once_zmq_lets_go_of_every_frame():
    """The prefill worker reuses blocks sent in place only once Released says so. On inproc,
    zmq shares the very memory with the receiver: released only when the receiver drops it."""
    ctx = zmq.Context()
    sender = Channel.connect(ctx, zmq.DEALER, "inproc://released")  # no peer yet: the message waits
    data = memoryview(bytearray(os.urandom(1 << 20)))
    released = sender.try_send(P.KVRelease("r", 0), [data[:300_000], data[300_000:]], track=True)
    receiver = None
    try:
        time.sleep(0.2)
        assert not released.done
        receiver = Channel.bind(ctx, zmq.ROUTER, "inproc://released")
        env = receiver.recv(5000)
        assert b"".join(bytes(f.buffer) for f in env.frames) == data.tobytes()
        time.sleep(0.2)
        assert not released.done  # the receiver still holds both frames
        env.frames.pop()
        time.sleep(0.2)
        assert not released.done  # and still the first
        del env
        deadline = time.monotonic() + 5  # pyzmq's collector thread lets go of it
        while not released.done:
            assert time.monotonic() < deadline, "the frames were never released"
            time.sleep(0.01)
    finally:
        sender.close()
        if receiver is not None:
            receiver.close()
        ctx.term()


@pytest.mark.parametrize("seed", range(40))
def test_pieces_in_any_layout_and_order_land_in_the_right_blocks(seed, monkeypatch):
    """The sender's frame plan and the receiver's placement, without processes: random pools,
    block tables with runs and holes, pieces of random layers and blocks in random order, frame
    bounds small enough that stretches are cut and gathered."""
    rng = random.Random(seed)
    layers, pool_blocks, block_size = rng.randint(1, 6), rng.randint(8, 40), rng.choice([1, 4, 16])
    shape = (layers, 2, pool_blocks, block_size, rng.choice([1, 2, 8]), rng.choice([8, 64, 256]))
    n = rng.randint(1, pool_blocks)

    def table():  # some consecutive runs, some scattered blocks
        ids = list(range(pool_blocks))
        if rng.random() < 0.5:
            rng.shuffle(ids)
        else:
            cut = rng.randrange(pool_blocks)
            ids = ids[cut:] + ids[:cut]
        return ids[:n]
    src_pool = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    dst_pool = torch.zeros(shape)
    out = Outgoing("r", 0, src_pool, table(), table(), {}, None)
    inbox = Inbox(dst_pool, out.dst_blocks)
    ub, units = unit_bytes(src_pool), unit_view(src_pool)
    monkeypatch.setattr(K, "MIN_FRAME_BYTES", ub * rng.randint(1, 4))
    monkeypatch.setattr(K, "CHUNK_BYTES", K.MIN_FRAME_BYTES * rng.randint(2, 6))  # as the real ones: at least twice
    bounds = sorted({0, layers, *rng.sample(range(layers + 1), min(2, layers + 1))})
    block_bounds = sorted({0, n, *rng.sample(range(n + 1), min(2, n + 1))})
    pieces = [(range(a, b), range(c, d)) for a, b in zip(bounds, bounds[1:])
              for c, d in zip(block_bounds, block_bounds[1:])]
    rng.shuffle(pieces)
    for layer_range, block_range in pieces:
        for frame, unit_runs in _piece(out, layer_range, block_range):
            assert (frame.end - frame.first) * ub <= K.CHUNK_BYTES
            if frame.in_place:
                assert len(frame.parts) == 1 and frame.parts[0][1] * ub >= K.MIN_FRAME_BYTES
            inbox.put(unit_runs, frame.take(units).clone())
            assert inbox.error is None
    assert inbox.complete
    assert torch.equal(dst_pool[:, :, out.dst_blocks], src_pool[:, :, out.src_blocks])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("layers", [slice(None), slice(2, 3)])
@pytest.mark.parametrize("head_dim, word", [(8, torch.int64), (6, torch.int32), (3, torch.int16)])
def test_every_way_of_copying_blocks_gives_the_runs_copies_bits(layers, device, head_dim, word):
    """What a GPU does with a grant (common/kv_transport/block_copy.py: one Triton launch on one GPU,
    interpreted here on a CPU; a gather and a scatter between two) gives the runs' copies' bits,
    fragmented, whole and one layer at a time, moved as the widest words a row divides into."""
    from common.kv_transport.block_copy import block_runs, copy_blocks, gather_scatter, launch_copy, words

    rng = random.Random(4)
    src_blocks, dst_blocks = rng.sample(range(40), 23), list(range(5, 15)) + rng.sample(range(20, 40), 13)
    assert len(block_runs(src_blocks, dst_blocks)) > 4
    src = torch.randn(4, 2, 40, 16, 2, head_dim, device=device).to(torch.bfloat16)
    assert {t.dtype for t in words(src[layers], src[layers])} == {word}
    want = torch.zeros_like(src)
    for s, d, n in block_runs(src_blocks, dst_blocks):
        want[layers, :, d:d + n] = src[layers, :, s:s + n]
    assert want.count_nonzero() > 0
    for copy in (gather_scatter, launch_copy, copy_blocks):  # copy_blocks: the kernel on a GPU, the runs on a CPU
        got = torch.zeros_like(src)
        copy(src, src_blocks, got, dst_blocks, layers)
        assert torch.equal(got, want), copy.__name__
    bigger = torch.zeros(4, 2, 50, 16, 2, head_dim, device=device, dtype=torch.bfloat16)  # pools of other sizes
    launch_copy(src, src_blocks, bigger, [b + 10 for b in dst_blocks], layers)
    assert torch.equal(bigger[:, :, 10:], want)


def test_a_handles_error_is_its_first_failed_send_and_looks_at_each_done_one_once(monkeypatch):
    """Handle.error() is asked after every streamed piece: it names the first send that failed, in
    order, one still running included in the look past it, and each send done well is looked at
    once, not on every piece (a rescan cost a 16-layer stream some 170 us a prefill)."""
    import concurrent.futures

    from common.kv_transport import base
    from common.kv_transport.base import Handle

    looked = []
    monkeypatch.setattr(base, "failure", lambda f: looked.append(f) or (f.exception() and str(f.exception())
                                                                        if f.done() else None))

    def done(error=None):
        f = concurrent.futures.Future()
        f.set_exception(error) if error else f.set_result(None)
        return f
    handle = Handle()
    for _ in range(16):
        handle.futures.append(done())
        assert handle.error() is None
    assert len(looked) == 16  # each once
    running = concurrent.futures.Future()
    handle.futures += [running, done(RuntimeError("second")), done(RuntimeError("third"))]
    assert handle.error() == "second"  # past the one still running
    handle = Handle(futures=[done(), running, done()])
    assert handle.error() is None
    running.set_exception(RuntimeError("late"))
    assert handle.error() == "late"


def test_a_streamed_transfers_block_ids_go_to_the_device_once(monkeypatch):
    """Streaming copies the same blocks of each layer in turn, a layer's pieces of every request in
    the step one after another: each request's ids are uploaded for its first layer and read again
    for the others, however many requests stream (the most recently used are kept, per stream)."""
    from common.kv_transport import block_copy

    uploads = []
    monkeypatch.setattr(block_copy, "upload", lambda t, device: uploads.append(t) or t)
    monkeypatch.setattr(block_copy, "_IDS", {})
    src, dst = torch.randn(4, 2, 12, 16, 2, 8), torch.zeros(4, 2, 12, 16, 2, 8)
    requests = [([r % 12, (r + 5) % 12], [11 - r % 12, r // 12]) for r in range(33)]  # 33 streaming a step
    for layer in range(4):
        for src_blocks, dst_blocks in requests:
            block_copy.launch_copy(src, src_blocks, dst, dst_blocks, slice(layer, layer + 1))
    assert len(uploads) == len(requests)
    src_blocks, dst_blocks = requests[-1]
    assert torch.equal(dst[:, :, dst_blocks], src[:, :, src_blocks])
    monkeypatch.setattr(block_copy, "IDS_KEPT", 40)
    block_copy.launch_copy(src, requests[0][0], dst, requests[0][1], slice(0, 1))  # used again: the most recent
    for other in range(39):  # others, uploaded each: the 32 requests used before it make room
        block_copy.launch_copy(src, [other % 12], dst, [other // 12], slice(0, 1))
    assert len(uploads) == len(requests) + 39 and len(block_copy._IDS) == 40
    block_copy.launch_copy(src, requests[0][0], dst, requests[0][1], slice(0, 1))
    block_copy.launch_copy(src, requests[1][0], dst, requests[1][1], slice(0, 1))
    assert len(uploads) == len(requests) + 40  # the first still kept, the second forgotten


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
def test_gpu_transport_delivers_bit_identical_kv(transport):
    if transport == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL point to point needs two GPUs, one per rank")
    shape, dtype, device, n = B.kv_shape("dummy:llama-tiny", 300, 16, None, "cuda:0", transport)
    run = B.TransportRun(transport, shape, dtype, device, n, fragmented=True)
    try:
        run.one(check=True)
    finally:
        run.close()


@pytest.mark.gpu
def test_cuda_ipc_on_one_gpu_decodes_only_once_copies_held_up_on_the_device_are_done(monkeypatch):
    """The header goes ahead of the copies: with the copy stream held up on the device for about
    0.1 s, the receiver must poll the event and compare the bits only after it completed (the
    warm-up transfer checks every bit); it would read zeros if it took the header's word."""
    from common.kv_transport.cuda_ipc import CudaIpcSender

    stream = CudaIpcSender._stream

    def held_up(self, device):
        made = device not in self.streams
        s = stream(self, device)
        if made:
            with torch.cuda.stream(s):
                torch.cuda._sleep(200_000_000)
        return s
    monkeypatch.setattr(CudaIpcSender, "_stream", held_up)
    shape, dtype, device, n = B.kv_shape("dummy:llama-tiny", 300, 16, None, "cuda:0", "cuda_ipc")
    t0 = time.perf_counter()
    run = B.TransportRun("cuda_ipc", shape, dtype, device, n, fragmented=True)  # its warm-up compares the bits
    try:
        assert run.sender.rings, "the copies were not queued with an event (the host waited for them)"
        assert time.perf_counter() - t0 > 0.05
    finally:
        run.close()


@pytest.fixture
def shm_peer():
    """A decode worker's shared pool, its advert, our own pool of the same shape, and a ShmSender:
    (segment, advert, ours, sender), all closed after the test."""
    shape = (2, 2, 4, 16, 2, 8)
    segment = SharedSegment.create(shape, torch.float32)
    sender = ShmSender()
    try:
        yield segment, ShmReceiver(segment.tensor, segment, "float32").advert(), torch.randn(shape), sender
    finally:
        sender.close()
        segment.close()


def test_a_one_sided_copy_queued_past_the_lease_writes_nothing(shm_peer):
    """shm copies run on a thread: one that starts after the grant's lease (the blocks may have
    gone to another request) must fail its transfer, not write into them."""
    segment, advert, ours, sender = shm_peer
    for write_by, copied in ((time.monotonic() - 0.001, False), (time.monotonic() + 60, True)):
        segment.tensor.zero_()
        out = Outgoing("r", 1, ours, [0, 1], [2, 3], advert, lambda m, f: None, write_by)
        handle = sender.open(out)
        sender.send(out, handle, range(2), range(2))
        sender.finish(handle)
        assert torch.equal(segment.tensor[:, :, 2:], ours[:, :, :2]) is copied
        assert (handle.error() is None) is copied
        if not copied:
            assert "lease ended before this copy could start" in handle.error()
            assert not segment.tensor.any()


def test_a_one_sided_copy_is_counted_for_the_peer_while_it_runs(shm_peer, monkeypatch):
    """The decode worker takes back blocks past their lease only while their writer is inside no
    copy: each copy into a peer's pool, its lease check included, is counted where it can see."""
    import common.kv_transport.mapped as M
    segment, advert, ours, sender = shm_peer
    seen = []
    monkeypatch.setattr(M, "copy_blocks", lambda *a: seen.append(len(in_flight(counts_of(os.getpid())))))
    for write_by in (time.monotonic() + 60, time.monotonic() - 1):
        out = Outgoing("r", 1, ours, [0, 1], [2, 3], advert, lambda m, f: None, write_by)
        handle = sender.open(out)
        sender.send(out, handle, range(2), range(2))
        sender.finish(handle)
    assert seen == [1]  # inside the copy; the late one wrote nothing
    assert in_flight(counts_of(os.getpid())) == {}


def test_a_dead_peers_pool_is_unmapped_only_after_the_copies_queued_into_it(shm_peer):
    """A prefill worker that swept a dead decode worker's pool while its copier thread still wrote
    into it died of SIGSEGV: the copies queued before the sweep go on (or fail), never into
    unmapped memory, and a copy queued after it fails its transfer by name."""
    _, advert, ours, sender = shm_peer
    out = Outgoing("r", 1, ours, [0, 1], [2, 3], advert, lambda m, f: None, time.monotonic() + 60)
    handle = sender.open(out)
    mapping = sender.maps[handle.info["key"]]
    gate = threading.Event()
    sender.copier.submit(gate.wait)  # the copier busy: the next copy waits in its queue
    sender.send(out, handle, range(2), range(2))
    sender.forget(advert)  # the sweep of a peer found gone
    assert mapping.tensor is not None  # not closed under the queued copy
    with pytest.raises(TransportError, match="worker is gone"):
        sender.send(out, handle, range(2), range(2))
    gate.set()
    sender.finish(handle)
    assert "closed here before this copy could start" in handle.error()
    sender.copier.submit(lambda: None).result(5)
    assert mapping.tensor is None  # closed on the copier's thread, after the copy


def test_choose_prefers_the_fastest_and_names_both_ends_when_none_fits():
    senders = {"shm": ShmSender(), "zmq": ZmqSender()}
    assert choose(senders, {"zmq": {}, "gloo": {"host": "h", "port": 1}}, "decode-0") == "zmq"
    far = {"shm": {"host": "elsewhere", "segment": "pdserve-kv-1-x", "nonce": "00", "shape": [1], "dtype": "float32"}}
    with pytest.raises(TransportError) as e:
        choose(senders, dict(far, gloo={}), "decode-0")
    assert "cannot reach decode worker 'decode-0' by a KV transport both use: shm: its pool is on host 'elsewhere'" \
        in str(e.value)
    with pytest.raises(TransportError) as e:
        choose(senders, {"gloo": {}}, "decode-0")
    assert "no KV transport in common with decode worker 'decode-0'" in str(e.value)
    assert "this prefill worker uses ['shm', 'zmq'], it offers ['gloo']" in str(e.value)
    from common.kv_transport.mapped import HOSTNAME

    exited = subprocess.Popen(["true"])
    exited.wait()  # a pid no process has now: a decode worker just killed (it was "no KV transport in common")
    dead = dict(far["shm"], host=HOSTNAME, segment=f"pdserve-kv-{exited.pid}-x")
    with pytest.raises(TransportError, match="cannot reach decode worker 'decode-0' by a KV transport both use: "
                                             "shm: its process has exited"):
        choose({"shm": senders["shm"]}, {"shm": dead}, "decode-0")
    forced = r"kv_transport='shm' is forced on this prefill worker, it offers \['zmq'\]"
    with pytest.raises(TransportError, match=forced):
        choose({"shm": senders["shm"]}, {"zmq": {}}, "decode-0", forced="shm")


# ----------------------------------------------------------------------------- clusters

@pytest.mark.parametrize("transport", CPU_TRANSPORTS + ["auto"])
def test_cluster_on_each_transport_matches_monolithic(tmp_path, transport):
    with cluster(tmp_path, worker_args=["--kv-transport", transport]) as c:
        check_cluster_matches(c.address, "dummy:nanogpt", n=30)
        with Client(c.address) as client:
            workers = wait_blocks_free(client)
            assert all(w["free_blocks"] == w["total_blocks"] for w in workers), workers
    used = "shm" if transport == "auto" else transport  # same host, CPU: shared memory is the fastest
    assert f"by {used}" in (tmp_path / "logs" / "prefill-0.log").read_text()
    # stopped, they exit cleanly (gloo's threads aborted the interpreter's teardown in about half the runs)
    assert [w.proc.returncode for w in c.workers] == [0, 0]
    # and take their copy counts with them (a worker's os._exit skipped the atexit that removes it)
    assert not [path for w in c.workers for path in glob.glob(f"/dev/shm/pdserve-copies-{w.proc.pid}-*")]


@pytest.mark.parametrize("enforce", [True, False], ids=["enforce-disagg", "fallback"])
def test_forced_transport_the_peer_lacks_is_refused_naming_both(tmp_path, enforce):
    """The error names both sides; without --enforce-disagg the decode worker then prefills the
    request itself (every prefill/decode pair failed it), and the router's log says why."""
    c = Cluster("dummy:nanogpt", 1, 1, 0, ["cpu"], "127.0.0.1", 0, 0, tmp_path / "logs", "least_loaded", [],
                threads=1, restart=False, router_args=["--enforce-disagg"] if enforce else [])
    c.workers[0].argv += ["--kv-transport", "shm"]  # prefill-0
    c.workers[1].argv += ["--kv-transport", "zmq"]  # decode-0
    try:
        c.start()
        with Client(c.address, timeout=60) as client:
            if enforce:
                with pytest.raises(RequestError) as e:
                    client.generate([1, 2, 3], max_tokens=4, temperature=0)
                message = e.value.message
            else:
                assert len(client.generate([1, 2, 3], max_tokens=4, temperature=0, ignore_eos=True).token_ids) == 4
                message = (tmp_path / "logs" / "router.log").read_text()
    finally:
        c.stop()
    assert "no KV transport in common with decode worker 'decode-0'" in message
    assert "kv_transport='shm' is forced on this prefill worker, it offers ['zmq']" in message


# ----------------------------------------------------------------------------- one decode worker, by hand

@contextlib.contextmanager
def decode_worker(tmp_path, transport: str, model: str = "dummy:nanogpt", args: tuple = ()):
    """A real decode worker process whose router is this test: its Register says where its KV
    ingress is; it is answered so that it heartbeats."""
    ctx = zmq.Context()
    router = Channel.bind(ctx, zmq.ROUTER, "tcp://127.0.0.1:0")
    with open(tmp_path / f"decode-{transport}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "common.cli", "decode", "--router", router.address,
                                 "--model", model, "--kv-transport", transport, "--threads", "1", *args],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        env = router.recv(120_000)
        assert env is not None and isinstance(env.msg, P.Register), (tmp_path / f"decode-{transport}.log").read_text()
        router.send(P.Registered(env.msg.worker_id, env.msg.incarnation), to=env.sender)
        yield types.SimpleNamespace(proc=proc, register=env.msg, identity=env.sender, router=router, ctx=ctx)
    finally:
        if proc.poll() is None:
            proc.terminate()  # a clean exit unlinks its shared pool
            proc.send_signal(signal.SIGCONT)  # one a failed test left stopped takes the SIGTERM too
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)  # also closes the test's own sockets on it


def heartbeat(d, timeout: float = 10.0) -> P.Heartbeat:
    """The decode worker's first heartbeat sent after now (older ones are skipped)."""
    while d.router.recv(0) is not None:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        env = d.router.recv(100)
        if env is not None and isinstance(env.msg, P.Heartbeat):
            return env.msg
    raise AssertionError("no heartbeat from the decode worker")


def test_decode_worker_refuses_bad_transfers_with_clear_errors(tmp_path):
    layout = Engine(model="dummy:nanogpt", num_blocks=4).kv_layout
    with decode_worker(tmp_path, "auto") as d:
        assert d.register.kv_transports == ["shm", "zmq", "gloo"]
        chan = Channel.connect(d.ctx, zmq.DEALER, d.register.kv_address)

        def ask(msg, frames=()):
            chan.send(msg, frames)
            env = chan.recv(10_000)
            assert env is not None, f"no answer to {type(msg).__name__}"
            return env.msg

        bad = dict(layout, head_dim=layout["head_dim"] * 2, dtype="bfloat16")
        refused = ask(P.KVReserve("a", 1, 20, bad))
        assert isinstance(refused, P.KVRefuse) and refused.code == "LAYOUT_MISMATCH"
        assert f"head_dim={bad['head_dim']!r}/{layout['head_dim']!r}" in refused.message
        assert "dtype='bfloat16'/'float32'" in refused.message

        def transfer(rid, transport, info=None, the_layout=layout, chunks=()):
            grant = ask(P.KVReserve(rid, 1, 20, layout))
            assert isinstance(grant, P.KVGrant) and set(grant.transports) == {"shm", "zmq", "gloo"}
            for chunk, frames in chunks:
                chan.send(chunk, frames)
            ack = ask(P.KVTransfer(rid, 1, list(range(21)), 20, 0, {}, 0, the_layout, 20, grant.block_ids[:2],
                                   transport, info if info is not None else {}))
            assert isinstance(ack, P.KVAck) and not ack.ok
            return ack.message

        differ = transfer("b", "zmq", the_layout=bad)
        assert "KV layouts differ (sender, receiver): dtype='bfloat16'/'float32'" in differ
        assert transfer("c", "nccl") == "KV transport 'nccl' is not offered here; offered: ['shm', 'zmq', 'gloo']"
        assert "a KV frame of 100 bytes; expected a positive multiple of" in \
            transfer("d", "zmq", chunks=[(P.KVChunk("d", 1, 2, [[0, 1]]), [b"x" * 100])])
        assert "only 0 of" in transfer("e", "zmq")  # no chunks at all
        assert "shm transfer into 'elsewhere'" in transfer("f", "shm", {"key": "elsewhere"})
        bad_pair = P.KVChunk("g", 1, 2, [[0, 1]], "gloo", {"pair": 3})
        assert "is not {pair: str, tag: int} of a working pair" in transfer("g", "gloo", chunks=[(bad_pair, [])])
        outside = P.KVChunk("h", 1, 2, [[0, 1], [10_000, 2]], "gloo", {"pair": "p/1", "tag": 0})
        assert "KV unit run [10000, 2] is not [first, count] inside" in transfer("h", "gloo", chunks=[(outside, [])])
        hb = heartbeat(d)
        while hb.free_blocks != hb.total_blocks:  # every refused reservation came back
            hb = heartbeat(d)
        assert d.proc.poll() is None


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_cancelled_reservation_waits_for_a_one_sided_writer(tmp_path, transport):
    """shm writers copy into our blocks unseen: a cancelled reservation's blocks come back when the
    writer says it is done (KVRelease), not before; with zmq only, at once."""
    layout = Engine(model="dummy:nanogpt", num_blocks=4).kv_layout
    with decode_worker(tmp_path, transport) as d:
        chan = Channel.connect(d.ctx, zmq.DEALER, d.register.kv_address)
        chan.send(P.KVReserve("x", 1, 100, layout))
        grant = chan.recv(10_000).msg
        assert isinstance(grant, P.KVGrant)
        d.router.send(P.CancelWork("x", 1), to=d.identity)
        time.sleep(0.5)  # the cancel is long handled by the next heartbeat
        hb = heartbeat(d)
        held = hb.total_blocks - hb.free_blocks
        assert held == (len(grant.block_ids) if transport == "shm" else 0), hb
        chan.send(P.KVRelease("x", 1))  # the writer is done with them
        while hb.free_blocks != hb.total_blocks:
            hb = heartbeat(d)


@contextlib.contextmanager
def writer_inside_a_copy():
    """A process that enters one counted copy (copy_count.py) and stays inside it until told, while
    another of its threads copies without pause, then waits to be killed: (process, a function
    that ends the first copy)."""
    code = ("import sys, threading, time; from common.kv_transport.copy_count import counted\n"
            "def busy():\n while True:\n  with counted(): time.sleep(0.05)\n"
            "threading.Thread(target=busy, daemon=True).start()\n"
            "with counted():\n print('in', flush=True); sys.stdin.readline()\n"
            "print('out', flush=True); sys.stdin.readline()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def leave():
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "out\n"
    try:
        assert proc.stdout.readline() == "in\n"
        yield proc, leave
    finally:
        proc.kill()
        proc.wait()


def test_the_copies_a_writer_is_inside_are_seen_from_another_process_and_a_dead_ones_file_is_swept():
    from common.kv_transport.copy_count import sweep

    with writer_inside_a_copy() as (writer, leave):
        counts = counts_of(writer.pid)
        waited = in_flight(counts)
        assert len(waited) in (1, 2) and not ended_since(counts, waited)  # the held copy, maybe the busy one's
        assert len(glob.glob(f"/dev/shm/pdserve-copies-{writer.pid}-*")) == 1
        time.sleep(0.3)
        assert not ended_since(counts_of(writer.pid), waited)  # the busy thread's copies ended; not the held one
        leave()
        assert ended_since(counts_of(writer.pid), waited)  # with no moment of the whole writer's idle
        assert counts_of(os.getppid()) == []  # a process that never counted
    with writer_inside_a_copy() as (killed, _):
        assert len(glob.glob(f"/dev/shm/pdserve-copies-{killed.pid}-*")) == 1
    # killed inside its copy: its file stays, counting one in flight (unless a decode worker that a
    # test running beside this one started has swept it since)
    assert counts_of(killed.pid) == []  # it has exited: it copies nothing
    sweep()  # as a writer or a decode worker starting does: the files of writers that have exited go
    assert not glob.glob(f"/dev/shm/pdserve-copies-{killed.pid}-*")


def test_a_forked_childs_exit_leaves_its_parents_count():
    """The count's file goes at its own process's exit: a forked child inherited the parent's exit
    hook, and its exit took the parent's file (its copies then unseen by decode workers)."""
    code = ("import os, sys, glob; from common.kv_transport.copy_count import counted\n"
            "with counted(): pass\n"
            "pid = os.fork()\n"
            "if pid == 0: sys.exit(0)\n"
            "os.waitpid(pid, 0)\n"
            "print(len(glob.glob(f'/dev/shm/pdserve-copies-{os.getpid()}-*')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "1", (r.stdout, r.stderr)


def test_blocks_past_their_lease_wait_for_a_writer_stopped_inside_a_copy(tmp_path):
    """A writer checks the lease as each copy starts, but one stopped inside a copy for longer than
    the lease's margin writes on when it resumes, past the lease's end: the blocks come back once
    the copies it was inside when the lease ended have ended (its other threads' later copies
    hold nothing up). Renewed too late, the reservation is refused, not granted other blocks under
    the same key (whose blocks were then lost). A writer inside no copy gets them back at the
    lease's end."""
    layout = Engine(model="dummy:nanogpt", num_blocks=4).kv_layout
    with decode_worker(tmp_path, "shm", args=("--kv-lease", "1")) as d, writer_inside_a_copy() as (writer, leave):
        chan = Channel.connect(d.ctx, zmq.DEALER, d.register.kv_address)
        chan.send(P.KVReserve("x", 1, 100, layout, writer_host=HOSTNAME, writer_pid=writer.pid))
        grant = chan.recv(10_000).msg
        assert isinstance(grant, P.KVGrant)
        time.sleep(2.5)  # the lease's second, and the writers' checks many times over
        hb = heartbeat(d)
        assert hb.total_blocks - hb.free_blocks == len(grant.block_ids), hb
        chan.send(P.KVReserve("x", 1, 100, layout, writer_host=HOSTNAME, writer_pid=writer.pid))
        late = chan.recv(10_000).msg
        assert isinstance(late, P.KVRefuse) and late.code == "TIMEOUT", late
        assert "was let go here (its lease ended, or it was cancelled)" in late.message
        leave()
        all_free(d)
        chan.send(P.KVReserve("y", 1, 100, layout, writer_host=HOSTNAME, writer_pid=writer.pid))
        assert isinstance(chan.recv(10_000).msg, P.KVGrant)
        all_free(d)


def all_free(d, timeout: float = 10.0):
    """Wait until the decode worker's heartbeats say that every block is free."""
    deadline = time.monotonic() + timeout
    hb = heartbeat(d)
    while hb.free_blocks != hb.total_blocks:
        assert time.monotonic() < deadline, hb
        hb = heartbeat(d)


def test_a_busy_decode_worker_queues_reservations_and_grants_them_in_order(tmp_path):
    """A reservation that finds no room is answered BUSY and queued; as room frees, the queue is
    granted in order of arrival without being asked again. Asking again keeps its place; a
    KVRelease (it ended at its first token) takes it out of the queue."""
    layout = Engine(model="dummy:nanogpt", num_blocks=4).kv_layout
    with decode_worker(tmp_path, "zmq", args=("--num-blocks", "16", "--max-num-seqs", "4")) as d:
        chan = Channel.connect(d.ctx, zmq.DEALER, d.register.kv_address)

        def answer(timeout_ms=10_000):
            env = chan.recv(timeout_ms)
            return None if env is None else env.msg

        def reserve(rid):  # 100 tokens and the next: 7 of the 16 blocks
            chan.send(P.KVReserve(rid, 1, 100, layout, 110))
            return answer()

        assert isinstance(reserve("a"), P.KVGrant)
        assert isinstance(reserve("b"), P.KVGrant)
        for rid in ("c", "d", "e"):
            busy = reserve(rid)
            assert isinstance(busy, P.KVRefuse) and busy.code == "BUSY" and "queued" in busy.message, busy
        assert isinstance(reserve("c"), P.KVRefuse)  # asked again: still first in line
        chan.send(P.KVRelease("d", 1))  # d ended at its prefill: out of the queue
        chan.send(P.KVRelease("a", 1))  # a's blocks come back: c, first in line, is granted unasked
        grant = answer()
        assert isinstance(grant, P.KVGrant) and grant.request_id == "c", grant
        assert answer(500) is None  # e waits: no room for it beside b and c
        chan.send(P.KVRelease("b", 1))
        grant = answer()
        assert isinstance(grant, P.KVGrant) and grant.request_id == "e", grant


def test_an_older_attempts_late_messages_leave_the_newer_attempt(tmp_path):
    """A retry's attempt 2 holds the decode worker's blocks when attempt 1's messages arrive late:
    the router's cancel of attempt 1 (another socket) must not drop attempt 2, and attempt 1's
    reservation (a prefill worker SIGSTOPped past its heartbeat timeout, asking again as it wakes)
    is refused while attempt 2 keeps its grant; attempt 2's own cancel frees it."""
    layout = Engine(model="dummy:nanogpt", num_blocks=4).kv_layout
    with decode_worker(tmp_path, "zmq") as d:
        newer = Channel.connect(d.ctx, zmq.DEALER, d.register.kv_address)
        newer.send(P.KVReserve("x", 2, 100, layout))
        grant = newer.recv(10_000).msg
        assert isinstance(grant, P.KVGrant) and grant.attempt == 2
        d.router.send(P.CancelWork("x", 1), to=d.identity)
        late = Channel.connect(d.ctx, zmq.DEALER, d.register.kv_address)
        late.send(P.KVReserve("x", 1, 100, layout))
        refused = late.recv(10_000).msg
        assert isinstance(refused, P.KVRefuse) and refused.code == "CANCELLED", refused
        assert "replaced by attempt 2" in refused.message
        newer.send(P.KVReserve("x", 2, 100, layout))  # attempt 2 asks again: the same blocks
        again = newer.recv(10_000).msg
        assert isinstance(again, P.KVGrant) and again.block_ids == grant.block_ids, again
        hb = heartbeat(d)
        assert hb.total_blocks - hb.free_blocks == len(grant.block_ids), hb
        d.router.send(P.CancelWork("x", 2), to=d.identity)  # its own attempt's cancel frees it
        deadline = time.monotonic() + 10
        while hb.free_blocks != hb.total_blocks and time.monotonic() < deadline:
            hb = heartbeat(d)
        assert hb.free_blocks == hb.total_blocks, hb


@pytest.fixture(scope="module")
def wide_kv_model(tmp_path_factory) -> str:
    """A tiny Llama whose KV is wide (64 KiB a token), so that a 1,000-token prompt's 64 MB of KV
    cannot hide in socket buffers."""
    from tests.checkpoints import VOCAB, _classes, randomize, write_tokenizer

    path = tmp_path_factory.mktemp("wide-kv")
    config_cls, model_cls = _classes("llama")
    config = config_cls(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, hidden_size=64, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=8, head_dim=256, intermediate_size=128,
                        max_position_embeddings=2048)
    model = model_cls(config).eval()
    randomize(model, 0)
    model.save_pretrained(path)
    write_tokenizer(path)
    return str(path)


def spin(worker: PrefillWorker, until, timeout: float = 30.0, steps: bool = True):
    """Run the prefill worker's loop by hand until until() holds."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out"
        for sock, _ in worker.poller.poll(5):
            chan, handler = worker.handlers.get(sock, (None, None))
            env = chan.recv(0) if chan is not None else None
            while env is not None:
                handler(env)
                env = chan.recv(0) if sock in worker.handlers else None
        if steps and worker.engine.has_unfinished():
            worker.on_outputs(worker.step())
        worker._tick(time.monotonic())


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_decode_killed_mid_transfer_leaves_prefill_no_blocks(tmp_path, transport, wide_kv_model):
    with decode_worker(tmp_path, transport, wide_kv_model) as d:
        cfg = WorkerConfig(router=d.router.address, worker_id="prefill-test", transfer_timeout_s=3.0,
                           engine=EngineConfig(model=wide_kv_model, kv_transport=transport))
        prefill = PrefillWorker(cfg)
        try:
            blocks = prefill.engine.block_manager
            prompt = [(7 * i) % 300 for i in range(1000)]  # 64 MB of KV
            prefill.accept(P.PrefillWork("r1", 1, prompt, len(prompt), {"max_tokens": 8, "temperature": 0.0}, 7,
                                         "decode-0", d.register.kv_address))
            spin(prefill, lambda: prefill.transfers["r1"].state == "granted", steps=False)
            os.kill(d.proc.pid, signal.SIGSTOP)  # granted, and now it will never answer
            spin(prefill, lambda: prefill.transfers["r1"].state == "sending")  # prefilled, the KV sent into it
            t = prefill.transfers["r1"]
            assert t.transport == transport and blocks.num_free_blocks < blocks.num_blocks
            segment = t.offer["shm"]["segment"] if transport == "shm" else None
            d.proc.kill()
            d.proc.wait()
            spin(prefill, lambda: not prefill.transfers and not prefill.draining and
                 blocks.num_free_blocks == blocks.num_blocks)
            errors = [env.msg for env in iter(lambda: d.router.recv(100), None) if isinstance(env.msg, P.WorkerError)]
            assert [(e.request_id, e.code) for e in errors] in ([("r1", "TIMEOUT")], [("r1", "TRANSFER_FAILED")])
            assert d.register.kv_address not in prefill.peers  # what we held for the dead peer is dropped
            if segment is not None:
                deadline = time.monotonic() + 10  # its resource tracker unlinks the segment it left
                while os.path.exists(f"/dev/shm/{segment}"):
                    assert time.monotonic() < deadline, f"/dev/shm/{segment} left behind"
                    time.sleep(0.1)
                assert not prefill.senders["shm"].maps
        finally:
            prefill.close()


def test_a_decode_peer_that_takes_nothing_never_blocks_the_prefill_worker():
    """A decode worker whose KV ingress is gone (nothing listens: its process died), with more
    reservations for it than our socket to it holds: each times out, and the prefill worker's
    loop goes on. A send at the socket's high-water mark once blocked it for good; it stopped
    heartbeating and never came back."""
    from router.launcher import free_port

    ctx = zmq.Context()
    router = Channel.bind(ctx, zmq.ROUTER, "tcp://127.0.0.1:0")
    prefill = PrefillWorker(WorkerConfig(router=router.address, worker_id="prefill-test", transfer_timeout_s=2.0,
                                         engine=EngineConfig(model="dummy:nanogpt")))
    gone, n = f"tcp://127.0.0.1:{free_port()}", 1100
    accepted = threading.Event()

    def accept_all():
        for i in range(n):
            prefill.accept(P.PrefillWork(f"r{i}", 1, [1, 2, 3, i % 200], 4, {"max_tokens": 4}, 7, "decode-x", gone))
        accepted.set()
    try:
        threading.Thread(target=accept_all, daemon=True).start()
        assert accepted.wait(60), "the prefill worker blocked in a send to a decode worker that takes nothing"
        spin(prefill, lambda: not prefill.transfers, timeout=120)
        codes = [env.msg.code for env in iter(lambda: router.recv(100), None) if isinstance(env.msg, P.WorkerError)]
        assert codes == ["TIMEOUT"] * n
        assert prefill.engine.block_manager.num_free_blocks == prefill.engine.block_manager.num_blocks
    finally:
        prefill.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_an_idle_decode_peer_is_dropped_and_made_again_when_needed(tmp_path, transport):
    """What a prefill worker holds for a decode worker (socket, shared-pool mapping, gloo pair)
    goes once unused for PEER_IDLE_S, and the next request to that worker makes it anew."""
    from prefill_worker.worker import PEER_IDLE_S

    prompts = [[(3 * i + k) % 200 for i in range(90)] for k in (1, 2)]
    with decode_worker(tmp_path, transport) as d:
        prefill = PrefillWorker(WorkerConfig(router=d.router.address, worker_id="prefill-test",
                                             engine=EngineConfig(model="dummy:nanogpt", kv_transport=transport)))
        held = {"zmq": lambda: {}, "shm": lambda: prefill.senders["shm"].maps,
                "gloo": lambda: prefill.senders["gloo"].pairs}[transport]
        tokens = {}
        try:
            for k, prompt in enumerate(prompts):
                rid = f"r{k}"
                prefill.accept(P.PrefillWork(rid, 1, prompt, len(prompt), {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                                             7, "decode-0", d.register.kv_address))
                spin(prefill, lambda: not prefill.transfers)  # acknowledged
                assert d.register.kv_address in prefill.peers and (transport == "zmq" or held())
                prefill.on_tick(time.monotonic() + 1)  # not idle yet: kept
                assert d.register.kv_address in prefill.peers
                prefill.on_tick(time.monotonic() + PEER_IDLE_S + 1)
                assert not prefill.peers and not prefill.peer_used and not prefill.offers and not held()
                finished = False
                while not finished:  # the first token from the prefill worker, then the decode worker's
                    env = d.router.recv(30_000)
                    assert env is not None, "the decode worker did not finish"
                    assert not isinstance(env.msg, P.WorkerError), env.msg
                    for msg in tokens_of(env.msg):
                        tokens[msg.request_id, msg.index] = msg.token_ids
                        finished = finished or msg.finish_reason is not None
        finally:
            prefill.close()
    expected = Engine(model="dummy:nanogpt").generate(prompts, SamplingParams(temperature=0, max_tokens=4,
                                                                              ignore_eos=True))
    got = [[t for (rid, _), ids in sorted(tokens.items()) if rid == f"r{k}" for t in ids] for k in range(2)]
    assert got == [e.token_ids for e in expected]


def test_cuda_ipc_closes_a_dead_peers_pool(monkeypatch):
    """An opened CUDA IPC pool stays allocated while it is open, even after its decode worker died;
    a restarted worker, which sizes its pool by the memory it finds free, must not wait PEER_IDLE_S
    (or a transfer to it) for the old one to go. Without a GPU:
    torch's rebuild of the tensor from its handle is replaced by a record of the handle."""
    import torch.multiprocessing.reductions as reductions

    from common.kv_transport import cuda_ipc
    from common.kv_transport.cuda_ipc import CudaIpcSender

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *args: ("pool", args[7]))
    monkeypatch.setattr(cuda_ipc, "warm_up", lambda pool: None)  # (compiles the copy kernel on a GPU)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def advert(handle: bytes, pid: int) -> dict:
        return {"ipc": [None, [2, 3], [3, 1], 0, None, "float32", 0, handle, 24, 0, False, "rc", 0, b"ev", True],
                "pid": pid}

    sender = CudaIpcSender()
    try:
        assert sender._mapped(advert(b"old", dead.pid)).tensor == ("pool", b"old")
        assert sender._mapped(advert(b"live", os.getpid())).tensor == ("pool", b"live")
        assert set(sender.maps) == {b"live".hex()}  # the dead worker's pool closed
        sender._mapped(advert(b"other", os.getpid()))
        assert set(sender.maps) == {b"live".hex(), b"other".hex()}  # a live one's stays open
        sender._mapped(advert(b"died", dead.pid))
        sender.sweep()  # the prefill worker's tick: no new pool needs opening for the old one to close
        assert set(sender.maps) == {b"live".hex(), b"other".hex()}
    finally:
        sender.close()


class StandInEvent:
    """A writer's CUDA event, without a GPU: query() answers in turn (an exception is raised)."""

    def __init__(self, *answers):
        self.answers = list(answers)

    def query(self):
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def stand_in_cuda_ipc_receiver(events: dict):
    """A cuda_ipc receiver whose writers' events are these stand-ins (its pool's IPC handle needs a GPU)."""
    from common.kv_transport.cuda_ipc import CudaIpcReceiver

    receiver = CudaIpcReceiver.__new__(CudaIpcReceiver)
    receiver.key, receiver._advert, receiver.device, receiver.events = "pool", {}, None, events
    receiver.unopened = []
    return receiver


def test_a_cuda_ipc_writer_lists_its_ring_once_per_pool_and_the_reader_opens_it_beside_its_transfers(monkeypatch):
    """Without a GPU (stand-in events and streams): the first header to a pool lists the writer's
    ring of events, later ones to that pool do not; the decode worker opens the ring on its next
    tick, so that a later transfer finds its event open, and a ring event that will not open is
    only logged (its transfer opens it, or fails, when it comes)."""
    import itertools
    import types

    from common.kv_transport import cuda_ipc
    from common.kv_transport.base import Handle

    class Recorded:
        def record(self, stream):
            pass

    sender, device = cuda_ipc.CudaIpcSender(), torch.device("cpu")
    handles = [b"ev%d" % i for i in range(10)]
    sender.ring_handles[device] = handles
    sender.rings[device] = itertools.cycle(zip([Recorded() for _ in handles], handles))
    infos = []
    try:
        for key in ("a", "a", "b", "a"):
            handle = Handle({"key": key}, queued_on=types.SimpleNamespace(device=device))
            sender.finish(handle)
            infos.append(handle.info)
    finally:
        sender.close()
    assert [("ring" in i, i["event"]) for i in infos] == [(True, b"ev0"), (False, b"ev1"), (True, b"ev2"),
                                                         (False, b"ev3")]
    assert infos[0]["ring"] == handles

    opened = []

    def from_ipc_handle(device, ipc):
        opened.append(ipc)
        if ipc == b"ev5":
            raise RuntimeError("invalid resource handle")
        return StandInEvent(True)
    monkeypatch.setattr(torch.cuda.Event, "from_ipc_handle", from_ipc_handle)
    receiver, pool = stand_in_cuda_ipc_receiver({}), torch.zeros(2, 2, 4, 16, 2, 8)
    receiver.begin(Inbox(pool, [1]), {**infos[0], "key": "pool"})
    assert opened == [b"ev0"]  # the transfer's own event, at once; the ring waits for the ticks
    receiver.poll(0.0)
    assert sorted(opened) == sorted(handles) and len(opened) == len(handles)  # each once
    inbox = Inbox(pool, [2])
    receiver.begin(inbox, {**infos[1], "key": "pool"})  # opened ahead: nothing to open now
    assert len(opened) == len(handles) and receiver.settle(inbox) and inbox.error is None
    receiver.begin(Inbox(pool, [3]), {"key": "pool", "event": b"ev5"})  # the one that did not open: tried again
    assert opened[-1] == b"ev5"


def test_cuda_ipc_decodes_once_the_writers_event_completed_and_fails_when_it_cannot_be_read():
    """On one GPU the header comes ahead of the copies, with the writer's event: the transfer
    settles once a poll finds the event complete; an event that cannot be read any more (its
    writer died) fails the transfer, and neither waits on the device; one that cannot be opened
    fails it at once, its blocks still being written as far as we can tell."""
    receiver = stand_in_cuda_ipc_receiver({})
    assert receiver.polled  # the decode worker polls without sleeping while this settles
    pool = torch.zeros(2, 2, 4, 16, 2, 8)
    for answers, error in (([False, False, True], None), ([False, RuntimeError("invalid resource handle")],
                                                           "the writer's completion event failed")):
        receiver.events[b"ev"] = StandInEvent(*answers)
        inbox = Inbox(pool, [1, 2])
        receiver.begin(inbox, {"key": "pool", "event": b"ev"})
        settled = [receiver.settle(inbox) for _ in answers]
        assert settled == [False] * (len(answers) - 1) + [True]
        assert receiver.settle(inbox) and not inbox.writing()  # and stays settled
        assert inbox.error.startswith(error) if error else inbox.error is None and inbox.complete
    inbox = Inbox(pool, [1, 2])
    receiver.begin(inbox, {"key": "pool", "event": ["not", "a", "handle"]})
    assert receiver.settle(inbox) and "is not an IPC event handle" in inbox.error and inbox.writing()
    inbox = Inbox(pool, [1, 2])
    receiver.begin(inbox, {"key": "pool"})  # a writer on another GPU: in place when the header comes
    assert receiver.settle(inbox) and inbox.complete and inbox.error is None


def test_blocks_fenced_against_a_writer_come_back_once_its_process_is_gone():
    """A reservation dropped while a one-sided writer (shm here) may still write its blocks is
    fenced until its lease ends: a stopped writer may resume (and checks its lease). A writer of
    this host whose process has exited, a zombie not yet reaped included, writes nothing more:
    its blocks come back at the next tick. One of another host, or alive, stays fenced."""
    from common.kv_transport.mapped import HOSTNAME
    from decode_worker.worker import WRITERS_CHECKED_S, DecodeWorker

    worker = DecodeWorker(WorkerConfig(router="tcp://127.0.0.1:9", engine=EngineConfig(model="dummy:nanogpt",
                                                                                     kv_transport="shm")))
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        layout, free = worker.engine.kv_layout, worker.engine.block_manager.num_free_blocks
        for rid, host in (("here", HOSTNAME), ("there", "another-host")):
            for attempt in (1, 2):  # the second: the router's next attempt, after the writer fell silent
                worker._reserve(b"peer", P.KVReserve(rid, attempt, 40, layout, 0, host, writer.pid))
        assert set(worker.fenced) == {("here", 1), ("there", 1)}
        worker.on_tick(time.monotonic())
        assert set(worker.fenced) == {("here", 1), ("there", 1)}  # its writer is alive
        writer.kill()
        deadline = time.monotonic() + 10
        while open(f"/proc/{writer.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":  # dead, not reaped
            assert time.monotonic() < deadline
            time.sleep(0.01)
        worker.on_tick(time.monotonic() + WRITERS_CHECKED_S)  # its writers are looked up that often
        assert set(worker.fenced) == {("there", 1)}
        assert worker.engine.block_manager.num_free_blocks == free - 3 * 3  # 40 tokens and one: 3 blocks each
    finally:
        writer.kill()
        writer.wait()
        worker.close()


def test_a_cuda_ipc_headers_blocks_come_back_only_once_its_event_completed():
    """The header comes ahead of the copies, so blocks it names may still be being written: a
    cancel then, or a header refused, fences them until its event completes (another request
    would get blocks still being written), and a transfer decodes only after it. Without a GPU:
    a decode worker in this process, its cuda_ipc receiver's events stand-ins."""
    from decode_worker.worker import DecodeWorker

    events = {}
    worker = DecodeWorker(WorkerConfig(router="tcp://127.0.0.1:9", engine=EngineConfig(model="dummy:nanogpt",
                                                                                     kv_transport="shm")))
    try:
        worker.receivers["cuda_ipc"] = stand_in_cuda_ipc_receiver(events)
        layout, free = worker.engine.kv_layout, worker.engine.block_manager.num_free_blocks

        def transfer(rid: str, block_ids=None) -> StandInEvent:
            worker._reserve(b"peer", P.KVReserve(rid, 1, 40, layout))
            events[rid.encode()] = event = StandInEvent(False)
            block_ids = worker.reservations[rid].block_ids if block_ids is None else block_ids
            worker._on_transfer(P.KVTransfer(rid, 1, list(range(41)), 40, 0, {}, 0, layout, 40, block_ids,
                                             "cuda_ipc", {"key": "pool", "event": rid.encode()}), b"peer")
            return event

        cancelled = transfer("cancelled")
        assert worker.poll_timeout() == 0  # a copy ends within a millisecond: no sleep
        worker.on_router(P.CancelWork("cancelled", 1))
        refused = transfer("refused", block_ids=[0])  # not the blocks granted
        assert "refused" not in worker.reservations
        decoding = transfer("decoding")
        for _ in range(3):
            worker.on_tick(time.monotonic())
        assert set(worker.fenced) == {("cancelled", 1), ("refused", 1)} and "decoding" in worker.arriving
        assert worker.engine.block_manager.num_free_blocks == free - 3 * 3  # 40 tokens: 3 blocks each
        for event in (cancelled, refused, decoding):
            event.answers = [True]
        worker.on_tick(time.monotonic())
        assert not worker.fenced and "decoding" in worker.streams and not worker.arriving
        assert worker.engine.block_manager.num_free_blocks == free - 3
    finally:
        worker.close()


def test_a_cuda_ipc_transfer_whose_writer_died_is_not_decoded_however_its_event_reads():
    """CUDA leaves an IPC event undefined once the process that made it is gone: a writer that died
    between its header and its copies may leave an event that reads complete over half-written
    blocks. A transfer whose writer (of this host) has exited when its event completes is refused,
    its blocks given back, and its request goes to another attempt; one whose writer lives decodes."""
    from common.kv_transport.mapped import HOSTNAME
    from decode_worker.worker import DecodeWorker

    events = {}
    worker = DecodeWorker(WorkerConfig(router="tcp://127.0.0.1:9", engine=EngineConfig(model="dummy:nanogpt",
                                                                                     kv_transport="shm")))
    writers = {rid: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
               for rid in ("dies", "lives")}
    try:
        worker.receivers["cuda_ipc"] = stand_in_cuda_ipc_receiver(events)
        layout, free = worker.engine.kv_layout, worker.engine.block_manager.num_free_blocks
        for rid, writer in writers.items():
            worker._reserve(b"peer", P.KVReserve(rid, 1, 40, layout, 0, HOSTNAME, writer.pid))
            events[rid.encode()] = StandInEvent(False)
            worker._on_transfer(P.KVTransfer(rid, 1, list(range(41)), 40, 0, {}, 0, layout, 40,
                                             worker.reservations[rid].block_ids, "cuda_ipc",
                                             {"key": "pool", "event": rid.encode()}), b"peer")
        writers["dies"].kill()
        writers["dies"].wait()
        for event in events.values():
            event.answers = [True]
        worker.on_tick(time.monotonic())
        assert not worker.arriving and set(worker.streams) == {"lives"}
        assert worker.engine.block_manager.num_free_blocks == free - 3  # 40 tokens: 3 blocks, the living's
    finally:
        for writer in writers.values():
            writer.kill()
            writer.wait()
        worker.close()


def _two_decode_cluster(tmp_path, prefill_args=(), decode0_args=()) -> Cluster:
    c = Cluster("dummy:nanogpt", 1, 2, 0, ["cpu"], "127.0.0.1", 0, 0, tmp_path / "logs", "least_loaded", [],
                threads=1, restart=False)
    c.workers[0].argv += list(prefill_args)  # prefill-0
    c.workers[1].argv += list(decode0_args)  # decode-0, which least_loaded tries first
    return c


def test_the_router_pairs_only_workers_that_share_a_kv_transport(tmp_path):
    """By what each registered: a prefill worker forced to shm never gets decode-0, which takes zmq only."""
    c = _two_decode_cluster(tmp_path, ["--kv-transport", "shm"], ["--kv-transport", "zmq"])
    try:
        c.start()
        with Client(c.address, timeout=60) as client:
            by = {w["worker_id"]: w["kv_transports"] for w in client.status().workers}
            assert by == {"prefill-0": ["shm"], "decode-0": ["zmq"], "decode-1": ["shm", "zmq", "gloo"]}
            results = client.generate_many([[1, 2, 3, k] for k in range(6)], max_tokens=3, temperature=0)
            assert all(len(r.token_ids) == 3 for r in results)
    finally:
        c.stop()
    assert " failed (" not in (tmp_path / "logs" / "router.log").read_text()


def test_a_prefill_worker_with_no_decode_worker_to_pair_with_gets_no_work(tmp_path):
    """prefill-0 is forced to shm, the only decode worker takes zmq: prefill-1 gets every request."""
    c = Cluster("dummy:nanogpt", 2, 1, 0, ["cpu"], "127.0.0.1", 0, 0, tmp_path / "logs", "least_loaded", [],
                threads=1, restart=False)
    c.workers[0].argv += ["--kv-transport", "shm"]  # prefill-0, which least_loaded tries first
    c.workers[2].argv += ["--kv-transport", "zmq"]  # decode-0
    try:
        c.start()
        with Client(c.address, timeout=60) as client:
            results = client.generate_many([[4, 5, k] for k in range(6)], max_tokens=3, temperature=0)
            assert all(len(r.token_ids) == 3 for r in results)
    finally:
        c.stop()
    assert " failed (" not in (tmp_path / "logs" / "router.log").read_text()
    assert "KV to" not in (tmp_path / "logs" / "prefill-0.log").read_text()


def test_a_request_that_failed_between_two_workers_is_retried_between_others(tmp_path):
    """decode-0's pool (8 blocks of 16 tokens) cannot hold a 300-token prompt, nor a 100-token one
    allowed 60 more tokens: it says so at once (NO_ROOM, not BUSY until the timeout, nor a grant
    that fails once the KV arrived), and the router's retry goes to decode-1, not to decode-0 again."""
    rng = random.Random(3)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (300, 100)]
    c = _two_decode_cluster(tmp_path, decode0_args=["--num-blocks", "8"])
    try:
        c.start()
        with Client(c.address, timeout=60) as client:
            got = [client.generate(p, max_tokens=60, temperature=0, ignore_eos=True).token_ids for p in prompts]
    finally:
        c.stop()
    expected = Engine(model="dummy:nanogpt").generate(prompts, SamplingParams(temperature=0, max_tokens=60,
                                                                              ignore_eos=True))
    assert got == [e.token_ids for e in expected]
    log = (tmp_path / "logs" / "router.log").read_text()
    assert log.count(" failed (") == 2 and log.count("NO_ROOM from decode-0") == 2, log  # its pool's


def test_a_request_no_decode_worker_can_hold_fails_at_once(tmp_path):
    """The only decode worker's pool cannot hold it: the first NO_ROOM fails it, instead of two
    more prefills that could only be refused again."""
    c = Cluster("dummy:nanogpt", 1, 1, 0, ["cpu"], "127.0.0.1", 0, 0, tmp_path / "logs", "least_loaded", [],
                threads=1, restart=False)
    c.workers[1].argv += ["--num-blocks", "8"]  # decode-0
    try:
        c.start()
        with Client(c.address, timeout=60) as client:
            with pytest.raises(RequestError, match="UNAVAILABLE: no decode worker can take this request; NO_ROOM "
                                                   "from decode-0"):  # its pool's, though prefill-0 relayed it
                client.generate([1] * 300, max_tokens=4)
            assert len(client.generate([1] * 20, max_tokens=4, ignore_eos=True).token_ids) == 4
    finally:
        c.stop()
    assert " failed (" not in (tmp_path / "logs" / "router.log").read_text()


@pytest.mark.gpu
def test_a_copy_kernel_that_fails_at_pairing_leaves_torchs_copies(monkeypatch, caplog):
    """The block-copy kernel compiles when cuda_ipc maps a peer's pool; a Triton failure there (not a
    RuntimeError) is said once, and that device's copies then take torch's way, bits intact."""
    import logging

    from common.kv_transport import block_copy

    monkeypatch.setattr(block_copy, "_FAILED", set())
    broken = lambda *a, **k: (_ for _ in ()).throw(Exception("PTX failed"))  # noqa: E731
    monkeypatch.setattr(block_copy, "launch_copy", broken)
    src = torch.randn(2, 2, 8, 16, 2, 8, device="cuda:0").to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger=block_copy.__name__):
        block_copy.warm_up(src)
    assert src.device in block_copy._FAILED and "PTX failed" in caplog.text
    dst = torch.zeros_like(src)
    block_copy.copy_blocks(src, [3, 1, 6], dst, [0, 5, 2])
    assert torch.equal(dst[:, :, [0, 5, 2]], src[:, :, [3, 1, 6]]) and dst[:, :, 1].count_nonzero() == 0
