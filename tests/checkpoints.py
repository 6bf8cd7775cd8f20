"""Tiny Hugging Face checkpoints written by `transformers` with random weights, for tests only.

Weights are redrawn larger than transformers' default init so that greedy output varies from
token to token (with the default 0.02 scale a tiny model repeats one token, which would make a
parity test unable to fail)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 300

CONFIGS = {
    "llama-gqa": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=128, max_position_embeddings=256)),
    "llama3-scaled-bias-sharded": ("llama", dict(
        hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, intermediate_size=160,
        max_position_embeddings=512, attention_bias=True, mlp_bias=True, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "qwen2-tied": ("qwen2", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=True)),
    "qwen2-mha": ("qwen2", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                                intermediate_size=192, max_position_embeddings=256, tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, intermediate_size=128, max_position_embeddings=256)),
    "qwen3-bias": ("qwen3", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=32, intermediate_size=128, max_position_embeddings=256,
                                 attention_bias=True)),
    "qwen3-mqa-tied": ("qwen3", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                                     head_dim=16, intermediate_size=128, max_position_embeddings=256,
                                     tie_word_embeddings=True)),
    # transformers reads a qwen3 GGUF with Qwen3Config's default head_dim, 128 (tests/test_gguf.py)
    "qwen3-head128": ("qwen3", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=128, intermediate_size=128, max_position_embeddings=256)),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)),
    "gpt2-wide": ("gpt2", dict(n_embd=96, n_layer=3, n_head=3, n_inner=200, n_positions=256)),
    "gpt2-untied": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, tie_word_embeddings=False)),
    # served up to its window, where attention is full attention (the parity prompts fit in it)
    "mistral-window": ("mistral", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                                       sliding_window=128)),
}


def _classes(arch: str):
    import transformers as tf

    return {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM), "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[arch]


def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in name or "ln" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name or "wte" in name or "wpe" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:  # Linear (out, in) or GPT-2 Conv1D (in, out): scale by the input size
                fan_in = p.shape[0] if "c_" in name else p.shape[1]
                p.copy_(2.5 * fan_in ** -0.5 * torch.randn(p.shape, generator=gen))


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer.json with a BOS post-processor, as Llama checkpoints ship."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 4, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 + ["hello world, pdserve!"] * 20,
                            trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(path / "tokenizer.json"))


def write_checkpoint(path: Path, name: str, seed: int = 0):
    """Write checkpoint `name` (a key of CONFIGS) into path; return the transformers model."""
    arch, kwargs = CONFIGS[name]
    config_cls, model_cls = _classes(arch)
    config = config_cls(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, **kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size="200KB" if "sharded" in name else "2GB")
    write_tokenizer(path)
    return model


def write_config_only(path: Path) -> Path:
    """A checkpoint directory whose config.json reads (what a launcher checks before it starts
    anything) but which holds no weights: a worker fails at start, as it loads them."""
    arch, kwargs = CONFIGS["llama-gqa"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": arch,
                                                  "vocab_size": VOCAB, "rms_norm_eps": 1e-5, **kwargs}))
    return path
