"""Tokenizers: bytes (256 tokens, no file), or a ``tokenizer.json`` of the user's, read with ``tokenizers``.

Nothing is downloaded: ``--tokenizer`` names a local file (``tokenizers.Tokenizer.save`` writes one; a
Hugging Face model folder has one too, and a folder is taken to mean its ``tokenizer.json``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protocol.errors import ConfigError

HF_EXTRA = "pip install 'ddiloco[hf]'"
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|eos|>")


class Tokenizer:
    """Bytes: each UTF-8 byte is a token, and a document ends with a newline."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = 10

    def encode_document(self, text: str) -> np.ndarray:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        return np.append(ids, self.eos_id) if self.eos_id is not None else ids


class FileTokenizer(Tokenizer):
    """A ``tokenizers`` tokenizer from a local ``tokenizer.json``; documents end with its end-of-document
    token when it has one of ``EOS_NAMES``."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ConfigError(f"tokenizer={path!r} needs the tokenizers library: {HF_EXTRA}") from None
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ConfigError(
                f"tokenizer={path!r} is invalid: no such file; give a local tokenizer.json (ddiloco never "
                "downloads tokenizers from the Hugging Face hub)"
            )
        try:
            self.tok = HFTokenizer.from_file(str(p))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception for a bad file
            raise ConfigError(f"{p}: not a tokenizers tokenizer.json ({str(e)[:200]})") from e
        self.name = str(p)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for n in EOS_NAMES if (i := self.tok.token_to_id(n)) is not None), None)

    def encode_document(self, text: str) -> np.ndarray:
        ids = np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        return np.append(ids, self.eos_id) if self.eos_id is not None else ids


def load_tokenizer(path: str | None) -> Tokenizer:
    return FileTokenizer(path) if path else Tokenizer()
