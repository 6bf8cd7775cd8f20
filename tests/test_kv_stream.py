"""Layer-wise KV streaming: the engine calls back after each layer with that layer's KV already in
the pool; every CPU transport (and cuda_ipc, on a GPU) delivers KV sent in pieces, in any order,
bit for bit; a prefill worker sends a layer's KV before the next layer runs; and clusters
streaming long, chunked, prefix-sharing prompts give exactly the monolithic engine's tokens."""

import random
import time

import pytest
import torch

import bench.transfer as B
from bench.handoff import transports_used
from common import protocol as P
from common.config import EngineConfig
from common.engine import Engine
from common.kv_transport import offered
from common.sampling_params import SamplingParams
from common.worker import WorkerConfig
from prefill_worker.worker import PrefillWorker
from router.client import Client
from tests.cluster import cluster, tokens_of, wait_blocks_free
from tests.test_kv_transport import CPU_TRANSPORTS, decode_worker, no_shm_leaks, spin, wide_kv_model  # noqa: F401

pytestmark = pytest.mark.timeout(300)


def test_on_layer_runs_once_each_layer_is_in_the_pool_and_before_the_next():
    engine = Engine(model="dummy:llama-tiny", num_blocks=16, max_num_batched_tokens=64, max_num_seqs=4)
    engine.add_request(list(range(3, 43)), SamplingParams(temperature=0, max_tokens=2))
    before = engine.kv_cache.clone()
    seen = []

    def hook(layer, batch):
        seen.append((layer, [s.seq.request_id for s in batch]))
        later = engine.kv_cache[layer + 1:]
        snapshots.append((engine.kv_cache[layer].clone(), torch.equal(later, before[layer + 1:])))
    snapshots = []
    engine.step(hook)
    L = engine.model_config.num_layers
    assert seen == [(i, ["req-0"]) for i in range(L)]
    for i, (layer_then, later_untouched) in enumerate(snapshots):
        assert torch.equal(layer_then, engine.kv_cache[i]), f"layer {i} changed after its callback"
        assert later_untouched, f"layers after {i} were written before its callback"
        assert not torch.equal(engine.kv_cache[i], before[i])


def pieces(layers: int, blocks: int, seed: int) -> list[tuple[range, range]]:
    """The transfer cut into layer groups x two block halves, shuffled."""
    cuts, half = sorted(random.Random(seed).sample(range(1, layers), 2)), blocks // 2
    groups = [range(a, b) for a, b in zip([0] + cuts, cuts + [layers])]
    out = [(g, bs) for g in groups for bs in (range(0, half), range(half, blocks))]
    random.Random(seed).shuffle(out)
    return out


@pytest.mark.parametrize("transport", CPU_TRANSPORTS + [pytest.param("cuda_ipc", marks=pytest.mark.gpu)])
def test_kv_sent_in_pieces_in_any_order_arrives_bit_identical(transport):
    """cuda_ipc: each piece's copy only queued, the header ahead of the copies with their event."""
    shape, dtype, device, n = B.kv_shape("dummy:llama-tiny", 300, 16, None, None, transport)
    run = B.TransportRun(transport, shape, dtype, device, n, fragmented=True, layer_groups=shape[0])
    try:  # the warm-up sent it layer by layer and compared every bit
        for seed in range(3):
            run.one(pieces=pieces(shape[0], n, seed))
        run.one(check=True, pieces=pieces(shape[0], n, 3))
    finally:
        run.close()


def monolithic(model: str, prompt: list[int], max_tokens: int) -> list[int]:
    return Engine(model=model).generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                  ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_prefill_sends_each_layer_before_the_next_runs(tmp_path, transport, wide_kv_model):
    """The wide model's layers each hold ~16 MB of a 1,000-token prompt's KV: over the streaming
    threshold, so each goes alone, right after it is computed, over three chunked steps."""
    prompt = [(7 * i) % 300 for i in range(1000)]
    with decode_worker(tmp_path, transport, wide_kv_model) as d:
        cfg = WorkerConfig(router=d.router.address, worker_id="prefill-test",
                           engine=EngineConfig(model=wide_kv_model, kv_transport=transport, max_num_batched_tokens=400))
        prefill = PrefillWorker(cfg)
        sent, running = [], []
        sender = prefill.senders[transport]
        send, stream = sender.send, prefill.stream
        sender.send = lambda out, handle, layers, blocks: (sent.append((running[-1], layers, blocks)),
                                                           send(out, handle, layers, blocks))
        prefill.stream = lambda layer, batch: (running.append(layer), stream(layer, batch))
        try:
            prefill.accept(P.PrefillWork("r1", 1, prompt, len(prompt), {"max_tokens": 6, "temperature": 0.0}, 7,
                                         "decode-0", d.register.kv_address))
            spin(prefill, lambda: prefill.transfers["r1"].state == "granted", steps=False)
            spin(prefill, lambda: not prefill.transfers)  # acknowledged
            L, n = prefill.engine.model_config.num_layers, -(-len(prompt) // 16)
            assert [(at, layers) for at, layers, _ in sent] == [(i, range(i, i + 1)) for _ in range(3) for i in range(L)]
            assert [blocks for _, _, blocks in sent[::L]] == [range(0, 25), range(25, 50), range(50, n)]
            tokens, done, reports = [], None, []
            while done is None:  # both workers report to their "router", this test: first token, then the rest
                env = d.router.recv(30_000)
                assert env is not None, "the decode worker sent no tokens"
                for msg in tokens_of(env.msg):
                    tokens += msg.token_ids
                    reports.append(msg)
                    done = msg if msg.finish_reason else None
            assert tokens == monolithic(wide_kv_model, prompt, 6)
            assert 0 <= done.timings["handoff_s"] < 30
            first = next(m.timings for m in reports if "handoff_s" not in m.timings)  # the prefill worker's report
            assert 0 < first["kv_stream_host_s"] < first["prefill_s"]
        finally:
            prefill.close()


@pytest.mark.parametrize("transport,stream", [(t, True) for t in CPU_TRANSPORTS] + [("auto", False)])
def test_cluster_streaming_long_chunked_prompts_matches_monolithic(tmp_path, transport, stream):
    """Prompts of up to 900 tokens prefilled in 128-token chunks, some sharing a cached prefix."""
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(300)]
    prompts = [[rng.randrange(256) for _ in range(rng.randint(200, 900))] for _ in range(4)]
    prompts += [shared + [rng.randrange(256) for _ in range(k)] for k in (1, 17, 200)]
    args = ["--kv-transport", transport, "--max-num-batched-tokens", "128"] + ([] if stream else ["--no-kv-stream"])
    with cluster(tmp_path, worker_args=args) as c, Client(c.address, timeout=300) as client:
        results = client.generate_many(prompts, max_tokens=5, temperature=0, ignore_eos=True)
        engine = Engine(model="dummy:nanogpt")
        expected = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        assert [r.token_ids for r in results] == [e.token_ids for e in expected]
        assert all(r.timings["handoff_s"] >= 0 for r in results)
        workers = wait_blocks_free(client)
        assert all(w["free_blocks"] == w["total_blocks"] for w in workers), workers
        # the transport `auto` chose, as the prefill worker's heartbeats report it (bench handoff names it)
        chosen = transport if transport != "auto" else offered("auto", torch.device("cpu"))[0]
        assert transports_used(client) == [chosen]


@pytest.mark.parametrize("end", ["cancelled", "first token"])
def test_a_shm_stream_says_it_is_done_only_after_its_last_copy(tmp_path, wide_kv_model, monkeypatch, end):
    """shm copies run on a thread; KVRelease tells the decode worker it may reuse the blocks, so
    it must not go while a copy into them is still queued: after a cancel, or after the request
    ended at its first token (max_tokens=1) with its streamed layers queued."""
    from common.kv_transport import JobThread, MappedSender

    slow = JobThread("slow-copier")
    monkeypatch.setattr(MappedSender, "send", lambda self, out, handle, layers, blocks: handle.futures.append(
        slow.submit(time.sleep, 0.15)))
    finish, queued_at_end = MappedSender.finish, []
    monkeypatch.setattr(MappedSender, "finish", lambda self, handle, release=False: (
        queued_at_end.append(not all(f.done() for f in handle.futures)), finish(self, handle, release))[1])
    prompt = [(5 * i) % 300 for i in range(1000)]
    max_tokens = 1 if end == "first token" else 2
    with decode_worker(tmp_path, "shm", wide_kv_model) as d:
        cfg = WorkerConfig(router=d.router.address, worker_id="prefill-test",
                           engine=EngineConfig(model=wide_kv_model, kv_transport="shm", max_num_batched_tokens=400))
        prefill = PrefillWorker(cfg)
        released = []
        release = prefill._release_reservation
        prefill._release_reservation = lambda rid: (released.append(all(f.done() for f in t.handle.futures)),
                                                    release(rid))[1]
        try:
            prefill.accept(P.PrefillWork("r1", 1, prompt, len(prompt), {"max_tokens": max_tokens, "temperature": 0.0},
                                         7, "decode-0", d.register.kv_address))
            spin(prefill, lambda: prefill.transfers["r1"].state == "streaming")
            t = prefill.transfers["r1"]
            if end == "cancelled":
                assert not all(f.done() for f in t.handle.futures)  # copies still queued
                prefill.on_router(P.CancelWork("r1", 1))
            else:
                spin(prefill, lambda: "r1" not in prefill.transfers)
            assert released == [True]
            assert queued_at_end[:1] == [True]  # the race this test is for: copies were queued when it ended
        finally:
            prefill.close()
            slow.shutdown()


def test_a_job_thread_that_was_shut_down_cancels_what_it_is_given():
    from common.kv_transport import JobThread

    jobs = JobThread("test")
    assert jobs.submit(lambda: 7).result(5) == 7
    jobs.shutdown()
    late = jobs.submit(lambda: 8)
    assert late.cancelled()
