"""KV events: each worker tells the router what its prefix cache gains and loses, so prefix_affine
routes by what the caches hold, not by a guess from what was sent. The events keep a mirror equal
to a real block manager's cache under churn; the router asks for the whole cache again when one
goes missing; and a restarted router finds the prompts where the workers still hold them."""

import asyncio
import random

import pytest

from common import protocol as P
from common.kv_cache import BlockManager
from common.sampling_params import SamplingParams
from common.sequence import Sequence
from router.client import Client
from router.prefix_affinity import PREDICTED_S, RESYNC_S, CacheMirror, PrefixIndex, PromptChain
from tests.cluster import cluster, serving_router
from tests.test_chaos import wait_rejoined
from tests.test_local_prefill import next_work
from tests.test_prefix_affinity import prompt, remember_in

pytestmark = pytest.mark.timeout(300)


def events(manager: BlockManager, seq: int) -> P.KVEvents:
    stored, removed = manager.take_changes()
    return P.KVEvents("w", seq, stored, removed)


def test_events_keep_the_router_s_mirror_equal_to_the_cache_while_the_guess_drifts():
    """Prompts sharing a dozen prefixes through a real BlockManager whose pool holds a third of
    them, each held for a while (decoding, as on a decode worker) when the next arrive: the mirror
    fed the events holds exactly the cache's hashes and predicts every prompt's hits; the guess,
    fed what was sent, drifts from them."""
    rng = random.Random(1)
    docs = [prompt(40 + d, rng.randint(40, 120)) for d in range(12)]
    manager = BlockManager(num_blocks=64, block_size=16)
    mirror, guess = CacheMirror(), PrefixIndex(capacity=64)
    assert not mirror.apply(P.KVEvents("w", 0, manager.watch(), [], reset=True))
    running: dict[Sequence, int] = {}  # -> the step it ends at
    exact = guessed = 0
    for i in range(300):
        ids = rng.choice(docs) + prompt(2000 + i, rng.randint(1, 40))
        seq = Sequence(str(i), ids, SamplingParams(max_tokens=1), 0, (), 10_000)
        for done in [s for s, end in running.items() if end <= i]:
            manager.free_seq(done)
            del running[done]
        while not manager.can_allocate(seq):  # a full pool: the oldest ends early (a preemption)
            manager.free_seq(oldest := next(iter(running)))
            del running[oldest]
        chain = PromptChain(ids)
        want, approx = mirror.matched(chain.hashes(16)) * 16, guess.matched(chain.hashes(16)) * 16
        manager.allocate(seq)
        exact += want == seq.num_cached_tokens
        guessed += approx == seq.num_cached_tokens
        seq.num_computed_tokens = len(ids)
        manager.cache_computed_blocks(seq)
        running[seq] = i + rng.choice((1, 2, 20))  # some decode long: their blocks stay held
        remember_in(guess, chain)
        assert not mirror.apply(events(manager, i + 1))
        assert mirror.held == set(manager.cached), i
    assert exact == 300 and guessed < 270, (exact, guessed)


def test_a_worker_sends_its_whole_cache_in_pieces_then_each_change_once(monkeypatch):
    """A reset larger than KV_EVENTS_MAX goes as several KVEvents, numbered on, the first marked
    reset; after it, only what changed (nothing: nothing sent); the mirror fed them equals the cache."""
    import common.worker as W

    monkeypatch.setattr(W, "KV_EVENTS_MAX", 2)
    manager = BlockManager(num_blocks=16, block_size=16)
    seq = Sequence("a", prompt(5, 90), SamplingParams(max_tokens=1), 0, (), 10_000)
    manager.allocate(seq)
    seq.num_computed_tokens = 90
    manager.cache_computed_blocks(seq)  # five full blocks
    sent = []
    worker = type("Worker", (), {"engine": type("Engine", (), {"block_manager": manager}), "worker_id": "w",
                                 "kv_events_seq": None, "to_router": lambda self, msg: sent.append(msg)})()
    W.WorkerBase._send_kv_events(worker, reset=True)
    assert [(m.seq, len(m.stored), m.reset) for m in sent] == [(0, 2, True), (1, 2, False), (2, 1, False)]
    W.WorkerBase._send_kv_events(worker)
    assert len(sent) == 3
    manager.free_seq(seq)
    manager.take_blocks(13)  # the 10 never used, the partial last block, then two full ones (the tail first)
    W.WorkerBase._send_kv_events(worker)
    assert len(sent) == 4 and (sent[-1].seq, sent[-1].stored, len(sent[-1].removed)) == (3, [], 2)
    mirror = CacheMirror()
    assert not any(mirror.apply(m) for m in sent)
    assert mirror.held == set(manager.cached) and len(mirror.held) == 3


def test_a_prompt_sent_counts_as_held_until_its_events_come_or_it_expires():
    now = [0.0]
    mirror = CacheMirror(clock=lambda: now[0])
    a, b = PromptChain(prompt(1, 64)), PromptChain(prompt(2, 64))
    mirror.apply(P.KVEvents("w", 0, a.hashes(16)[:1], [], reset=True))
    mirror.add(a.hashes(16), a.blocks(16))
    mirror.add(b.hashes(16), b.blocks(16))
    assert mirror.matched(a.hashes(16)) == mirror.matched(b.hashes(16)) == 3
    now[0] = PREDICTED_S / 2
    assert not mirror.apply(P.KVEvents("w", 1, a.hashes(16)[1:], []))  # a computed: held from now on
    now[0] = PREDICTED_S + 1
    assert (mirror.matched(a.hashes(16)), mirror.matched(b.hashes(16))) == (3, 0)  # b never came
    assert not mirror.apply(P.KVEvents("w", 2, [], a.hashes(16)[1:2]))  # evicted: a's match stops before it
    assert mirror.matched(a.hashes(16)) == 1


def test_a_missing_event_is_answered_by_a_resync_and_nothing_is_applied_until_it_comes():
    """A gap (or a delta before any reset) asks for the whole cache; the deltas after it wait for
    the reset and ask again only once RESYNC_S has passed (the ask itself may have been lost)."""
    now = [0.0]
    mirror = CacheMirror(clock=lambda: now[0])
    a, b = PromptChain(prompt(1, 64)), PromptChain(prompt(2, 64))
    assert mirror.apply(P.KVEvents("w", 0, a.hashes(16), []))  # a delta before any reset
    assert not mirror.apply(P.KVEvents("w", 5, a.hashes(16), [], reset=True))
    assert mirror.apply(P.KVEvents("w", 7, b.hashes(16), []))  # 6 went missing
    assert not mirror.apply(P.KVEvents("w", 8, [], a.hashes(16)))
    now[0] = RESYNC_S
    assert mirror.apply(P.KVEvents("w", 9, [], a.hashes(16)))
    assert mirror.matched(b.hashes(16)) == 0 and mirror.matched(a.hashes(16)) == 3
    assert not mirror.apply(P.KVEvents("w", 10, b.hashes(16), [], reset=True)) and mirror.held == set(b.hashes(16))
    assert not mirror.apply(P.KVEvents("w", 11, a.hashes(16), []))
    assert mirror.held == set(a.hashes(16) + b.hashes(16))


def test_the_router_routes_by_the_events_and_asks_for_a_resync():
    """Two prefill workers: the one whose events hold a prompt gets it (by the guess, a tie, the
    first); a gap in its events gets it a KVEventsResync; with --no-kv-events no worker is asked
    for events and any sent are ignored."""
    greedy = {"max_tokens": 4, "temperature": 0}

    async def scenario(kv_events: bool):
        async with serving_router(policy="prefix_affine", heartbeat_timeout_s=60, kv_events=kv_events) \
                as (router, connect):
            names = [("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")]
            workers = {}
            for name, role in names:
                chan = connect(router.backend.address, f"{name}/1".encode())
                await chan.send(P.Register(role, name, "1", "cpu", 64, 16, "tcp://127.0.0.1:1",
                                           router.prompts.model_config.fingerprint, [], "float32"))
                registered = (await chan.arecv()).msg
                assert registered.kv_events is kv_events
                workers[name] = chan
            doc = prompt(3, 80)
            await workers["prefill-1"].send(P.KVEvents("prefill-1", 0, PromptChain(doc).hashes(16), [], reset=True))
            for _ in range(50):  # the router reads workers and clients on sockets of their own: in no set order
                await asyncio.sleep(0.01)
                if isinstance(router.registry.workers["prefill-1"].prefix_index, CacheMirror):
                    break
            client = connect(router.frontend.address)
            await client.send(P.Generate("a", doc, greedy, False))
            got = (await next_work(workers))[0]
            await workers["prefill-1"].send(P.KVEvents("prefill-1", 2, [], []))
            resync = None
            if kv_events:
                resync = (await asyncio.wait_for(workers["prefill-1"].arecv(), 10)).msg
            return got, resync, router.metrics.render().decode()

    got, resync, metrics = asyncio.run(scenario(True))
    assert got == "prefill-1" and isinstance(resync, P.KVEventsResync)
    assert 'pdserve:kv_event_resyncs_total{model_name="dummy:nanogpt"} 1.0' in metrics
    got, _, metrics = asyncio.run(scenario(False))
    assert got == "prefill-0" and 'kv_event_resyncs_total{model_name="dummy:nanogpt"} 0.0' in metrics


def test_a_restarted_router_finds_each_prefix_where_the_workers_hold_it(tmp_path):
    """Two prefill workers compute a prefix each; the router restarts and the workers rejoin,
    telling it their caches: each prefix, asked in the other order, goes to the worker that holds
    it (by a guess begun empty, the first would go to the other worker, the second follow it)."""
    prefixes = [prompt(60 + g, 64) for g in range(2)]
    with cluster(tmp_path, prefill=2, decode=1, restart=True, router_args=["--policy", "prefix_affine"]) as c, \
            Client(c.address, timeout=60) as client:
        first = [client.generate(p + prompt(70 + g, 8), max_tokens=2, temperature=0) for g, p in enumerate(prefixes)]
        assert [r.timings["cached_tokens"] for r in first] == [0, 0]
        c.router.proc.kill()
        wait_rejoined(c, client, 3)
        again = [client.generate(prefixes[g] + prompt(80 + g, 8), max_tokens=2, temperature=0) for g in (1, 0)]
        assert [r.timings["cached_tokens"] for r in again] == [64, 64]
