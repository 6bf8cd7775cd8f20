"""`pdserve bench scaling` end to end, as a user runs it: real clusters of dummy:nanogpt on 2 CPU
workers (2mono and 1p1d), a small sweep, the JSON and the PNGs written, no process left behind;
and bad input refused before anything is launched."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


REPO = Path(__file__).resolve().parent.parent


def pdserve_cmd() -> list[str]:
    """This checkout's `pdserve` (an installed console script may be another checkout's)."""
    return [sys.executable, "-m", "common.cli"]


def session_processes(sid: int) -> list[str]:
    """Processes still alive in session sid (the bench and everything it started)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(text.split(")", 1)[0] + ")")
    return out


def small_trace(path: Path) -> str:
    rows = [{"arrival": round(0.05 * i, 3), "prompt_tokens": 16 + (7 * i) % 48, "output_tokens": 4 + i % 12}
            for i in range(24)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_small_sweep_end_to_end(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        pdserve_cmd() + ["bench", "scaling", "--model", "dummy:nanogpt", "--devices", "cpu", "--workers", "2",
                         "--topologies", "2mono,1p1d", "--workload", small_trace(tmp_path / "small.jsonl"),
                         "--ttft-slo-ms", "50", "--itl-slo-ms", "10", "--duration", "1.5", "--min-requests", "12",
                         "--max-requests", "40", "--start-rate", "8", "--refine", "1", "--out-dir", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=REPO)
    try:
        stdout, stderr = proc.communicate(timeout=110)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert session_processes(proc.pid) == [], "the bench left processes behind"

    result = json.loads(stdout.strip().splitlines()[-1])
    assert json.loads((out / "scaling.json").read_text()) == result
    rows = {r["topology"]: r for r in result["results"]}
    assert set(rows) == {"2mono", "1p1d"}
    # each topology says when its sweep ended, in the order they ran (a profile is compared with it)
    assert result["results"][0]["finished_unix"] <= result["results"][1]["finished_unix"] <= time.time()
    for r in rows.values():
        assert r["devices"] == 2 and r["goodput_rps"] > 0
        assert r["goodput_per_device_rps"] == pytest.approx(r["goodput_rps"] / 2, abs=1e-3)
        rates = [p["rate"] for p in r["points"]]
        assert r["goodput_rps"] in [round(x, 4) for x in rates]
        at = next(p for p in r["points"] if round(p["rate"], 4) == r["goodput_rps"])
        assert at["attainment"] >= 0.9
        # the search went on until attainment fell clearly below the target
        assert any(p["rate"] > r["goodput_rps"] and p["attainment"] < 0.9 for p in r["points"])
        assert r["saturation_tok_s"] == max(p["output_tok_s"] for p in r["points"])
        assert r["saturation_rps"] == round(max(p["requests_s"] for p in r["points"]), 3)
        for k in ("ttft", "itl", "e2e"):
            lat = [r["at_goodput"][f"{k}_p{q}_ms"] for q in (50, 90, 99)]
            assert 0 <= lat[0] <= lat[1] <= lat[2]
    assert result["best"]["2"] == max(rows.values(), key=lambda r: r["goodput_rps"])["topology"]
    assert "2mono" in stdout and "goodput req/s" in stdout  # the table
    assert sorted(p.name for p in (out / "logs" / "1p1d").iterdir()) == ["decode-0.log", "prefill-0.log", "router.log"]

    for name in ("attainment.png", "goodput_per_device.png", "latency_at_goodput.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    assert sorted(Path(p).name for p in result["plots"]) == sorted(["attainment.png", "goodput_per_device.png",
                                                                     "latency_at_goodput.png"])
    progress = [line for line in stderr.splitlines() if line.startswith("[scaling")]
    assert any("2mono: launching (1/2 topologies, 1 after it)" in line for line in progress)
    assert any("1p1d (2/2): " in line and "req/s x" in line for line in progress)


def run(*args):
    return subprocess.run(pdserve_cmd() + list(args), capture_output=True, text=True, timeout=60, cwd=REPO)


def test_bad_input_is_named_before_anything_starts(tmp_path):
    r = run("bench", "scaling", "--workload", "chatty")
    assert r.returncode == 2 and "workload 'chatty' is unknown; allowed: chat, long-context, realistic" in r.stderr
    r = run("bench", "scaling", "--ttft-slo-ms", "0")
    assert r.returncode == 2 and "--ttft-slo-ms 0.0" in r.stderr and "allowed: a number of ms > 0" in r.stderr
    r = run("bench", "scaling", "--workers", "2", "--topologies", "1p1d,2p1d")
    assert r.returncode == 2 and "topology 2p1d needs 3 workers; the devices allow 2" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival": 0, "prompt_tokens": 4, "output_tokens": 2}\n{"arrival": 1, "prompt_tokens": 4}\n')
    r = run("bench", "scaling", "--workload", str(bad))
    assert r.returncode == 2 and "bad.jsonl:2: field 'output_tokens' is missing" in r.stderr


def test_a_point_spans_the_duration_10_ttft_targets_and_4_request_lifetimes():
    """A burst shorter than these is absorbed, by the queues or a growing batch, at any rate."""
    from bench.goodput import SLO
    from bench.scaling import Sweep

    sweep = Sweep()  # 15 s, 30 to 400 requests
    assert sweep.requests_at(4.0, SLO(200, 10), 20) == 60  # 4 req/s over 15 s
    assert sweep.requests_at(40.0, SLO(200, 10), 20) == 400  # 600 capped: still 10 s of arrivals
    assert sweep.requests_at(4.0, SLO(3000, 10), 20) == 120  # 10 TTFT targets: 30 s
    assert sweep.requests_at(4.0, SLO(1000, 100), 100) == 176  # 4 lifetimes of 1 + 100 x 0.1 s: 44 s
    assert sweep.requests_at(40.0, SLO(1000, 100), 100) == 1760  # past max_requests


def test_a_sweep_refuses_points_that_would_never_end():
    """--duration inf, and a TTFT target so loose that a point's burst (10 targets long, so that
    queues cannot absorb it) would take billions of requests: named errors, not an overflow or a hang."""
    from bench.goodput import SLO
    from bench.scaling import MAX_POINT_REQUESTS, Sweep
    from common.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="--duration inf; allowed: a number of seconds > 0"):
        Sweep(duration_s=math.inf)
    sweep = Sweep()
    with pytest.raises(InvalidArgument, match="--ttft-slo-ms 1e\\+12: a point at 4 req/s would take"):
        sweep.requests_at(4.0, SLO(1e12, 1), 20)
    with pytest.raises(InvalidArgument, match="--ttft-slo-ms 1 and --itl-slo-ms 1e\\+12: a point at 4 req/s would "
                                              "take .* over 4 request lifetimes at the targets: TTFT \\+ 20 mean"):
        sweep.requests_at(4.0, SLO(1, 1e12), 20)
    assert sweep.requests_at(4.0, SLO(MAX_POINT_REQUESTS / 4 / 10 * 1e3, 1), 20) == MAX_POINT_REQUESTS
    with pytest.raises(InvalidArgument, match="--duration 1e\\+12: a point at 4 req/s .* over a quarter of the"):
        Sweep(duration_s=1e12).requests_at(4.0, SLO(1000, 100), 20)


def test_a_topology_s_placement_flags_reach_its_router(monkeypatch, tmp_path):
    """1p1d+queue2+local64: the cluster bench scaling launches runs the router with those flags."""
    import bench.scaling
    from bench.goodput import SLO
    from bench.scaling import Sweep, SweepProgress, Topology, sweep_topology
    from bench.workloads import get_workload

    class Launched(Exception):
        pass

    def cluster(*args, router_args=(), **kwargs):
        raise Launched(router_args)

    monkeypatch.setattr(bench.scaling, "Cluster", cluster)
    with pytest.raises(Launched) as e:
        sweep_topology("dummy:nanogpt", Topology.parse("1p1d+queue2+local64"), ["cpu"], get_workload("chat"),
                       SLO(1000, 100), Sweep(), [], SweepProgress(1), tmp_path)
    assert e.value.args[0] == ["--max-local-prefill-length", "64", "--max-prefill-queue", "2"]


def test_what_would_launch_for_nothing_is_refused_before_any_launch(capsys):
    """Each was found only once a cluster had launched, or not at all: a topology named twice ran
    twice and kept the second's figures; 0.001 req/s took 8 hours for its first point's 30
    requests; a TTFT target of 1e300 ms printed a count hundreds of digits long."""
    from bench.goodput import SLO
    from bench.scaling import Sweep, Topology, check_topologies, resolve_devices
    from common.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="--topologies names 1mono twice; allowed: each topology once"):
        check_topologies([Topology.parse("1mono"), Topology.parse("1p1d"), Topology.parse("1mono")], 2, ["cpu"])
    with pytest.raises(InvalidArgument, match="65 workers; allowed: at most 64 on one host"):
        check_topologies([Topology.parse("64p1d")], 100, ["cuda:0"])
    with pytest.raises(InvalidArgument, match="'cpu,cpu': cpu is one device, its cores shared by the workers"):
        resolve_devices("cpu,cpu", None)
    with pytest.raises(InvalidArgument, match=r"--start-rate 0.001: its point would take 3e\+04 s for its 30 requests"
                                              r" \(--min-requests 30\); allowed: .* here >= 0.00833 req/s"):
        Sweep(start_rate=0.001).check_start(SLO(100, 10), 20)
    Sweep(start_rate=0.01).check_start(SLO(100, 10), 20)
    with pytest.raises(InvalidArgument, match=r"a point at 0.05 req/s would take 5e\+296 requests"):
        Sweep().check_start(SLO(1e300, 10), 20)
    Sweep(min_requests=400, max_requests=400).check_start(SLO(100, 10), 20)  # its start rate is measured


def test_no_topology_meeting_the_slo_is_no_best_and_its_latencies_are_dashes(capsys):
    from bench.scaling import best_per_n, print_results

    nan = float("nan")
    rows = [{"topology": t, "devices": 1, "goodput_rps": g, "goodput_per_device_rps": g, "saturation_rps": 1.0,
             "saturation_tok_s": 10.0, "others_cores": 0.0,
             "at_goodput": {f"{k}_p{q}_ms": (nan if g == 0 else 5.0) for k in ("ttft", "itl", "e2e")
                            for q in (50, 90, 99)}} for t, g in (("1mono", 0.0), ("2mono", 0.0))]
    assert best_per_n(rows) == {}
    rows.append({**rows[0], "topology": "3mono", "devices": 2, "goodput_rps": 1.5,
                 "at_goodput": {k: 5.0 for k in rows[0]["at_goodput"]}})
    assert best_per_n(rows) == {"2": "3mono"}
    print_results("t", rows, best_per_n(rows))
    table = capsys.readouterr().out.splitlines()
    assert table[3].split()[6:9] == ["-", "-", "-"] and table[5].split()[6:9] == ["5/5/5"] * 3


def test_a_cluster_process_gone_during_a_point_ends_the_sweep_with_its_log(tmp_path):
    """Its failed requests were taken for the topology's: a Ctrl-C that reached the workers (or a
    crash) measured a cluster that was gone, and the run wrote its figures as if finished."""
    from types import SimpleNamespace

    from bench.scaling import check_alive
    from router.client import RequestError
    from router.launcher import Child

    def child(name, code):
        c = Child(name, [sys.executable, "-c", f"print('{name} says bye'); raise SystemExit({code})"],
                  tmp_path / f"{name}.log")
        c.start()
        c.proc.wait()
        return c

    alive = Child("router", [sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "router.log")
    alive.start()
    try:
        with pytest.raises(RequestError) as e:
            check_alive(SimpleNamespace(children=[alive, child("decode-0", 3)]), "the point at 2 req/s of 1p1d")
    finally:
        alive.proc.kill()
        alive.proc.wait()
    assert e.value.code == "UNAVAILABLE"
    assert e.value.message.startswith("decode-0 exited with 3 during the point at 2 req/s of 1p1d; nothing of this "
                                      f"run is saved. Its log, {tmp_path / 'decode-0.log'}, ends:")
    assert "decode-0 says bye" in e.value.message


def test_an_empty_out_dir_is_refused_and_the_help_shows_no_none_bounds():
    """Path("") is the current folder, where the run wrote its files and logs; click's range of a
    float flag with no bounds read "[x<=None]"."""
    from click.testing import CliRunner

    from common.cli import main

    r = CliRunner().invoke(main, ["bench", "scaling", "--out-dir", ""])
    assert r.exit_code == 2 and "Invalid value for '--out-dir': '' is empty; allowed: a folder's path" in r.output
    r = CliRunner().invoke(main, ["bench", "scaling", "--help"])
    assert r.exit_code == 0 and "--ttft-slo-ms" in r.output and "None" not in r.output
