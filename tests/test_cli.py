"""The `pdserve` command line, run as a user runs it: a real subprocess."""

import json
import shutil
import subprocess
import sys

from common.engine import Engine
from common.sampling import SamplingParams


def pdserve(*args, timeout=120):
    exe = shutil.which("pdserve")
    cmd = [exe] if exe else [sys.executable, "-m", "common.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout)


def test_generate_json_matches_engine():
    r = pdserve("generate", "--prompt", "Hello", "--prompt-ids", "1,2,3", "--max-tokens", "6",
                "--ignore-eos", "--temperature", "0.7", "--seed", "5", "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", [1, 2, 3]]
    expected = Engine(model="dummy:nanogpt").generate(
        ["Hello", [1, 2, 3]], SamplingParams(temperature=0.7, seed=5, max_tokens=6, ignore_eos=True))
    assert [line["token_ids"] for line in lines] == [e.token_ids for e in expected]
    assert [line["text"] for line in lines] == [e.text for e in expected]


def test_generate_rejects_bad_values_clearly():
    r = pdserve("generate", "--prompt", "x", "--temperature", "-1")
    assert r.returncode == 2
    assert "INVALID_ARGUMENT" in r.stderr and "temperature=-1.0" in r.stderr
    r = pdserve("generate", "--prompt-ids", "1,x")
    assert r.returncode == 2 and "comma-separated" in r.stderr
    r = pdserve("generate", "--model", "dummy:nope", "--prompt", "x")
    assert r.returncode == 2 and "dummy:nanogpt" in r.stderr


def test_bench_engine_prints_table_and_json():
    r = pdserve("bench", "engine", "--num-requests", "4", "--prompt-len", "8", "--output-len", "4",
                "--batch-sizes", "1,2", "--kv-lens", "8,16", "--steps", "2")
    assert r.returncode == 0, r.stderr
    *table, last = r.stdout.strip().splitlines()
    assert any("output tok/s" in line for line in table)
    result = json.loads(last)
    assert result["output_tok_s"] > 0
    assert set(result["decode_tok_s"]) == {"b1_kv8", "b1_kv16", "b2_kv8", "b2_kv16"}
