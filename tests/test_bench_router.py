"""`pdserve bench router`: a real router process fed by synthetic workers. Every token a client
gets is checked against the prompt it echoes, so the bench also proves the router delivers many
interleaved streams whole and in order under load."""

import json
import subprocess
import sys

import pytest

from bench.router_capacity import LoadGenerator
from common import protocol as P
from common.errors import InvalidArgument
from bench.router_capacity import run_router_bench


@pytest.mark.parametrize("frontend", ["zmq", "zmq-per-token"])
def test_a_small_run_delivers_every_stream_whole_and_reports_the_routers_cpu(frontend):
    r = subprocess.run([sys.executable, "-m", "common.cli", "bench", "router", "--concurrency", "4,32",
                        "--seconds", "1", "--max-tokens", "24", "--workers", "2", "--frontend", frontend],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["errors"] == 0, r.stdout
    assert [p["concurrency"] for p in result["points"]] == [4, 32]
    assert result["requests_done"] >= 32  # many requests of 24 tokens ran through each level
    for p in result["points"]:
        assert p["delivered_tok_s"] > 0 and p["router_us_per_token"] > 0 and p["router_cores"] > 0
    # 32 streams on 2 workers: the SDK's client gets each worker step's tokens in one message (some
    # 8 at rest, 2 on a machine loaded twice over), the per-token frontend one token a message
    assert (result["points"][1]["tokens_per_message"] > 1) == (frontend == "zmq"), result["points"]
    assert "router us/token" in r.stdout and "concurrency" in r.stderr  # the table, and progress


def test_the_load_generator_catches_a_lost_a_repeated_and_a_foreign_token():
    gen = LoadGenerator.__new__(LoadGenerator)  # its checks alone, no socket
    gen.open, gen.tokens, gen.done, gen.gaps, gen.errors, gen.max_tokens = {}, 0, 0, [], [], 3
    gen.messages, gen.token_batches = 0, False
    gen.open["a"] = [gen.expected([5, 6]), 0, None]  # 5, 6, 5
    gen.on_reply(P.Token("a", 0, [5]))
    assert not gen.errors
    gen.on_reply(P.Token("a", 2, [5]))  # index 1 was skipped
    gen.on_reply(P.Token("a", 1, [9]))  # the wrong token
    gen.on_reply(P.Token("b", 0, [1]))  # a stream never asked for
    gen.on_reply(P.Done("a", "length", [5, 6]))  # too short
    gen.on_reply(P.TokenBatch([]))  # a batch to a client that asked for none
    assert len(gen.errors) == 5, gen.errors


@pytest.mark.parametrize("kwargs, named", [
    ({"workers": 0}, "workers=0"), ({"step_ms": 0.0}, "step_ms=0.0"), ({"concurrencies": [0, 4]}, "concurrencies"),
    ({"max_tokens": 1}, "max_tokens=1"), ({"prompt_len": 1000, "max_tokens": 1000}, "prompt_len + max_tokens")])
def test_bad_settings_are_named_before_anything_starts(kwargs, named):
    with pytest.raises(InvalidArgument, match=named.replace("+", r"\+")):
        run_router_bench(**kwargs)


@pytest.mark.parametrize("api_servers", [1, 2])
def test_the_http_frontend_streams_every_request_whole_through_the_openai_api(api_servers):
    r = subprocess.run([sys.executable, "-m", "common.cli", "bench", "router", "--frontend", "http",
                        "--concurrency", "8", "--seconds", "1", "--max-tokens", "16", "--workers", "1",
                        "--api-servers", str(api_servers)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["frontend"] == "http" and result["errors"] == 0, r.stdout
    (point,) = result["points"]
    assert result["requests_done"] >= 8 and point["delivered_tok_s"] > 0
    # HTTP's own work is where it is served: in the router, or in the API servers beside it
    assert (point["api_servers_cores"] > 0) == (api_servers > 1), point


def test_an_unknown_frontend_is_named_with_the_ones_allowed():
    with pytest.raises(InvalidArgument, match=r"frontend='grpc'; allowed: zmq, zmq-per-token, http"):
        run_router_bench(frontend="grpc")
    with pytest.raises(InvalidArgument, match=r"api_servers=2; allowed: 1, or more with frontend=http"):
        run_router_bench(frontend="zmq", api_servers=2)
