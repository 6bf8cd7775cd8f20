"""Bad input to the benches and to deploy/launch.sh gets a clear error that names the flag, the
value and what is allowed (exit 2), never a traceback nor bash's own: a bench whose router is
not there says UNAVAILABLE before it measures, a run whose requests all failed still prints its
table, counts of 0 are refused when parsed, and a transfer larger than the memory says so first."""

import math
import sys
import time

import pytest

import router.client
from bench.report import print_table
from bench.serve import compare_frontends, run_serve_bench
from common.cli import run
from router.launcher import free_port

pytestmark = pytest.mark.timeout(60)


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """`pdserve ARGS` in this process, as the console script runs it: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["pdserve", *args])
    with pytest.raises(SystemExit) as e:
        run()
    out, err = capsys.readouterr()
    return e.value.code, out, err


# ----------------------------------------------------------------------------- bench serve

def test_serve_to_no_router_says_unavailable_before_it_measures(monkeypatch, capsys):
    monkeypatch.setattr(router.client, "CONNECT_TIMEOUT_S", 0.5)
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    code, out, err = run_cli(monkeypatch, capsys, "bench", "serve", "--scenarios", "smoke_test", "--router", address)
    assert code == 2, err
    assert f"error [UNAVAILABLE]: no router answers at {address}" in err, err
    assert "Traceback" not in err and time.monotonic() - started < 10
    assert out == ""  # no table: nothing was measured


def test_a_run_whose_requests_all_failed_prints_its_table(monkeypatch, capsys):
    """The requests fail (no router, found out only once they are sent): each row counts them
    failed and shows "-" for what it could not measure, and the router's overhead line, which
    has no figure to take, is left out (it raised TypeError on the None)."""
    monkeypatch.setattr(router.client, "CONNECT_TIMEOUT_S", 0.3)
    monkeypatch.setattr(router.client.Client, "status", lambda self, timeout=None: None)  # pass the early check
    result = run_serve_bench("dummy:nanogpt", [], ["smoke_test"], f"tcp://127.0.0.1:{free_port()}", 0, [])
    row, = result["results"]
    assert (row["requests"], row["failed"], row["output_tokens"], row["router_p50_ms"]) == (4, 4, 0, None)
    assert math.isnan(row["ttft_p50_ms"]) and "router_overhead_ms" not in result
    out = capsys.readouterr().out
    table_row = next(line for line in out.splitlines() if line.lstrip().startswith("smoke_test"))
    assert table_row.split()[5:] == ["4", "4", "0.0"] + ["-"] * 8, table_row  # after "external ADDRESS - zmq"
    assert "router overhead" not in out


def test_frontends_are_compared_over_the_pairs_that_served():
    def row(frontend, ttft, tok_s):
        return {"topology": "mono", "policy": "least_loaded", "scenario": "smoke_test", "frontend": frontend,
                "ttft_p50_ms": ttft, "output_tok_s": tok_s}
    failed = [row("zmq", math.nan, 0.0), row("http", math.nan, 0.0)]
    assert compare_frontends(failed) == []  # was ZeroDivisionError
    served = [row("zmq", 10.0, 100.0), row("http", 12.0, 90.0)]
    out, = compare_frontends(served + failed)
    assert (out["runs"], out["ttft_p50_delta_ms"], out["output_tok_s_ratio"]) == (1, 2.0, 0.9)


def test_a_table_shows_a_missing_value_as_a_dash(capsys):
    print_table("t", ["a", "b", "c", "d"], [[None, math.nan, 1.25, 3]])
    assert capsys.readouterr().out.splitlines()[-2].split() == ["-", "-", "1.2", "3"]
