"""GGUF files (llama.cpp's single-file format): the model config and the weights, read with the
`gguf` package (the reader llama.cpp maintains), dequantized at load into the engine's dtype.

Architectures `llama` (Llama 2/3, SmolLM, Mistral-style), `qwen2` and `qwen3`. The config comes
from the `<arch>.*` metadata; tensors are renamed to their Hugging Face names and go through the
same weight plan (fusing, shape checks) as a Hugging Face checkpoint (common/checkpoint.py).

llama.cpp's converter permutes the rows of a `llama` file's Q and K projections so that its rope
rotates adjacent pairs; pdserve's rope (Hugging Face's) rotates the two halves of each head, so
the permutation is undone here, as `transformers` does. Qwen files are not permuted.

Llama 3.1+ files carry their rope scaling as a `rope_freqs.weight` tensor of per-frequency
divisors rather than as metadata; it becomes rope_scaling {"rope_type": "freq_factors"}.

The fingerprint (equal in every process that loads the same file, computed by the router too)
hashes the header (all metadata and the tensor table) and 64 evenly spaced 64 KiB samples of the
tensor data: a few MiB read, whatever the file's size.
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

import numpy as np
import torch

from common.checkpoint import fill_weights, weight_plan
from common.config import ModelConfig
from common.errors import ModelLoadError
from common.gguf_quants import SUPPORTED, dequantize
from common.model import Transformer

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_SCALINGS = ("none", "linear")
_REQUIRED = object()
_SAMPLES, _SAMPLE_BYTES = 64, 64 * 1024
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


def _reader(path: Path):
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """GGUFReader over a plain ndarray view of its memory map: parsing the metadata slices the
        map a million times, and numpy's memmap subclass costs microseconds per slice (3x the
        whole parse); the view keeps the map alive and reads the same pages."""

        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = value.view(np.ndarray)

    return Reader(str(path))


class GGUFFile:
    """One opened file: metadata by key, tensors by name."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.reader = _reader(path)
        except Exception as e:  # the reader raises ValueError, struct and numpy errors alike
            raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default=_REQUIRED):
        field = self.reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"{self.path}: metadata key {key!r} is missing")
            return default
        return field.contents()

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in torch order (GGUF lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def qtype(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def read(self, name: str, device: torch.device) -> torch.Tensor:
        """A tensor dequantized to float32 on `device`, in its torch shape."""
        shape, qtype = self.shape(name), self.qtype(name)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        raw = np.asarray(self.tensors[name].data).reshape(-1).view(np.uint8).reshape(rows, -1)
        out = torch.empty(rows, shape[-1], dtype=torch.float32, device=device)
        step = max(1, _CHUNK_VALUES // shape[-1])
        for r in range(0, rows, step):
            chunk = torch.from_numpy(raw[r:r + step].copy()).to(device)
            out[r:r + step] = dequantize(chunk, qtype)
        return out.view(shape)

    @functools.cached_property
    def fingerprint(self) -> str:
        size = self.path.stat().st_size
        start = self.reader.data_offset
        h = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=8)
        with open(self.path, "rb") as f:
            h.update(f.read(start))
            step = max(1, (size - start) // _SAMPLES)
            for i in range(_SAMPLES):
                f.seek(start + i * step)
                h.update(f.read(_SAMPLE_BYTES))
        return "gguf-" + h.hexdigest()


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(Path(path))


def open_gguf(path: Path) -> GGUFFile:
    """The file, parsed once per process (the config, the tokenizer and the weights all read it)."""
    try:
        st = path.stat()
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from e
    return _open(str(path.resolve()), st.st_mtime_ns, st.st_size)


def gguf_model_config(path: Path) -> ModelConfig:
    g = open_gguf(path)
    arch = g.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: general.architecture={arch!r} is not supported; allowed: "
                             + ", ".join(ARCHITECTURES))

    def meta(key, default=_REQUIRED):
        return g.get(f"{arch}.{key}", default)

    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    kv_heads = meta("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per layer; pdserve's KV layout needs one value
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(f"{path}: {arch}.attention.head_count_kv differs between layers ({kv_heads[:8]}...); "
                                 "allowed: one value for every layer")
        kv_heads = kv_heads[0]
    head_dim = meta("attention.key_length", hidden // heads)
    rope_dim = meta("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ModelLoadError(f"{path}: {arch}.rope.dimension_count={rope_dim} is not supported; allowed: the head "
                             f"dimension ({head_dim}), rope over the whole head")
    if "token_embd.weight" not in g.tensors:
        raise ModelLoadError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = g.shape("token_embd.weight")[0]
    scaling = meta("rope.scaling.type", "none")
    if scaling not in ROPE_SCALINGS:
        raise ModelLoadError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported; allowed: "
                             + ", ".join(ROPE_SCALINGS))
    rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))} if scaling == "linear" else None
    if "rope_freqs.weight" in g.tensors:
        factors = g.read("rope_freqs.weight", torch.device("cpu")).tolist()
        if len(factors) != head_dim // 2:
            raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' has {len(factors)} values, expected {head_dim // 2}")
        rope_scaling = {"rope_type": "freq_factors", "factors": factors}
    eos = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        i = g.get(f"tokenizer.ggml.{key}", None)
        if isinstance(i, int) and i not in eos:
            eos.append(i)
    return ModelConfig(
        arch="llama", vocab_size=vocab, hidden_size=hidden, num_layers=meta("block_count"), num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=meta("feed_forward_length"),
        max_position_embeddings=meta("context_length"), norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        qkv_bias="blk.0.attn_q.bias" in g.tensors, o_bias="blk.0.attn_output.bias" in g.tensors,
        mlp_bias="blk.0.ffn_up.bias" in g.tensors, qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
        rope_theta=float(meta("rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in g.tensors, eos_token_ids=tuple(eos), name=str(path),
        fingerprint=g.fingerprint)


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
        t = g.read(name, device)
        module = ".".join(hf_name.split(".")[3:-1])  # model.layers.N.<module>.weight
        return _unpermute(t, heads[module]) if module in heads else t

    fill_weights(model, plan, fetch)

