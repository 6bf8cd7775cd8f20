"""Build a model from a spec, the one place that tells specs apart:
- `dummy:<preset>`: random weights from a fixed seed and a byte-level tokenizer, no files (like
  vLLM's dummy load format);
- a named model (`smollm2`): a GGUF file fetched by `pdserve pull` (common/model_hub.py);
- a GGUF file (common/gguf_loader.py, common/gguf_tokenizer.py);
- a local Hugging Face checkpoint directory (config.json, model.safetensors or a sharded index,
  tokenizer.json), read here without `transformers`.

Checkpoint tensors are mapped onto pdserve's fused layout here and nowhere else (GGUF tensors are
renamed to their Hugging Face names first); every tensor's shape is checked before it is copied,
so a mismatch names the file, the tensor and the shape expected.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from common.attention import make_attention
from common.chat import hf_chat_template
from common.config import ModelConfig
from common.errors import ModelLoadError
from common.model import Transformer
from common.sampling import GOLDEN, logical_shr, splitmix64
from common.tokenizer import ByteTokenizer, HFTokenizer

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


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer: ByteTokenizer | HFTokenizer | None


def model_config(spec: str) -> ModelConfig:
    """The ModelConfig of a spec without loading any weights (enough to size a KV layout)."""
    if spec.startswith("dummy:"):
        return _dummy_config(spec)
    path = model_path(spec)
    if path.is_file():
        from common.gguf_loader import gguf_model_config

        return gguf_model_config(path)
    return hf_model_config(path)


def load_model(spec: str, device: torch.device, dtype: torch.dtype, attention_backend: str = "auto",
               block_size: int = 16) -> LoadedModel:
    cfg = model_config(spec)
    attention = make_attention(attention_backend, device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype,
                               block_size)
    with torch.device("meta"):
        model = Transformer(cfg, attention)
    model = model.to(dtype).to_empty(device=device)
    if spec.startswith("dummy:"):
        _fill_random(model, spec)
        tokenizer = ByteTokenizer()
    elif (path := model_path(spec)).is_file():
        from common.gguf_loader import load_gguf_weights

        load_gguf_weights(model, cfg, path)
        tokenizer = load_tokenizer(spec)
    else:
        _load_hf_weights(model, cfg, path)
        tokenizer = load_tokenizer(spec)
    model.setup_rope(device)
    return LoadedModel(model.eval().requires_grad_(False), cfg, tokenizer)


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer | None:
    """The tokenizer of a spec, without its weights (what the router needs)."""
    if spec.startswith("dummy:"):
        _dummy_config(spec)
        return ByteTokenizer()
    path = model_path(spec)
    if path.is_file():
        from common.gguf_loader import open_gguf
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


def model_path(spec: str) -> Path:
    """A named model's GGUF file, a GGUF file, or a checkpoint directory."""
    from common.model_hub import NAMED_MODELS, named_model_path

    if spec in NAMED_MODELS:
        return named_model_path(spec)
    path = Path(spec).expanduser()
    if path.is_file() or (path / "config.json").is_file():
        return path
    raise ModelLoadError(f"model={spec!r} is not a dummy preset ("
                         + ", ".join(f"dummy:{p}" for p in DUMMY_PRESETS)
                         + "), a named model (" + ", ".join(NAMED_MODELS)
                         + "), a GGUF file or a directory holding config.json")


_CHUNK = 1 << 22  # elements drawn at once: int64 temporaries of 32 MB


def counter_uniform(seed: int, start: int, n: int, device: torch.device) -> torch.Tensor:
    """n float32 numbers uniform in [-1, 1), the elements start..start+n of stream `seed`: SplitMix64
    of each element's index, in int64 arithmetic (it wraps alike on every device), then its top 24
    bits, which float32 holds exactly. So any device draws the same numbers, and a GPU draws them
    itself instead of waiting for the CPU."""
    z = splitmix64(torch.arange(start, start + n, dtype=torch.int64, device=device) * GOLDEN + seed)
    return (logical_shr(z, 40).to(torch.float32) - 2.0 ** 23) * 2.0 ** -23


def _fill_random(model: Transformer, spec: str):
    """Deterministic random weights, drawn where the model lives: each tensor a counter-based
    stream (counter_uniform) seeded by its name, scaled in float32 then cast to the model's dtype, so
    every device and dtype starts from the same numbers. Scales keep the residual stream near unit
    size, so greedy output is varied rather than one repeated token."""
    for name, p in model.named_parameters():
        seed = int.from_bytes(hashlib.blake2b(f"{spec}/{name}".encode(), digest_size=8).digest(), "little") >> 1
        if name.endswith("bias"):
            mean, std = 0.0, 0.02
        elif p.dim() == 1:  # norm scales
            mean, std = 1.0, 0.1
        elif "embed" in name:
            mean, std = 0.0, 0.3
        else:
            mean, std = 0.0, 3.0 * p.shape[1] ** -0.5
        flat = p.data.view(-1)
        for start in range(0, flat.numel(), _CHUNK):
            n = min(_CHUNK, flat.numel() - start)
            u = counter_uniform(seed, start, n, p.device)
            flat[start:start + n].copy_(u * (std * 3.0 ** 0.5) + mean)  # uniform of that std


# ---------------------------------------------------------------- Hugging Face checkpoints

_LLAMA_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_GPT2_ACTS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def hf_model_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    try:
        text = cfg_file.read_text()
        raw = json.loads(text)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_file}: cannot read ({e})") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{cfg_file}: not a JSON object")
    fingerprint = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    mt = raw.get("model_type")
    eos = _eos_ids(raw, path)

    def need(key):
        if key not in raw:
            raise ModelLoadError(f"{cfg_file}: missing {key!r}, needed for model_type={mt!r}")
        return raw[key]

    if mt in _LLAMA_TYPES:
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{cfg_file}: hidden_act={raw['hidden_act']!r} is not supported; allowed: 'silu'")
        if raw.get("use_sliding_window"):
            raise ModelLoadError(f"{cfg_file}: use_sliding_window=true is not supported")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise ModelLoadError(f"{cfg_file}: rope_type={kind!r} is not supported; allowed: default, linear, llama3")
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        bias = bool(raw.get("attention_bias", False))
        return ModelConfig(
            arch="llama", vocab_size=need("vocab_size"), hidden_size=hidden,
            num_layers=need("num_hidden_layers"), num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads, intermediate_size=need("intermediate_size"),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            norm_eps=raw.get("rms_norm_eps", 1e-6),
            qkv_bias=True if mt == "qwen2" else bias, o_bias=bias if mt in ("llama", "mistral") else False,
            mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=mt == "qwen3", rope_theta=float(theta),
            rope_scaling=rope if kind != "default" else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), eos_token_ids=eos, name=str(path),
            fingerprint=fingerprint)
    if mt == "gpt2":
        act = raw.get("activation_function", "gelu_new")
        if act not in _GPT2_ACTS:
            raise ModelLoadError(f"{cfg_file}: activation_function={act!r} is not supported; allowed: {_GPT2_ACTS}")
        hidden, heads = need("n_embd"), need("n_head")
        return ModelConfig(
            arch="gpt2", vocab_size=need("vocab_size"), hidden_size=hidden, num_layers=need("n_layer"),
            num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            intermediate_size=raw.get("n_inner") or 4 * hidden, max_position_embeddings=need("n_positions"),
            norm_eps=raw.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)), eos_token_ids=eos, name=str(path),
            fingerprint=fingerprint)
    raise ModelLoadError(f"{cfg_file}: model_type={mt!r} is not supported; allowed: "
                         + ", ".join(_LLAMA_TYPES + ("gpt2",)))


def _eos_ids(raw: dict, path: Path) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [raw]
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        try:
            sources.append(json.loads(gen_file.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{gen_file}: cannot read ({e})") from e
    for src in sources:
        eos = src.get("eos_token_id")
        for i in (eos if isinstance(eos, list) else [eos]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def weight_plan(cfg: ModelConfig) -> dict[str, tuple[list[tuple[str, tuple[int, ...]]], bool]]:
    """pdserve parameter -> ([(checkpoint tensor, checkpoint shape)], transpose). Several sources
    are concatenated along dim 0 (fused qkv and gate_up)."""
    C, H, K, D, I, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    plan: dict = {}
    if cfg.arch == "gpt2":
        plan["embed.weight"] = ([("wte.weight", (V, C))], False)
        plan["pos_embed.weight"] = ([("wpe.weight", (cfg.max_position_embeddings, C))], False)
        plan["norm.weight"], plan["norm.bias"] = ([("ln_f.weight", (C,))], False), ([("ln_f.bias", (C,))], False)
        for i in range(cfg.num_layers):
            h, o = f"h.{i}.", f"layers.{i}."
            for ours, theirs, shape_w in (("attn_norm", "ln_1", None), ("mlp_norm", "ln_2", None),
                                          ("qkv", "attn.c_attn", (C, 3 * C)), ("o", "attn.c_proj", (C, C)),
                                          ("up", "mlp.c_fc", (C, I)), ("down", "mlp.c_proj", (I, C))):
                if shape_w is None:  # LayerNorm
                    plan[o + ours + ".weight"] = ([(h + theirs + ".weight", (C,))], False)
                    plan[o + ours + ".bias"] = ([(h + theirs + ".bias", (C,))], False)
                else:  # Conv1D stores (in, out)
                    plan[o + ours + ".weight"] = ([(h + theirs + ".weight", shape_w)], True)
                    plan[o + ours + ".bias"] = ([(h + theirs + ".bias", (shape_w[1],))], False)
        return plan
    plan["embed.weight"] = ([("model.embed_tokens.weight", (V, C))], False)
    plan["norm.weight"] = ([("model.norm.weight", (C,))], False)
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = ([("lm_head.weight", (V, C))], False)
    for i in range(cfg.num_layers):
        a, o = f"model.layers.{i}.", f"layers.{i}."
        qkv = [(a + f"self_attn.{n}_proj", rows) for n, rows in (("q", H * D), ("k", K * D), ("v", K * D))]
        plan[o + "qkv.weight"] = ([(n + ".weight", (r, C)) for n, r in qkv], False)
        if cfg.qkv_bias:
            plan[o + "qkv.bias"] = ([(n + ".bias", (r,)) for n, r in qkv], False)
        plan[o + "o.weight"] = ([(a + "self_attn.o_proj.weight", (C, H * D))], False)
        if cfg.o_bias:
            plan[o + "o.bias"] = ([(a + "self_attn.o_proj.bias", (C,))], False)
        plan[o + "up.weight"] = ([(a + "mlp.gate_proj.weight", (I, C)), (a + "mlp.up_proj.weight", (I, C))], False)
        plan[o + "down.weight"] = ([(a + "mlp.down_proj.weight", (C, I))], False)
        if cfg.mlp_bias:
            plan[o + "up.bias"] = ([(a + "mlp.gate_proj.bias", (I,)), (a + "mlp.up_proj.bias", (I,))], False)
            plan[o + "down.bias"] = ([(a + "mlp.down_proj.bias", (C,))], False)
        plan[o + "attn_norm.weight"] = ([(a + "input_layernorm.weight", (C,))], False)
        plan[o + "mlp_norm.weight"] = ([(a + "post_attention_layernorm.weight", (C,))], False)
        if cfg.qk_norm:
            plan[o + "q_norm.weight"] = ([(a + "self_attn.q_norm.weight", (D,))], False)
            plan[o + "k_norm.weight"] = ([(a + "self_attn.k_norm.weight", (D,))], False)
    return plan


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")


def _checkpoint_index(path: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> file, from model.safetensors or a sharded index."""
    from safetensors import safe_open

    index_file = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index_file}: not a safetensors index ({e})") from e
        files = {name: path / f for name, f in weight_map.items()}
    elif single.is_file():
        files = {}
    else:
        raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json")
    for f in sorted(set(files.values())) or [single]:
        if not f.is_file():
            raise ModelLoadError(f"{f}: named by the index but missing")
        with safe_open(str(f), framework="pt") as sf:
            files.update({name: f for name in sf.keys()})
    return files


def _load_hf_weights(model: Transformer, cfg: ModelConfig, path: Path):
    from safetensors import safe_open

    files = _checkpoint_index(path)
    # GPT-2 checkpoints are saved with or without the "transformer." prefix.
    prefix = "transformer." if cfg.arch == "gpt2" and any(n.startswith("transformer.") for n in files) else ""
    plan = weight_plan(cfg)
    wanted = {prefix + n for sources, _ in plan.values() for n, _ in sources}
    tied_head = "lm_head.weight" if cfg.tie_word_embeddings or cfg.arch == "gpt2" else None
    for name in files:
        if name not in wanted and name != tied_head and not name.endswith(_IGNORED_SUFFIXES):
            raise ModelLoadError(f"{files[name]}: unexpected tensor {name!r}; config.json describes "
                                 f"{cfg.num_layers} layers of model type {cfg.arch!r}")
    handles: dict[Path, object] = {}

    def fetch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        full = prefix + name
        if full not in files:
            raise ModelLoadError(f"{path}: tensor {full!r} (expected shape {list(shape)}) is missing")
        f = files[full]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt").__enter__()
        t = handles[f].get_tensor(full)
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{f}: tensor {full!r} has shape {list(t.shape)}, expected {list(shape)}")
        return t

    try:
        fill_weights(model, plan, fetch)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


def fill_weights(model: Transformer, plan: dict, fetch) -> None:
    """Copy every planned source into its parameter: fetch(name, shape) returns the checked
    checkpoint tensor; several sources fill consecutive rows (fused qkv and gate_up)."""
    params = dict(model.named_parameters())
    for ours, (sources, transpose) in plan.items():
        dst, row = params[ours].data, 0
        for name, shape in sources:
            t = fetch(name, shape)
            t = t.t() if transpose else t
            dst[row:row + t.shape[0]].copy_(t)
            row += t.shape[0]
        if row != dst.shape[0]:  # rows left as torch.empty left them
            raise ModelLoadError(f"{ours}: its sources fill {row} of its {dst.shape[0]} rows")
