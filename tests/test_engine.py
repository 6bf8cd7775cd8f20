"""The engine's promises: a request's tokens do not depend on its batch, its chunking, a
preemption or a prefix-cache hit; every block comes back; bad input is refused clearly."""

import random

import pytest

from common.attention import decode_groups, decode_kv_read
from common.engine import Engine
from common.errors import InvalidArgument
from common.sampling_params import SamplingParams

MODELS = ["dummy:nanogpt", "dummy:llama-tiny"]


def prompts(n, lo, hi, seed=0, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def mixed_params(n, max_tokens=12):
    """Greedy and seeded requests side by side, with every filter in play."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        else:
            out.append(SamplingParams(temperature=0.9, top_p=0.9, top_k=50 * (i % 3), seed=1000 + i,
                                      max_tokens=max_tokens, ignore_eos=True))
    return out


def tokens(outs):
    return [o.token_ids for o in outs]


def assert_all_blocks_free(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("model", MODELS)
def test_batch_invariance(model):
    ps, params = prompts(16, 1, 80, seed=1), mixed_params(16)
    engine = Engine(model=model)
    alone = [engine.generate([p], [sp])[0].token_ids for p, sp in zip(ps, params)]
    batched = tokens(engine.generate(ps, params))
    assert batched == alone
    assert len({tuple(t) for t in alone}) == 16
    assert_all_blocks_free(engine)


def test_decode_groups_cover_every_row_at_its_width():
    lengths = sorted([1000, 990, 900, 600, 500, 300, 100, 40, 20] + [30] * 20, reverse=True)
    groups = decode_groups(lengths, 16)
    assert [g[0] for g in groups] == [0] + [g[1] for g in groups[:-1]] and groups[-1][1] == len(lengths)
    for first, end, blocks in groups:  # each run is read at its longest row's width
        assert blocks == -(-lengths[first] // 16) and all(-(-n // 16) <= blocks for n in lengths[first:end])
    assert 1 < len(groups) and decode_kv_read(lengths, 16) < len(lengths) * 1008
    assert decode_groups([100, 96, 90], 16) == [(0, 3, 7)]  # similar lengths: one read


@pytest.mark.parametrize("model", MODELS)
def test_batch_invariance_across_runs_of_lengths(model):
    """A batch whose decodes the portable attention reads in several runs (a few long sequences,
    many short ones) gives each request the tokens it gets alone."""
    ps = prompts(3, 500, 700, seed=4) + prompts(13, 5, 40, seed=5)
    params = mixed_params(16, max_tokens=6)
    engine = Engine(model=model)
    alone = [engine.generate([p], [sp])[0].token_ids for p, sp in zip(ps, params)]
    runs = []
    prepare = engine.runner.prepare
    engine.runner.prepare = lambda batch, prev=None: (out := prepare(batch, prev), runs.append(len(out[3].decode_groups or [])))[0]
    assert tokens(engine.generate(ps, params)) == alone
    assert max(runs) > 1  # some step read its decodes in more than one run
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_prefill_same_tokens(model, chunk):
    ps, params = prompts(4, 3, 40, seed=2), mixed_params(4, max_tokens=8)
    whole = tokens(Engine(model=model).generate(ps, params))
    engine = Engine(model=model, max_num_batched_tokens=chunk, max_num_seqs=min(chunk, 4))
    assert tokens(engine.generate(ps, params)) == whole
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("model", MODELS)
def test_preemption_recompute_same_tokens(model):
    ps, params = prompts(6, 10, 20, seed=3), mixed_params(6, max_tokens=30)
    reference = tokens(Engine(model=model).generate(ps, params))
    # Each request grows to 13 blocks of 4 tokens; 26 blocks cannot hold all six.
    engine = Engine(model=model, block_size=4, num_blocks=26)
    assert tokens(engine.generate(ps, params)) == reference
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("model", MODELS)
def test_prefix_cache_hit_same_tokens(model):
    base = prompts(1, 40, 40, seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = Engine(model=model, block_size=16)
    first = engine.generate([base], params)[0]
    # Same 32-token prefix; then a follow-up turn that extends the first conversation, whose
    # generated tokens were cached too (50 tokens: 3 full blocks).
    follow_ups = [base[:32] + [7, 8, 9], base + first.token_ids + [5]]
    outs = [engine.generate([p], params)[0] for p in follow_ups]
    cold = Engine(model=model, enable_prefix_caching=False)
    assert [o.token_ids for o in outs] == [cold.generate([p], params)[0].token_ids for p in follow_ups]
    assert first.metrics["num_cached_tokens"] == 0
    assert [o.metrics["num_cached_tokens"] for o in outs] == [32, 48]
    assert_all_blocks_free(engine)


def test_same_prefix_in_one_batch_is_not_read_before_computed():
    base = prompts(1, 40, 40, seed=5)[0]
    ps = [base + [1], base + [2], base + [3]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [Engine(model="dummy:nanogpt").generate([p], params)[0].token_ids for p in ps]
    engine = Engine(model="dummy:nanogpt", max_num_batched_tokens=64)  # forces chunked prefill
    assert tokens(engine.generate(ps, params)) == alone


def test_abort_frees_blocks():
    engine = Engine(model="dummy:nanogpt")
    ids = [engine.add_request(p, SamplingParams(max_tokens=50)) for p in prompts(4, 20, 40)]
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for i in ids:
        assert engine.abort_request(i)
    assert not engine.abort_request(ids[0])
    assert not engine.has_unfinished()
    assert_all_blocks_free(engine)


def test_stop_token_and_length_limits():
    engine = Engine(model="dummy:nanogpt", max_model_len=32)
    p = prompts(1, 10, 10, seed=6)[0]
    free_run = engine.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 12
    stop = free_run.token_ids[5]
    first = free_run.token_ids.index(stop)
    stopped = engine.generate([p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run.token_ids[:first + 1]
    capped = engine.generate([prompts(1, 30, 30)[0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 2  # 30 + 2 = max_model_len


def test_stop_string_across_tokens_ends_the_text_in_process(tmp_path):
    """The in-process engine stops at a stop string as the router does: at the token that
    completes it, with the string cut from the text (kept with include_stop_str_in_output)."""
    from tests.checkpoints import write_checkpoint

    write_checkpoint(tmp_path, "llama-gqa")
    engine = Engine(model=str(tmp_path))
    tok = engine.tokenizer
    free = engine.generate("the quick brown", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    prefixes = [tok.decode(free.token_ids[:k]) for k in range(len(free.token_ids) + 1)]
    # two characters either side of a token boundary, in the middle of the output
    k = next(k for k in range(4, len(prefixes) - 1)
             if len(prefixes[k]) > len(prefixes[k - 1]) and len(prefixes[k + 1]) > len(prefixes[k]))
    stop = prefixes[-1][len(prefixes[k]) - 1:len(prefixes[k]) + 1]
    at = prefixes[-1].index(stop)
    completes = next(i for i, text in enumerate(prefixes) if stop in text)
    for include in (False, True):
        out = engine.generate("the quick brown", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                stop=[stop], include_stop_str_in_output=include))[0]
        assert out.finish_reason == "stop"
        assert out.token_ids == free.token_ids[:completes]
        assert out.text == prefixes[-1][:at + (len(stop) if include else 0)]
    # a stop token ending the request before any stop string: the text is the same with or without
    # one, and holds the stop token's only with include_stop_str_in_output (vLLM's rule)
    by_id = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[free.token_ids[3]])
    plain = engine.generate("the quick brown", by_id)[0]
    shown = tok.decode(plain.token_ids[:-1]).rstrip("\ufffd")  # (random weights: it may end inside a character)
    assert plain.token_ids[-1] == free.token_ids[3] and plain.text == shown
    both = engine.generate("the quick brown", SamplingParams(**{**by_id.__dict__, "stop": ["\x00never"]}))[0]
    assert (both.token_ids, both.text) == (plain.token_ids, plain.text) and plain.text
    for stop in ([], ["\x00never"]):
        kept = engine.generate("the quick brown", SamplingParams(**{**by_id.__dict__, "stop": stop,
                                                                    "include_stop_str_in_output": True}))[0]
        assert (kept.token_ids, kept.text) == (plain.token_ids, tok.decode(plain.token_ids).rstrip("\ufffd"))
    assert_all_blocks_free(engine)


def test_an_output_ending_inside_a_character_ends_its_text_before_it():
    """Output that ends inside a multi-byte character (byte 0xC3, twice) shows no U+FFFD for it,
    as vLLM's text never does, with stop strings to find or without."""
    engine = Engine(model="dummy:nanogpt")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={0xC3: 100.0})
    plain = engine.generate("ab", params)[0]
    assert (plain.token_ids, plain.text, plain.finish_reason) == ([0xC3, 0xC3], "", "length")
    for stop in (["\ufffd"], ["\x00never"]):
        out = engine.generate("ab", SamplingParams(**{**params.__dict__, "stop": stop}))[0]
        assert (out.token_ids, out.text, out.finish_reason) == ([0xC3, 0xC3], "", "length")


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    engine = Engine(model="dummy:llama-tiny")
    p = prompts(1, 8, 8, seed=7)[0]
    runs = [engine.generate([p], SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True))[0].token_ids
            for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    # a negative seed, as vLLM and OpenAI take: its low 63 bits
    assert (SamplingParams(seed=-1).seed, SamplingParams(seed=-2**63).seed) == (2**63 - 1, 0)


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"), (dict(seed=-2**63 - 1), "seed"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_invalid_sampling_params_name_the_field(kwargs, name):
    with pytest.raises(InvalidArgument, match=name):
        SamplingParams(**kwargs)


def test_a_tokenizer_giving_ids_past_the_vocabulary_is_refused_before_any_step(monkeypatch):
    """A GGUF whose tokenizer and weights disagree must not take a worker down on a text prompt
    (an embedding lookup past the table raised in the step): the engine and the router refuse it."""
    from router.prompts import Prompts

    engine, prompts = Engine(model="dummy:nanogpt"), Prompts("dummy:nanogpt")
    for tok in (engine.tokenizer, prompts.tokenizer):
        monkeypatch.setattr(tok, "encode", lambda text, add_special_tokens=True: [104, 258])
    with pytest.raises(InvalidArgument, match=r"tokenizer gave token id 258 .* \[0, 258\)"):
        engine.add_request("hi")
    with pytest.raises(InvalidArgument, match="tokenizer gave token id 258") as e:
        prompts.validate("hi", None, {})
    assert e.value.param == "prompt" and not engine.has_unfinished()
    assert len(engine.generate([[104, 105]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_invalid_prompts_are_refused_and_engine_keeps_serving():
    engine = Engine(model="dummy:nanogpt", max_model_len=64)
    with pytest.raises(InvalidArgument, match="prompt has 64 tokens but the model.s maximum context length is 64 "
                                              "tokens; allowed: at most 63"):
        engine.add_request([1] * 64)
    with pytest.raises(InvalidArgument, match="empty"):
        engine.add_request([])
    with pytest.raises(InvalidArgument, match=r"\[258\].*\[0, 258\)"):
        engine.add_request([1, 258])
    for bad in ([-1], [True], [2.0], ["a"]):  # below the vocabulary, a bool, a float, a string
        with pytest.raises(InvalidArgument, match=r"prompt token ids \[.*\] are invalid; allowed: integers"):
            engine.add_request([5, *bad, 6])
    with pytest.raises(InvalidArgument, match="already in use"):
        engine.add_request([1], request_id="a")
        engine.add_request([1], request_id="a")
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_request_larger_than_pool_is_refused():
    engine = Engine(model="dummy:nanogpt", block_size=4, num_blocks=4)
    with pytest.raises(InvalidArgument, match="num_blocks=4"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=10))


@pytest.mark.parametrize("kwargs, name", [
    (dict(block_size=3), "block_size"), (dict(dtype="int8"), "dtype"), (dict(device="tpu"), "device"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"),
    (dict(model="dummy:nope"), "dummy:nanogpt"), (dict(model="/no/such/dir"), "config.json"),
])
def test_invalid_engine_config(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Engine(**kwargs)


def test_prefix_hash_is_chained_over_blocks():
    """A block repeated inside one prompt must not hit itself: its KV depends on its position."""
    block = prompts(1, 16, 16, seed=8)[0]
    p = block * 3 + [1, 2]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = Engine(model="dummy:llama-tiny", block_size=16)
    engine.generate([p], params)
    again = engine.generate([p], params)[0]
    assert again.metrics["num_cached_tokens"] == 48
    assert again.token_ids == Engine(model="dummy:llama-tiny", enable_prefix_caching=False).generate([p], params)[0].token_ids


def test_prefix_hit_is_confirmed_by_tokens(monkeypatch):
    """Even if every block hashed alike, a hit is taken only when the tokens match."""
    import common.sequence

    def colliding(chain, token_ids, block_size, blocks):
        chain += [b"collision"] * (blocks - len(chain))
        return chain

    monkeypatch.setattr(common.sequence, "extend_chain", colliding)
    ps = prompts(3, 40, 40, seed=9)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = Engine(model="dummy:nanogpt", block_size=16)
    got = [engine.generate([p], params)[0] for p in ps]
    assert all(o.metrics["num_cached_tokens"] == 0 for o in got)
    cold = Engine(model="dummy:nanogpt", enable_prefix_caching=False)
    assert [o.token_ids for o in got] == [cold.generate([p], params)[0].token_ids for p in ps]


def test_logprobs_of_prompt_and_output_do_not_depend_on_chunking_or_the_prefix_cache():
    """Prompt logprobs need every prompt position's logits: a cached prefix is recomputed for
    them, and chunked prefill gives the same values; output logprobs match too."""
    base = prompts(1, 50, 50, seed=6)[0]
    asks = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    whole = Engine(model="dummy:nanogpt", enable_prefix_caching=False).generate([base], asks)[0]
    assert whole.prompt_logprobs[0] is None and len(whole.prompt_logprobs) == 50 and len(whole.logprobs) == 6
    assert all(len(e[1]) == 2 for e in whole.prompt_logprobs[1:]) and all(len(e[1]) == 3 for e in whole.logprobs)
    engine = Engine(model="dummy:nanogpt", max_num_batched_tokens=7, max_num_seqs=4)
    engine.generate([base], SamplingParams(temperature=0, max_tokens=2))  # caches the prefix
    out = engine.generate([base], asks)[0]
    assert out.metrics["num_cached_tokens"] == 0  # not taken from the cache
    assert out.token_ids == whole.token_ids
    for got, want in zip(out.prompt_logprobs[1:] + out.logprobs, whole.prompt_logprobs[1:] + whole.logprobs):
        assert got[1] == want[1] and got[0] == pytest.approx(want[0], abs=1e-4)
    plain = engine.generate([base], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.logprobs is None and plain.prompt_logprobs is None and plain.metrics["num_cached_tokens"] == 48
    assert_all_blocks_free(engine)


def test_each_step_s_output_holds_the_logprobs_of_its_own_tokens():
    """An output kept past later steps still holds its own tokens' logprobs, as its token_ids are
    its own: before, every output shared the request's growing list."""
    engine = Engine(model="dummy:nanogpt")
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True, logprobs=1))
    kept = []
    while engine.has_unfinished():
        kept += engine.step()
    assert [len(o.token_ids) for o in kept] == [1, 2, 3, 4]
    assert [len(o.logprobs) for o in kept] == [1, 2, 3, 4]
    assert [o.new_logprobs for o in kept] == [[e] for e in kept[-1].logprobs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_output_keeps_the_tokens_of_its_step(async_scheduling):
    """An output reads its tokens from the request's list on access (not a copy a step): what it
    shows must still be its step's tokens after later steps, a stop and the request's end."""
    engine = Engine(model="dummy:nanogpt", async_scheduling=async_scheduling)
    engine.add_request(prompts(1, 9, 9)[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    final = outs[-1].token_ids
    assert len(final) == 8 and outs[-1].finished
    assert [o.token_ids for o in outs] == [final[:i + 1] for i in range(8)]
    assert [o.new_token_ids for o in outs] == [[t] for t in final] and [o.num_tokens for o in outs] == list(range(1, 9))


def test_the_block_table_array_follows_its_list():
    """prepare() reads a sequence's blocks from an int64 copy kept in step with its list: grown by
    appends, copied anew when the list is replaced (freed and allocated again, a KV arrival)."""
    from common.sequence import Sequence

    seq = Sequence("r", [1, 2, 3], SamplingParams(), 0, (), 100)
    assert list(seq.block_table_array()) == []
    seq.block_table += [4, 5]
    first = seq.block_table_array()
    assert list(first) == [4, 5]
    seq.block_table.append(9)
    assert seq.block_table_array() is first and list(first) == [4, 5, 9]
    seq.block_table = [7, 8, 6]  # the same length, other blocks
    assert list(seq.block_table_array()) == [7, 8, 6]
    seq.block_table = [3]
    assert list(seq.block_table_array()) == [3]


def test_a_chunks_slots_are_its_positions_in_its_blocks():
    """prepare() takes a prefill chunk's KV slots a block's run at a time: the slots of each
    position, wherever the chunk starts and ends in its blocks."""
    from common.model_runner import chunk_slots

    rng = random.Random(3)
    table = rng.sample(range(1000), 40)
    for start, end in [(0, 1), (0, 16), (5, 6), (15, 17), (16, 640), (3, 333)] + \
            [sorted(rng.sample(range(641), 2)) for _ in range(50)]:
        assert chunk_slots(table, start, end, 16) == [table[p // 16] * 16 + p % 16 for p in range(start, end)]


def test_a_kv_pool_larger_than_the_memory_is_refused_by_name():
    """Not the allocator's RuntimeError: the flag, the pool's size, what is available and what fits."""
    with pytest.raises(InvalidArgument) as e:
        Engine(model="dummy:nanogpt", num_blocks=10**10)
    message = str(e.value)
    assert message.startswith("num_blocks=10000000000: a KV pool of ") and "available on cpu" in message
    fits = int(message.split("allowed: at most ")[1].split()[0])
    assert 4 < fits < 10**10
    assert Engine(model="dummy:nanogpt", num_blocks=min(fits // 2, 4096)).generate([1, 2, 3], SamplingParams(
        max_tokens=2, ignore_eos=True))[0].token_ids  # a pool that fits is made and serves
