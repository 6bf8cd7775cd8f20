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


def read_tensor(g: GGUFFile, name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                heads: int | None = None) -> torch.Tensor:
    """A tensor dequantized into `dtype` on `device`, in its torch shape. It goes a chunk of rows at
    a time straight into the result, so that loading holds no float32 copy of a whole tensor (an
    8B model's embedding is 2 GiB of them). With heads, the rows of a llama file's Q or K projection
    go back into Hugging Face's order on the way (_unpermuted_rows)."""
    shape, qtype = g.shape(name), g.qtype(name)
    if heads is not None and len(shape) == 1:  # a bias: its values are the rows to put in order
        t = read_tensor(g, name, device, dtype)
        return torch.empty_like(t).index_copy_(0, _unpermuted_rows(t.shape[0], heads, device), t)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    raw = np.asarray(g.tensors[name].data).reshape(-1).view(np.uint8).reshape(rows, -1)
    out = torch.empty(rows, shape[-1], dtype=dtype, device=device)
    where = None if heads is None else _unpermuted_rows(rows, heads, device)
    step = max(1, _CHUNK_VALUES // shape[-1])
    for r in range(0, rows, step):
        values = dequantize(torch.from_numpy(raw[r:r + step].copy()).to(device), qtype)
        if where is None:
            out[r:r + step] = values
        else:
            out.index_copy_(0, where[r:r + step], values.to(dtype))
    return out.view(shape)


def _gguf_name(hf_name: str) -> str:
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    if m:
        return f"blk.{m[1]}.{_TO_GGUF[m[2]]}.{m[3]}"
    module, kind = hf_name.rsplit(".", 1)
    return f"{_TO_GGUF[module]}.{kind}"


def _unpermuted_rows(rows: int, heads: int, device: torch.device) -> torch.Tensor:
    """Where each row of a llama file's Q or K projection goes: llama.cpp's converter orders each
    head's rows (half, pair), Hugging Face's rope wants (pair, half)."""
    per_head = rows // heads
    r = torch.arange(rows, device=device)
    within = r % per_head
    return r - within + (within % 2) * (per_head // 2) + within // 2


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
    params = dict(model.named_parameters())
    dtypes = {n: params[ours].dtype for ours, (sources, _) in plan.items() for n, _ in sources}

    def fetch(hf_name: str, shape: tuple[int, ...]) -> torch.Tensor:
        name = _gguf_name(hf_name)
        if name not in g.tensors:
            raise ModelLoadError(f"{path}: tensor {name!r} (expected shape {list(shape)}) is missing")
        if g.shape(name) != shape:
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {list(g.shape(name))}, expected {list(shape)}")
        module = ".".join(hf_name.split(".")[3:-1])  # model.layers.N.<module>.weight
        return read_tensor(g, name, device, dtypes[hf_name], heads.get(module))

    fill_weights(model, plan, fetch)

