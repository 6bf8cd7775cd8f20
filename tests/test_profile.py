"""The planner's profile fits a monolithic worker's step cost from its own step trace
(bench/profile.fit_steps): synthetic traces whose cost is known."""

import random

import pytest

from bench.profile import fit_steps
from bench.simulate import StepCost

TRUE = StepCost(prefill_base=1e-3, prefill_token=2e-5, prefill_attn=1e-8, decode_base=1e-3, decode_seq=3e-5,
                decode_kv=5e-7, prefill_mixed=1e-5)  # a prefill token beside decodes: 1.5x its cost alone
GAP_MS = 0.2  # the loop's own time between steps
SLOW_EVERY = 10  # one step in ten is held up twice as long (a neighbour took the core)


def shapes():
    """(prefill tokens, token x context, decodes, KV read): prefills alone, decodes alone, and mixed."""
    out = [(n, n * n, 0, 0) for n in (16, 64, 256, 1024)]
    out += [(0, 0, b, b * length) for b in (1, 4, 16, 32) for length in (64, 512)]
    out += [(n, n * n, b, b * 512) for n in (64, 512) for b in (4, 32)]
    return out


def row(start, n, ctx, b, kv, seconds, gap_ms):
    step_ms = seconds * 1e3 - GAP_MS
    return {"start": start, "step_ms": step_ms * 0.9, "send_ms": step_ms * 0.1, "gap_ms": gap_ms,
            "decodes": float(b), "kv_tokens": float(kv), "kv_padded": float(kv), "prefill_tokens": float(n),
            "prefill_token_ctx": float(ctx)}


def trace(slowdown: float, t0: float, rng: random.Random) -> list[dict]:
    """Twenty steps of every shape, in a run whose contention stretched them by `slowdown`; the
    first step of each shape follows a second of idling."""
    rows, t = [], t0
    for n, ctx, b, kv in shapes():
        cost = TRUE.of_sums(n, ctx, b, kv)
        for i in range(20):
            held = 2.0 if i % SLOW_EVERY == SLOW_EVERY - 1 else 1.0
            seconds = cost * held * slowdown * rng.uniform(0.98, 1.02)
            rows.append(row(t, n, ctx, b, kv, seconds, 1000.0 if i == 0 else GAP_MS))
            t += seconds + 1e-4
    return rows


def test_a_trace_is_fitted_to_the_mean_step_of_each_shape():
    rng = random.Random(0)
    calm, loaded = trace(1.0, 100.0, rng), trace(1.5, 200.0, rng)
    warm_up = [row(50.0, 64, 64 * 64, 0, 0, 5.0, None)]  # before any run: left out
    windows = [(100.0, 199.0, {"slow": 1.0}), (200.0, 299.0, {"slow": 1.5})]
    cost, means = fit_steps(warm_up + calm + loaded, windows, padded=True, slow=lambda cpu: cpu["slow"])

    held = (SLOW_EVERY - 1 + 2) / SLOW_EVERY  # the mean step is 1.1x the usual one
    for n, ctx, b, kv in shapes():
        want = TRUE.of_sums(n, ctx, b, kv) * held
        assert cost([(n, 0)] if n else [], b, kv) == pytest.approx(want, rel=0.04), (n, b, kv)
    # the runs' contention divided out: both runs' steps of a shape fall in one mean
    assert sum(m[-1] for m in means) == len(calm) + len(loaded) and len(means) == len(shapes())
    # what a prefill token costs more beside decodes than alone is told apart from its cost alone
    assert cost.prefill_mixed == pytest.approx(TRUE.prefill_mixed * held, rel=0.1)
    assert cost.prefill_token == pytest.approx(TRUE.prefill_token * held, rel=0.1)


def test_a_trace_with_no_step_in_any_run_is_an_error():
    with pytest.raises(RuntimeError, match="no step of the profile's runs"):
        fit_steps([row(1.0, 16, 256, 0, 0, 0.01, None)], [(5.0, 6.0, {})], padded=False, slow=lambda _: 1.0)
