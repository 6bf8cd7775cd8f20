"""`pdserve launch`: a whole cluster on this host (router, prefill, decode and mono workers), one
OS process each, logs per process, and supervision:

- prints `ready: router at tcp://HOST:PORT` once every worker has registered, after where more
  workers join (`workers join at tcp://HOST:WORKER_PORT`);
- restarts a crashed worker with exponential backoff (it rejoins under a new incarnation);
- on Ctrl-C / SIGTERM stops every child (SIGTERM, then SIGKILL after a grace period), and each
  child also gets SIGTERM from the kernel if the launcher itself dies, so none is orphaned. The
  children ignore the terminal's Ctrl-C (common/signals.py): each is stopped once, by its launcher.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import InvalidArgument, StartupError, made_dir, port_free
from common.signals import DRAIN_TIMEOUT_S, deaf_to_ctrl_c
from common.memory import DEFAULT_UTILIZATION, launch_plan

PR_SET_PDEATHSIG = 1


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and that the kernel will not hand to anyone else: it lies below the
    ephemeral range, from which the kernel picks the ports of every `bind(0)` and outgoing
    connection. A port from bind(0) is released before the router binds it, and a worker starting
    beside the router (binding its own sockets to "*") could be given it in between."""
    low, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(200 if low > 2048 else 0):
        port = rng.randrange(max(1024, low // 2), low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    continue
                raise  # the host is not this machine's: every port would fail alike (and a name be resolved again)
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # a crowded host: fall back to the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


HEALTHY_S = 30.0  # a process up this long starts its restart backoff over
MAX_WORKERS = 64  # one launch's: 999999999999p1d in a bench began starting them all


def restart_delay(restarts: int, first: float = 0.5) -> float:
    """The wait before restarting a process that died `restarts` times in a row: doubling from
    `first`, up to 8 s (the launcher's workers and router, the router's API servers)."""
    return min(first * 2 ** restarts, 8.0)


def flag_value(args: list[str], flag: str) -> str | None:
    """The value given to flag in args (as 'FLAG VALUE' or 'FLAG=VALUE'; the last one wins), or None."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def check_port_free(host: str, port: int, flag: str) -> None:
    """InvalidArgument naming the port and its flag if something holds it (as the router would
    bind it: SO_REUSEADDR, so a port in TIME_WAIT counts as free)."""
    with socket.socket() as s, port_free(host, port, flag):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))


def threads_per_worker(workers: int, cores: int | None = None) -> int:
    """Torch threads for each of `workers` workers sharing this host's cores: one core is left to the
    router, the clients and the system (vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU=1), the rest split
    evenly. A worker's threads that lose a core to the router stall its every parallel op, which
    costs more than the thread gave (bench scaling, README)."""
    cores = cores or os.cpu_count() or 1
    return max(1, (cores - 1) // max(1, workers))


def check_worker_count(n: int) -> None:
    if n > MAX_WORKERS:
        raise InvalidArgument(f"{n} workers; allowed: at most {MAX_WORKERS} on one host (each is a process with its "
                              "own model; more hosts join with pdserve prefill/decode --router)")


def die_with_parent(sig: signal.Signals = signal.SIGTERM):
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def _as_child():
    """A child's set-up before it execs: it goes with its launcher, which alone takes Ctrl-C."""
    die_with_parent()
    deaf_to_ctrl_c()


def ended(returncode: int) -> str:
    """How a child process ended, in words, as deploy/launch.sh says it: "exited with 1", or "was
    killed by SIGKILL" (Python's -9, a shell's 137)."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            pass
    return f"exited with {returncode}"


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = 0.0
    env: dict = field(default_factory=dict)
    log_offset: int = 0  # where this run's lines begin in its log (kept across runs)

    def start(self):
        log = open(self.log_path, "ab")
        self.log_offset = log.tell()
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=_as_child, env=env)
        log.close()
        self.started_at = time.monotonic()

    def run_log(self, limit: int = 2000) -> str:
        """The last `limit` characters this run wrote to the log: an earlier run's error is not its."""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")[-limit:]


class Cluster:
    """Workers are assigned `devices` in turn. Workers that share a GPU split it (common/memory.py:
    each gets --gpu-memory-utilization, decode workers the larger shares) unless worker_args size
    the pool already; `device_share` is the fraction of each GPU the split hands out (clusters side
    by side on one GPU: their shares adding up to 1)."""

    def __init__(self, model: str, prefill: int, decode: int, mono: int, devices: list[str], host: str, port: int,
                 worker_port: int, log_dir: Path, policy: str, worker_args: list[str], threads: int | None,
                 restart: bool = True, router_args: list[str] = (), http_port: int | None = None,
                 api_key: str | None = None, device_share: float = 1.0, api_server_count: int = 1):
        def given_or_free(port: int, flag: str) -> int:
            if port:
                return port
            with port_free(host, 0, flag):  # a host of another machine: picking a port says so
                return free_port(host)

        self.host, self.port = host, given_or_free(port, "--port")
        self.worker_port = given_or_free(worker_port, "--worker-port")
        self.http_port = None if http_port is None else given_or_free(http_port, "--http-port")
        self.api_server_count = api_server_count  # 1: HTTP (if any) in the router process
        if self.http_port is not None:
            router_args = ["--http-port", str(self.http_port), "--api-server-count", str(api_server_count),
                           *router_args]
        context = flag_value(worker_args, "--max-model-len")
        if context is not None and flag_value(router_args, "--max-model-len") is None:
            router_args = [*router_args, "--max-model-len", context]  # the router admits what workers serve
        self.log_dir = Path(log_dir)
        self.restart = restart
        self.drain_s = float(flag_value(worker_args, "--drain-timeout") or DRAIN_TIMEOUT_S)
        self.killed: list[str] = []  # children stop() had to kill
        self.expected = prefill + decode + mono
        if self.expected == 0:
            raise ValueError("a cluster needs at least one worker: --prefill/--decode, or --mono")
        check_worker_count(self.expected)
        if prefill and not decode:
            raise ValueError(f"--prefill {prefill} --decode 0: prefill workers need a decode worker to hand KV to; "
                             "allowed: --decode >= 1, or --prefill 0 with --mono (mono workers prefill for themselves)")
        if decode and not prefill and "--enforce-disagg" in router_args:
            raise ValueError(f"--prefill 0 --decode {decode} with --enforce-disagg: no worker may prefill; allowed: "
                             "--prefill >= 1, or decode workers alone without --enforce-disagg (they prefill)")
        threads = threads or threads_per_worker(self.expected)
        cli = [sys.executable, "-m", "common.cli"]
        self.router = Child("router", cli + ["router", "--model", model, "--host", host, "--port", str(self.port),
                                             "--worker-port", str(self.worker_port), "--policy", policy,
                                             *router_args], self.log_dir / "router.log",
                            env={"PDSERVE_API_KEY": api_key} if api_key else {})  # a key in argv would show in ps
        self.workers = []
        counts: dict[str, int] = {}
        for role, device, share in launch_plan(prefill, decode, mono, devices, worker_args,
                                               DEFAULT_UTILIZATION * device_share):
            n = counts[role] = counts.get(role, -1) + 1
            name = f"{role}-{n}"
            argv = cli + [role, "--router", f"tcp://{host}:{self.worker_port}", "--worker-id", name,
                          "--model", model, "--device", device, "--host", host, "--threads", str(threads),
                          *([] if share is None else ["--gpu-memory-utilization", str(share)]), *worker_args]
            self.workers.append(Child(name, argv, self.log_dir / f"{name}.log"))

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def http_url(self) -> str | None:
        return None if self.http_port is None else f"http://{self.host}:{self.http_port}"

    @property
    def children(self) -> list[Child]:
        return [self.router] + self.workers

    def check_ports(self):
        """Another router on these ports would answer the readiness check, and take our workers."""
        for port, flag in ((self.port, "--port"), (self.worker_port, "--worker-port"), (self.http_port, "--http-port")):
            if port is not None:
                check_port_free(self.host, port, flag)

    def start(self, ready_timeout: float = 180.0):
        self.check_ports()
        made_dir(self.log_dir, "--log-dir")
        for c in self.children:
            c.start()
        self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float):
        from router.client import Client, RequestError

        deadline = time.monotonic() + timeout
        with Client(self.address, timeout=2.0) as client:
            while time.monotonic() < deadline:
                for c in self.children:
                    if c.proc.poll() is not None:
                        raise StartupError(f"{c.name} {ended(c.proc.returncode)} during start-up; "
                                           f"see {c.log_path}:\n{c.run_log()}")
                try:
                    status = client.status(timeout=2.0)
                except RequestError:  # still starting (a client fails at once once it has waited long)
                    time.sleep(0.1)
                    continue
                if sum(w["alive"] for w in status.workers) >= self.expected:
                    return
                time.sleep(0.1)
        raise StartupError(f"cluster not ready within {timeout}s; logs in {self.log_dir}")

    def supervise_once(self):
        """Restart any child that exited, with exponential backoff."""
        now = time.monotonic()
        for c in self.children:
            if c.proc is None or c.proc.poll() is None or c.next_start == math.inf:
                continue
            if not self.restart:
                c.next_start = math.inf  # said once
                self._say(c, f"{c.name} {ended(c.proc.returncode)}; not restarted (--no-restart)")
                continue
            if c.next_start == 0.0:
                if now - c.started_at > HEALTHY_S or c.proc.returncode == 0:
                    c.restarts = 0  # it had been healthy, or left as told (a rolling restart): no backoff
                delay = restart_delay(c.restarts)
                c.next_start = now + delay
                self._say(c, f"{c.name} {ended(c.proc.returncode)}; restarting in {delay:.1f}s")
            elif now >= c.next_start:
                c.restarts += 1
                c.next_start = 0.0
                c.start()

    @staticmethod
    def _say(c: Child, line: str) -> None:
        """On the console and in the child's log, stamped as the processes' own lines are."""
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} [launcher] {line}"
        with open(c.log_path, "a") as f:
            f.write(f"\n{line}\n")
        print(line, file=sys.stderr, flush=True)

    def stop(self, grace_s: float = 5.0):
        """Every process at once, each draining (--drain-timeout): the router admits nothing new and
        carries the tokens of what the workers finish, then ends what no worker is left to finish
        with an error its clients read. SIGTERM each; one still running grace_s past its drain is
        killed, and named in self.killed."""
        self._stop([*self.workers, self.router], grace_s + self.drain_s)

    def _stop(self, children: list[Child], grace_s: float):
        running = [c for c in children if c.proc is not None and c.proc.poll() is None]
        for c in running:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in running:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
                self.killed.append(c.name)
                print(f"[launcher] {c.name} did not stop within {grace_s:g}s of SIGTERM; killed it", file=sys.stderr,
                      flush=True)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


def run_launch(cluster: Cluster):
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(True))
    try:
        cluster.start()
        if cluster.http_url:
            print(f"HTTP API at {cluster.http_url}", flush=True)
        print(f"workers join at tcp://{cluster.host}:{cluster.worker_port}", flush=True)  # (pdserve prefill --router)
        print(f"ready: router at {cluster.address}", flush=True)
        while not stopping:
            cluster.supervise_once()
            time.sleep(0.1)
    finally:
        if any(c.proc is not None for c in cluster.children):  # a refused start started nothing
            cluster.stop()
            print("stopped", flush=True)
