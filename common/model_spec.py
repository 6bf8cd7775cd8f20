"""What a model spec names, read without torch and without weights: its ModelConfig and its
tokenizer. The router needs both (token ids, the context length, the end-of-sequence ids, the
fingerprint workers must share) and nothing else of the model, so it starts without torch.

A spec is one of:
- `dummy:<preset>`: random weights from a fixed seed and a byte-level tokenizer, no files (like
  vLLM's dummy load format);
- a named model (`smollm2`): a GGUF file fetched by `pdserve pull` (common/model_hub.py);
- a GGUF file (common/gguf_file.py, common/gguf_tokenizer.py);
- a local Hugging Face checkpoint directory (config.json, tokenizer.json), read here without
  `transformers`.
The weights of each are loaded by common/checkpoint.py.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from common.chat import hf_chat_template, json_object
from common.errors import InvalidArgument, ModelLoadError, short_repr
from common.tokenizer import ByteTokenizer, HFTokenizer


@dataclass
class ModelConfig:
    """Shape and flavour of a decoder-only transformer. `arch` is "llama" (Llama, Qwen2, Qwen3:
    RMSNorm, rotary positions, gated SiLU MLP) or "gpt2" (LayerNorm, learned positions, GELU MLP)."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    fingerprint: str = ""  # equal for equal weights: two workers must agree on it to share KV

    def __post_init__(self):
        """Every value checked for type and range, whichever file it came from: a config.json's
        "2.0", "1e-6" or null, or a GGUF's damaged field, is refused here by name, not met later
        as a TypeError (or, for a rope factor of 0, as degenerate output)."""
        if self.arch not in ("llama", "gpt2"):
            raise InvalidArgument(f"arch={self.arch!r} is not supported; allowed: 'llama', 'gpt2'")
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "intermediate_size", "max_position_embeddings"):
            check_number(key, getattr(self, key), integer=True)
        for key in ("norm_eps", "rope_theta"):
            check_number(key, getattr(self, key))
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(f"num_heads={self.num_heads} must be a multiple of "
                                  f"num_kv_heads={self.num_kv_heads}")
        if self.arch == "llama" and self.head_dim % 2:
            raise InvalidArgument(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.arch == "gpt2" and self.num_heads * self.head_dim != self.hidden_size:
            raise InvalidArgument(f"hidden_size={self.hidden_size} must be num_heads={self.num_heads} times "
                                  f"head_dim={self.head_dim}")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling, self.head_dim)
        for i in self.eos_token_ids:
            if not 0 <= i < self.vocab_size:
                raise InvalidArgument(f"end-of-sequence token id {i} is invalid; allowed: an id of the vocabulary "
                                      f"(0..{self.vocab_size - 1})")

    def served_context(self, max_model_len: int | None, spec: str) -> int:
        """The context served (vLLM's --max-model-len): at most, and by default, the model's own;
        positions past it were never trained."""
        full = self.max_position_embeddings
        if max_model_len is not None and not 2 <= max_model_len <= full:
            raise InvalidArgument(f"--max-model-len {max_model_len}; allowed: 2..{full} (the context of model "
                                  f"{spec!r}: positions past it were never trained)")
        return max_model_len or full

    @property
    def kv_values_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def check_number(key: str, value, integer: bool = False, low: int = 1):
    """value, if an int >= low (integer), else a finite number > 0; never a bool or a string: the
    one check of a model file's numbers (config.json's, a GGUF's), or InvalidArgument naming it."""
    if integer:
        if isinstance(value, int) and not isinstance(value, bool) and value >= low:
            return value
        allowed = f"an integer >= {low}"
    else:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf:
            return value
        allowed = "a finite number > 0"
    raise InvalidArgument(f"{key}={short_repr(value)} is invalid; allowed: {allowed}")


ROPE_SCALING_FIELDS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                         "original_max_position_embeddings"),
                       "freq_factors": ()}


def _check_rope_scaling(scaling, head_dim: int) -> None:
    if not isinstance(scaling, dict):
        raise InvalidArgument(f"rope_scaling={scaling!r} is not supported; allowed: an object such as "
                              '{"rope_type": "linear", "factor": 2.0}')
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_SCALING_FIELDS:
        raise InvalidArgument(f"rope_scaling's rope_type={kind!r} is not supported; allowed: "
                              + ", ".join(ROPE_SCALING_FIELDS))
    for key in ROPE_SCALING_FIELDS[kind]:
        if key not in scaling:
            raise InvalidArgument(f"rope_scaling of rope_type {kind!r} has no {key!r}; allowed: an object with "
                                  + ", ".join(ROPE_SCALING_FIELDS[kind]))
        check_number(f"rope_scaling's {key}", scaling[key])
    if kind == "llama3" and scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
        raise InvalidArgument(f"rope_scaling's low_freq_factor={scaling['low_freq_factor']!r} must be below its "
                              f"high_freq_factor={scaling['high_freq_factor']!r}")
    if kind == "freq_factors":
        factors = scaling.get("factors")
        if not isinstance(factors, (list, tuple)) or len(factors) != head_dim // 2:
            raise InvalidArgument(f"rope frequency factors: {head_dim // 2} expected (head_dim / 2), got "
                                  f"{len(factors) if isinstance(factors, (list, tuple)) else short_repr(factors)}")
        for f in factors:
            check_number("a rope frequency factor", f)


_BYTE = ByteTokenizer
DUMMY_PRESETS: dict[str, ModelConfig] = {
    # GPT-2 architecture at NanoGPT size; the default model.
    "nanogpt": ModelConfig(arch="gpt2", vocab_size=_BYTE.vocab_size, hidden_size=64, num_layers=4, num_heads=4,
                           num_kv_heads=4, head_dim=16, intermediate_size=256, max_position_embeddings=1024,
                           tie_word_embeddings=True, eos_token_ids=(_BYTE.eos_token_id,)),
    "llama-tiny": ModelConfig(arch="llama", vocab_size=_BYTE.vocab_size, hidden_size=128, num_layers=4,
                              num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=384,
                              max_position_embeddings=2048, norm_eps=1e-6,
                              eos_token_ids=(_BYTE.eos_token_id,)),
    "qwen3-tiny": ModelConfig(arch="llama", vocab_size=_BYTE.vocab_size, hidden_size=128, num_layers=4,
                              num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=384,
                              max_position_embeddings=2048, norm_eps=1e-6, qk_norm=True,
                              rope_theta=1_000_000.0, tie_word_embeddings=True,
                              eos_token_ids=(_BYTE.eos_token_id,)),
    # Llama-3.2-1B's shapes, for GPU benchmarks.
    "llama-1b": ModelConfig(arch="llama", vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
                            num_kv_heads=8, head_dim=64, intermediate_size=8192, max_position_embeddings=131072,
                            norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                            eos_token_ids=(_BYTE.eos_token_id,)),
}


def model_config(spec: str) -> ModelConfig:
    """The ModelConfig of a spec without loading any weights (enough to size a KV layout)."""
    if spec.startswith("dummy:"):
        return _dummy_config(spec)
    path = model_path(spec)
    try:
        if path.is_file():
            from common.gguf_file import gguf_model_config

            return gguf_model_config(path)
        return hf_model_config(path)
    except InvalidArgument as e:  # a value of the file's: check_number's, or ModelConfig's own checks
        raise ModelLoadError(f"{path if path.is_file() else path / 'config.json'}: {e}") from None


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer | None:
    """The tokenizer of a spec, without its weights (what the router needs)."""
    if spec.startswith("dummy:"):
        _dummy_config(spec)
        return ByteTokenizer()
    path = model_path(spec)
    if path.is_file():
        from common.gguf_file import open_gguf
        from common.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(open_gguf(path))
    tok_file = path / "tokenizer.json"
    return HFTokenizer.from_file(tok_file, hf_chat_template(path)) if tok_file.exists() else None


def _dummy_config(spec: str) -> ModelConfig:
    preset = spec.removeprefix("dummy:")
    if preset not in DUMMY_PRESETS:
        raise ModelLoadError(f"model={spec!r}: unknown dummy preset; allowed: "
                             + ", ".join(f"dummy:{p}" for p in DUMMY_PRESETS))
    return replace(DUMMY_PRESETS[preset], name=spec, fingerprint=spec)


LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # what a clone made without git-lfs holds for a file


def model_path(spec: str) -> Path:
    """A named model's GGUF file, a GGUF file, or a checkpoint directory."""
    from common.model_hub import NAMED_MODELS, named_model_path

    if spec in NAMED_MODELS:
        return named_model_path(spec)
    path = Path(spec).expanduser()
    if path.is_file() or (path / "config.json").is_file():
        return path
    found = ("no such file or directory" if not path.exists() else
             "a directory without config.json" if path.is_dir() else "not a regular file")
    raise ModelLoadError(f"model={spec!r} is not a dummy preset ("
                         + ", ".join(f"dummy:{p}" for p in DUMMY_PRESETS)
                         + "), a named model (" + ", ".join(NAMED_MODELS)
                         + f"), a GGUF file or a directory holding config.json ({spec}: {found})")


# ---------------------------------------------------------------- Hugging Face checkpoints

_LLAMA_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_CONTEXT_DEFAULTS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "mistral": 131072}  # transformers' configs'
_GPT2_ACTS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_SAMPLES, _SAMPLE_BYTES = 64, 64 * 1024  # what a fingerprint reads of a weights file: 4 MiB, whatever its size


def sample_file(h, path: Path, start: int = 0) -> None:
    """Feed the hash h a file's size and _SAMPLES slices of it from `start` on. Two checkpoints
    that share their config (a base model and its fine-tune) differ there: a model's fingerprint,
    which the router compares with each worker's, covers its weights without reading them all."""
    size = path.stat().st_size
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        h.update(f.read(start))
        step = max(1, (size - start) // _SAMPLES)
        for i in range(_SAMPLES):
            f.seek(start + i * step)
            h.update(f.read(_SAMPLE_BYTES))


def hf_model_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    try:
        text = cfg_file.read_text()
        raw = json.loads(text)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_file}: cannot read ({e})") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{cfg_file}: not a JSON object")
    h = hashlib.blake2b(text.encode(), digest_size=8)
    for weights in sorted(path.glob("*.safetensors")):
        sample_file(h, weights)
    fingerprint = h.hexdigest()
    mt = raw.get("model_type")
    eos = _eos_ids(raw, path)

    def need(key, default=None, integer=True):
        """raw[key] (or default, where one is given), checked to be a number of its kind."""
        if key not in raw and default is None:
            raise ModelLoadError(f"{cfg_file}: missing {key!r}, needed for model_type={mt!r}")
        return check_number(key, raw.get(key, default), integer)  # refused: model_config names the file

    quantized = raw.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        raise ModelLoadError(f"{cfg_file}: quantization_config (quant_method={method!r}) is not supported; allowed: "
                             "a checkpoint of float32, float16 or bfloat16 weights, or a GGUF file")
    if mt in _LLAMA_TYPES:
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{cfg_file}: hidden_act={raw['hidden_act']!r} is not supported; allowed: 'silu'")
        if raw.get("use_sliding_window"):
            raise ModelLoadError(f"{cfg_file}: use_sliding_window=true is not supported")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ModelLoadError(f"{cfg_file}: rope_scaling={short_repr(rope)} is not supported; allowed: an object "
                                 'such as {"rope_type": "linear", "factor": 2.0}')
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise ModelLoadError(f"{cfg_file}: rope_type={kind!r} is not supported; allowed: default, linear, llama3")
        heads, hidden = need("num_attention_heads"), need("hidden_size")
        context = need("max_position_embeddings", _CONTEXT_DEFAULTS[mt])
        window = raw.get("sliding_window", 4096) if mt == "mistral" else None  # MistralConfig's default
        if window is not None:  # within the window, attention is full attention: served up to it, token-exact
            context = min(context, check_number("sliding_window", window, integer=True))
        bias = bool(raw.get("attention_bias", False)) and mt != "mistral"  # transformers' Mistral has none
        return ModelConfig(
            arch="llama", vocab_size=need("vocab_size"), hidden_size=hidden,
            num_layers=need("num_hidden_layers"), num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim", 128 if mt == "qwen3" else None) or hidden // heads,  # Qwen3Config's 128
            intermediate_size=need("intermediate_size"),
            max_position_embeddings=context, norm_eps=need("rms_norm_eps", 1e-6, integer=False),
            qkv_bias=True if mt == "qwen2" else bias, o_bias=bias if mt != "qwen2" else False,
            mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=mt == "qwen3", rope_theta=theta,
            rope_scaling=rope if kind != "default" else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), eos_token_ids=eos, name=str(path),
            fingerprint=fingerprint)
    if mt == "gpt2":
        act = raw.get("activation_function", "gelu_new")
        if act not in _GPT2_ACTS:
            raise ModelLoadError(f"{cfg_file}: activation_function={act!r} is not supported; allowed: {_GPT2_ACTS}")
        for key, usual in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
            if raw.get(key, usual) != usual:
                raise ModelLoadError(f"{cfg_file}: {key}={raw[key]!r} is not supported; allowed: "
                                     f"{json.dumps(usual)} (attention scaled by 1/sqrt(head_dim) in every layer)")
        hidden, heads = need("n_embd"), need("n_head")
        if hidden % heads:
            raise ModelLoadError(f"{cfg_file}: n_embd={hidden} is not a multiple of n_head={heads}; allowed: "
                                 "heads that split the embedding evenly")
        return ModelConfig(
            arch="gpt2", vocab_size=need("vocab_size"), hidden_size=hidden, num_layers=need("n_layer"),
            num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            intermediate_size=raw.get("n_inner") or 4 * hidden, max_position_embeddings=need("n_positions"),
            norm_eps=need("layer_norm_epsilon", 1e-5, integer=False),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)), eos_token_ids=eos, name=str(path),
            fingerprint=fingerprint)
    raise ModelLoadError(f"{cfg_file}: model_type={mt!r} is not supported; allowed: "
                         + ", ".join(_LLAMA_TYPES + ("gpt2",)))


def _eos_ids(raw: dict, path: Path) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (raw, json_object(path / "generation_config.json")):
        eos = src.get("eos_token_id")
        for i in (eos if isinstance(eos, list) else [eos]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)
