"""The goodput search on synthetic latency records and attainment curves whose answer is known."""

import math
from dataclasses import replace

import pytest

from bench.goodput import BACKLOG_LIMIT, SLO, Delivery, Latency, Point, attainment, delivered, find_goodput
from common.errors import InvalidArgument


def test_attainment_counts_requests_meeting_both_targets():
    slo = SLO(ttft_ms=100, itl_ms=10)
    records = [Latency(50, 5), Latency(100, 10),  # meet (the bounds are inclusive)
               Latency(101, 5), Latency(50, 10.5),  # miss one target each
               Latency(None),  # failed: meets nothing
               Latency(80, None)]  # one token only: TTFT alone decides
    assert attainment(records, slo) == pytest.approx(3 / 6)
    assert attainment([], slo) == 0.0


def records_at(rate: float) -> list[Latency]:
    """100 requests whose TTFTs are rate x 1, 2, ..., 100 ms: under a 200 ms target, floor(200 / rate)
    of them meet it, so attainment >= 90% exactly when rate <= 200 / 90."""
    return [Latency(rate * i, 1.0) for i in range(1, 101)]


def test_goodput_of_synthetic_records_is_the_hand_computed_knee():
    slo = SLO(ttft_ms=200, itl_ms=5)
    measured = []

    def measure(rate):
        measured.append(rate)
        return Point(rate, attainment(records_at(rate), slo))

    s = find_goodput(measure, 0.9, start=1.0, growth=2.0, refine=3)
    knee = 200 / 90
    # climbs 1, 2 (pass), 4 (attainment 50%: clearly below), then bisects 2..4 three times
    assert measured[:3] == [1.0, 2.0, 4.0]
    assert len(measured) == 6
    assert knee / 2 ** (1 / 8) <= s.goodput <= knee
    assert s.goodput == pytest.approx(2 * 2 ** (1 / 8))  # 2.83 and 2.38 fail, 2.18 passes
    assert s.at_goodput.rate == s.goodput


def step_curve(knee: float, below: float = 0.5):
    return lambda rate: Point(rate, 1.0 if rate <= knee else below)


def test_step_curve_knee_between_grid_points():
    s = find_goodput(step_curve(6.0), 0.9, start=1.0)
    assert s.goodput == pytest.approx(4 * math.sqrt(2))  # 1, 2, 4 pass; 8 fails; 5.66 passes, 6.73, 6.17 fail
    assert [p.rate for p in s.points][:4] == [1.0, 2.0, 4.0, 8.0]


def test_a_start_that_fails_comes_down_first():
    s = find_goodput(step_curve(0.3, below=0.0), 0.9, start=1.0)
    assert [p.rate for p in s.points][:3] == [1.0, 0.5, 0.25]
    assert 0.3 / 2 ** (1 / 8) <= s.goodput <= 0.3


def test_one_marginal_miss_is_noise_but_a_clear_one_ends_the_climb():
    curve = {1: 1.0, 2: 1.0, 4: 0.85, 8: 0.95, 16: 0.3}

    def measure(rate):
        return Point(rate, curve.get(rate, 1.0 if rate < 12 else 0.3))

    s = find_goodput(measure, 0.9, start=1.0, refine=1)
    assert [p.rate for p in s.points] == [1, 2, 4, 8, 16, pytest.approx(8 * math.sqrt(2))]
    assert s.goodput == pytest.approx(8 * math.sqrt(2))
    # two marginal misses in a row are the knee
    curve = {1: 1.0, 2: 0.85, 4: 0.88}
    s = find_goodput(lambda r: Point(r, curve.get(r, 0.0)), 0.9, start=1.0, refine=0)
    assert s.goodput == 1.0 and [p.rate for p in s.points] == [1, 2, 4]


def saturating(capacity: float, noisy: dict[float, float] | None = None):
    """Every request within the SLO at any rate (a loose target: the batch absorbs the overload
    while the run lasts), but no more than `capacity` completes a second; `noisy`: rates whose
    completions fell short by that fraction anyway."""
    def measure(rate):
        done = min(rate, capacity) * (1 - (noisy or {}).get(rate, 0.0))
        return Point(rate, 1.0, requests_s=done, offered_rps=rate, window_s=60.0, in_flight=rate * 1.0)
    return measure


def test_a_rate_the_system_does_not_keep_up_with_fails_though_every_request_met_the_slo():
    s = find_goodput(saturating(10.0), 0.9, start=1.0)
    # 1, 2, 4, 8 keep up; 16 leaves 37.5% behind: a clear miss; bisection finds where 10% is left
    assert [p.rate for p in s.points][:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert 10.0 / 2 ** (1 / 16) <= s.goodput <= 10.0 / (1 - BACKLOG_LIMIT)
    assert s.points[4].backlog == pytest.approx(0.375) and s.points[4].to_json()["backlog"] == 0.375


def test_a_shortfall_of_a_request_or_two_in_flight_is_no_backlog():
    """12 requests at 8 req/s: the steady part (1 s) saw 9 arrive and 8 complete, one still in
    flight at its end: 11% short, but the requests in flight vary by more than that."""
    p = Point(8.0, 1.0, requests_s=7.75, offered_rps=8.72, window_s=1.03, in_flight=0.9)
    assert p.backlog > BACKLOG_LIMIT and p.meets(0.9)
    assert not replace(p, window_s=60.0).meets(0.9)  # 58 requests short in a minute: a backlog


def test_one_short_point_in_the_climb_is_noise():
    """Completions 15% short at 4 req/s (the requests in flight at the window's two ends differ by
    chance) do not end the climb; a backlog twice the limit does, at once."""
    s = find_goodput(saturating(20.0, noisy={4.0: 0.15}), 0.9, start=1.0, refine=0)
    assert [p.rate for p in s.points] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0] and s.goodput == 16.0


def test_never_meeting_the_slo_is_zero_goodput():
    s = find_goodput(lambda r: Point(r, 0.2), 0.9, start=4.0)
    assert s.goodput == 0.0 and s.at_goodput is None


def test_throughput_at_saturation_is_the_best_delivered():
    rates = {1: 100.0, 2: 200.0, 4: 350.0, 8: 340.0}
    s = find_goodput(lambda r: Point(r, 1.0 if r <= 4 else 0.0, output_tok_s=rates.get(r, 300.0)), 0.9, 1.0,
                     refine=0)
    assert s.saturation.output_tok_s == 350.0


def test_delivered_counts_the_steady_part_of_a_run():
    # one request a second for 9 s, each taking 2 s with 10 tokens: the steady part is 2..8 s, in
    # which the system delivers what arrives (counted to the last completion: 9 in 10 s)
    arrivals = [float(i) for i in range(9)]
    ends = [a + 2 for a in arrivals]
    tokens = [a + 0.2 * k for a in arrivals for k in range(1, 11)]
    d = delivered(arrivals, ends, tokens)
    assert (d.offered_rps, d.requests_s, d.output_tok_s) == pytest.approx((1.0, 1.0, 10.0))
    # a run stopped at 4 s counts up to then: the window is 1..4 s
    stopped = delivered(arrivals, ends, tokens, until=4.0)
    assert stopped.output_tok_s == pytest.approx(sum(1 < t <= 4 for t in tokens) / 3) and stopped.requests_s == pytest.approx(1.0)
    # arrivals twice as dense in the first half offer 2 a second there and 1 after: the window sees both
    dense = [i / 2 for i in range(9)] + [5.0 + i for i in range(5)]
    assert delivered(dense, [], []).offered_rps == pytest.approx(sum(2.25 < a <= 9 for a in dense) / 6.75)


def test_a_burst_is_counted_from_its_arrival_to_its_last_event():
    assert delivered([0.0, 0.0], [1.0, 2.0], [0.5, 1.0, 1.5, 2.0]) == Delivery(1.0, 1.0, 2.0, 2.0)
    # nearly a burst: a window of 0.75 ms would make rates of noise
    near = delivered([0.0] * 20 + [0.001], [1.0] * 21, [0.5] * 21 + [1.0] * 21)
    assert (near.requests_s, near.output_tok_s) == pytest.approx((21.0, 42.0))
    # stopped at 0.6 s: nothing completed yet, 21 tokens delivered in 0.6 s
    stopped = delivered([0.0] * 20 + [0.001], [1.0] * 21, [0.5] * 21 + [1.0] * 21, until=0.6)
    assert (stopped.requests_s, stopped.output_tok_s) == pytest.approx((0.0, 21 / 0.6))
    assert delivered([], [], []) == Delivery(0.0, 0.0, 0.0)


@pytest.mark.parametrize("ttft, itl, attain, flag", [(0, 10, 0.9, "--ttft-slo-ms"), (-5, 10, 0.9, "--ttft-slo-ms"),
                                                      (100, 0, 0.9, "--itl-slo-ms"), (100, 10, 1.5, "--attainment"),
                                                      (float("nan"), 10, 0.9, "--ttft-slo-ms")])
def test_slo_must_be_positive(ttft, itl, attain, flag):
    with pytest.raises(InvalidArgument, match=flag):
        SLO(ttft, itl, attain)


def test_bench_serve_counts_failed_requests_apart():
    """A failed request adds to 'failed', and none of its partial stream to the latencies or tokens."""
    from bench.serve import Sample, summarize

    good = Sample(sent=0.0, first=0.010, token_times=[0.010, 0.020, 0.030], end=0.030, tokens=3, router_s=0.001)
    failed = Sample(sent=0.0, first=0.500, token_times=[0.500, 0.900], end=None, tokens=0, error="UNAVAILABLE")
    s = summarize([good, failed], wall=1.0)
    assert (s["requests"], s["failed"], s["output_tokens"]) == (2, 1, 3)
    assert s["ttft_p99_ms"] == pytest.approx(10) and s["itl_p99_ms"] == pytest.approx(10)
    assert s["router_p50_ms"] == pytest.approx(1)
