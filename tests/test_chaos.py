"""Fault tolerance with real processes: workers SIGKILLed or SIGSTOPped mid-request, the router
restarted. Every request either completes with exactly the fault-free tokens (no duplicate, no
gap) or ends with a coded error; nothing hangs and no KV block leaks."""

import signal
import subprocess
import time

import pytest

from bench.chaos import leaked_blocks, run_chaos
from common.engine import Engine
from common.sampling_params import SamplingParams
from router.client import Client, RequestError
from tests.cluster import cluster, stop
from tests.test_cluster import HAVE_LLGUIDANCE
from tests.test_scaling import REPO, pdserve_cmd

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
FAST_FAILOVER = ["--heartbeat-timeout", "0.6", "--decode-stall-timeout", "10", "--max-attempts", "10"]


def reference(prompts, sampling):
    return [o.token_ids for o in Engine(model="dummy:nanogpt").generate(prompts, [SamplingParams(**s) for s in sampling])]


def wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def wait_rejoined(c, client, workers: int):
    """Until the launcher has restarted c's router and `workers` workers have registered with it."""
    def rejoined():
        c.supervise_once()
        try:
            return sum(w["alive"] for w in client.status(timeout=1).workers) == workers
        except RequestError:
            return False
    wait_for(rejoined, timeout=60, what="the router to restart and the workers to re-register")


def stream_all(client, prompts, sampling):
    return [client.stream(p, **s) for p, s in zip(prompts, sampling)]


def collect(streams, first_chunks=None):
    """Drain streams; return (final tokens, streamed tokens, attempts) per stream, checking order."""
    out = []
    for i, s in enumerate(streams):
        streamed = []
        for chunk in ([first_chunks[i]] if first_chunks else []) + list(s):
            assert chunk.index == len(streamed), "duplicated or missing position in the stream"
            streamed += chunk.token_ids
        out.append((s.result.token_ids, streamed, s.result.timings.get("attempts")))
    return out


def workload(n, max_tokens=120):
    prompts = [[(7 * i + j) % 250 for j in range(10 + 5 * i)] for i in range(n)]
    sampling = [dict(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i)
                for i in range(n)]
    for s in sampling[::3]:  # penalties count a migrated request's output as its first worker did
        s.update(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.2)
    # a structured output's grammar replays the output a migrated request had
    for s in sampling[1::3] if HAVE_LLGUIDANCE else []:
        s.update(structured_outputs={"regex": "[a-z]+( [a-z]+)*"})
    return prompts, sampling


@pytest.mark.parametrize("fault, worker_args", [(signal.SIGKILL, []), (signal.SIGSTOP, []),
                                                (signal.SIGSTOP, ["--async-scheduling"])],
                         ids=["kill", "stop", "stop-async"])
def test_decode_worker_lost_mid_stream_requests_migrate(tmp_path, fault, worker_args):
    """A stopped worker with async scheduling comes back holding a launched step, whose blocks
    must come back too once it drops its work."""
    prompts, sampling = workload(6)
    want = reference(prompts, sampling)
    with cluster(tmp_path, prefill=1, decode=2, router_args=FAST_FAILOVER, worker_args=worker_args) as c, \
            Client(c.address, timeout=120) as client:
        streams = stream_all(client, prompts, sampling)
        first = [next(s) for s in streams]  # every request is decoding
        victim = c.workers[1].proc  # decode-0
        victim.send_signal(fault)
        try:
            results = collect(streams, first)
        finally:
            if fault == signal.SIGSTOP:
                victim.send_signal(signal.SIGCONT)
        assert [r[0] for r in results] == want
        assert [r[1] for r in results] == want
        assert any(r[2] > 1 for r in results), "no request was migrated"
        if fault == signal.SIGSTOP:  # the stopped worker comes back under a new incarnation
            wait_for(lambda: sum(w["alive"] and w["worker_id"] == "decode-0" for w in client.status().workers) == 1,
                     what="decode-0 to re-register")
        leaks = leaked_blocks(c.address, 3 if fault == signal.SIGSTOP else 2)
        assert not any(leaks.values()), leaks


def test_prefill_worker_killed_requests_go_to_another(tmp_path):
    prompts, sampling = workload(12, max_tokens=8)
    prompts = [p * 12 for p in prompts]  # long prompts: the prefill queue is busy when the kill lands
    want = reference(prompts, sampling)
    with cluster(tmp_path, prefill=2, decode=1, router_args=FAST_FAILOVER) as c, Client(c.address, timeout=120) as client:
        ids = [client.submit(p, stream=False, **s) for p, s in zip(prompts, sampling)]
        c.workers[0].proc.kill()  # prefill-0
        results = [client.wait(rid) for rid in ids]
        assert [r.token_ids for r in results] == want
        assert not any(leaked_blocks(c.address, 2).values())


def test_no_live_worker_ends_with_a_coded_error_not_a_hang(tmp_path):
    args = ["--heartbeat-timeout", "0.5", "--queue-timeout", "2"]
    with cluster(tmp_path, prefill=1, decode=1, router_args=args) as c, Client(c.address, timeout=60) as client:
        stream = client.stream([1, 2, 3], max_tokens=500, ignore_eos=True)
        next(stream)
        c.workers[1].proc.kill()  # the only decode worker; nothing restarts it
        t0 = time.monotonic()
        with pytest.raises(RequestError) as e:
            for _ in stream:
                pass
        assert e.value.code == "UNAVAILABLE"
        assert time.monotonic() - t0 < 30


def test_router_restart_fails_inflight_clearly_and_workers_rejoin(tmp_path):
    with cluster(tmp_path, prefill=1, decode=1, restart=True) as c, Client(c.address, timeout=60) as client:
        stream = client.stream([5, 6, 7], max_tokens=1000, ignore_eos=True)
        next(stream)
        c.router.proc.kill()
        with pytest.raises(RequestError) as e:
            for _ in stream:
                pass
        assert e.value.code == "UNAVAILABLE" and "lost the connection" in e.value.message
        wait_rejoined(c, client, 2)
        r = client.generate([5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True)
        assert r.token_ids == reference([[5, 6, 7]], [dict(max_tokens=4, temperature=0, ignore_eos=True)])[0]
        # A crashed worker is restarted too, and rejoins.
        old = c.workers[0].proc
        old.kill()
        old.wait()
        wait_for(lambda: (c.supervise_once(), c.workers[0].proc is not old)[1], what="prefill-0 to restart")
        incarnations = lambda: {w["incarnation"] for w in client.status().workers
                                if w["alive"] and w["worker_id"] == "prefill-0"}
        before = incarnations()
        wait_for(lambda: incarnations() and incarnations() != before, what="prefill-0 to rejoin")
        assert len(client.generate([1, 2], max_tokens=3, ignore_eos=True).token_ids) == 3


def test_chaos_small(tmp_path):
    """Prompts of up to 16 tokens are prefilled by their decode workers (--max-local-prefill-length),
    the others handed off: both kinds survive the faults token-exact."""
    result = run_chaos(requests=60, kills=3, concurrency=12, seed=1, interval_s=1.0, stop_s=1.0,
                       log_dir=tmp_path / "logs", verbose=False, router_args=["--max-local-prefill-length", "16"])
    assert result["kills"] == 3
    assert result["completed"] == result["total"] == 60, result
    assert result["token_exact"] == 60, result
    assert result["duplicated_tokens"] == 0 and result["missing_tokens"] == 0, result
    assert result["leaked_blocks"] == 0, result


def test_a_second_worker_with_a_live_workers_id_waits_and_joins_once_that_one_is_gone(tmp_path):
    """A second decode worker started with --worker-id decode-0: the router refuses it while the first
    lives, and the cluster serves on (before, the two displaced each other every heartbeat and every
    request failed). Once the first is killed, the second joins in its place."""
    log = tmp_path / "second.log"
    with cluster(tmp_path, prefill=1, decode=1) as c, Client(c.address, timeout=60) as client, \
            open(log, "w") as out:
        first = next(w["incarnation"] for w in client.status().workers if w["worker_id"] == "decode-0")
        second = subprocess.Popen(pdserve_cmd() + ["decode", "--router", f"tcp://127.0.0.1:{c.worker_port}",
                                                   "--worker-id", "decode-0", "--model", "dummy:nanogpt"],
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
        try:
            wait_for(lambda: "refuses to register it" in log.read_text(), what="the second worker to be refused")
            prompts = [[i + 1, 2, 3] for i in range(8)]
            sampling = [dict(max_tokens=20, temperature=0, ignore_eos=True)] * len(prompts)
            results = client.generate_many(prompts, max_tokens=20, temperature=0, ignore_eos=True)
            assert [r.token_ids for r in results] == reference(prompts, sampling)
            assert [w["incarnation"] for w in client.status().workers if w["worker_id"] == "decode-0"] == [first]
            assert second.poll() is None, log.read_text()  # it waits, registering again
            c.workers[1].proc.kill()
            wait_for(lambda: {w["incarnation"] for w in client.status().workers
                              if w["worker_id"] == "decode-0" and w["alive"]} - {first}, what="the second to join")
            assert client.generate([1, 2, 3], max_tokens=20, temperature=0, ignore_eos=True).token_ids == \
                results[0].token_ids
        finally:
            stop(second)
