"""`pdserve plan`: recommendations on synthetic profiles whose answer is known by hand, and the
whole command (profile real workers once, save, plan from the saved profile) as a user runs it."""

import json
import subprocess
import time
from dataclasses import replace

import pytest

from bench.plan import Planner, Profile, compare, parse_placements
from bench.scaling import Sweep, Topology
from bench.workloads import Lengths, Workload, get_workload
from bench.goodput import SLO
from common.errors import InvalidArgument
from tests.test_scaling import REPO, pdserve_cmd
from tests.test_simulate import DECODE_BOUND, PREFILL_BOUND

SWEEP = Sweep(duration_s=6.0, min_requests=60, max_requests=240, start_rate=4.0, refine=3)


def planner(model, prompt: int, output: int, slo: SLO) -> Planner:
    profile = Profile("synthetic", "gpu", None, {1: model})
    workload = Workload("fixed", Lengths(prompt, prompt), Lengths(output, output), arrival="constant")
    return Planner(profile, workload, slo, SWEEP, local_workers=4, network_gbps=25.0, network_latency_ms=0.05,
                   devices_per_host=8, say=lambda _: None)


def test_prefill_bound_plan_adds_prefill_workers():
    """20 requests/s per prefill worker (see tests/test_simulate.py): past 1P1D's goodput a second
    prefill worker doubles it, a second decode worker does nothing."""
    p = planner(PREFILL_BOUND, 100, 10, SLO(200, 20))
    ladder = p.ladder(3)
    assert [s["topology"] for s in ladder] == ["1p1d", "2p1d"]
    assert ladder[0]["add"] == "prefill" and 18 <= ladder[0]["goodput_rps"] <= 21
    assert ladder[1]["goodput_rps"] == pytest.approx(2 * ladder[0]["goodput_rps"], rel=0.1)
    plan = p.plan(3)
    assert plan["best_xpyd"] == "2p1d"
    assert {r["topology"]: r["bound"] for r in plan["topologies"]}["1p2d"] == "prefill"
    # a row within the search's resolution of the best is called a tie (one was ranked by row order)
    assert Sweep(refine=4).resolution == pytest.approx(2 ** (1 / 16) - 1) and SWEEP.resolution < 0.1
    goodput = {r["topology"]: r["goodput_rps"] for r in plan["topologies"]}
    best = goodput[plan["best"]]
    assert plan["tied_with_best"] == [t for t, g in goodput.items()
                                      if t != plan["best"] and g * (1 + SWEEP.resolution) >= best]
    assert "1p2d" not in plan["tied_with_best"]


def test_decode_bound_plan_adds_decode_workers():
    p = planner(DECODE_BOUND, 16, 41, SLO(200, 12))
    ladder = p.ladder(3)
    assert [s["topology"] for s in ladder] == ["1p1d", "1p2d"] and ladder[0]["add"] == "decode"
    plan = p.plan(3)
    assert plan["best_xpyd"] == "1p2d"
    assert {r["topology"]: r["bound"] for r in plan["topologies"]}["2p1d"] == "decode"


def test_past_this_machine_every_host_runs_the_same_split():
    """8 devices, 4 per host: 2 hosts, splits 2 x (aPbD); each host takes half the rate. Prefill-bound
    at 20 requests/s per prefill worker: 6p2d serves 6 x 20."""
    p = planner(PREFILL_BOUND, 100, 10, SLO(200, 20))
    p.local_workers, p.devices_per_host = 1, 4
    plan = p.plan(8)
    assert [r["topology"] for r in plan["topologies"]] == ["8mono", "2p6d", "4p4d", "6p2d"]
    goodput = {r["topology"]: r["goodput_rps"] for r in plan["topologies"]}
    assert goodput["6p2d"] == pytest.approx(120, rel=0.1) and goodput["2p6d"] == pytest.approx(40, rel=0.1)
    assert plan["best_xpyd"] == "6p2d" and not plan["local"]
    with pytest.raises(InvalidArgument, match="--plan-devices 10: past this machine a plan is whole hosts of "
                                              "--devices-per-host 4; allowed: 8 or 12"):
        p.hosts(10)


def test_a_looser_ttft_target_never_lowers_goodput():
    """The measured CPU profile under a loose TPOT target: a batch grows to absorb a rate it cannot
    sustain, so a short window (15 s of arrivals, as 10 TTFT targets of 1 s gave) once put 1P1D's
    goodput at 27 req/s under a 1 s target and at 19 under 5 s. Windows of 4 request lifetimes and
    the backlog rule (bench/goodput.py) give what long runs give, whatever the TTFT target."""
    profile = Profile.load(REPO / "bench/results/cpu-nanogpt-chat/profile.json")
    t = Topology.parse("1p1d")
    goodput = {}
    for ttft in (1000, 5000):
        p = Planner(profile, get_workload("chat"), SLO(ttft, 100), Sweep(), local_workers=2, network_gbps=25.0,
                    network_latency_ms=0.05, devices_per_host=8, say=lambda _: None)
        goodput[ttft] = p.goodput(t)
    assert goodput[5000] >= goodput[1000] / 2 ** (1 / 8), goodput  # within two bisection steps


def test_compare_replays_a_measurement():
    p = planner(PREFILL_BOUND, 100, 10, SLO(200, 20))
    rows = compare(p, {"results": [{"topology": "1p1d", "goodput_rps": 20.0, "start_rate": 5.0, "others_cores": 0}]})
    assert rows[0]["topology"] == "1p1d" and abs(rows[0]["error"]) <= 0.1
    replayed = p.search(Topology.parse("1p1d"), start=5.0)  # the measured search's start rate, replayed
    assert replayed.points[0].rate == 5.0 and rows[0]["predicted_rps"] == round(replayed.goodput, 4)
    assert p.search(Topology.parse("1p1d")).points[0].rate == SWEEP.start_rate  # the plan's own search
    assert rows[0]["profile_after_min"] is None  # neither says when it was measured


def test_placements_are_planned_beside_each_split_and_compared():
    """Prefill-bound at 20 requests/s a prefill worker: with +queue1 the decode worker, whose
    decodes cost little, prefills what the prefill worker has no room for, and 1P1D serves more;
    +local100 moves every prompt to the decode worker, which is then as prefill-bound alone."""
    p = planner(PREFILL_BOUND, 100, 10, SLO(200, 20))
    p.placements = parse_placements(["+queue1", "+local100"])
    rows = {r["topology"]: r["goodput_rps"] for r in p.plan(2)["topologies"]}
    assert set(rows) == {"2mono", "1p1d", "1p1d+queue1", "1p1d+local100"}
    assert rows["1p1d+queue1"] > 1.2 * rows["1p1d"] and rows["1p1d+local100"] == pytest.approx(rows["1p1d"], rel=0.15)
    row, = compare(p, {"results": [{"topology": "1p1d+queue1", "goodput_rps": 30.0, "start_rate": 5.0}]})
    assert row["topology"] == "1p1d+queue1" and row["predicted_rps"] > 1.2 * rows["1p1d"]


def test_compare_says_how_long_after_each_topologys_sweep_the_profile_was_taken():
    p = planner(PREFILL_BOUND, 100, 10, SLO(200, 20))
    p.profile = replace(p.profile, measured_unix=10_000 + 1_800)
    row = {"goodput_rps": 20.0, "start_rate": 5.0, "others_cores": 0}
    rows = compare(p, {"results": [{**row, "topology": "1p1d", "finished_unix": 10_000},
                                   {**row, "topology": "2mono", "finished_unix": 10_000 + 2_400}]})
    assert [r["profile_after_min"] for r in rows] == [30.0, -10.0]


def test_plan_profiles_once_then_plans_from_the_saved_profile(tmp_path):
    profile = tmp_path / "profile.json"
    # one thread: two torch threads on two shared cores slow down badly whenever a neighbour takes one;
    # a 256-token context keeps the profile short (its decode requests shrink to fit it)
    args = ["plan", "--profile", str(profile), "--workers", "1", "--threads", "1", "--worker-arg=--max-num-seqs",
            "--worker-arg=8", "--worker-arg=--max-model-len", "--worker-arg=256",
            "--ttft-slo-ms", "500", "--itl-slo-ms", "50", "--duration", "2",
            "--min-requests", "20", "--max-requests", "60", "--refine", "1"]
    # the plans are checked from the second run: the first plans one device, the profile being its point
    first = subprocess.run(pdserve_cmd() + args + ["--plan-devices", "1"], capture_output=True, text=True,
                           timeout=150, cwd=REPO)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = json.loads(profile.read_text())
    assert time.time() - 300 < saved["measured_unix"] <= time.time()
    (p,) = saved["profiles"]
    assert p["threads"] == 1
    step = p["worker_model"]["step"]
    assert step["decode_base"] + step["decode_seq"] > 0 and step["prefill_token"] + step["prefill_base"] > 0
    assert p["worker_model"]["engine"]["max_num_seqs"] == 8 and p["worker_model"]["engine"]["max_model_len"] == 256
    assert max(b for b, _, _ in p["points"]["decode_s"]) == 8  # batches up to max_num_seqs
    # the monolithic worker's cost comes from its own steps, prefills inside decode batches among them
    shapes = p["points"]["mono_steps"]
    # the decode runs' prompts (32 and 190 tokens) sum to even prefills; only the mixed run's 253 is odd
    assert any(b and round(n) % 2 for n, _, b, *_ in shapes) and any(n and not b for n, _, b, *_ in shapes), shapes
    assert "steps with a prefill beside decodes" in first.stderr
    mono = p["worker_model"]["mono_step"]
    assert mono["prefill_base"] == mono["decode_base"] and mono["prefill_base"] + mono["prefill_token"] > 0
    assert "profile (threads" in first.stderr

    again = subprocess.run(pdserve_cmd() + args + ["--plan-devices", "1,3"], capture_output=True, text=True,
                           timeout=150, cwd=REPO)
    assert again.returncode == 0 and "profile (threads" not in again.stderr  # read, not measured again
    result = json.loads(again.stdout.strip().splitlines()[-1])
    plans = {p["devices"]: p for p in result["plans"]}
    assert set(plans) == {1, 3} and plans[1]["local"] and not plans[3]["local"]
    assert [t["topology"] for t in plans[3]["topologies"]] == ["3mono", "1p2d", "2p1d"]
    assert plans[3]["best"] in {"3mono", "1p2d", "2p1d"} and plans[3]["topologies"][0]["goodput_rps"] > 0
    assert [s["topology"] for s in result["ladder"]][0] == "1p1d" and result["ladder"][0]["add"] in ("prefill", "decode")
    assert any("GB/s" in a for a in result["assumptions"]) and "assumptions:" in again.stdout

    r = subprocess.run(pdserve_cmd() + ["plan", "--profile", str(tmp_path / "p.json"), "--compare",
                                        str(tmp_path / "none.json")], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "none.json" in r.stderr


def test_a_profile_of_another_version_is_refused_by_name(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"profile_version": 1, "model": "dummy:nanogpt", "device": "cpu", "profiles": []}))
    with pytest.raises(InvalidArgument, match=r"old.json' is version 1; allowed: 3.*--reprofile"):
        Profile.load(old)


def test_a_slice_scaled_to_the_cluster_offers_and_delivers_hosts_times_as_much():
    from bench.goodput import Point, Search
    from bench.plan import scaled

    s = scaled(Search([Point(2.0, 1.0, requests_s=1.9, output_tok_s=190.0, offered_rps=2.1)], 2.0), hosts=8)
    (p,) = s.points
    assert s.goodput == 16.0 and (p.rate, p.offered_rps, p.requests_s, p.output_tok_s) == pytest.approx(
        (16.0, 16.8, 15.2, 1520.0)) and p.attainment == 1.0


def test_a_bad_placement_is_named_before_any_profile_is_taken(tmp_path):
    r = subprocess.run(pdserve_cmd() + ["plan", "--profile", str(tmp_path / "p.json"), "--placements", "+local256,+fast"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "--placements '+fast'; allowed: +localN and/or +queueN" in r.stderr, r.stderr
    assert not (tmp_path / "p.json").exists()  # no profile was taken


def test_a_profile_path_that_cannot_be_written_is_refused_before_profiling(tmp_path, monkeypatch):
    """--profile under a file (or in a folder that cannot be made) took minutes of profiling, then a
    FileNotFoundError traceback: it is refused by name first. The profile is then saved whole."""
    import bench.profile

    (tmp_path / "afile").write_text("")
    profiled = []
    monkeypatch.setattr(bench.profile, "profile_workers", lambda *a, **k: profiled.append(a) or fake_profile())
    with pytest.raises(InvalidArgument, match=r"--profile '.*afile'.*allowed: a folder"):
        bench.profile.run_profile("dummy:nanogpt", "cpu", 1, [], tmp_path / "afile" / "p.json", threads=1)
    with pytest.raises(InvalidArgument, match=r"--profile '.*' is a folder; allowed: a file path"):
        bench.profile.run_profile("dummy:nanogpt", "cpu", 1, [], tmp_path, threads=1)
    assert not profiled
    out = tmp_path / "new" / "p.json"
    bench.profile.run_profile("dummy:nanogpt", "cpu", 1, [], out, threads=1)
    assert len(profiled) == 1 and Profile.load(out).models[1].threads == 1
    assert sorted(p.name for p in out.parent.iterdir()) == ["p.json"]  # no temporary file left


def fake_profile() -> dict:
    from dataclasses import asdict

    from tests.test_simulate import DECODE_BOUND

    return {"threads": 1, "worker_model": asdict(replace(DECODE_BOUND, mono_step=DECODE_BOUND.step)),
            "others_cores": 0.0, "points": {}}


def invoke_plan(monkeypatch, args: list[str]):
    """`pdserve plan ARGS` in-process with the profiling and the planning replaced by recorders:
    (the exception it raised or None, the calls made: [("profile"|"plan", args)])."""
    from click.testing import CliRunner

    from bench.cli import plan

    calls = []
    monkeypatch.setattr("bench.profile.run_profile", lambda *a, **k: calls.append(("profile", a)))
    monkeypatch.setattr("bench.plan.run_plan", lambda *a, **k: calls.append(("plan", a)))
    r = CliRunner().invoke(plan, args)
    return r.exception, calls, r.output


SAVED = REPO / "bench/results/cpu-nanogpt-chat/profile.json"
SWEPT = REPO / "bench/results/cpu-nanogpt-chat/scaling.json"


def test_files_that_are_no_profile_or_no_scaling_result_are_refused_by_name(tmp_path, monkeypatch):
    """An empty profile list failed in min(); a profile, a plan or a list given to --compare
    failed with KeyError / TypeError tracebacks."""
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({**json.loads(SAVED.read_text()), "profiles": []}))
    with pytest.raises(InvalidArgument, match=r"empty.json' holds no worker profile"):
        Profile.load(empty)
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "plan.json").write_text(json.dumps({"bench": "plan", "plans": []}))
    broken = {**json.loads(SWEPT.read_text())}
    del broken["workload"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    for name, what in ((SAVED, "a profile"), (tmp_path / "list.json", "a JSON list"),
                       (tmp_path / "plan.json", "the result of 'plan'"),
                       (tmp_path / "broken.json", "a bench scaling result it cannot use (KeyError: 'workload')")):
        error, calls, _ = invoke_plan(monkeypatch, ["--profile", str(SAVED), "--compare", str(name)])
        assert isinstance(error, InvalidArgument) and not calls, error
        assert str(error).startswith(f"--compare '{name}' is {what}"), error
        assert "allowed: the scaling.json that pdserve bench scaling wrote" in str(error)


def test_a_saved_profile_is_announced_and_one_of_another_model_device_or_threads_refused(monkeypatch):
    """A nanogpt CPU profile planned --model dummy:llama-1b --device cuda:0 as nanogpt, silently."""
    for args, flag in ((["--model", "dummy:llama-1b"], "--model dummy:llama-1b"), (["--device", "cuda:0"],
                       "--device cuda:0"), (["--threads", "2"], "--threads 2")):
        error, calls, _ = invoke_plan(monkeypatch, ["--profile", str(SAVED), *args])
        assert isinstance(error, InvalidArgument), error
        assert str(error).startswith(f"{flag}: profile '{SAVED}' measured "), error
        assert "--reprofile" in str(error) and not calls
    # what the profile measured, given or not, plans from it, saying which it read and how old it is
    given = ["--model", "dummy:nanogpt", "--threads", "1"]
    error, calls, output = invoke_plan(monkeypatch, ["--profile", str(SAVED), *given])
    assert error is None and [c for c, _ in calls] == ["plan"]
    assert f"read profile '{SAVED}': dummy:nanogpt on cpu" in output and "when: not recorded" in output
    profile = replace(Profile.load(SAVED), measured_unix=1_000_000)
    assert "measured 90 min ago" in profile.describe("p.json", now=1_000_000 + 5_400)
    assert "measured 3 days ago" in profile.describe("p.json", now=1_000_000 + 3 * 86_400)


def test_compare_refuses_a_flag_its_replay_would_replace(monkeypatch):
    """--compare plans with the sweep's workload, SLO and search: --ttft-slo-ms 500 was silently
    replaced by the sweep's 200. A flag given with the sweep's own value is fine."""
    for args, said in ((["--ttft-slo-ms", "500"], "--ttft-slo-ms 500 with --compare"),
                       (["--workload", "long-context"], "--workload long-context with --compare"),
                       (["--seed", "3"], "--seed 3 with --compare")):
        error, calls, _ = invoke_plan(monkeypatch, ["--profile", str(SAVED), "--compare", str(SWEPT), *args])
        assert isinstance(error, InvalidArgument) and str(error).startswith(said) and not calls, error
        assert "allowed: " in str(error) and "or plan without --compare" in str(error)
    error, calls, _ = invoke_plan(monkeypatch, ["--profile", str(SAVED), "--compare", str(SWEPT), "--ttft-slo-ms",
                                                "200", "--workload", "chat"])
    assert error is None and [c for c, _ in calls] == ["plan"]


def test_sizes_that_would_simulate_for_hours_are_refused_by_name(monkeypatch):
    """--plan-devices 1024 --devices-per-host 1024 simulated 1,023 splits of 1,024 workers: hours, silently."""
    for args, said in ((["--plan-devices", "1024", "--devices-per-host", "1024"], "--devices-per-host 1024; allowed: "
                        "1..16"), (["--plan-devices", "1000000"], "--plan-devices 1000000; allowed: device counts "
                                                                  "1..65,536")):
        error, calls, _ = invoke_plan(monkeypatch, ["--profile", str(SAVED), *args])
        assert isinstance(error, InvalidArgument) and str(error).startswith(said) and not calls, error
    from bench.plan import check_sizes

    with pytest.raises(InvalidArgument, match="--plan-devices 32 with --workers 32: .*allowed: at most 16"):
        check_sizes([32], 32, 8)


def test_no_slo_met_has_no_best_and_a_measured_zero_no_error():
    """An SLO nothing meets planned 'best 2mono' among zeros; a measured goodput of 0 showed +nan%."""
    p = planner(DECODE_BOUND, 16, 41, SLO(0.01, 0.01))
    plan = p.plan(2)
    assert all(r["goodput_rps"] == 0 for r in plan["topologies"])
    assert plan["best"] is None and plan["best_xpyd"] is None and plan["xpyd_over_mono"] is None
    assert p.ladder(3) == [{"topology": "1p1d", "goodput_rps": 0.0, "add": None}]
    row, = compare(p, {"results": [{"topology": "1p1d", "goodput_rps": 0.0, "start_rate": 5.0}]})
    assert row["error"] is None and row["error_under_others"] is None
    from bench.plan import percent, relative

    assert percent(relative(12.0, 0.0)) == "-" and percent(relative(11.0, 10.0)) == "+10.0%"
