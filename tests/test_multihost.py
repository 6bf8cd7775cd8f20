"""Three hosts on one machine: router, prefill and decode each in its own network namespace,
joined by veth links to a bridge, talking over real (virtual) Ethernet. The decode worker's link
is cut during decoding and restored: the router declares it dead, the worker comes back under a
new incarnation, and the request still finishes with exactly the fault-free tokens. The decode
worker binds every interface (0.0.0.0), and prefill reaches it at the address it advertises.

Skipped where namespaces cannot be created (not root, no iproute2)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.engine import Engine
from common.sampling_params import SamplingParams
from router.client import Client

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
SUBNET = "10.231.77"  # only inside the namespaces this test creates


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for network namespaces")
    tag = f"{os.getpid() % 10000}"
    bridge, names = f"pdbr{tag}", {role: f"pd{role[0]}{tag}" for role in ("router", "prefill", "decode")}
    try:
        sh("ip", "link", "add", bridge, "type", "bridge")
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create network devices here: {e.stderr.decode().strip()}")
    created, addresses = [], {}
    try:
        sh("ip", "addr", "add", f"{SUBNET}.254/24", "dev", bridge)
        sh("ip", "link", "set", bridge, "up")
        for i, (role, ns) in enumerate(names.items(), start=1):
            sh("ip", "netns", "add", ns)
            created.append(ns)
            sh("ip", "link", "add", f"v{ns}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", f"v{ns}", "master", bridge, "up")
            sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            addresses[role] = f"{SUBNET}.{i}"
        yield names, addresses, lambda role, up: sh("ip", "link", "set", f"v{names[role]}", "up" if up else "down")
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def test_three_hosts_survive_a_cut_link(hosts, tmp_path):
    names, ip, link = hosts
    cli = [sys.executable, "-m", "common.cli"]
    procs = []

    def start(role, *args):
        log = open(tmp_path / f"{role}.log", "wb")
        procs.append(subprocess.Popen(["ip", "netns", "exec", names[role], *cli, *args], cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))

    try:
        start("router", "router", "--host", ip["router"], "--port", "7100", "--worker-port", "7101",
              "--heartbeat-timeout", "1", "--queue-timeout", "60")
        start("prefill", "prefill", "--router", f"tcp://{ip['router']}:7101", "--worker-id", "prefill-0", "--threads", "1")
        # every interface, a port a firewall can open: it advertises its address on the route to the router
        start("decode", "decode", "--router", f"tcp://{ip['router']}:7101", "--worker-id", "decode-0",
              "--host", "0.0.0.0", "--kv-port", "7102", "--threads", "1")
        prompt = [9, 8, 7, 6, 5]
        sampling = dict(max_tokens=300, temperature=0.8, seed=3, ignore_eos=True)
        want = Engine(model="dummy:nanogpt").generate([prompt], SamplingParams(**sampling))[0].token_ids
        with Client(f"tcp://{ip['router']}:7100", timeout=120) as client:
            deadline = time.monotonic() + 120
            while sum(w["alive"] for w in client.status().workers) < 2:
                assert time.monotonic() < deadline, "workers did not register across the namespaces"
                time.sleep(0.2)
            decode = next(w for w in client.status().workers if w["role"] == "decode")
            assert decode["kv_address"] == f"tcp://{ip['decode']}:7102"  # KV crosses the virtual wire
            stream = client.stream(prompt, **sampling)
            streamed = []
            for chunk in stream:
                assert chunk.index == len(streamed)
                streamed += chunk.token_ids
                if len(streamed) >= 20 and not hasattr(stream, "cut"):
                    link("decode", False)  # the decode host drops off the network mid-decode
                    stream.cut = time.monotonic()
                    time.sleep(2.5)  # past the router's 1 s heartbeat timeout
                    link("decode", True)
            assert stream.result.token_ids == want and streamed == want
            assert stream.result.timings["attempts"] >= 2
            incarnations = {w["incarnation"] for w in client.status().workers if w["worker_id"] == "decode-0"}
            assert len(incarnations) == 1  # the registry holds the new incarnation only
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
