"""Speculative decoding by n-gram lookup (common/speculative.py): drafts are found where they
should be, and an engine that speculates gives the tokens and logprobs of one that does not,
greedy and seeded, batched, chunked and with a small pool, frees every block, and leaves requests
whose logits are adjusted or masked to plain decoding. A 1P1D cluster whose decode worker
speculates gives the monolithic engine's tokens and counts its drafts in /metrics."""

import array
import asyncio
import importlib.util
import itertools
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from common.config import EngineConfig
from common.engine import Engine
from common.errors import InvalidArgument
from common.sampling_params import SamplingParams
from common.speculative import SpeculativeConfig, ngram_draft
from tests.cluster import cluster
from tests.test_cluster import run_concurrently

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def draft(ids, k, lo, hi):
    return ngram_draft(array.array("q", ids), k, lo, hi)


def test_ngram_draft_takes_what_followed_the_latest_longest_match():
    assert draft([1, 2, 3, 4, 5, 1, 2, 3], 4, 1, 3) == [4, 5, 1, 2]
    assert draft([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]  # the latest of two
    assert draft([7, 2, 3, 8, 2, 3, 1, 7, 3], 2, 1, 2) == [1, 7]  # 7 3 never occurred; 3 did, last at 5
    assert draft([4, 5, 6, 1, 2, 9, 5, 6], 3, 2, 2) == [1, 2, 9]
    assert draft([4, 5, 6, 1, 2, 9, 5, 7], 3, 2, 3) == []  # 5 7 never occurred, 7 is below min
    assert draft([5, 6, 7], 3, 1, 2) == [] and draft([3], 3, 1, 2) == []
    assert draft([1, 1, 1], 3, 2, 2) == [1]  # an occurrence overlapping the suffix, followed by its last token
    assert draft([2, 1, 1], 3, 1, 1) == [1]
    # 256 and 1 are the bytes 00 01 00 ..., 01 00 ...: a byte match across two tokens is no match
    assert draft([256, 1, 0, 0, 1], 3, 1, 2) == [0, 0, 1]


@pytest.mark.parametrize("spec, message", [
    ("{", "is not JSON"),
    ([1], "allowed: an object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle'; allowed: 'ngram'"),
    ({"method": "ngram"}, "num_speculative_tokens=None; allowed: an integer in 1..16"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens=17"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 > prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "has ['draft_model']; allowed keys"),
])
def test_a_bad_config_is_refused_by_name(spec, message):
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("(", r"\(")):
        SpeculativeConfig.parse(spec)


def test_config_defaults_as_vllms_and_turns_async_scheduling_off():
    both = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (both.prompt_lookup_max, both.prompt_lookup_min) == (5, 5)
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert (one.prompt_lookup_max, one.prompt_lookup_min) == (2, 2)
    assert SpeculativeConfig.parse(one.as_dict()) == one
    assert EngineConfig(speculative_config=NGRAM).async_scheduling is False
    with pytest.raises(InvalidArgument, match="async_scheduling=True with speculative_config"):
        EngineConfig(speculative_config=NGRAM, async_scheduling=True)


def workload(n=12):
    """Prompts that repeat themselves (drafts to find), greedy and seeded with filters, logprobs,
    stop tokens and short max_tokens; every third request with a penalty (never drafted)."""
    prompts, sampling = [], []
    for i in range(n):
        motif = [(7 * i + j) % 250 + 1 for j in range(2 + i % 4)]
        prompts.append((motif * 8)[:5 + 3 * i])
        s = dict(max_tokens=6 + 5 * (i % 6), seed=i, logprobs=2 if i % 4 == 1 else None, ignore_eos=i % 5 != 0)
        s.update(temperature=0.0) if i % 2 == 0 else s.update(temperature=0.8, top_k=40, top_p=0.9)
        if i % 3 == 2:
            s.update(repetition_penalty=1.2)
        if i % 5 == 3:
            s.update(stop_token_ids=[motif[0]])
        sampling.append(s)
    return prompts, sampling


def run(engine, prompts, sampling):
    outs = engine.generate(prompts, [SamplingParams(**s) for s in sampling])
    assert engine.block_manager.num_free_blocks == engine.num_blocks  # drafts' blocks too
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in outs]


def oracle_drafts(engine, prompts, plain):
    """Make engine's drafter propose what plain decoding went on to sample, every third draft with
    its last token wrong: drafts kept whole, in part and not at all, whatever the model (a random
    model of a large vocabulary repeats too little for n-grams to find drafts)."""
    going_on = {tuple(p): list(p) + out for p, (out, _, _) in zip(prompts, plain)}
    proposed = itertools.count()

    def propose(seq, max_tokens):
        at = len(seq.token_ids)
        draft = going_on[tuple(seq.prompt_token_ids)][at:at + min(max_tokens, NGRAM["num_speculative_tokens"])]
        if draft and next(proposed) % 3 == 2:
            draft[-1] = (draft[-1] + 1) % engine.model_config.vocab_size
        return draft

    engine.drafter.propose = propose


@pytest.fixture(scope="module")
def plain():
    prompts, sampling = workload()
    return run(Engine(model="dummy:nanogpt", batch_invariant=True), prompts, sampling)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 7, "max_num_seqs": 4}, {"num_blocks": 24},
                                {"enable_prefix_caching": False}])
def test_speculating_gives_the_tokens_and_logprobs_of_plain_decoding(plain, kw):
    """With batch-invariant kernels a chunk's rows are a decode's bits: the same tokens and
    logprobs, whatever was drafted. A budget of 7 tokens cuts drafts short; 24 blocks leave drafts
    few blocks to grow into (the watermark is kept)."""
    prompts, sampling = workload()
    engine = Engine(model="dummy:nanogpt", batch_invariant=True, speculative_config=NGRAM, **kw)
    assert run(engine, prompts, sampling) == plain
    drafts, drafted, accepted = engine.drafter.counters()
    assert drafts > 10 and 0 < accepted <= drafted  # it did speculate, and some drafts were kept


def test_drafts_kept_whole_in_part_or_not_at_all_give_the_tokens_of_plain_decoding(plain):
    """Drafts of what plain decoding sampled (a third with a wrong last token): long runs of kept
    drafts advance a request several tokens a step, and still give plain decoding's tokens."""
    prompts, sampling = workload()
    engine = Engine(model="dummy:nanogpt", batch_invariant=True, speculative_config=NGRAM)
    oracle_drafts(engine, prompts, plain)
    assert run(engine, prompts, sampling) == plain
    drafts, drafted, accepted = engine.drafter.counters()
    assert drafts > 10 and drafted // 2 < accepted < drafted


def test_requests_whose_logits_are_adjusted_or_masked_are_not_drafted():
    prompts = [[3, 4, 5] * 6] * 3
    sampling = [SamplingParams(max_tokens=12, temperature=0, presence_penalty=0.5),
                SamplingParams(max_tokens=12, temperature=0, logit_bias={9: 1.0}),
                SamplingParams(max_tokens=12, temperature=0, min_tokens=12, ignore_eos=True)]
    if importlib.util.find_spec("llguidance"):
        prompts.append([3, 4, 5] * 6)
        sampling.append(SamplingParams(max_tokens=12, temperature=0, structured_outputs={"regex": "[a-z]{3,9}"}))
    engine = Engine(model="dummy:nanogpt", batch_invariant=True, speculative_config=NGRAM)
    plain = Engine(model="dummy:nanogpt", batch_invariant=True)
    assert [o.token_ids for o in engine.generate(prompts, sampling)] == \
        [o.token_ids for o in plain.generate(prompts, sampling)]
    assert engine.drafter.counters() == [0, 0, 0]
    # min_tokens stops holding a request back once it is met: it speculates from there
    engine.generate([[3, 4, 5] * 6], SamplingParams(max_tokens=20, temperature=0, min_tokens=2, ignore_eos=True))
    assert engine.drafter.num_drafts > 0


def test_cli_generate_speculates_and_refuses_a_bad_config():
    args = [sys.executable, "-m", "common.cli", "generate", "--prompt-ids", "1,2,3,1,2,3,1,2", "--max-tokens", "30",
            "--json", "--batch-invariant"]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
    spec = subprocess.run(args + ["--speculative-config", json.dumps(NGRAM)], capture_output=True, text=True,
                          timeout=120, check=True)
    assert json.loads(spec.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    bad = subprocess.run(args + ["--speculative-config", '{"method": "medusa"}'], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "method='medusa'; allowed: 'ngram'" in bad.stderr


def test_a_decode_worker_that_speculates_serves_the_monolithic_tokens(tmp_path):
    prompts, sampling = workload(16)
    for s in sampling:
        s.pop("logprobs")  # compared below as tokens; the engine test compares logprobs
    want = [o.token_ids for o in Engine(model="dummy:nanogpt", batch_invariant=True).generate(
        prompts, [SamplingParams(**s) for s in sampling])]
    args = ["--batch-invariant", f"--speculative-config={json.dumps(NGRAM)}"]
    with cluster(tmp_path, worker_args=args, http=True) as c:
        results = asyncio.run(run_concurrently(c.address, prompts, sampling))
        assert [r.token_ids for r, _ in results] == want
        for (result, chunks), w in zip(results, want):  # several tokens a message, in order
            assert [t for chunk in chunks for t in chunk.token_ids] == w
        names = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")

        def counters():
            metrics = urllib.request.urlopen(f"{c.http_url}/metrics", timeout=10).read().decode().splitlines()
            return [float(next(x for x in metrics if x.startswith(f"pdserve:{n}_total{{")).rsplit(" ", 1)[1])
                    for n in names]
        seen = [counters()]
        while len(seen) < 2 or seen[-1] != seen[-2]:  # heartbeats carry them, every 0.2 s: wait until they settle
            time.sleep(0.5)
            seen.append(counters())
            assert len(seen) < 20, seen
        drafts, drafted, accepted = seen[-1]
        assert drafts > 0 and 0 < accepted <= drafted
