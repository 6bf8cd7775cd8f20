"""PDSERVE_STEP_TRACE: every worker of a real cluster writes its steps, and the rows add up to the
work the requests asked for."""

from common.step_trace import decode_loop_share, read as rows
from router.client import Client
from tests.cluster import cluster


def test_workers_trace_their_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_STEP_TRACE", str(tmp_path / "trace"))
    prompts = [list(range(1, 1 + n)) for n in (40, 70, 100)]
    with cluster(tmp_path, worker_args=["--no-prefix-caching"]) as c, Client(c.address, timeout=60) as client:
        for p in prompts:
            assert len(client.generate(p, max_tokens=8, ignore_eos=True).token_ids) == 8
        assert [w["prefix_caching"] for w in client.status().workers] == [False, False]  # as registered
    prefill, decode = (rows(next((tmp_path / "trace").glob(f"{name}-*.tsv"))) for name in ("prefill-0", "decode-0"))
    assert sum(r["prefill_tokens"] for r in prefill) == 210 and not any(r["decodes"] for r in prefill)
    assert sum(r["prefill_token_ctx"] for r in prefill) == sum(n * n for n in (40, 70, 100))  # one chunk each
    assert sum(r["decodes"] for r in decode) == 3 * 7 and not any(r["prefill_tokens"] for r in decode)
    assert max(r["longest"] for r in decode) == 100 + 7  # the last step reads the prompt and 7 tokens
    assert all(r["kv_padded"] >= r["kv_tokens"] >= r["longest"] for r in decode)
    assert sum(r["kv_tokens"] for r in decode) == sum(sum(range(n + 1, n + 8)) for n in (40, 70, 100))
    assert all(r["step_ms"] > 0 and r["send_ms"] >= 0 and r["decodes"] + r["prefill_tokens"] > 0
               for r in prefill + decode)  # no row for a step that ran nothing
    for trace in (prefill, decode):  # a gap before every step but the first; no device timeline on a CPU
        assert trace[0]["gap_ms"] is None and all(r["gap_ms"] >= 0 for r in trace[1:])
        assert all(r["gpu_ms"] is None for r in trace)
    share = decode_loop_share(decode)
    assert share["steps"] == len(decode) - 1 and share["device_busy"] is None and share["loop_ms_p50"] > 0


def test_loop_share_counts_decode_steps_with_the_gap_before_them():
    base = dict(start=0.0, send_ms=1.0, longest=10, kv_tokens=10, kv_padded=10, prefill_token_ctx=0)
    rows = [dict(base, step_ms=2.0, gap_ms=None, gpu_ms=1.0, decodes=4, prefill_tokens=0),  # the first: no gap
            dict(base, step_ms=2.0, gap_ms=1.0, gpu_ms=2.0, decodes=4, prefill_tokens=0),
            dict(base, step_ms=5.0, gap_ms=1.0, gpu_ms=4.0, decodes=4, prefill_tokens=30),  # holds a prefill
            dict(base, step_ms=4.0, gap_ms=3.0, gpu_ms=2.0, decodes=64, prefill_tokens=0),
            dict(base, step_ms=2.0, gap_ms=1.0, gpu_ms=1.0, decodes=2, prefill_tokens=0)]  # below min_decodes
    share = decode_loop_share(rows, min_decodes=4)
    assert share == {"steps": 2, "step_ms_p50": 4.0, "loop_ms_p50": 8.0, "device_busy": round(4.0 / 12.0, 3)}
