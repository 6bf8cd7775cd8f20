"""The planner's simulator on synthetic profiles whose answers can be worked out by hand: a
prefill-bound and a decode-bound workload, and the real scheduler's limits inside it."""

from dataclasses import replace

import pytest

from bench.goodput import SLO, find_goodput
from bench.simulate import EngineShape, Hosting, StepCost, WorkerModel, host_slowdown, simulate
from bench.workloads import Request, get_workload


def constant(rate: float, n: int, prompt: int, output: int) -> list[Request]:
    return [Request(i / rate, prompt, output) for i in range(n)]


def goodput(model, topology, slo, prompt, output, n=120):
    p, d, m = topology
    return find_goodput(lambda r: simulate(model, p, d, m, Hosting(), r, constant(r, n, prompt, output), slo),
                        slo.attainment, start=4.0, refine=4).goodput


# Prefill-bound: a 100-token prompt costs 0.5 ms a token whether batched or not, so a prefill
# worker serves 1 / 50 ms = 20 requests/s; past that the queue (and TTFT) grows without bound.
# Decoding 10 tokens at 1 ms a step is never the limit.
PREFILL_BOUND = WorkerModel(StepCost(prefill_token=0.5e-3, decode_base=1e-3), EngineShape(4096, 16, 64, 2048, 1024),
                            kv_bytes_per_token=1024)
# Decode-bound: a decode step takes 10 ms at any batch size, and a decode worker holds at most 8
# requests (max_num_seqs), each for 40 steps (400 ms) from its reservation: 8 / 0.4 s = 20
# requests/s. Past that, requests wait for a slot between their first and second token, and TPOT
# (10 ms a token when a slot is free) grows past its 12 ms target.
DECODE_BOUND = WorkerModel(StepCost(prefill_token=1e-6, decode_base=10e-3), EngineShape(4096, 16, 8, 2048, 1024),
                           kv_bytes_per_token=1024)


def test_prefill_bound_goodput_scales_with_prefill_workers():
    slo = SLO(ttft_ms=200, itl_ms=20)
    one = goodput(PREFILL_BOUND, (1, 1, 0), slo, 100, 10)
    assert 18 <= one <= 21  # the hand-computed 20 req/s, within the search's step
    assert goodput(PREFILL_BOUND, (2, 1, 0), slo, 100, 10) == pytest.approx(2 * one, rel=0.1)
    assert goodput(PREFILL_BOUND, (1, 2, 0), slo, 100, 10) == pytest.approx(one, rel=0.1)


def test_decode_bound_goodput_scales_with_decode_workers():
    slo = SLO(ttft_ms=200, itl_ms=12)
    one = goodput(DECODE_BOUND, (1, 1, 0), slo, 16, 41)  # 41 tokens: the first from the prefill, 40 decoded
    assert 17 <= one <= 20.5
    assert goodput(DECODE_BOUND, (1, 2, 0), slo, 16, 41) == pytest.approx(2 * one, rel=0.1)
    assert goodput(DECODE_BOUND, (2, 1, 0), slo, 16, 41) == pytest.approx(one, rel=0.1)


def test_latencies_below_saturation_are_the_step_times():
    slo = SLO(ttft_ms=1000, itl_ms=1000)
    p = simulate(DECODE_BOUND, 1, 1, 0, Hosting(), 4.7, constant(4.7, 20, 16, 41), slo)
    assert [r.ttft for r in p.records] == pytest.approx([0.016] * 20)  # 16 prompt tokens at 1 us each, no queue
    # 40 decode steps of 10 ms after the first token, plus at most one step's wait to join the batch
    decode = [r.e2e - r.ttft for r in p.records]
    assert all(400 - 1e-6 <= t <= 410 + 1e-6 for t in decode) and max(decode) > 401
    assert all(10.0 - 1e-6 <= r.tpot <= 410 / 40 + 1e-6 for r in p.records)


def test_monolithic_prefill_shares_the_step_with_decodes():
    """A mono worker batches a new prompt with its running decodes: the decodes' gap that step is
    the mixed step's time (10 ms base + 100 tokens x 0.5 ms), which a decode worker never sees."""
    model = WorkerModel(StepCost(prefill_token=0.5e-3, decode_base=10e-3, prefill_base=10e-3),
                        EngineShape(4096, 16, 64, 2048, 1024), kv_bytes_per_token=1024)
    reqs = [Request(0.0, 100, 30), Request(0.105, 100, 30)]
    slo = SLO(1000, 1000)
    mono = simulate(model, 0, 0, 1, Hosting(), 10.0, reqs, slo)
    assert max(mono.records[0].itl) == pytest.approx(60.0)  # the step that prefilled the second prompt
    split = simulate(model, 1, 1, 0, Hosting(), 10.0, reqs, slo)
    assert max(split.records[0].itl[1:]) == pytest.approx(10.0)


def test_kv_pools_limit_admission():
    """Pools that hold one prompt at a time, smaller than the longest request: a prefill worker
    admits no prompt before its decode worker has granted it room (common/scheduler.py), so
    each prompt waits for the one before to be prefilled, handed off and decoded."""
    model = WorkerModel(StepCost(prefill_token=1e-3, decode_base=1e-3), EngineShape(8, 16, 64, 2048, 1024),
                        kv_bytes_per_token=1024, handoff_base_s=0.005)
    reqs = [Request(0.0, 100, 2) for _ in range(3)]  # 7 blocks each; the pools have 8
    p = simulate(model, 1, 1, 0, Hosting(), 1.0, reqs, SLO(1000, 1000))
    # The first: prefilled in 100 ms, handed off in 5, decoded at 106. The others wait in the
    # decode worker's queue of reservations, granted in order as room frees: the second at 106,
    # prefilled by 206, decoded at 212; the third granted then, prefilled by 312.
    assert sorted(r.ttft for r in p.records) == pytest.approx([100, 206, 312])


def test_least_loaded_router_spreads_requests():
    model = PREFILL_BOUND
    p = simulate(model, 0, 0, 2, Hosting(), 100.0, [Request(0.0, 100, 10), Request(0.0, 100, 10)], SLO(1000, 1000))
    assert sorted(round(r.ttft) for r in p.records) == [50, 50]  # one each, in parallel


def test_network_between_hosts_moves_handoff():
    """1P1D whose KV crosses hosts: latency + bytes / bandwidth between the first and second token."""
    model = WorkerModel(StepCost(prefill_token=1e-6, decode_base=1e-3), EngineShape(4096, 16, 64, 2048, 1024),
                        kv_bytes_per_token=1_000_000)
    one_host = simulate(model, 1, 1, 0, Hosting(), 1.0, [Request(0.0, 100, 3)], SLO(1000, 1000))
    far = Hosting(cross_host=1.0, network_gbps=1.0, network_latency_s=0.002)
    two_hosts = simulate(model, 1, 1, 0, far, 1.0, [Request(0.0, 100, 3)], SLO(1000, 1000))
    # 100 MB at 1 GB/s = 100 ms, plus 2 ms of latency
    assert two_hosts.records[0].itl[0] - one_host.records[0].itl[0] == pytest.approx(102.0, abs=0.01)
    half = Hosting(cross_host=0.5, network_gbps=1.0, network_latency_s=0.002)
    reqs = [Request(i * 1.0, 100, 3) for i in range(200)]
    crossed = sum(r.itl[0] > 50 for r in simulate(model, 1, 1, 0, half, 1.0, reqs, SLO(1000, 1000)).records)
    assert 70 <= crossed <= 130  # about half, the same on every run


def test_cpu_contention_stretches_steps():
    """Two single-thread workers stepping at once on one core take twice as long; one alone does not."""
    model = PREFILL_BOUND
    reqs = [Request(0.0, 100, 2), Request(0.0, 100, 2)]
    alone = simulate(model, 0, 0, 2, Hosting(), 1.0, reqs, SLO(1000, 1000))
    shared = simulate(model, 0, 0, 2, Hosting(host_cores=1), 1.0, reqs, SLO(1000, 1000))
    assert [r.ttft for r in alone.records] == pytest.approx([50, 50])
    assert [r.ttft for r in shared.records] == pytest.approx([100, 100])
    staggered = simulate(model, 0, 0, 2, Hosting(host_cores=1), 1.0, [Request(0.0, 100, 1), Request(0.025, 100, 1)],
                         SLO(1000, 1000))
    # the first runs alone for 25 ms (half its work), then both at half speed: it ends at 75 ms;
    # the second has done 25 ms of its 50 by then, and ends alone 25 ms later, at 100 ms (75 after it arrived)
    assert [r.ttft for r in staggered.records] == pytest.approx([75, 75])


def test_the_router_and_clients_take_their_cores_first():
    """One worker on a 2-core host whose router and clients keep 1.5 cores busy gets the 0.5 left:
    its 50 ms prefill takes 100 ms (sharing all cores alike would give (1 + 1.5) / 2 = 1.25x)."""
    model = replace(PREFILL_BOUND, front_cpu_request_s=1.5)  # at 1 request/s: 1.5 cores
    host = Hosting(host_cores=2, front_on_host=True)
    one = simulate(model, 0, 0, 1, host, 1.0, [Request(0.0, 100, 1)], SLO(1000, 1000))
    assert one.records[0].ttft == pytest.approx(100)
    assert host_slowdown(1, 1.0, 1.5, 2) == pytest.approx(2.0) and host_slowdown(1, 1.0, 0.5, 2) == 1.0


def test_workers_stepping_side_by_side_pay_co_run():
    """Cores to spare, but a step beside another costs co_run times alone; a step alone does not."""
    model = replace(PREFILL_BOUND, co_run=1.5)
    host = Hosting(host_cores=4)
    both = simulate(model, 0, 0, 2, host, 1.0, [Request(0.0, 100, 1), Request(0.0, 100, 1)], SLO(1000, 1000))
    assert [r.ttft for r in both.records] == pytest.approx([75, 75])
    apart = simulate(model, 0, 0, 2, host, 1.0, [Request(0.0, 100, 1), Request(1.0, 100, 1)], SLO(1000, 1000))
    assert [r.ttft for r in apart.records] == pytest.approx([50, 50])


def test_a_request_no_decode_pool_can_hold_fails_at_once_and_a_pool_sized_one_is_served():
    """As the real cluster does: the decode workers answer NO_ROOM and the router fails it; one
    that fills an idle pool exactly is granted (the watermark is kept only beside others)."""
    model = WorkerModel(StepCost(prefill_token=1e-3, decode_base=1e-3), EngineShape(8, 16, 64, 2048, 1024),
                        kv_bytes_per_token=1024)
    p = simulate(model, 1, 1, 0, Hosting(), 1.0, [Request(0.0, 100, 2), Request(0.5, 200, 2), Request(1.0, 112, 1)],
                 SLO(1000, 1000))
    assert [r.ttft is not None for r in p.records] == [True, False, True]
    assert p.records[2].ttft < 1000 and p.records[2].e2e is not None  # 113 tokens: all 8 blocks


def test_a_rate_delivers_itself_below_saturation_and_the_service_rate_above():
    """DECODE_BOUND serves 20 requests/s. Counted in the run's steady part, a rate below that
    delivers itself, and one above it the service rate: not less, for the warm-up and the drain
    of the last requests' 410 ms, which a count from first arrival to last completion includes."""
    slo = SLO(ttft_ms=200, itl_ms=12)
    below = simulate(DECODE_BOUND, 1, 1, 0, Hosting(), 10.0, constant(10.0, 60, 16, 41), slo)
    assert below.requests_s == pytest.approx(10.0, rel=0.02)  # first arrival to last completion: 9.51
    assert below.output_tok_s == pytest.approx(10.0 * 41, rel=0.02)
    above = simulate(DECODE_BOUND, 1, 1, 0, Hosting(), 40.0, constant(40.0, 240, 16, 41), slo)
    assert above.requests_s == pytest.approx(20.0, rel=0.1)
    s = find_goodput(lambda r: simulate(DECODE_BOUND, 1, 1, 0, Hosting(), r, constant(r, 120, 16, 41), slo),
                     slo.attainment, start=4.0, refine=4)
    assert s.at_goodput.requests_s == pytest.approx(s.goodput, rel=0.05)
    assert max(p.requests_s for p in s.points) >= s.goodput  # saturation is no less than goodput
    # Poisson arrivals: a window is offered more or fewer than the rate names, and delivers what it is offered
    poisson = [Request(r.arrival, 16, 41) for r in get_workload("chat").requests(10.0, 200)]
    p = simulate(DECODE_BOUND, 1, 1, 0, Hosting(), 10.0, poisson, slo)
    assert p.requests_s == pytest.approx(p.offered_rps, rel=0.1) and p.offered_rps != pytest.approx(10.0, rel=0.01)


def test_a_local_prefill_has_no_handoff_and_a_queue_limit_spreads_a_burst():
    """+local: a prompt up to the limit is prefilled by its decode worker, so its second token does
    not wait for the 50 ms handoff; +queue2: of 8 prompts at once, the prefill worker takes 2 and
    the decode worker the other 6. Each worker's first step starts with the one prompt it had (50
    ms), the rest wait for the next: 1p1d's last first token comes at 50 + 7 x 50 ms, +queue2's at
    50 + 5 x 50 (+ the 1 ms decode step batched with it)."""
    model = replace(PREFILL_BOUND, handoff_base_s=0.05)
    slo = SLO(10_000, 10_000)
    reqs = [Request(0.0, 100, 10)]
    remote = simulate(model, 1, 1, 0, Hosting(), 1.0, reqs, slo)
    local = simulate(model, 1, 1, 0, Hosting(), 1.0, reqs, slo, local_prefill=(100, 0))
    assert remote.records[0].itl[0] == pytest.approx(51.0)  # the handoff, then a 1 ms decode step
    assert local.records[0].itl[0] == pytest.approx(1.0) and local.records[0].ttft == remote.records[0].ttft
    assert simulate(model, 1, 1, 0, Hosting(), 1.0, reqs, slo, local_prefill=(99, 0)).records[0].itl[0] == \
        pytest.approx(51.0)  # one token past the limit: handed off
    burst = [Request(0.0, 100, 10) for _ in range(8)]
    together = simulate(model, 1, 1, 0, Hosting(), 1.0, burst, slo)
    spread = simulate(model, 1, 1, 0, Hosting(), 1.0, burst, slo, local_prefill=(0, 2))
    assert max(r.ttft for r in together.records) == pytest.approx(400.0)
    assert sorted(round(r.ttft) for r in spread.records) == [50, 50, 100] + [301] * 5
