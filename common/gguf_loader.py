"""A GGUF file's weights (the file itself, its config and fingerprint: common/gguf_file.py),
dequantized at load into the engine's dtype. Tensors are renamed to their Hugging Face names and go
through the same weight plan (fusing, shape checks) as a Hugging Face checkpoint
(common/checkpoint.py).

llama.cpp's converter permutes the rows of a `llama` file's Q and K projections so that its rope
rotates adjacent pairs; pdserve's rope (Hugging Face's) rotates the two halves of each head, so
the permutation is undone here, as `transformers` does. Qwen files are not permuted.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from common.checkpoint import fill_weights, weight_plan
from common.errors import ModelLoadError
from common.gguf_file import GGUFFile, open_gguf
from common.gguf_quants import SUPPORTED, dequantize
from common.model import Transformer
from common.model_spec import ModelConfig

_CHUNK_VALUES = 1 << 24  # dequantize at most this many values at once (bounds the temporaries)

_LAYER_NAMES = {  # GGUF per-layer tensor -> Hugging Face module under model.layers.N.
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_TO_GGUF = {hf: gguf for gguf, hf in {**_LAYER_NAMES, **_GLOBAL_NAMES}.items()}
_IGNORED = ("rope_freqs.weight",)  # read into the config, not a parameter


def read_tensor(g: GGUFFile, name: str, device: torch.device) -> torch.Tensor:
    """A tensor dequantized to float32 on `device`, in its torch shape."""
    shape, qtype = g.shape(name), g.qtype(name)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    raw = np.asarray(g.tensors[name].data).reshape(-1).view(np.uint8).reshape(rows, -1)
    out = torch.empty(rows, shape[-1], dtype=torch.float32, device=device)
    step = max(1, _CHUNK_VALUES // shape[-1])
    for r in range(0, rows, step):
        chunk = torch.from_numpy(raw[r:r + step].copy()).to(device)
        out[r:r + step] = dequantize(chunk, qtype)
    return out.view(shape)


def _gguf_name(hf_name: str) -> str:
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    if m:
        return f"blk.{m[1]}.{_TO_GGUF[m[2]]}.{m[3]}"
    module, kind = hf_name.rsplit(".", 1)
    return f"{_TO_GGUF[module]}.{kind}"


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head (half, pair) -> (pair, half) row order of a Q or K projection."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf_weights(model: Transformer, cfg: ModelConfig, path: Path) -> None:
    g = open_gguf(path)
    arch = g.get("general.architecture")
    plan = weight_plan(cfg)
    wanted = {_gguf_name(n) for sources, _ in plan.values() for n, _ in sources}
    for name in g.tensors:
        if name not in wanted and name not in _IGNORED:
            raise ModelLoadError(f"{path}: unexpected tensor {name!r}; the metadata describes {cfg.num_layers} "
                                 f"layers of architecture {arch!r}")
        if g.qtype(name) not in SUPPORTED:
            raise ModelLoadError(f"{path}: tensor {name!r} has type {g.qtype(name)}; allowed: " + ", ".join(SUPPORTED))
    heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads} if arch == "llama" else {}
    device = next(model.parameters()).device

    def fetch(hf_name: str, shape: tuple[int, ...]) -> torch.Tensor:
        name = _gguf_name(hf_name)
        if name not in g.tensors:
            raise ModelLoadError(f"{path}: tensor {name!r} (expected shape {list(shape)}) is missing")
        if g.shape(name) != shape:
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {list(g.shape(name))}, expected {list(shape)}")
        t = read_tensor(g, name, device)
        module = ".".join(hf_name.split(".")[3:-1])  # model.layers.N.<module>.weight
        return _unpermute(t, heads[module]) if module in heads else t

    fill_weights(model, plan, fetch)

