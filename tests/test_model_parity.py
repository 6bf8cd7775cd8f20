"""Greedy output equals `transformers`' generate, token for token, for every supported family."""

import random

import pytest
import torch

from common.checkpoint import load_model
from common.engine import Engine
from common.errors import InvalidArgument
from common.sampling_params import SamplingParams
from tests.checkpoints import CONFIGS, VOCAB, write_checkpoint

PROMPT_LENS = (1, 5, 17, 40)
NEW_TOKENS = 12


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_transformers(tmp_path, name):
    ref = write_checkpoint(tmp_path, name)
    rng = random.Random(name)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    assert len({tuple(e) for e in expected}) > 1 and any(len(set(e)) > 3 for e in expected), \
        "reference output too uniform to be a meaningful comparison"
    engine = Engine(model=str(tmp_path), block_size=8, max_num_batched_tokens=64)
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert [g.token_ids for g in got] == expected
    if "sharded" in name:
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1


def test_a_sliding_window_is_the_context_served(tmp_path):
    """Past its window a Mistral attends to fewer tokens than we would: its tokens would differ
    from transformers' with no error, so a prompt is refused there."""
    write_checkpoint(tmp_path, "mistral-window")
    engine = Engine(model=str(tmp_path))
    assert engine.max_model_len == 128
    with pytest.raises(InvalidArgument, match="maximum context length is 128 tokens"):
        engine.add_request(list(range(2, 130)))


def test_an_untied_gpt2_head_is_loaded_not_left_empty(tmp_path):
    """Its lm_head.weight was skipped as if tied: the head served what torch.empty left."""
    write_checkpoint(tmp_path, "gpt2-untied")
    model = load_model(str(tmp_path), torch.device("cpu"), torch.float32).model
    from safetensors.torch import load_file

    assert torch.equal(model.lm_head.weight, load_file(tmp_path / "model.safetensors")["lm_head.weight"])


def test_text_prompt_uses_checkpoint_tokenizer(tmp_path):
    from transformers import PreTrainedTokenizerFast

    write_checkpoint(tmp_path, "llama-gqa")
    engine = Engine(model=str(tmp_path))
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = "the quick brown fox"
    ids = hf_tok(text)["input_ids"]
    assert ids[0] == 0  # BOS from the tokenizer's post-processor
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    by_text, by_ids = engine.generate([text, ids], params)
    assert by_text.prompt_token_ids == ids
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.text == hf_tok.decode(by_ids.token_ids, skip_special_tokens=True)


def engine_prompt_logits(engine: Engine, ids: list[int], last: int | None = None) -> torch.Tensor:
    """Logits at every prompt position (or the `last` few) through the engine's own paged prefill path."""
    from common.scheduler import ScheduledSeq
    from common.sequence import Sequence

    seq = Sequence("logits", ids, SamplingParams(max_tokens=1), 0, (), engine.max_model_len)
    engine.block_manager.allocate(seq)
    try:
        _, input_ids, positions, meta, _ = engine.runner.prepare([ScheduledSeq(seq, len(ids))])
        with torch.inference_mode():
            hidden_TC = engine.model(input_ids, positions, engine.kv_cache, meta)
            return engine.model.logits(hidden_TC if last is None else hidden_TC[-last:])
    finally:
        engine.block_manager.free_seq(seq)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_logits_match_transformers(tmp_path, name):
    """Tokens can hide small numeric errors; logits cannot (an exact-vs-tanh GELU or a wrong
    rope scaling band shows up here as a 1e-3 difference)."""
    ref = write_checkpoint(tmp_path, name)
    rng = random.Random(1)
    ids = [rng.randrange(2, VOCAB) for _ in range(100)]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    engine = Engine(model=str(tmp_path), enable_prefix_caching=False)
    got = engine_prompt_logits(engine, ids)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
