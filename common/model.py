"""Decoder-only transformers over a packed batch and a paged KV cache.

One module serves the Llama family (Llama 2/3, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm) and
GPT-2: they differ in norm, position encoding, MLP and biases, all flags of ModelConfig. Weights
are stored fused (qkv, gate_up) so each layer is a few large matmuls; the checkpoint loader does
the fusing. The forward takes the whole step's tokens as one (T,) sequence: no batch dimension and
no padding, so decode tokens and prefill chunks share every matmul.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from common.attention import AttentionMetadata
from common.model_spec import ModelConfig

if TYPE_CHECKING:  # (it imports triton: only the batch-invariant kernels make partials)
    from common.linear_partials import Partials


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # As Hugging Face does: normalise in float32, scale in the model's dtype.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def add_norm(norm: nn.Module, x_TC: torch.Tensor, delta_TC: torch.Tensor | Partials | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, norm(x + delta)): the residual stream's add and the norm after it, in one kernel
    where the norm has one (common/batch_invariant.py), with the same bits as the two ops."""
    if delta_TC is None:
        return x_TC, norm(x_TC)
    if hasattr(norm, "add_norm"):
        return norm.add_norm(x_TC, delta_TC)
    x_TC = x_TC + total(delta_TC)
    return x_TC, norm(x_TC)


def deferred(linear: nn.Module, x_TC: torch.Tensor) -> torch.Tensor | Partials:
    """linear(x), or where the layer can leave adding its K segments to the kernel that reads its
    output (the batch-invariant linear, for a few rows: common/linear_partials.py), its partials.
    Each such output here goes to add_norm, silu_mul or the attention's rope_attend, which take both."""
    return linear.deferred(x_TC) if hasattr(linear, "deferred") else linear(x_TC)


def total(delta: torch.Tensor | Partials) -> torch.Tensor:
    """A matmul's output as a tensor, its partials added where deferred left them."""
    return delta.total() if hasattr(delta, "total") else delta


def silu_mul(h_TX: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a gated MLP's fused product [gate, up] (torch's ops; a layer's
    silu_mul, which common/batch_invariant.py swaps for its kernel)."""
    gate, up = h_TX.chunk(2, dim=-1)
    return F.silu(gate) * up


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, cfg.norm_eps) if cfg.arch == "llama" else nn.LayerNorm(dim, eps=cfg.norm_eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "freq_factors":  # one divisor per frequency, as GGUF files store llama3 scaling
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def apply_rope(x_TND, cos_TF, sin_TF):
    x1, x2 = x_TND.chunk(2, dim=-1)
    cos, sin = cos_TF[:, None, :], sin_TF[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention):
        super().__init__()
        C, H, K, D, I = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        gpt2 = cfg.arch == "gpt2"
        self.sizes = (H * D, K * D, K * D)
        self.H, self.K, self.D = H, K, D
        self.attn_norm = make_norm(cfg, C)
        self.qkv = nn.Linear(C, (H + 2 * K) * D, bias=cfg.qkv_bias or gpt2)
        self.o = nn.Linear(H * D, C, bias=cfg.o_bias or gpt2)
        self.q_norm = RMSNorm(D, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.norm_eps) if cfg.qk_norm else None
        self.mlp_norm = make_norm(cfg, C)
        self.gated = not gpt2
        self.up = nn.Linear(C, 2 * I if self.gated else I, bias=cfg.mlp_bias or gpt2)
        self.down = nn.Linear(I, C, bias=cfg.mlp_bias or gpt2)
        self.silu_mul = silu_mul
        self.attention = attention

    def forward(self, x_TC, delta_TC, rope, k_cache, v_cache, meta: AttentionMetadata):
        """The residual stream is x + delta, the add left to the next norm (add_norm); returns the
        stream after the layer the same way, as (x, delta)."""
        T = x_TC.shape[0]
        x_TC, h_TC = add_norm(self.attn_norm, x_TC, delta_TC)
        if rope is not None and self.q_norm is None and hasattr(self.attention, "rope_attend"):
            o_THD = self.attention.rope_attend(deferred(self.qkv, h_TC), rope, k_cache, v_cache, meta)  # one kernel
        else:
            q, k, v = self.qkv(h_TC).split(self.sizes, dim=-1)
            q_THD, k_TKD, v_TKD = q.view(T, self.H, self.D), k.view(T, self.K, self.D), v.view(T, self.K, self.D)
            if self.q_norm is not None:
                q_THD, k_TKD = self.q_norm(q_THD), self.k_norm(k_TKD)
            if rope is not None:
                q_THD, k_TKD = apply_rope(q_THD, *rope), apply_rope(k_TKD, *rope)
            o_THD = self.attention(q_THD, k_TKD, v_TKD, k_cache, v_cache, meta)
        x_TC, h_TC = add_norm(self.mlp_norm, x_TC, deferred(self.o, o_THD.reshape(T, -1)))
        if self.gated:
            h_TI = self.silu_mul(deferred(self.up, h_TC))
        else:
            h_TI = F.gelu(self.up(h_TC), approximate="tanh")
        return x_TC, deferred(self.down, h_TI)


def _embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding left uninitialised (the loader fills it): nn.Embedding's own init draws a normal,
    which on the meta device imports torch._dynamo, 1.3 s of every worker's start."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention):
        super().__init__()
        self.cfg = cfg
        self.embed = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = _embedding(cfg.max_position_embeddings, cfg.hidden_size) if cfg.arch == "gpt2" else None
        self.attention = attention  # every layer's backend (one object: it holds no per-layer state)
        self.layers = nn.ModuleList(Layer(cfg, attention) for _ in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope_cos = self.rope_sin = None
        self.project = F.linear  # the output projection's matmul (common/batch_invariant.py swaps it)

    def setup_rope(self, device: torch.device, positions: int | None = None):
        """Rotary tables in float32 on the device (kept out of the parameters so a dtype cast
        never rounds them); cast per step to the activations' dtype, as Hugging Face does. For
        `positions` (an engine's max_model_len), else the model's whole context."""
        if self.cfg.arch == "llama":
            inv_freq = rope_inv_freq(self.cfg)
            freqs_PF = torch.outer(torch.arange(positions or self.cfg.max_position_embeddings).float(), inv_freq)
            self.rope_cos, self.rope_sin = freqs_PF.cos().to(device), freqs_PF.sin().to(device)

    def forward(self, input_ids_T, positions_T, kv_cache, meta: AttentionMetadata, on_layer=None):
        """kv_cache: (layers, 2, blocks, block_size, kv_heads, head_dim). Returns hidden (T, C).
        on_layer(i), if given, runs once layer i's KV is written (queued, on a GPU)."""
        x_TC = self.embed(input_ids_T)
        rope = None
        if self.pos_embed is not None:
            x_TC = x_TC + self.pos_embed(positions_T)
        else:
            dtype = x_TC.dtype
            rope = (self.rope_cos[positions_T].to(dtype), self.rope_sin[positions_T].to(dtype))
        delta_TC = None
        for i, layer in enumerate(self.layers):
            x_TC, delta_TC = layer(x_TC, delta_TC, rope, kv_cache[i, 0], kv_cache[i, 1], meta)
            if on_layer is not None:
                on_layer(i)
        return x_TC if delta_TC is None else x_TC + total(delta_TC)

    def logits(self, hidden_SC):
        h = self.norm(hidden_SC)
        return self.project(h, self.embed.weight if self.lm_head is None else self.lm_head.weight)
