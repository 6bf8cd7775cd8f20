"""The prefix_affine policy: prompts that share a prefix go to the prefill worker that computed it,
while its load stays within reach of the others'; its memory of what each worker holds is bounded
by the worker's pool; and in a real cluster the prefill workers' caches then hit where least_loaded
would have computed the prefix again."""

import json
import random
import subprocess
import sys
import time

import pytest

from common.prefix_hash import prefix_hashes
from router.client import Client
from router.prefix_affinity import PrefixIndex
from router.registry import PREFILL_ROLES, Registry, Worker
from tests.cluster import cluster

pytestmark = pytest.mark.timeout(300)


def registry(n: int = 2, blocks: int = 64) -> Registry:
    r = Registry("prefix_affine")
    for i in range(n):
        r.workers[f"prefill-{i}"] = Worker(f"prefill-{i}", "prefill", "x", b"", "cpu", blocks, 16, "")
    return r


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def test_a_shared_prefix_follows_the_worker_that_has_it_until_its_load_outweighs_it():
    r = registry()
    system = prompt(0, 96)  # six full blocks
    first = r.pick(PREFILL_ROLES, prompt=system + prompt(1, 20))
    first.assigned.add("a")  # busy with it
    # a new prefix goes to the idle worker; the shared one follows the worker that has it, though busier
    other = r.pick(PREFILL_ROLES, prompt=prompt(2, 100))
    assert other is not first
    other.assigned.add("b")
    first.assigned.add("c")  # loads 2 and 1: one mean (1.5) apart is less than a whole prompt cached
    assert r.pick(PREFILL_ROLES, prompt=system + prompt(3, 20)) is first
    first.assigned.update({"d", "e", "f"})  # loads 5 and 1: the load outweighs it
    assert r.pick(PREFILL_ROLES, prompt=system + prompt(4, 20)) is other


def test_without_a_cached_prefix_it_is_least_loaded_and_without_a_prompt_too():
    r = registry(3)
    r.workers["prefill-0"].assigned.add("a")
    r.workers["prefill-1"].queued = 4
    assert r.pick(PREFILL_ROLES, prompt=prompt(5, 50)).worker_id == "prefill-2"
    r.workers["prefill-2"].assigned.update({"b", "c"})
    assert r.pick(PREFILL_ROLES).worker_id == "prefill-0"  # loads 1, 2, 2


def test_what_a_worker_holds_is_bounded_by_its_pool_least_recently_sent_forgotten_first():
    index = PrefixIndex(capacity=8)
    a, b = prefix_hashes(prompt(6, 81), 16), prefix_hashes(prompt(7, 81), 16)  # five blocks each
    index.add(a)
    assert index.matched(a) == 5 and index.matched(b) == 0
    index.add(b)  # ten blocks sent, eight kept: a's first two forgotten, so none of a's chain matches
    assert len(index.blocks) == 8 and index.matched(b) == 5 and index.matched(a) == 0
    index.add(b[:1])
    assert list(index.blocks)[-1] == b[0]  # sent again: the most recent


def test_the_chain_is_the_block_managers():
    """The router's hashes are the ones the workers' prefix caches use: full blocks, never the last token."""
    from common.kv_cache import PREFIX_HASH_SEED, block_hash

    ids = prompt(8, 48)
    assert prefix_hashes(ids, 16) == [block_hash(PREFIX_HASH_SEED, ids[:16]),
                                      block_hash(block_hash(PREFIX_HASH_SEED, ids[:16]), ids[16:32])]
    assert len(prefix_hashes(ids + [1], 16)) == 3


def settled(client: Client):
    """Once the workers' heartbeats say nothing waits: loads are the router's own again."""
    deadline = time.monotonic() + 10
    while any(w["queued"] or w["running"] for w in client.status().workers) and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("policy, want", [
    ("prefix_affine", [64] * 6),
    ("least_loaded", [0, 0, 64, 64, 0, 64])])  # by load alone: 1st, 3rd to prefill-0, 2nd to prefill-1
def test_in_a_cluster_each_prefix_is_computed_once_by_the_worker_that_has_it(tmp_path, policy, want):
    """Two prefill workers, three prefixes asked about in three turns of three requests at once,
    in a new order each turn: with prefix_affine every repeat finds its prefix cached on the
    worker it goes to (Done.timings' cached_tokens); by load alone, half of them do not."""
    prefixes = [prompt(10 + g, 64) for g in range(3)]
    with cluster(tmp_path, prefill=2, decode=1, router_args=["--policy", policy]) as c, \
            Client(c.address, timeout=60) as client:
        cached = []
        for turn in range(3):
            settled(client)
            order = [(g + turn) % 3 for g in range(3)]
            results = client.generate_many([prefixes[g] + prompt(100 * turn + g, 8) for g in order],
                                           max_tokens=2, temperature=0)
            cached += [r.timings["cached_tokens"] for r in results]
    assert cached[:3] == [0, 0, 0] and cached[3:] == want, cached


def test_bench_serve_compares_policies_side_by_side_on_shared_prefixes():
    r = subprocess.run([sys.executable, "-m", "common.cli", "bench", "serve", "--topologies", "2p1d", "--scenarios",
                        "shared_prefixes", "--policies", "least_loaded,prefix_affine"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["policy"]: row for row in json.loads(r.stdout.strip().splitlines()[-1])["results"]}
    assert set(rows) == {"least_loaded", "prefix_affine"} and all(row["failed"] == 0 for row in rows.values())
    # the documents fill one and a half pools: each computed once where it stays, more of every prompt is a hit
    assert rows["prefix_affine"]["prompt_cached_pct"] > rows["least_loaded"]["prompt_cached_pct"] + 10, rows
    assert "cached %" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "common.cli", "bench", "serve", "--policies", "nearest"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "policy 'nearest' is unknown; allowed: least_loaded, round_robin, prefix_affine" \
        in bad.stderr, bad.stderr
