"""GGUF files for tests, written with `gguf`'s own writer and quantizer the way llama.cpp's
convert_hf_to_gguf.py writes them: from a tiny Hugging Face checkpoint (tests/checkpoints.py),
Q and K rows permuted for `llama`, llama3 rope scaling as a `rope_freqs` tensor, the byte-level
BPE tokenizer as tokens, merges and token types."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

# Types the gguf package can quantize (it only dequantizes the K-quants); 2-D tensors take them
# in turn, so every model test loads all of them.
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16", "F32")
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def quantized(data: np.ndarray, qtype: str) -> tuple[np.ndarray, object]:
    """(array to write, raw_dtype) for gguf's writer."""
    from gguf import GGMLQuantizationType, quants

    t = GGMLQuantizationType[qtype]
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == "F32":
        return data, None
    if qtype == "F16":
        return data.astype(np.float16), None
    return quants.quantize(data, t), t


def _gguf_name(hf: str) -> str:
    module, kind = hf.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, i, rest = module.split(".", 3)
        return f"blk.{i}.{_LAYER[rest]}.{kind}"
    return f"{_GLOBAL[module]}.{kind}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: the rows of each head from (half, i) to (i, half)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(cfg) -> np.ndarray:
    """As convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors."""
    rs = cfg.rope_scaling if getattr(cfg, "rope_scaling", None) else cfg.rope_parameters
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    theta = rs.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw data of a type gguf cannot quantize: random bytes, with finite float16 scales where
    the K-quant formats keep them (random bits there would be NaN or inf half the time)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for off in {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(qtype, ()):
        scales = (0.05 * rng.standard_normal(raw.shape[0])).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def write_gpt2_tokenizer(w, checkpoint_dir: Path, vocab_size: int, bos: int, eos: int, pre: str = "gpt-2",
                         extra: dict | None = None, more_merges: list[str] = ()):
    """The checkpoint's tokenizer.json as llama.cpp stores a byte-level BPE vocabulary; `extra`
    {id: (text, TokenType)} puts other tokens in place of those ids, `more_merges` ("a b") follow its merges."""
    from gguf import TokenType

    tok = json.loads((checkpoint_dir / "tokenizer.json").read_text())
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [TokenType.UNUSED] * vocab_size
    for t, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = t, TokenType.NORMAL
    for added in tok["added_tokens"]:
        types[added["id"]] = TokenType.CONTROL
    for i, (t, kind) in (extra or {}).items():
        tokens[i], types[i] = t, kind
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]] + list(more_merges))
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(True)


def write_gguf(path: Path, model, checkpoint_dir: Path, arch: str, qtypes=QUANTIZABLE, metadata: dict | None = None,
               skip: tuple[str, ...] = (), raw: dict | None = None, tokenizer=None) -> Path:
    """Convert the transformers `model` (saved in checkpoint_dir with its tokenizer.json) to GGUF.
    2-D tensors take `qtypes` in turn; norms and biases stay F32, as llama.cpp keeps them.
    `metadata` adds or overrides keys (value, or (value, GGUFValueType)); `skip` leaves tensors
    out; `raw` {name: (qtype, bytes)} replaces a tensor's data; `tokenizer(writer)` writes other
    tokenizer metadata than the checkpoint's."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)

    if tokenizer is None:
        write_gpt2_tokenizer(w, checkpoint_dir, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    else:
        tokenizer(w)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (metadata or {}).items():
        value, vtype = value if isinstance(value, tuple) else (value, GGUFValueType.STRING)
        w.add_key_value(key, value, vtype)

    rs = getattr(cfg, "rope_scaling", None) or rope
    if arch == "llama" and rs.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg))
    turn = 0
    tied = getattr(cfg, "tie_word_embeddings", False)
    for hf_name, t in model.state_dict().items():
        if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            continue
        name = _gguf_name(hf_name)
        if name in skip:
            continue
        data = t.detach().float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            data = _permute(data, heads if ".attn_q." in name else kv_heads)
        qtype = "F32"
        if data.ndim == 2:
            qtype, turn = qtypes[turn % len(qtypes)], turn + 1
        if name in (raw or {}):
            qtype, data = raw[name]
            w.add_tensor(name, data, raw_dtype=GGMLQuantizationType[qtype])
            continue
        array, raw_dtype = quantized(data, qtype)
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
