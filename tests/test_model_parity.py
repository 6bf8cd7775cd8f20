"""Greedy output equals `transformers`' generate, token for token, for every supported family."""

import json
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


def assert_greedy_matches(ref, path, name: str, **engine_args):
    rng = random.Random(name)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    assert len({tuple(e) for e in expected}) > 1 and any(len(set(e)) > 3 for e in expected), \
        "reference output too uniform to be a meaningful comparison"
    engine = Engine(model=str(path), block_size=8, max_num_batched_tokens=64, **engine_args)
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert [g.token_ids for g in got] == expected


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_transformers(tmp_path, name):
    ref = write_checkpoint(tmp_path, name)
    assert_greedy_matches(ref, tmp_path, name)
    if "sharded" in name:
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1


def test_keys_a_config_leaves_out_take_the_defaults_of_its_transformers_class(tmp_path):
    """A hand-written config.json may leave out keys that its transformers class fills in: Qwen3's
    head_dim is then 128, not hidden / heads (a shape error), Mistral's window 4096, and each
    family's context its own. transformers' Mistral has no attention biases, whatever
    attention_bias says (their tensors were looked for, and missing)."""
    from common.model_spec import model_config

    def edited(name, **changes):
        path = tmp_path / name
        ref = write_checkpoint(path, name)
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
        return ref, path

    ref, path = edited("qwen3-head128", head_dim=None, max_position_embeddings=None)
    assert (model_config(str(path)).head_dim, model_config(str(path)).max_position_embeddings) == (128, 32768)
    assert_greedy_matches(ref, path, "qwen3-head128", max_model_len=256)
    ref, path = edited("mistral-window", attention_bias=True, sliding_window=None, max_position_embeddings=None)
    assert model_config(str(path)).max_position_embeddings == 4096  # its window, within 131,072
    assert_greedy_matches(ref, path, "mistral-window", max_model_len=256)  # (prompts inside either window)
    ref, path = edited("qwen2-tied", max_position_embeddings=None)
    assert model_config(str(path)).max_position_embeddings == 32768


def test_a_gpt2_whose_attention_is_not_scaled_by_its_head_size_is_refused_by_name(tmp_path):
    """Some GPT-2 checkpoints scale attention by the layer's depth, or not at all: served with the
    usual 1/sqrt(head_dim), their tokens differed from transformers' with no error."""
    from common.errors import ModelLoadError
    from common.model_spec import model_config

    write_checkpoint(tmp_path, "gpt2")
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value in (("scale_attn_weights", False), ("scale_attn_by_inverse_layer_idx", True)):
        (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ModelLoadError, match=f"{key}={value!r} is not supported; allowed: "):
            model_config(str(tmp_path))


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
