"""Logit adjustments (common/logits_processing.py): logit_bias, min_tokens, repetition, frequency
and presence penalties and min_p, checked against `transformers`' logits processors and the
OpenAI formula, then through the engine: transformers' greedy generate with the same settings,
and the same tokens alone, batched, chunked and with async scheduling."""

import math
import random
from collections import Counter

import pytest
import torch

from common.engine import Engine
from common.logits_processing import adjust, adjusted_rows
from common.sampling_params import SamplingParams
from common.sequence import PENDING, Sequence
from tests.checkpoints import VOCAB, write_checkpoint
from tests.test_async_scheduling import assert_same_results
from tests.test_engine import assert_all_blocks_free, prompts

EOS = 1  # tests/checkpoints.py's


def reference(logits_V: torch.Tensor, prompt: list[int], outputs: list[int], p: SamplingParams) -> torch.Tensor:
    """One row adjusted by transformers' processors where it has them, OpenAI's formula where not."""
    from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                              RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)
    ids = torch.tensor([prompt + outputs])
    x = logits_V.float().clone()[None]
    if p.logit_bias:
        x = SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()})(ids, x)
    if p.min_tokens:
        stops = sorted(set(p.stop_token_ids) | ({EOS} if not p.ignore_eos else set()))
        x = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, stops)(ids, x)
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    for t, c in Counter(outputs).items():  # OpenAI: mu[j] -= c[j] * frequency + (c[j] > 0) * presence
        x[0, t] -= c * p.frequency_penalty + p.presence_penalty
    if p.min_p and not p.greedy:
        kept = MinPLogitsWarper(p.min_p)(ids, x / p.temperature) > -math.inf
        x = x.masked_fill(~kept, -math.inf)
    return x[0]


def test_adjust_matches_transformers_row_by_row():
    V, rng = 64, random.Random(3)
    cases = [SamplingParams(repetition_penalty=1.5, temperature=0),
             SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4, seed=1),
             SamplingParams(),  # in the batch, not adjusted: left bit for bit
             SamplingParams(logit_bias={3: 5.0, 9: -100, 60: 0.5}, min_tokens=9, stop_token_ids=[7], seed=2),
             SamplingParams(min_p=0.1, temperature=2.0, repetition_penalty=0.8, frequency_penalty=1.0, seed=3),
             SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[5], presence_penalty=2.0, temperature=0)]
    seqs = []
    for i, (p, n) in enumerate(zip(cases, (5, 7, 3, 4, 9, 1))):  # rows 3 and 5 short of their min_tokens
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 12))]
        outputs = [rng.randrange(8) for _ in range(n)]  # repeats among few tokens
        seqs.append(Sequence(f"r{i}", prompt, p, 0, (EOS,), 1000, outputs))
    num_decode = 4  # rows 0-3 decode: their newest token is their input
    newest = [q.token_ids[-1] for q in seqs]
    seqs[1].token_ids[-1] = PENDING  # async scheduling: still sampled on the device, fed as input
    logits = torch.randn(len(cases), V) * 3
    rows = adjusted_rows(seqs)
    assert rows == [0, 1, 3, 4, 5]
    got, for_logprobs = adjust(logits, seqs, rows, num_decode, torch.tensor(newest + [0] * 3))
    assert for_logprobs is logits  # raw, with no grammar to mask them
    for i, (q, p) in enumerate(zip(seqs, cases)):
        outputs = q.token_ids[q.num_prompt_tokens:-1] + [newest[i]]
        want = reference(logits[i], q.prompt_token_ids, outputs, p)
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[2], logits[2])
    assert got[3, 7] == -math.inf and got[3, EOS] == -math.inf  # under min_tokens: stops can't be drawn
    assert got[5, 5] == -math.inf and got[5, EOS] > -math.inf  # ignore_eos: only its own stop ids
    assert (got[4] == -math.inf).any() and (got[4] > -math.inf).sum() > 1  # min_p cut the tail


def test_greedy_with_penalty_bias_and_min_tokens_matches_transformers(tmp_path):
    ref = write_checkpoint(tmp_path, "llama-gqa")
    rng = random.Random(5)
    ps = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (1, 6, 30)]
    engine = Engine(model=str(tmp_path), block_size=8)
    plain = SamplingParams(temperature=0, max_tokens=14)
    cases = [  # (ours, transformers' generate)
        (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
        (dict(logit_bias={17: 4.0, 40: 6.0}, repetition_penalty=1.3),
         dict(sequence_bias={(17,): 4.0, (40,): 6.0}, repetition_penalty=1.3)),
        (dict(logit_bias={EOS: 40.0}, min_tokens=5), dict(sequence_bias={(EOS,): 40.0}, min_new_tokens=5)),
    ]
    for ours, theirs in cases:
        params = SamplingParams(temperature=0, max_tokens=14, **ours)
        got = engine.generate(ps, params)
        base = engine.generate(ps, plain)
        for p, g, b in zip(ps, got, base):
            with torch.no_grad():
                out = ref.generate(torch.tensor([p]), max_new_tokens=14, do_sample=False, pad_token_id=0,
                                   eos_token_id=EOS, **theirs)
            want = out[0, len(p):].tolist()
            assert g.token_ids == want[:len(g.token_ids)] and (g.finish_reason == "length" or want[len(g.token_ids) - 1] == EOS)
        assert [g.token_ids for g in got] != [b.token_ids for b in base], f"{ours} changed nothing"
        if "min_tokens" in ours:
            assert all(len(g.token_ids) == 6 and g.token_ids[-1] == EOS and g.finish_reason == "stop" for g in got)
    assert_all_blocks_free(engine)


def mixed_adjustments(n: int) -> list[SamplingParams]:
    rng = random.Random(11)
    out = []
    for i in range(n):
        kind = i % 4
        p = SamplingParams(temperature=0 if i % 2 else 0.9, top_k=20 * (i % 3), seed=200 + i,
                           max_tokens=rng.randint(16, 24), ignore_eos=True)
        if kind == 0:
            p.repetition_penalty, p.frequency_penalty = 3.0, 2.0
        elif kind == 1:
            p.presence_penalty, p.min_p = 2.0, 0.1
        elif kind == 2:
            p.logit_bias, p.min_tokens, p.stop_token_ids = {rng.randrange(64): 4.0, 5: -20.0}, 3, [5]
        out.append(p)  # kind 3: none, beside the adjusted ones
    return out


def test_adjusted_requests_sample_alike_alone_batched_chunked_and_async():
    model = "dummy:llama-tiny"
    ps = prompts(8, 2, 40, seed=9)
    params = mixed_adjustments(len(ps))
    single = Engine(model=model)
    alone = [single.generate([p], sp)[0] for p, sp in zip(ps, params)]
    for kwargs in (dict(max_num_seqs=4, max_num_batched_tokens=7),
                   dict(max_num_seqs=8, async_scheduling=True, block_size=4, num_blocks=30)):
        engine = Engine(model=model, **kwargs)
        got = engine.generate(ps, params)
        assert_same_results(got, alone)
        assert_all_blocks_free(engine)
        if "num_blocks" in kwargs:
            assert engine.scheduler.num_preemptions > 0
    neutral = single.generate(ps, [SamplingParams(temperature=p.temperature, top_k=p.top_k, seed=p.seed,
                                                               max_tokens=p.max_tokens, ignore_eos=True)
                                                for p in params])
    changed = [a.token_ids != b.token_ids for a, b in zip(alone, neutral)]
    assert sum(changed[i] for i in range(len(ps)) if i % 4 != 3) >= 4, changed
    assert not any(changed[i] for i in range(len(ps)) if i % 4 == 3)


def test_every_token_counts_at_once_the_newest_pending_one_included():
    """Three tokens biased far above the rest and a frequency penalty of 2: which comes next hangs
    on the counts of all three so far, the newest included, which async scheduling still samples
    on the device when the next step is prepared."""
    ps = prompts(4, 5, 30, seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={10: 100, 20: 100, 30: 100},
                            frequency_penalty=2.0)
    runs = [Engine(model="dummy:llama-tiny", async_scheduling=on).generate(ps, params) for on in (False, True)]
    assert [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[0]]
    for out in runs[0]:
        counts = Counter(out.token_ids)
        assert set(counts) == {10, 20, 30} and min(counts.values()) >= 3, counts  # the penalty spreads them


def test_logit_bias_outside_the_vocabulary_is_refused_by_name():
    engine = Engine(model="dummy:nanogpt")
    V = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token ids \[{V}\] are invalid; allowed: integers in \[0, {V}\)"):
        engine.add_request([1, 2], SamplingParams(logit_bias={V: 1.0}))
    assert not engine.has_unfinished()
