"""Workloads for scaling experiments: named mixes, JSONL traces replayed at any rate, and bad input
named in its error."""

import json
import os
import re
import statistics

import pytest

from bench.scaling import Topology, all_topologies, check_topologies, resolve_devices
from bench.serve import parse_topology
from bench.workloads import WORKLOADS, Request, fit, get_workload, load_trace
from common.errors import InvalidArgument


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_named_workloads_arrive_at_the_rate_asked(name):
    w = get_workload(name)
    reqs = w.requests(20.0, 2000, seed=3)
    gaps = [b.arrival - a.arrival for a, b in zip(reqs, reqs[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=1e-9)  # the rate offered is the rate named
    assert all(g >= 0 for g in gaps) and statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1, rel=0.1)  # Poisson's
    assert all(w.prompt.lo <= r.prompt_tokens <= w.prompt.hi and w.output.lo <= r.output_tokens <= w.output.hi
               for r in reqs)
    assert w.requests(20.0, 2000, seed=3) == reqs  # seeded
    few = w.requests(5.0, 50, seed=3)
    assert [(r.prompt_tokens, r.output_tokens) for r in few] == [(r.prompt_tokens, r.output_tokens) for r in reqs[:50]]
    assert statistics.mean(b.arrival - a.arrival for a, b in zip(few, few[1:])) == pytest.approx(1 / 5)


def test_named_workloads_have_their_shape():
    chat, long, realistic = (statistics.median(r.prompt_tokens for r in get_workload(n).requests(1, 500))
                             for n in ("chat", "long-context", "realistic"))
    assert chat < realistic < long
    out = {n: statistics.median(r.output_tokens for r in get_workload(n).requests(1, 500))
           for n in ("chat", "long-context")}
    assert out["long-context"] < out["chat"]


def test_fit_cuts_prompts_to_the_context():
    assert fit(Request(0.0, 5000, 64), 1024) == Request(0.0, 959, 64)
    assert fit(Request(0.0, 100, 900), 1024) == Request(0.0, 100, 512)  # outputs at most half the context
    assert fit(Request(0.0, 10, 10), 1024) == Request(0.0, 10, 10)


def write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_trace_is_replayed_at_each_rate(tmp_path):
    rows = [{"arrival": t, "prompt_tokens": 10 * (i + 1), "output_tokens": i + 1}
            for i, t in enumerate([0.0, 0.5, 0.5, 2.0])]  # 3 gaps in 2 s: 1.5 requests/s
    w = get_workload(write(tmp_path / "trace.jsonl", rows))
    assert [r.arrival for r in w.requests(1.5, 4)] == pytest.approx([0.0, 0.5, 0.5, 2.0])
    fast = w.requests(3.0, 6)  # twice the rate: half the times; cycled with the trace's period
    assert [r.arrival for r in fast] == pytest.approx([0.0, 0.25, 0.25, 1.0, 4 / 3, 4 / 3 + 0.25])
    assert [r.prompt_tokens for r in fast] == [10, 20, 30, 40, 10, 20]
    burst = get_workload(write(tmp_path / "burst.jsonl", rows[1:3]))  # two rows at one instant
    assert [r.arrival for r in burst.requests(1.0, 6)] == pytest.approx([0, 0, 2, 2, 4, 4])  # 1 request/s


@pytest.mark.parametrize("line, problem", [
    ('{"arrival": 0.1, "prompt_tokens": 5}', "field 'output_tokens' is missing"),
    ('{"arrival": 0.1, "prompt_tokens": "many", "output_tokens": 4}', "field 'prompt_tokens' is 'many'"),
    ('{"arrival": 0.1, "prompt_tokens": 0, "output_tokens": 4}', "field 'prompt_tokens' is 0"),
    ('{"arrival": -1, "prompt_tokens": 3, "output_tokens": 4}', "field 'arrival' is -1"),
    ('{"arrival": 0.1, "prompt_tokens": 3.5, "output_tokens": 4}', "field 'prompt_tokens' is 3.5"),
    ('{"arrival": 0.1, "prompt_tokens": 3, "output_tokens": true}', "field 'output_tokens' is True"),
    ('{"arrival": NaN, "prompt_tokens": 3, "output_tokens": 4}', "field 'arrival' is nan"),
    ('{"arrival": 0.05, "prompt_tokens": 3, "output_tokens": 4}', "before the previous row's 0.1"),
    ('[1, 2, 3]', "is not a JSON object"),
    ('{"arrival": 0.2,', "not JSON"),
])
def test_malformed_jsonl_row_is_named_by_line_and_field(tmp_path, line, problem):
    path = write(tmp_path / "bad.jsonl", ['{"arrival": 0.0, "prompt_tokens": 3, "output_tokens": 4}',
                                          '{"arrival": 0.1, "prompt_tokens": 3, "output_tokens": 4}', "", line])
    with pytest.raises(InvalidArgument) as e:
        load_trace(path)
    assert "bad.jsonl:4: " in str(e.value) and problem in str(e.value)


def test_unknown_workload_and_empty_trace(tmp_path):
    with pytest.raises(InvalidArgument, match="workload 'chatty' is unknown; allowed: chat, long-context, realistic"):
        get_workload("chatty")
    with pytest.raises(InvalidArgument, match="has no requests"):
        get_workload(write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(InvalidArgument, match="cannot be read"):
        get_workload(str(tmp_path / "missing.jsonl"))


def test_topologies_and_what_the_devices_allow(monkeypatch):
    assert [t.name for t in all_topologies(3)] == ["1mono", "2mono", "1p1d", "3mono", "1p2d", "2p1d"]
    assert Topology.parse("mono") == Topology(0, 0, 1) and Topology.parse("2p3d").devices == 5
    with pytest.raises(InvalidArgument, match="topology '0p1d' is not supported"):
        Topology.parse("0p1d")
    queued = Topology.parse("1p1d+queue2+local64")  # named in one order whatever order it was given in
    assert (queued.name, queued.devices, queued.router_args) == \
        ("1p1d+local64+queue2", 2, ["--max-local-prefill-length", "64", "--max-prefill-queue", "2"])
    assert Topology.parse(queued.name) == queued and Topology.parse("1p1d").router_args == []
    assert parse_topology("2p1d+local256") == (2, 1, 0, 256, 0)
    assert parse_topology("1p2d+queue2+local64") == (1, 2, 0, 64, 2)
    assert parse_topology("3mono") == (0, 0, 3, 0, 0)
    for bad in ("1p1d+local0", "1p1d+local8+local9", "1p1d+queue", "2mono+local8"):
        with pytest.raises(ValueError, match=rf"topology '{re.escape(bad)}' is not supported; allowed: .*\+localN"):
            parse_topology(bad)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert resolve_devices("cpu", 2) == (["cpu"], 2)
    with pytest.raises(InvalidArgument, match=r"--workers 3 on cpu; allowed: 1\.\.2"):
        resolve_devices("cpu", 3)
    assert resolve_devices("cuda:0,cuda:1", None) == (["cuda:0", "cuda:1"], 2)
    with pytest.raises(InvalidArgument, match="mixes cpu"):
        resolve_devices("cpu,cuda:0", None)
    for cores, hint in ((2, "this machine's cores allow no more"), (8, "raise --workers")):  # once both said raise
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        with pytest.raises(InvalidArgument, match=f"topology 2p1d needs 3 workers; the devices allow 2 .*{hint}"):
            check_topologies([Topology.parse("1p1d"), Topology.parse("2p1d")], 2, ["cpu"])
