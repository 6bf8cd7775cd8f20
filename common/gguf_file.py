"""GGUF files (llama.cpp's single-file format), read with the `gguf` package (the reader llama.cpp
maintains) and numpy, without torch: the metadata, the tensor table, the model config and the
fingerprint. The router reads these; the weights are common/gguf_loader.py's.

Architectures `llama` (Llama 2/3, SmolLM, Mistral-style), `qwen2` and `qwen3`. The config comes
from the `<arch>.*` metadata. Llama 3.1+ files carry their rope scaling as a `rope_freqs.weight`
tensor of per-frequency divisors rather than as metadata; it becomes rope_scaling
{"rope_type": "freq_factors"}.

The fingerprint (equal in every process that loads the same file, computed by the router too)
hashes the header (all metadata and the tensor table) and 64 evenly spaced 64 KiB samples of the
tensor data: a few MiB read, whatever the file's size.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np

from common.errors import InvalidArgument, ModelLoadError, short_repr as _short
from common.model_spec import LFS_POINTER, ModelConfig, check_number, sample_file

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_SCALINGS = ("none", "linear")
_REQUIRED = object()




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
            with open(path, "rb") as f:
                magic = f.read(len(LFS_POINTER))
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot read ({e})") from e
        if magic == LFS_POINTER:
            raise ModelLoadError(f"{path}: a Git LFS pointer, not the model; allowed: the file itself (run "
                                 "`git lfs pull` in the checkout)")
        magic = magic[:4]
        if magic != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (it begins {magic!r}, not b'GGUF'); allowed: a GGUF "
                                 "file, or a Hugging Face checkpoint directory")
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

    def floats(self, name: str) -> list[float]:
        """An unquantized (F32 or F16) tensor's values, flat."""
        if self.qtype(name) not in ("F32", "F16"):
            raise ModelLoadError(f"{self.path}: tensor {name!r} has type {self.qtype(name)}; allowed: F32, F16")
        return np.asarray(self.tensors[name].data, dtype=np.float32).reshape(-1).tolist()

    @functools.cached_property
    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=8)
        sample_file(h, self.path, self.reader.data_offset)  # the header whole, then the tensors sampled
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


def _number(g: GGUFFile, key: str, default=_REQUIRED, kind: type = int, low: int = 1):
    """A numeric metadata value, checked before the config is computed from it: an integer >= low,
    or (kind float) a finite float > 0. llama.cpp may store a per-layer array; one whose layers all
    agree is that value (pdserve's layers are all alike)."""
    value = g.get(key, default)
    if isinstance(value, list) and value:
        if len(set(value)) != 1:
            raise ModelLoadError(f"{g.path}: {key} differs between layers ({_short(value)}); allowed: one value for "
                                 "every layer")
        value = value[0]
    try:
        value = check_number(key, value, kind is int, low)
    except InvalidArgument as e:
        raise ModelLoadError(f"{g.path}: {e}") from None
    return value if kind is int else float(value)


def gguf_model_config(path: Path) -> ModelConfig:
    g = open_gguf(path)
    parts = _number(g, "split.count", 1)
    if parts > 1:
        part = _number(g, "split.no", 0, low=0) + 1
        first = path.name if part == 1 else "PART-1.gguf"
        raise ModelLoadError(f"{path}: split.count={parts}: the file is part {part} of {parts} of a split GGUF; "
                             "allowed: a single-file GGUF (merge the parts with llama.cpp's "
                             f"`llama-gguf-split --merge {first} merged.gguf`)")
    arch = g.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: general.architecture={arch!r} is not supported; allowed: "
                             + ", ".join(ARCHITECTURES))

    def meta(key, default=_REQUIRED):
        return g.get(f"{arch}.{key}", default)

    def number(key, default=_REQUIRED, kind=int):
        return _number(g, f"{arch}.{key}", default, kind)

    hidden, heads = number("embedding_length"), number("attention.head_count")
    kv_heads = number("attention.head_count_kv", heads)
    if f"{arch}.attention.key_length" not in g.reader.fields and hidden % heads:
        raise ModelLoadError(f"{path}: {arch}.embedding_length={hidden} is not a multiple of "
                             f"{arch}.attention.head_count={heads}; allowed: a multiple, or the head size given "
                             f"as {arch}.attention.key_length")
    head_dim = number("attention.key_length", hidden // heads)
    rope_dim = number("rope.dimension_count", head_dim)
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
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": number("rope.scaling.factor", kind=float)}
    if "rope_freqs.weight" in g.tensors:
        factors = g.floats("rope_freqs.weight")
        if len(factors) != head_dim // 2:
            raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' has {len(factors)} values, "
                                 f"expected {head_dim // 2}")
        rope_scaling = {"rope_type": "freq_factors", "factors": factors}
    eos = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        i = g.get(f"tokenizer.ggml.{key}", None)
        if isinstance(i, int) and i not in eos:
            eos.append(i)
    return ModelConfig(
        arch="llama", vocab_size=vocab, hidden_size=hidden, num_layers=number("block_count"), num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=number("feed_forward_length"),
        max_position_embeddings=number("context_length"),
        norm_eps=number("attention.layer_norm_rms_epsilon", kind=float),
        qkv_bias="blk.0.attn_q.bias" in g.tensors, o_bias="blk.0.attn_output.bias" in g.tensors,
        mlp_bias="blk.0.ffn_up.bias" in g.tensors, qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
        rope_theta=number("rope.freq_base", 10000.0, float), rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in g.tensors, eos_token_ids=tuple(eos), name=str(path),
        fingerprint=g.fingerprint)
