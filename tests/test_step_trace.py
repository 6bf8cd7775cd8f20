"""PDSERVE_STEP_TRACE: every worker of a real cluster writes its steps, and the rows add up to the
work the requests asked for."""

import csv

from router.client import Client
from tests.cluster import cluster


def rows(path):
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f, delimiter="\t")]


def test_workers_trace_their_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_STEP_TRACE", str(tmp_path / "trace"))
    prompts = [list(range(1, 1 + n)) for n in (40, 70, 100)]
    with cluster(tmp_path, worker_args=["--no-prefix-caching"]) as c, Client(c.address, timeout=60) as client:
        for p in prompts:
            assert len(client.generate(p, max_tokens=8, ignore_eos=True).token_ids) == 8
    prefill, decode = (rows(next((tmp_path / "trace").glob(f"{name}-*.tsv"))) for name in ("prefill-0", "decode-0"))
    assert sum(r["prefill_tokens"] for r in prefill) == 210 and not any(r["decodes"] for r in prefill)
    assert sum(r["prefill_token_ctx"] for r in prefill) == sum(n * n for n in (40, 70, 100))  # one chunk each
    assert sum(r["decodes"] for r in decode) == 3 * 7 and not any(r["prefill_tokens"] for r in decode)
    assert max(r["longest"] for r in decode) == 100 + 7  # the last step reads the prompt and 7 tokens
    assert all(r["kv_padded"] >= r["kv_tokens"] >= r["longest"] for r in decode)
    assert sum(r["kv_tokens"] for r in decode) == sum(sum(range(n + 1, n + 8)) for n in (40, 70, 100))
    assert all(r["step_ms"] > 0 and r["send_ms"] >= 0 and r["decodes"] + r["prefill_tokens"] > 0
               for r in prefill + decode)  # no row for a step that ran nothing
