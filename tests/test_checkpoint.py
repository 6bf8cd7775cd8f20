"""Loading checkpoints: bad directories fail at load with the file, tensor and shape named."""

import json

import msgpack
import pytest
import torch

from common.checkpoint import counter_uniform, load_model
from common.engine import Engine
from common.errors import InvalidArgument, ModelLoadError
from common.sampling_params import SamplingParams
from tests.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint(path, "llama-gqa")
    return path


def edited_copy(src, dst, **config_changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelLoadError, match=r"model_type='bert' is not supported; allowed: llama, qwen2"):
        Engine(model=str(tmp_path))


def test_missing_weights_file(tmp_path, llama_dir):
    d = edited_copy(llama_dir, tmp_path / "ck")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        Engine(model=str(d))


def test_shape_mismatch_names_file_tensor_and_shape(tmp_path, llama_dir):
    d = edited_copy(llama_dir, tmp_path / "ck", intermediate_size=129)
    with pytest.raises(ModelLoadError) as e:
        Engine(model=str(d))
    msg = str(e.value)
    assert "model.safetensors" in msg and "'model.layers.0.mlp.gate_proj.weight'" in msg
    assert "shape [128, 64], expected [129, 64]" in msg


def test_missing_and_unexpected_tensors(tmp_path, llama_dir):
    more = edited_copy(llama_dir, tmp_path / "more", num_hidden_layers=3)
    with pytest.raises(ModelLoadError, match=r"'model.layers.2.self_attn.q_proj.weight' \(expected shape \[64, 64\]\) is missing"):
        Engine(model=str(more))
    fewer = edited_copy(llama_dir, tmp_path / "fewer", num_hidden_layers=1)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model.layers.1"):
        Engine(model=str(fewer))


BAD_CONFIGS = [  # (config.json changes, what the error says)
    ({"num_hidden_layers": 2.0}, "num_hidden_layers=2.0 is invalid; allowed: an integer >= 1"),
    ({"vocab_size": "300"}, "vocab_size='300' is invalid; allowed: an integer >= 1"),
    ({"num_attention_heads": None}, "num_attention_heads=None is invalid; allowed: an integer >= 1"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6' is invalid; allowed: a finite number > 0"),
    ({"rope_theta": "abc"}, "rope_theta='abc' is invalid; allowed: a finite number > 0"),
    ({"rope_scaling": "linear"}, "rope_scaling='linear' is not supported; allowed: an object"),
    ({"rope_scaling": {"type": "linear"}}, "rope_scaling of rope_type 'linear' has no 'factor'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}},
     "rope_scaling's factor=0 is invalid; allowed: a finite number > 0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling of rope_type 'llama3' has no"),
    ({"quantization_config": {"quant_method": "fbgemm_fp8"}},
     "quantization_config (quant_method='fbgemm_fp8') is not supported; allowed: a checkpoint of float32"),
]


@pytest.mark.parametrize("changes, says", BAD_CONFIGS, ids=[str(c) for c, _ in BAD_CONFIGS])
def test_a_config_value_of_the_wrong_type_or_range_is_refused_by_name(tmp_path, llama_dir, changes, says):
    """Each was a TypeError, KeyError or ValueError from deep inside the load (a factor of 0 gave
    degenerate output); an fp8 checkpoint loaded its weights cast to float."""
    from common.model_spec import model_config

    d = tmp_path / "ck"
    d.mkdir()
    cfg = json.loads((llama_dir / "config.json").read_text())
    del cfg["rope_parameters"]  # transformers 5's; older checkpoints have rope_theta and rope_scaling
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))
    with pytest.raises(ModelLoadError) as e:
        model_config(str(d))
    assert str(e.value).startswith(str(d)) and says in str(e.value), e.value


def test_a_gpt2_with_heads_that_do_not_split_its_width_or_bad_side_files_are_refused(tmp_path, llama_dir):
    from common.model_spec import load_tokenizer, model_config

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 300, "n_embd": 64,
                                                  "n_head": 3, "n_layer": 2, "n_positions": 128}))
    with pytest.raises(ModelLoadError, match="n_embd=64 is not a multiple of n_head=3"):
        model_config(str(gpt2))
    d = edited_copy(llama_dir, tmp_path / "ck")
    (d / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match=r"generation_config.json: holds \[1, 2\]; allowed: a JSON object"):
        model_config(str(d))
    (d / "generation_config.json").write_text('{"eos_token_id": [1, 300]}')
    with pytest.raises(ModelLoadError, match=r"end-of-sequence token id 300 is invalid; allowed: an id of the "
                                             r"vocabulary \(0..299\)"):
        model_config(str(d))
    (d / "generation_config.json").unlink()
    (d / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    with pytest.raises(ModelLoadError, match="chat_template.jinja: cannot read .*; allowed: a Jinja template in UTF-8"):
        load_tokenizer(str(d))


def test_weights_that_are_cut_short_not_there_or_quantized_are_refused_by_file(tmp_path, llama_dir):
    """A clone made without git-lfs holds a pointer where the weights belong: a traceback from
    safetensors before; so was a file cut short."""
    from safetensors.torch import load_file, save_file

    cut = edited_copy(llama_dir, tmp_path / "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match=r"model.safetensors: not a whole safetensors file \("):
        load_model(str(cut), torch.device("cpu"), torch.float32)
    lfs = edited_copy(llama_dir, tmp_path / "lfs")
    (lfs / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n")
    with pytest.raises(ModelLoadError, match="model.safetensors: a Git LFS pointer, not the weights"):
        load_model(str(lfs), torch.device("cpu"), torch.float32)
    int8 = edited_copy(llama_dir, tmp_path / "int8")
    tensors = load_file(int8 / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    save_file(tensors, int8 / "model.safetensors")
    with pytest.raises(ModelLoadError, match="'model.norm.weight' is int8; allowed: float32, float16 or bfloat16"):
        load_model(str(int8), torch.device("cpu"), torch.float32)


def test_the_rotary_tables_hold_the_context_served_not_the_models():
    """A Qwen2.5-1M's million positions took 1 GB of tables to serve 256 tokens."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    short = Engine(model="dummy:llama-tiny", max_model_len=100)
    whole = Engine(model="dummy:llama-tiny")
    assert short.model.rope_cos.shape[0] == 100 and whole.model.rope_cos.shape[0] == 2048
    prompt = list(range(3, 80))
    assert short.generate([prompt], params)[0].token_ids == whole.generate([prompt], params)[0].token_ids


def test_eos_ids_from_generation_config(tmp_path, llama_dir):
    d = edited_copy(llama_dir, tmp_path / "ck")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    engine = Engine(model=str(d))
    assert engine.model_config.eos_token_ids == (1, 7)


def test_checkpoint_without_tokenizer_takes_token_ids(tmp_path, llama_dir):
    d = edited_copy(llama_dir, tmp_path / "ck")
    (d / "tokenizer.json").unlink()
    engine = Engine(model=str(d))
    with pytest.raises(InvalidArgument, match="has no tokenizer.json; send token ids"):
        engine.add_request("hello")
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.text is None
    # stop strings are found in the text, which it has none of: they would never match
    with pytest.raises(InvalidArgument, match=r"stop=\['x'\] needs the model's tokenizer to find text") as e:
        engine.add_request([5, 6], SamplingParams(stop=["x"]))
    assert e.value.param == "stop"
    from router.prompts import Prompts

    with pytest.raises(InvalidArgument, match=r"stop=\['x'\] needs the model's tokenizer"):
        Prompts(str(d)).validate([5, 6], None, {"stop": ["x"]})


def splitmix64_reference(x: int) -> int:
    """SplitMix64's finalizer on Python's unbounded ints, masked to 64 bits: what int64 torch must match."""
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


@pytest.mark.parametrize("seed, start", [(0, 0), (7, 12_345), (2**63 - 1, 2**40)])
def test_counter_uniform_is_splitmix64(seed, start):
    got = counter_uniform(seed, start, 6, torch.device("cpu")).tolist()
    want = [((splitmix64_reference((start + i) * 0x9E3779B97F4A7C15 + seed) >> 40) - 2**23) / 2**23 for i in range(6)]
    assert got == want


def test_counter_uniform_is_a_stream_that_chunks_alike():
    whole = counter_uniform(7, 0, 10_000, torch.device("cpu"))
    parts = torch.cat([counter_uniform(7, 0, 4_321, torch.device("cpu")), counter_uniform(7, 4_321, 5_679, torch.device("cpu"))])
    assert torch.equal(whole, parts) and not torch.equal(whole, counter_uniform(8, 0, 10_000, torch.device("cpu")))
    assert whole.dtype == torch.float32 and -1 <= whole.min() and whole.max() < 1
    assert abs(whole.mean().item()) < 0.02 and abs(whole.std().item() - 3 ** -0.5) < 0.01
    assert len(torch.unique(whole)) > 9_990  # 24 bits each: hardly a repeat


def test_dummy_weights_are_the_same_in_every_dtype():
    """Drawn in float32 and cast: a bfloat16 model holds the float32 model's weights, rounded."""
    f32 = dict(load_model("dummy:llama-tiny", torch.device("cpu"), torch.float32).model.named_parameters())
    bf16 = dict(load_model("dummy:llama-tiny", torch.device("cpu"), torch.bfloat16).model.named_parameters())
    again = dict(load_model("dummy:llama-tiny", torch.device("cpu"), torch.float32).model.named_parameters())
    assert all(torch.equal(f32[k], again[k]) and torch.equal(f32[k].to(torch.bfloat16), bf16[k]) for k in f32)
    norms = [v for k, v in f32.items() if v.dim() == 1 and "norm" in k]
    assert norms and all(0.8 < v.min() and v.max() < 1.2 for v in norms)  # 1 +- 0.1 * sqrt(3)


def test_building_a_model_leaves_torch_dynamo_unloaded():
    """nn.Embedding's own init on the meta device imports torch._dynamo: 1.3 s of CPU in every worker's
    start. A fresh process builds and runs an engine without it."""
    import subprocess
    import sys

    code = ("import sys; from common.engine import Engine; e = Engine(model='dummy:nanogpt'); "
            "e.generate([[1, 2, 3]]); print('torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_text_with_a_lone_surrogate_or_a_value_msgpack_cannot_carry_is_refused_by_name(llama_dir):
    """JSON and Python strings may hold one; UTF-8 and the `tokenizers` library (a TypeError) may not."""
    from common import protocol as P
    from router.client_requests import generate_message

    for model in (str(llama_dir), "dummy:nanogpt"):  # a tokenizer.json, and the byte tokenizer
        engine = Engine(model=model)
        with pytest.raises(InvalidArgument, match="lone surrogate such as"):
            engine.add_request("a\ud800")
        assert engine.generate("ab", SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids  # serving on
    with pytest.raises(InvalidArgument, match="lone surrogate such as"):  # a chat template's rendering
        engine.tokenizer.encode_chat([{"role": "user", "content": "\udfff b"}])
    with pytest.raises(InvalidArgument, match="a string of this Generate holds a lone surrogate"):
        P.encode(generate_message("r", "a\ud800", None, {}, True))
    for prompt, sampling in (([1, 2**70], {}), ("a", {"temperature": 2**70}), ("a", {"stop": [object()]})):
        with pytest.raises(InvalidArgument, match="this Generate holds a value that cannot be sent"):
            P.encode(generate_message("r", prompt, None, sampling, True))
    deep = []
    for _ in range(3000):
        deep = [deep]
    with pytest.raises(InvalidArgument, match="this Generate holds a value that cannot be sent"):  # was msgpack's
        P.encode(generate_message("r", "a", None, {"stop": deep}, True))  # own ValueError
    # what the router refused whole, naming no request (its caller waited out its timeout): by name, unsent
    for messages, sampling, text in ((None, {"temperature": {1: 2}}, "temperature holds a map key 1; allowed: text"),
                                     ([{"role": "user", "content": "hi", **{f"k{i}": "" for i in range(5000)}}], {},
                                      "messages holds a map of 5002 entries; allowed: at most 4096")):
        with pytest.raises(InvalidArgument, match=text):
            generate_message("r", "a" if messages is None else None, messages, sampling, True)
    # and from a client that does not check: refused under the request's own id, at once
    for bad in ({1: 2}, {f"k{i}": 0 for i in range(5000)}):
        buf = msgpack.packb({"request_id": "r7", "prompt": "a", "sampling": {"temperature": bad},
                             "v": P.PROTOCOL_VERSION, "type": "Generate"})
        with pytest.raises(P.ProtocolError, match="not valid msgpack") as e:
            P.decode(buf)
        assert e.value.request_id == "r7"


def test_a_fine_tune_with_the_base_models_config_has_its_own_fingerprint(tmp_path, llama_dir):
    """The router refuses a worker whose fingerprint is not its model's. A fingerprint of
    config.json alone let a fine-tune serve beside its base model: wrong tokens, nothing said."""
    import shutil

    from common.model_spec import hf_model_config

    tuned = tmp_path / "tuned"
    write_checkpoint(tuned, "llama-gqa", seed=1)
    assert (tuned / "config.json").read_text() == (llama_dir / "config.json").read_text()
    base = hf_model_config(llama_dir).fingerprint
    assert hf_model_config(shutil.copytree(llama_dir, tmp_path / "copy")).fingerprint == base
    assert hf_model_config(tuned).fingerprint != base


def test_a_long_text_tokenizes_as_a_short_one_does(llama_dir):
    """Past LONG_TEXT_CHARS the tokenizer's encode_batch runs (it lets go of the GIL, for the
    event loop beside a /tokenize of megabytes): the same ids as encode's."""
    from common.model_spec import load_tokenizer
    from common.tokenizer import LONG_TEXT_CHARS

    tok = load_tokenizer(str(llama_dir))
    text = "Hello world, 12345 héllo " * (LONG_TEXT_CHARS // 10)
    assert len(text) > LONG_TEXT_CHARS
    for special in (True, False):
        assert tok.encode(text, add_special_tokens=special) == tok.backend.encode(text, add_special_tokens=special).ids
