"""`pdserve bench transfer`: the KV of N tokens moved from a sender process to a receiver process
by one KV transport, through the very code the workers run (common/kv_transport/), beside the
ceilings measured in the same run. For the CPU transports: plain ZeroMQ PUSH/PULL of the same
bytes in the same frames between two processes, and a memcpy of the same bytes. For the GPU
transports (cuda_ipc, nccl): a device-to-device copy of the same bytes, from the sender's device
to the receiver's. Repetitions of the transport and its ceilings are taken in turn, so that the
machine's drift hits all alike.

--devices are assigned to the sender, then the receiver, as `pdserve launch` assigns them to
workers: one device is both's (nccl's receiver then takes the next GPU: NCCL refuses two ranks on
one).

Only the model's KV layout is needed, not its weights. One repetition is one whole transfer as
a prefill worker makes it (in --layer-groups pieces, as layer-wise streaming sends it): the
sender moves its blocks and sends the KVTransfer header; the receiver (a decode worker's KV
ingress without the engine) settles the bytes into its granted blocks and answers KVAck.
Latency is taken at the sender, from start to acknowledgement; for the one-sided transports (shm,
cuda_ipc) also to the moment its copies are done ("in place": before the header is sent, or on one
GPU, where the header goes ahead with the copies' event, once the sender's copy stream is done),
which is what the copy itself costs beside the ceiling, and to the moment the header was sent
("header sent": the host's own part, its copies done or queued). Their host time is also split
into its phases (open, the pieces' copies queued or done, finish, the header), and --profile lists
the sender's Python functions by their own time: on a GPU, where a copy is queued in microseconds,
the host's part is most of a small transfer's cost. A first, untimed transfer makes the gloo pair
or maps the shared pool, and checks that the receiver's blocks equal the sender's, bit for bit.
"""

from __future__ import annotations

import cProfile
import math
import multiprocessing as mp
import os
import random
import signal
import sys
import time

import torch
import zmq

from bench.report import pct, print_json, print_table
from common import protocol as P
from common.channel import Channel, Waker
from common.model_spec import model_config
from common.config import DTYPE_NAMES, KV_TRANSPORT_DEVICE, default_dtype, resolve_device, dtype_of
from common.errors import InvalidArgument
from common.kv_cache import SharedSegment, available_bytes
from common.kv_transport import (Inbox, Outgoing, frame_plan, make_receivers, make_senders, tune_malloc, unit_bytes,
                                 unit_stretches)
from common.kv_transport.mapped import MappedSender
from common.memory import gib

TIMEOUT_S = 60.0
SEED = 1234
# The most copies of one process's KV pool the bench holds at once on a device, about: the sender's
# pool and the receiver's, the receiver's check of the warm-up (the sender's pool made again, and the
# blocks it compares) and the ceilings' buffers (raw ZeroMQ's, memcpy's or d2d's two).
POOL_COPIES = 6


def kv_shape(spec: str, tokens: int, block_size: int, dtype: str | None, device: str | None, transport: str):
    """(pool shape, dtype, device, blocks per transfer) for the KV of `tokens` tokens of this model."""
    if tokens < 1 or block_size < 1:
        raise InvalidArgument(f"tokens={tokens}, block_size={block_size}; allowed: both >= 1")
    device = resolve_device(device or ("cuda:0" if KV_TRANSPORT_DEVICE.get(transport) == "cuda" else "cpu"))
    if KV_TRANSPORT_DEVICE.get(transport, device.type) != device.type:
        raise InvalidArgument(f"transport={transport!r} does not work with device={str(device)!r}; it needs a "
                              f"{KV_TRANSPORT_DEVICE[transport]} pool")
    dtype = dtype or default_dtype(device.type)
    if dtype not in DTYPE_NAMES:
        raise InvalidArgument(f"dtype={dtype!r} is not supported; allowed: {list(DTYPE_NAMES)}")
    mc = model_config(spec)
    n = -(-tokens // block_size)
    shape = (mc.num_layers, 2, n + 1, block_size, mc.num_kv_heads, mc.head_dim)  # one spare block each side
    return shape, dtype, device, n


def check_memory(spec: str, tokens: int, shape, dtype: str, devices: set[torch.device]) -> None:
    """InvalidArgument naming --tokens, before anything is allocated, if POOL_COPIES of a pool of
    this shape do not fit in what one of the devices has available."""
    block = math.prod(shape) // shape[2] * dtype_of(dtype).itemsize
    pool = block * shape[2]
    for device in sorted(devices, key=str):
        available = available_bytes(device)
        if POOL_COPIES * pool <= available:
            continue
        fits = (available // (POOL_COPIES * block) - 1) * shape[3]  # tokens in whole blocks, less the spare one
        allowed = f"--tokens <= {fits} (or a smaller --model or --dtype)" if fits >= 1 else \
            "a smaller --block-size, --model or --dtype"
        raise InvalidArgument(
            f"--tokens {tokens}: a KV pool of {spec} ({dtype}, {shape[2]} blocks of {shape[3]} tokens) is {gib(pool)}, "
            f"and the bench holds about {POOL_COPIES} such at once (the sender's and the receiver's, the warm-up's "
            f"check, the ceilings' buffers): {gib(POOL_COPIES * pool)}, more than the {gib(available)} available on "
            f"{'this machine' if device.type == 'cpu' else device}; allowed: {allowed}", param="--tokens")


def peer_device(transport: str, sender: torch.device, devices: list[str] | None) -> torch.device:
    """The receiver's device: the second of --devices, else the sender's (for nccl, the next GPU)."""
    if devices and len(devices) > 1:
        peer = resolve_device(devices[1])
    elif transport == "nccl":
        peer = torch.device("cuda", (sender.index or 0) + 1)
    else:
        peer = sender
    if KV_TRANSPORT_DEVICE.get(transport, peer.type) != peer.type:
        raise InvalidArgument(f"transport={transport!r} does not work with a receiver on {str(peer)!r}; it needs a "
                              f"{KV_TRANSPORT_DEVICE[transport]} pool")
    if transport == "nccl" and (peer == sender or (peer.index or 0) >= torch.cuda.device_count()):
        raise InvalidArgument(f"transport='nccl' needs its receiver on a second GPU (NCCL refuses two ranks on one; "
                              f"this machine has {torch.cuda.device_count()}); pass --devices cuda:0,cuda:1")
    return peer


def _block_ids(n: int, fragmented: bool, seed: int) -> list[int]:
    """n of a pool's n + 1 blocks: consecutive (offset by seed), or shuffled by it."""
    ids = list(range(n + 1))
    if fragmented:
        random.Random(seed).shuffle(ids)
    return ids[:n] if fragmented else ids[seed % 2:seed % 2 + n]


def _sender_pool(shape, dtype: str, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    return torch.randn(shape, generator=g).to(dtype_of(dtype)).to(device)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ----------------------------------------------------------------------------- the two processes

def _receiver(transport: str, shape, dtype: str, device: str, src: list[int], dst: list[int], conn):
    """Receiver process: a decode worker's KV ingress and nothing else."""
    torch.set_num_threads(1)
    tune_malloc()
    dev = torch.device(device)
    segment = SharedSegment.create(shape, dtype_of(dtype)) if transport == "shm" else None
    pool = segment.tensor if segment else torch.zeros(shape, dtype=dtype_of(dtype), device=dev)
    waker = Waker()  # gloo settles off this thread: it wakes us, as it wakes a decode worker
    receiver = make_receivers([transport], pool, segment, dtype, "127.0.0.1", TIMEOUT_S, required=True,
                              wake=waker.wake)[transport]
    ctx = zmq.Context()
    chan = Channel.bind(ctx, zmq.ROUTER, "tcp://127.0.0.1:0", end="kv_ingress")
    poller = zmq.Poller()
    poller.register(chan.sock, zmq.POLLIN)
    poller.register(waker.fd, zmq.POLLIN)
    conn.send((chan.address, receiver.advert()))
    inboxes: dict[str, Inbox] = {}
    arriving: dict[str, tuple[P.KVTransfer, bytes]] = {}
    parent = os.getppid()
    try:
        while os.getppid() == parent:
            ready = dict(poller.poll(0 if arriving and receiver.polled else 100))
            if waker.fd in ready:
                waker.drain()
            env = chan.recv(0) if chan.sock in ready else None
            msg = env.msg if env is not None else None
            if isinstance(msg, P.KVRelease):
                break
            if isinstance(msg, (P.KVChunk, P.KVTransfer)):  # dst: the blocks "granted" to every transfer
                inbox = inboxes.setdefault(msg.request_id, Inbox(pool, dst))
            if isinstance(msg, P.KVChunk):
                receiver.chunk(inbox, msg, env.frames)
            elif isinstance(msg, P.KVTransfer):
                receiver.begin(inbox, msg.transport_info)
                arriving[msg.request_id] = (msg, env.sender)
            for rid, (msg, sender) in list(arriving.items()):
                inbox = inboxes[rid]
                if receiver.settle(inbox):
                    del arriving[rid], inboxes[rid]
                    why = inbox.error or ""
                    if not why and rid == "warmup":
                        want = _sender_pool(shape, dtype, dev)[:, :, src]
                        if not _same_bits(pool[:, :, msg.block_ids], want):
                            why = "the received KV differs from the sent KV"
                    chan.send(P.KVAck(rid, msg.attempt, not why, why), to=sender)
            receiver.poll(time.monotonic())  # as a decode worker's tick does
    finally:
        receiver.close()
        chan.close()
        ctx.term()
        waker.close()
        if segment is not None:
            pool = None
            segment.close()


def _raw_puller(address: str, ack_address: str, nbytes: int, repeats: int):
    """Receiver of the raw ZeroMQ ceiling: counts the bytes of each repetition, then acknowledges."""
    tune_malloc()  # as the workers do: the ceiling gets the same help
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(address)
    push.connect(ack_address)
    for _ in range(repeats):
        got = 0
        while got < nbytes:
            got += len(pull.recv(copy=False).buffer)
        push.send(b"")
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()


def _spawn(target, *args) -> mp.Process:
    """A child deaf to Ctrl-C, which reaches the terminal's whole process group: the parent stops
    it (each printed a KeyboardInterrupt traceback beside the parent's "Aborted!"). Its SIGINT is
    ignored from its first instruction, as an ignored signal stays ignored across exec."""
    proc = mp.get_context("spawn").Process(target=_child, args=(target, *args), daemon=True)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc.start()
    finally:
        signal.signal(signal.SIGINT, before)
    return proc


def _child(target, *args):
    """A SIGTERM leaves through the child's finally blocks, which free its shared memory."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    target(*args)


def _stop(proc: mp.Process, grace_s: float = 10.0):
    """Wait grace_s for it to end by itself, then SIGTERM it, then SIGKILL it."""
    proc.join(grace_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()


# ----------------------------------------------------------------------------- measurements

class TransportRun:
    """Sender side of transfers by one transport to a receiver process; one() times one of them."""

    def __init__(self, transport: str, shape, dtype: str, device: torch.device, n: int, fragmented: bool = False,
                 layer_groups: int = 1, peer: torch.device | None = None):
        self.transport, self.shape, self.n = transport, shape, n
        bounds = [shape[0] * i // layer_groups for i in range(layer_groups + 1)]
        self.pieces = [(range(a, b), range(n)) for a, b in zip(bounds, bounds[1:])]  # as layer-wise streaming sends
        self.src, self.dst = _block_ids(n, fragmented, 0), _block_ids(n, fragmented, 1)
        self.pool = _sender_pool(shape, dtype, device)
        self.layout = {"layers": shape[0], "block_size": shape[3], "kv_heads": shape[4], "head_dim": shape[5],
                       "dtype": dtype}
        self.peer = peer = peer or peer_device(transport, device, None)
        parent_conn, child_conn = mp.get_context("spawn").Pipe()
        self.proc = _spawn(_receiver, transport, shape, dtype, str(peer), self.src, self.dst, child_conn)
        self.ctx = zmq.Context()
        self.sender = make_senders([transport], f"bench-{os.getpid()}", "127.0.0.1", TIMEOUT_S, device)[transport]
        self.chan = None
        self.count = 0
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while not parent_conn.poll(0.1):
                if not self.proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the {transport} receiver process did not start "
                                       f"(exit code {self.proc.exitcode})")
            address, self.advert = parent_conn.recv()
            self.chan = Channel.connect(self.ctx, zmq.DEALER, address, end="kv_sender")
            self.one(check=True)  # warm-up: makes the gloo pair, maps the shared pool
        except BaseException:
            self.close()
            raise

    def one(self, check: bool = False, pieces: list[tuple[range, range]] | None = None,
            profiler: cProfile.Profile | None = None) -> float:
        """One transfer, all at once or in these (layers, blocks) pieces in this order; the profiler,
        if any, runs until the header is sent (the host's part, not the wait for the peer)."""
        rid = "warmup" if check else f"r{self.count}"
        self.count += 1
        tokens = self.n * self.shape[3]
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        send = lambda m, f: self.chan.try_send(m, f, track=True)  # noqa: E731 (the prefill worker's send)
        out = Outgoing(rid, 0, self.pool, self.src, self.dst, self.advert, send)
        handle = self.sender.open(out)
        opened = time.perf_counter()
        for layers, blocks in pieces or self.pieces:
            self.sender.send(out, handle, layers, blocks)
        queued = time.perf_counter()
        self.sender.finish(handle)
        finished = time.perf_counter()
        self.in_place = finished - t0  # one-sided: every byte is in place, or queued (cuda_ipc)
        self.chan.send(P.KVTransfer(rid, 0, [0] * (tokens + 1), tokens, 0, {}, 0, self.layout, tokens, self.dst,
                                    self.transport, handle.info))
        sent = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        self.header_sent = sent - t0  # the host's part: its copies queued or done, the header gone
        self.phases = dict(zip(PHASES, (opened - t0, queued - opened, finished - queued, sent - finished)))
        if handle.queued_on is not None:  # the header went ahead of the copies: in place once they are done
            handle.queued_on.synchronize()
            self.in_place = time.perf_counter() - t0
        env = self.chan.recv(int(TIMEOUT_S * 1000))
        elapsed = time.perf_counter() - t0
        if env is None or not isinstance(env.msg, P.KVAck):
            raise RuntimeError(f"no acknowledgement of transfer {rid} within {TIMEOUT_S}s")
        if not env.msg.ok:
            raise RuntimeError(f"transfer {rid} by {self.transport} failed: {env.msg.message}")
        return elapsed

    def close(self):
        if self.chan is not None:
            self.chan.send(P.KVRelease("stop", 0))
        self.sender.close()
        _stop(self.proc, 10.0 if self.chan is not None else 0.0)  # else nothing told it to stop
        if self.chan is not None:
            self.chan.close()
        self.ctx.term()


class RawZmqRun:
    """Plain PUSH/PULL of the same bytes in the same frames as the zmq transport sends, one
    message each, acknowledged once all arrived."""

    def __init__(self, frame_sizes: list[int], repeats: int):
        self.nbytes = nbytes = sum(frame_sizes)
        self.bounds = [(sum(frame_sizes[:i]), sum(frame_sizes[:i + 1])) for i in range(len(frame_sizes))]
        self.ctx = zmq.Context()
        self.push, self.acks = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.push.bind("tcp://127.0.0.1:0")
        self.acks.bind("tcp://127.0.0.1:0")
        self.proc = _spawn(_raw_puller, self.push.getsockopt_string(zmq.LAST_ENDPOINT),
                           self.acks.getsockopt_string(zmq.LAST_ENDPOINT), nbytes, repeats + 1)
        self.repeats, self.done = repeats + 1, 0
        self.buf = memoryview(torch.randn(-(-nbytes // 4)).numpy()).cast("B")[:nbytes]
        self.one()  # warm-up

    def one(self) -> float:
        t0 = time.perf_counter()
        for first, end in self.bounds:
            self.push.send(self.buf[first:end], copy=False)
        if not self.acks.poll(int(TIMEOUT_S * 1000)):
            raise RuntimeError(f"raw ZeroMQ receiver did not acknowledge within {TIMEOUT_S}s")
        self.acks.recv()
        self.done += 1
        return time.perf_counter() - t0

    def close(self):
        _stop(self.proc, 10.0 if self.done == self.repeats else 0.0)  # cut short: it waits for bytes forever
        self.push.close(linger=0)
        self.acks.close(linger=0)
        self.ctx.term()


class DeviceCopyRun:
    """The GPU transports' ceiling: one device-to-device copy of the same bytes, from the sender's
    device to the receiver's, timed as the transport is (host clock, until the copy is done)."""

    def __init__(self, nbytes: int, src: torch.device, dst: torch.device):
        self.src = torch.randn(-(-nbytes // 4), device=src)
        self.dst = torch.empty_like(self.src, device=dst)
        self.one()

    def one(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        torch.cuda.synchronize(self.dst.device)
        torch.cuda.synchronize(self.src.device)
        return time.perf_counter() - t0

    def close(self):
        pass


class MemcpyRun:
    def __init__(self, nbytes: int):
        self.src = torch.randn(-(-nbytes // 4))
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)

    def one(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0

    def close(self):
        pass


CEILING_KEYS = {"raw zmq": "raw_zmq", "memcpy": "memcpy", "d2d": "d2d"}  # a ceiling's name -> its JSON keys' stem
IN_PLACE = "in place"  # a one-sided transport's copies done (see the docstring)
HEADER_SENT = "header sent"  # and the host's part of it: copies done or queued, header sent
PHASES = ("open", "copies", "finish", "header")  # the host's part, phase by phase (TransportRun.one)
ROW_KEYS = CEILING_KEYS | {IN_PLACE: "in_place", HEADER_SENT: "header_sent"}


def measure(transport: str, shape, dtype: str, device: torch.device, n: int, repeats: int,
            fragmented: bool = False, layer_groups: int = 1, peer: torch.device | None = None,
            profiler: cProfile.Profile | None = None) -> dict[str, list[float]]:
    """Seconds per repetition of the transport and of each ceiling, taken in turn (this machine's
    speed drifts: interleaving keeps the ratios honest); for a one-sided transport also its host
    phases'. The profiler, if any, runs through the transport's host part of each (TransportRun.one)."""
    nbytes = math.prod(shape) // shape[2] * n * dtype_of(dtype).itemsize
    runs = {}
    try:
        runs[transport] = run = TransportRun(transport, shape, dtype, device, n, fragmented, layer_groups, peer)
        if KV_TRANSPORT_DEVICE.get(transport) == "cuda":
            runs["d2d"] = DeviceCopyRun(nbytes, device, run.peer)
        else:
            ub = unit_bytes(run.pool)
            plan = list(frame_plan(unit_stretches(shape[2], run.src, range(shape[0])), ub))
            runs["raw zmq"] = RawZmqRun([(f.end - f.first) * ub for f in plan], repeats)
            runs["memcpy"] = MemcpyRun(nbytes)
        one_sided = isinstance(run.sender, MappedSender)
        times = {name: [] for name in (transport, *((HEADER_SENT, IN_PLACE, *PHASES) if one_sided else ()), *runs)}
        for _ in range(repeats):
            for name, run in runs.items():
                if name != transport:
                    times[name].append(run.one())
                    continue
                times[name].append(run.one(profiler=profiler))
                if one_sided:
                    times[HEADER_SENT].append(run.header_sent)
                    times[IN_PLACE].append(run.in_place)
                    for phase, sec in run.phases.items():
                        times[phase].append(sec)
        return times
    finally:
        for run in runs.values():
            run.close()


def run_transfer_bench(transport: str, spec: str, tokens: int, repeats: int, block_size: int = 16,
                       dtype: str | None = None, devices: list[str] | None = None, fragmented: bool = False,
                       layer_groups: int = 1, profile: int = 0) -> dict:
    """The bench (see the module docstring); profile > 0 also prints the sender's `profile` Python
    functions that took the most of its own time in a transfer."""
    if repeats < 1:
        raise InvalidArgument(f"repeats={repeats}; allowed: >= 1")
    if devices and len(devices) > 2:
        raise InvalidArgument(f"--devices {','.join(devices)} names {len(devices)} devices; allowed: the sender's, "
                              "then optionally the receiver's", param="--devices")
    shape, dtype, dev, n = kv_shape(spec, tokens, block_size, dtype, devices[0] if devices else None, transport)
    peer = peer_device(transport, dev, devices)
    if not 1 <= layer_groups <= shape[0]:
        raise InvalidArgument(f"layer_groups={layer_groups}; allowed: 1..{shape[0]} (the model's layers)")
    check_memory(spec, tokens, shape, dtype, {dev, peer})
    torch.set_num_threads(1)
    tune_malloc()
    nbytes = math.prod(shape) // shape[2] * n * dtype_of(dtype).itemsize
    result = {"bench": "transfer", "transport": transport, "model": spec, "tokens": n * block_size, "bytes": nbytes,
              "repeats": repeats, "device": str(dev), "peer_device": str(peer), "dtype": dtype,
              "fragmented": fragmented, "layer_groups": layer_groups}
    rows, phases = [], {}
    profiler = cProfile.Profile() if profile else None
    for name, times in measure(transport, shape, dtype, dev, n, repeats, fragmented, layer_groups, peer,
                               profiler).items():
        p50, p99 = pct(times, 50), pct(times, 99)
        if name in PHASES:
            phases[name] = (p50, p99)
            continue
        key = ROW_KEYS[name] + "_" if name in ROW_KEYS else ""
        result.update({f"{key}gbps": round(nbytes / p50 / 1e9, 3), f"{key}p50_ms": round(p50 * 1e3, 3),
                       f"{key}p99_ms": round(p99 * 1e3, 3)})
        rows.append([f"{transport}, {name}" if name in (IN_PLACE, HEADER_SENT) else name, f"{nbytes / p50 / 1e9:.2f}",
                     f"{p50 * 1e3:.2f}", f"{p99 * 1e3:.2f}", f"{result['gbps'] * p50 / nbytes * 1e9:.2f}x"])
        if name in CEILING_KEYS:
            result[f"vs_{CEILING_KEYS[name]}"] = round(result["gbps"] / result[f"{key}gbps"], 3)
    if "in_place_p50_ms" in result and "d2d_p50_ms" in result:  # issue 12: within 0.1 ms of the copy's time
        result["in_place_over_d2d_ms"] = round(result["in_place_p50_ms"] - result["d2d_p50_ms"], 3)
    print_table(f"pdserve bench transfer: {transport} {dev} -> {peer}, {spec} KV of {n * block_size} tokens = "
                f"{nbytes / 2**20:.1f} MiB ({dtype}, {'scattered' if fragmented else 'consecutive'} blocks, in "
                f"{layer_groups} layer group{'s' * (layer_groups > 1)}), p50 of {repeats}, taken in turn",
                ["path", "GB/s", "p50 ms", "p99 ms", f"{transport} / path"], rows)
    if phases:
        result["host_us"] = {phase: round(p50 * 1e6, 1) for phase, (p50, _) in phases.items()}
        print_table(f"the sender's host time until the header was sent, by phase (µs; {layer_groups} piece"
                    f"{'s' * (layer_groups > 1)} a transfer)", ["phase", "p50", "p99"],
                    [[phase, f"{p50 * 1e6:.1f}", f"{p99 * 1e6:.1f}"] for phase, (p50, p99) in phases.items()])
    if profiler is not None:
        from bench.step_profile import profiled_functions

        functions = profiled_functions(profiler, repeats, profile)
        result["host_functions"] = functions
        print_table("the sender's Python functions until the header was sent, by their own time (cProfile, which "
                    "slows them), µs a transfer",
                    ["function", "calls", "µs"], [[f["function"], f"{f['calls']:.0f}", f"{f['us']:.1f}"]
                                                  for f in functions])
    print_json(result)
    return result
