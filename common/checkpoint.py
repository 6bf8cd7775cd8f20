"""Build a model from a spec: its weights drawn (`dummy:`) or read from a GGUF file or a Hugging
Face checkpoint (model.safetensors or a sharded index), onto the device. What the spec names
besides its weights, the config and the tokenizer, is read by common/model_spec.py.

Checkpoint tensors are mapped onto pdserve's fused layout here and nowhere else (GGUF tensors are
renamed to their Hugging Face names first); every tensor's shape is checked before it is copied,
so a mismatch names the file, the tensor and the shape expected.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from common.attention import make_attention
from common.errors import ModelLoadError
from common.model import Transformer
from common.model_spec import LFS_POINTER, ModelConfig, load_tokenizer, model_config, model_path
from common.sampling import GOLDEN, logical_shr, splitmix64
from common.tokenizer import ByteTokenizer, HFTokenizer


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer: ByteTokenizer | HFTokenizer | None


def load_model(spec: str, device: torch.device, dtype: torch.dtype, attention_backend: str = "auto",
               block_size: int = 16, rope: bool = True) -> LoadedModel:
    """rope=False: the caller sizes the rotary tables (Transformer.setup_rope), as an engine does
    for its max_model_len: a model's whole context (a million tokens, or a damaged GGUF's four
    billion) may be far more than it serves."""
    cfg = model_config(spec)
    attention = make_attention(attention_backend, device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype,
                               block_size)
    with torch.device("meta"):
        model = Transformer(cfg, attention)
    _materialize(model, dtype, device)
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
    if rope:
        model.setup_rope(device)
    return LoadedModel(model.eval().requires_grad_(False), cfg, tokenizer)


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give a model built on the meta device empty parameters of `dtype` on `device`, for the
    loader to fill. Not Module.to_empty: from meta, torch's empty_like imports sympy, half a second
    of every worker's start."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                                        requires_grad=False)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=dtype if b.is_floating_point() else b.dtype,
                                                    device=device)


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
        if not cfg.tie_word_embeddings:
            plan["lm_head.weight"] = ([("lm_head.weight", (V, C))], False)
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
    index_file = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index_file}: not a safetensors index ({e})") from e
        files = {name: path / f for name, f in weight_map.items()}
    elif single.is_file():
        files = {}
    else:
        raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json")
    for f in sorted(set(files.values())) or [single]:
        if not f.is_file():
            raise ModelLoadError(f"{f}: named by the index but missing")
        with _safetensors(f) as sf:
            files.update({name: f for name in sf.keys()})
    return files


def _safetensors(f: Path):
    """safe_open(f), or a ModelLoadError naming the file and what is wrong with it: a clone made
    without git-lfs holds a text pointer where the weights belong; a copy cut short, a header
    that does not cover the file."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(f), framework="pt")
    except (SafetensorError, OSError) as e:
        with open(f, "rb") as head:
            if head.read(len(LFS_POINTER)) == LFS_POINTER:
                raise ModelLoadError(f"{f}: a Git LFS pointer, not the weights; allowed: the file itself (run "
                                     "`git lfs pull` in the checkout)") from None
        raise ModelLoadError(f"{f}: not a whole safetensors file ({e})") from None


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _load_hf_weights(model: Transformer, cfg: ModelConfig, path: Path):
    files = _checkpoint_index(path)
    # GPT-2 checkpoints are saved with or without the "transformer." prefix; its lm_head never has it.
    prefix = "transformer." if cfg.arch == "gpt2" and any(n.startswith("transformer.") for n in files) else ""

    def full(name: str) -> str:
        return name if name == "lm_head.weight" else prefix + name

    plan = weight_plan(cfg)
    wanted = {full(n) for sources, _ in plan.values() for n, _ in sources}
    tied_head = "lm_head.weight" if cfg.tie_word_embeddings else None
    for name in files:
        if name not in wanted and name != tied_head and not name.endswith(_IGNORED_SUFFIXES):
            raise ModelLoadError(f"{files[name]}: unexpected tensor {name!r}; config.json describes "
                                 f"{cfg.num_layers} layers of model type {cfg.arch!r}")
    handles: dict[Path, object] = {}

    def fetch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        name = full(name)
        if name not in files:
            raise ModelLoadError(f"{path}: tensor {name!r} (expected shape {list(shape)}) is missing")
        f = files[name]
        if f not in handles:
            handles[f] = _safetensors(f).__enter__()
        try:
            t = handles[f].get_tensor(name)
        except Exception as e:  # safetensors' own error, for a file cut short after its header
            raise ModelLoadError(f"{f}: tensor {name!r} cannot be read ({e})") from None
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{f}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise ModelLoadError(f"{f}: tensor {name!r} is {str(t.dtype).removeprefix('torch.')}; allowed: float32, "
                                 "float16 or bfloat16 (a quantized checkpoint is not supported: use a GGUF file)")
        return t

    try:
        fill_weights(model, plan, fetch)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


def fill_weights(model: Transformer, plan: dict, fetch) -> None:
    """Copy every planned source into its parameter: fetch(name, shape) returns the checked
    checkpoint tensor; several sources fill consecutive rows (fused qkv and gate_up). A parameter
    the plan leaves out is an error: it would serve what torch.empty left in memory."""
    params = dict(model.named_parameters())
    unplanned = sorted(set(params) - set(plan))
    if unplanned:
        raise ModelLoadError(f"{model.cfg.name}: no weights planned for {', '.join(unplanned)}")
    for ours, (sources, transpose) in plan.items():
        dst, row = params[ours].data, 0
        for name, shape in sources:
            t = fetch(name, shape)
            t = t.t() if transpose else t
            dst[row:row + t.shape[0]].copy_(t)
            row += t.shape[0]
        if row != dst.shape[0]:  # rows left as torch.empty left them
            raise ModelLoadError(f"{ours}: its sources fill {row} of its {dst.shape[0]} rows")
