"""Tokenizers: a byte-level one for the embedded dummy models (no files), and Hugging Face
`tokenizer.json` files through the `tokenizers` library (no `transformers`)."""

from __future__ import annotations

from pathlib import Path

from common.errors import ModelLoadError


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; 256 is BOS and 257 EOS. Ids past 257 (the
    model's padded vocabulary) decode to nothing."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's tokenizer.json. Special tokens (BOS) are added as the file's post-processor
    says, as `transformers` would."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own exception types
            raise ModelLoadError(f"{path}: not a readable tokenizer.json ({e})") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)
