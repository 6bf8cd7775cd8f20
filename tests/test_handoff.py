"""The engine's disaggregation hooks, in-process: a prefill engine computes a prompt's KV and first
token, its blocks are copied into blocks a decode engine reserved, and the decode engine finishes
the request with exactly the monolithic engine's tokens."""

import pytest
import torch

from common.engine import Engine
from common.sampling_params import SamplingParams
from tests.test_engine import assert_all_blocks_free, mixed_params, prompts


def handoff(prefill: Engine, decode: Engine, ps, params, migrate_after: int = 0):
    """Run each request P->D; with migrate_after, re-prefill prompt + the first tokens generated
    on a second pass, as a migration after a decode worker died would."""
    seeds = [sp.seed if sp.seed is not None else 7 for sp in params]
    for i, (p, sp) in enumerate(zip(ps, params)):
        prefill.add_sequence(f"r{i}", p, len(p), sp, seeds[i], prefill_only=True)
    results = {}
    while prefill.has_unfinished():
        for out in prefill.step():
            assert out.finished
            if out.finish_reason != "prefilled":
                results[out.request_id] = out.token_ids
                continue
            i = int(out.request_id[1:])
            tokens = out.prompt_token_ids + out.token_ids
            blocks = decode.reserve(len(tokens) - 1)
            assert blocks is not None
            src_blocks = prefill.held[out.request_id].block_table
            assert len(src_blocks) <= len(blocks)
            src, dst = torch.tensor(src_blocks), torch.tensor(blocks[:len(src_blocks)])
            for layer in range(prefill.model_config.num_layers):  # (2, blocks, block_size, kv_heads, head_dim)
                decode.kv_cache[layer].index_copy_(1, dst, prefill.kv_cache[layer].index_select(1, src))
            assert prefill.release(out.request_id)
            decode.add_prefilled(out.request_id, tokens, len(ps[i]), params[i], seeds[i], blocks)
    while decode.has_unfinished():
        for out in decode.step():
            if out.finished:
                results[out.request_id] = out.token_ids
    return [results[f"r{i}"] for i in range(len(ps))]


@pytest.mark.parametrize("model", ["dummy:nanogpt", "dummy:llama-tiny"])
def test_prefill_to_decode_handoff_matches_monolithic(model):
    ps, params = prompts(12, 1, 70, seed=20), mixed_params(12, max_tokens=10)
    params[0] = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)  # done at prefill
    ps[1] = ps[1][:1] * 32  # a prompt filling its blocks exactly: decode needs one block more
    expected = [o.token_ids for o in Engine(model=model).generate(ps, params)]
    prefill = Engine(model=model, max_num_batched_tokens=64)
    decode = Engine(model=model, block_size=16)
    assert handoff(prefill, decode, ps, params) == expected
    assert_all_blocks_free(prefill)
    assert_all_blocks_free(decode)
    assert decode.num_reserved_seqs == 0


def test_reserve_backpressure_and_unreserve():
    engine = Engine(model="dummy:nanogpt", block_size=4, num_blocks=20, max_num_seqs=2)
    a = engine.reserve(30)  # 8 blocks
    b = engine.reserve(10)
    assert a and b
    assert engine.reserve(1) is None  # no running slot left
    engine.unreserve(b)
    assert engine.reserve(60) is None  # 16 blocks: more than are free
    engine.unreserve(a)
    assert engine.num_reserved_seqs == 0
    assert_all_blocks_free(engine)


def test_add_prefilled_refuses_ids_no_prompt_could_hold():
    """A KVTransfer's token ids and seed come over the network: one out of the vocabulary raised in
    the next step (an embedding lookup), a seed past int64 in the sampler, and either took the
    decode worker, and every request in it, down."""
    from common.errors import InvalidArgument

    engine = Engine(model="dummy:nanogpt", num_blocks=8)
    blocks = engine.reserve(20)
    V = engine.model_config.vocab_size
    with pytest.raises(InvalidArgument, match=rf"prompt token ids \[{V}\] are invalid"):
        engine.add_prefilled("r", list(range(20)) + [V], 20, SamplingParams(), 0, blocks)
    with pytest.raises(InvalidArgument, match=r"num_prompt_tokens=21 is invalid; allowed: 1..20"):
        engine.add_prefilled("r", list(range(21)), 21, SamplingParams(), 0, blocks)
    for seed in (2**64 - 1, 2**63, -1):
        with pytest.raises(InvalidArgument, match=rf"seed={seed} is out of range; allowed: 0..2\*\*63 - 1"):
            engine.add_prefilled("r", list(range(21)), 20, SamplingParams(temperature=1.0), seed, blocks)
    engine.unreserve(blocks)  # what the decode worker does with a refused transfer
    assert not engine.has_unfinished() and engine.num_reserved_seqs == 0
    assert_all_blocks_free(engine)


def test_a_request_filling_the_pool_alone_is_granted_as_admission_would_take_it():
    """The watermark is kept only beside other sequences, on both sides: a prompt that fits an
    empty monolithic pool fits an empty decode pool (it was refused NO_ROOM after three prefills)."""
    engine = Engine(model="dummy:nanogpt", block_size=16, num_blocks=12)
    blocks = engine.reserve(180)  # 12 blocks with its next token: all of them
    assert blocks is not None and len(blocks) == 12
    engine.unreserve(blocks)
    assert engine.reserve(10) and engine.reserve(160) is None  # 11 of 11 free: beside another, the watermark stays


def test_preempted_requests_resume_before_new_kv_is_granted_room():
    engine = Engine(model="dummy:nanogpt", block_size=4, num_blocks=20)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    blocks = engine.reserve(9)
    engine.add_prefilled("a", list(range(1, 11)), 9, params, 1, blocks)
    engine.step()
    engine.scheduler._preempt(engine.scheduler.running[0])  # as a full pool makes schedule() do
    assert engine.reserve(3) is None  # its room goes to "a" first, though the pool has it free
    engine.step()  # "a" resumes by recompute
    assert engine.scheduler.running and not engine.scheduler.waiting and engine.reserve(3) is not None


def test_the_first_request_refused_keeps_its_room_from_later_ones():
    """Else a long prompt loses every race for freed blocks to short ones (they need fewer) and
    waits out its transfer timeout while short requests keep coming."""
    engine = Engine(model="dummy:nanogpt", block_size=4, num_blocks=20)
    a = engine.reserve(44, "a")  # 12 blocks: 8 free
    assert engine.reserve(30, "long") is None  # 8 blocks, and the watermark beside "a"
    assert engine.reserve(3, "short") is None  # 1 block fits, but not beside the long one's 8
    engine.unreserve(a)
    assert engine.reserve(3, "short") and engine.reserve(30, "long")  # room for both now
    s = engine.scheduler  # 11 blocks free
    s.first_refused = ("big", 36, 100.0)  # 10 blocks, refused at t=100 s...
    assert s.reservable("short", 3, 2, now=100.2) is None
    assert s.reservable("short", 3, 2, now=100.6) == 1  # ...and not asked again for 0.5 s: given up


def test_abort_releases_held_blocks():
    engine = Engine(model="dummy:nanogpt")
    engine.add_sequence("x", [1, 2, 3, 4], 4, SamplingParams(max_tokens=5), 1, prefill_only=True)
    (out,) = engine.step()
    assert out.finish_reason == "prefilled" and "x" in engine.held
    assert engine.abort_request("x")
    assert_all_blocks_free(engine)


def test_prefills_awaiting_their_grant_leave_room_for_the_longest_request():
    """Prefills whose decode worker has not granted blocks yet may take the pool only up to what
    leaves room for a request of max_model_len: else they could fill it while the decode worker's
    room is promised to requests that cannot start their prefill, and neither side would move
    until a lease ran out (a real 1P1D cluster stalled 30 s that way; see test_cluster)."""
    engine = Engine(model="dummy:nanogpt", block_size=4, num_blocks=20, max_model_len=32)  # room: 20 - 8
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(4):  # 4 blocks each
        engine.add_sequence(f"u{i}", [i + 1] * 15, 15, params, 1, prefill_only=True)
    engine.add_sequence("g", [9] * 28, 28, params, 1, prefill_only=True)  # 7 blocks, granted though behind
    engine.kv_granted("g")
    done = {o.request_id for o in engine.step()}
    assert done == {"u0", "u1", "u2", "g"}  # u3 would pass the 12 blocks: g went ahead of it
    assert [s.request_id for s in engine.scheduler.waiting] == ["u3"] and engine.block_manager.num_free_blocks == 1
    engine.kv_granted("u0")  # no longer counts against the room, but still holds its blocks
    assert engine.step() == [] and engine.scheduler.ungranted_blocks() == 8
    assert engine.release("u0") and engine.release("g")
    assert [o.request_id for o in engine.step()] == ["u3"]
    for rid in ("u1", "u2", "u3"):
        assert engine.release(rid)
    assert_all_blocks_free(engine)
