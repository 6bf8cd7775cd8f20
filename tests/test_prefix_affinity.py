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
from router.prefix_affinity import MAX_BLOCKS, PrefixIndex, PromptChain, remember
from router.registry import PREFILL_ROLES, Registry, Worker
from tests.cluster import cluster

pytestmark = pytest.mark.timeout(300)


def registry(n: int = 2, blocks: int = 64) -> Registry:
    r = Registry("prefix_affine")
    for i in range(n):
        r.workers[f"prefill-{i}"] = Worker(f"prefill-{i}", "prefill", "x", b"", "cpu", blocks, 16, "")
    return r


def pick(r: Registry, ids: list[int]) -> Worker:
    """The prefill worker prefix_affine picks for ids, which then holds them, as the router does it."""
    chain = PromptChain(ids)
    w = r.pick(PREFILL_ROLES, prompt=chain)
    remember(w, chain)
    return w


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def test_a_shared_prefix_follows_the_worker_that_has_it_until_its_load_outweighs_it():
    r = registry()
    system = prompt(0, 96)  # six full blocks
    first = pick(r, system + prompt(1, 20))
    first.assigned.add("a")  # busy with it
    # a new prefix goes to the idle worker; the shared one follows the worker that has it, though busier
    other = pick(r, prompt(2, 100))
    assert other is not first
    other.assigned.add("b")
    first.assigned.add("c")  # loads 2 and 1: half a request each way of the mean, over LOAD_FLOOR (4)
    assert pick(r, system + prompt(3, 20)) is first  # 6 of its 7 blocks cached outweigh that
    first.assigned.update({"d", "e", "f"})  # loads 5 and 1: two requests each way of the mean (3), over 4
    assert pick(r, system + prompt(4, 20)) is other


def test_a_worker_without_a_prefix_cache_is_never_taken_to_hold_one():
    r = registry()
    r.workers["prefill-0"].prefix_caching = False  # started with --no-prefix-caching
    system = prompt(0, 96)
    first = pick(r, system + prompt(1, 20))
    assert first.worker_id == "prefill-0"  # nothing cached anywhere: the first of equals
    first.assigned.add("a")
    second = pick(r, system + prompt(2, 20))  # by load, not by a cache prefill-0 does not keep
    assert second.worker_id == "prefill-1"
    second.assigned.add("b")
    assert pick(r, system + prompt(3, 20)) is second  # its cache holds the prefix


def test_without_a_cached_prefix_it_is_least_loaded_and_without_a_prompt_too():
    r = registry(3)
    r.workers["prefill-0"].assigned.add("a")
    r.workers["prefill-1"].queued = 4
    assert pick(r, prompt(5, 50)).worker_id == "prefill-2"
    r.workers["prefill-2"].assigned.update({"b", "c"})
    assert r.pick(PREFILL_ROLES).worker_id == "prefill-0"  # loads 1, 2, 2


def test_what_a_worker_holds_is_bounded_by_its_pool_a_prompt_s_beginning_kept_longest():
    index = PrefixIndex(capacity=8)
    a, b = PromptChain(prompt(6, 81)), PromptChain(prompt(7, 81))  # five full blocks and one partial each
    remember_in(index, a)
    assert index.matched(a.hashes(16)) == 5 and index.matched(b.hashes(16)) == 0
    remember_in(index, b)  # twelve blocks sent, eight kept: a's partial block and last three go first
    assert len(index.blocks) == 8 and index.matched(b.hashes(16)) == 5 and index.matched(a.hashes(16)) == 2


def remember_in(index: PrefixIndex, chain: PromptChain):
    index.add(chain.hashes(16), chain.blocks(16))


def test_the_router_s_mirror_predicts_a_real_block_manager_s_hits_exactly():
    """Prompts sharing a dozen prefixes, one at a time through a real BlockManager whose pool holds
    a third of them: the index, fed only what was sent, says exactly what each prompt finds cached."""
    from common.kv_cache import BlockManager
    from common.sampling_params import SamplingParams
    from common.sequence import Sequence

    rng = random.Random(0)
    docs = [prompt(20 + d, rng.randint(40, 120)) for d in range(12)]
    manager, index = BlockManager(num_blocks=32, block_size=16), PrefixIndex(capacity=32)
    hits = []
    for i in range(300):
        ids = rng.choice(docs) + prompt(1000 + i, rng.randint(1, 40))
        seq = Sequence(str(i), ids, SamplingParams(max_tokens=1), 0, (), 10_000)
        chain = PromptChain(ids)
        predicted = index.matched(chain.hashes(16)) * 16
        manager.allocate(seq)
        assert seq.num_cached_tokens == predicted, (i, seq.num_cached_tokens, predicted)
        hits.append(predicted > 0)
        seq.num_computed_tokens = len(ids)  # prefilled
        manager.cache_computed_blocks(seq)
        manager.free_seq(seq)
        remember_in(index, chain)
    assert 0.3 < sum(hits) / len(hits) < 0.9  # hits and misses both: the pool is too small for every prefix


def test_the_chain_is_the_block_managers():
    """Full blocks of all but the last token, chained from the seed, as the block manager publishes
    them (its sequences' chains are computed a block at a time and many at once)."""
    from common.kv_cache import BlockManager
    from common.prefix_hash import PREFIX_HASH_SEED, block_hash
    from common.sampling_params import SamplingParams
    from common.sequence import Sequence

    ids = prompt(8, 48)
    assert prefix_hashes(ids, 16) == [block_hash(PREFIX_HASH_SEED, ids[:16]),
                                      block_hash(block_hash(PREFIX_HASH_SEED, ids[:16]), ids[16:32])]
    manager, long_ids = BlockManager(num_blocks=64, block_size=16), prompt(11, 16 * 20 + 5)
    seq = Sequence("a", long_ids, SamplingParams(max_tokens=1), 0, (), 10_000)
    manager.allocate(seq)
    for computed in (3, 16, 50, 16 * 20 + 5):  # published as the KV is computed, in pieces
        seq.num_computed_tokens = computed
        manager.cache_computed_blocks(seq)
    published = [manager.blocks[b].hash for b in seq.block_table[:seq.num_published_blocks]]
    assert published == prefix_hashes(long_ids + [0], 16)
    again = Sequence("b", long_ids, SamplingParams(max_tokens=1), 0, (), 10_000)
    manager.allocate(again)  # its walk of the cache, a block at a time, finds them all
    assert again.num_cached_tokens == 16 * 20 and again.block_table[:20] == seq.block_table[:20]
    assert len(prefix_hashes(ids + [1], 16)) == 3
    long = prompt(9, 16 * MAX_BLOCKS + 100)
    assert PromptChain(long).hashes(16) == prefix_hashes(long, 16)[:MAX_BLOCKS]  # its beginning, bounded
    # a chain extended by more tokens (an output, a migration's) continues the one it had: the same hashes
    for head, tail in ((ids, prompt(10, 40)), (ids[:17], [5]), (ids, []), (long[:16 * MAX_BLOCKS - 7], long[:30])):
        chain = PromptChain(head)
        chain.hashes(16)
        assert chain.extended(tail).hashes(16) == PromptChain(head + tail).hashes(16), (len(head), len(tail))


def settled(client: Client):
    """Once the workers' heartbeats say nothing waits: loads are the router's own again."""
    deadline = time.monotonic() + 10
    while True:
        workers = client.status().workers
        if not any(w["queued"] or w["running"] for w in workers):
            return
        assert time.monotonic() < deadline, f"the workers were still busy after 10 s: {workers}"
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
                        "shared_prefixes", "--policies", "least_loaded,prefix_affine", "--num-requests", "256"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["policy"]: row for row in json.loads(r.stdout.strip().splitlines()[-1])["results"]}
    assert set(rows) == {"least_loaded", "prefix_affine"}
    assert all((row["requests"], row["failed"]) == (256, 0) for row in rows.values()), rows
    # the documents fill one and a half pools: each computed once where it stays, more of every prompt is a hit
    assert rows["prefix_affine"]["prompt_cached_pct"] > rows["least_loaded"]["prompt_cached_pct"] + 10, rows
    # the workers told the router their caches: what it expected to be cached was, give or take a race
    assert rows["prefix_affine"]["kv_events"] and rows["prefix_affine"]["prefix_mispredicted_pct"] < 10, rows
    assert rows["least_loaded"]["prefix_mispredicted_pct"] is None
    assert "cached %" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "common.cli", "bench", "serve", "--policies", "nearest"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "policy 'nearest' is unknown; allowed: least_loaded, round_robin, prefix_affine" \
        in bad.stderr, bad.stderr
