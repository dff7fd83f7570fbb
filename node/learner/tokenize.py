"""Tokenizers: bytes (256 tokens, no file), or a ``tokenizer.json`` of the user's, read with ``tokenizers``.

Nothing is downloaded: ``--tokenizer`` names a local file (``tokenizers.Tokenizer.save`` writes one; a
Hugging Face model folder has one too, and a folder is taken to mean its ``tokenizer.json``).

A GPT-2 style byte-level BPE (no normaliser, the ``ByteLevel`` pre-tokeniser with its regex, a BPE model; the
GPT-2 tokenizer itself is one) is encoded through a memo of pre-token -> ids in front of the library: a
document is split with the same regex, and only pre-tokens not seen before go through the BPE model.
Measured (``bench/corpus.py --steps memo``): 1.9-3.25x the library's own ``encode`` per core; the library's
cost is building each token's offsets and strings, not the merges. Every batch checks a sample against the
library and falls back to it for good on the first difference; a document holding one of the tokenizer's
added tokens goes through the library.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from protocol.errors import ConfigError

logger = logging.getLogger(__name__)
HF_EXTRA = "pip install 'ddiloco[hf]'"
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|eos|>")
# The split of tokenizers' ByteLevel pre-tokeniser (use_regex=true), the GPT-2 pattern.
BYTE_LEVEL_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MEMO_LIMIT = 1 << 18  # pre-tokens remembered (about 50 MB) before the memo starts again
CHECK_CHARS = 50_000  # the sample each batch checks against the library


class Tokenizer:
    """Bytes: each UTF-8 byte is a token, and a document ends with a newline."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = 10

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's token ids, no end-of-document token."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def encode_document(self, text: str) -> np.ndarray:
        ids = self.encode_texts([text])[0].astype(np.int64)
        return np.append(ids, self.eos_id) if self.eos_id is not None else ids


def _byte_chars() -> list[str]:
    """The byte -> character table of byte-level BPE: printable Latin-1 bytes stand for themselves, the others
    take the characters from U+0100 on, in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(0x100 + extra))
            extra += 1
    return out


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
        self.name = self.path = str(p)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for n in EOS_NAMES if (i := self.tok.token_to_id(n)) is not None), None)
        # where the tokenizer is plain byte-level BPE (``_memo_fits``): its split, byte alphabet, added tokens
        self._split = self._chars = self._added = None
        self._memo: dict[str, list[int]] | None = {} if self._memo_fits() else None

    def _memo_fits(self) -> bool:
        try:
            import regex
        except ImportError:
            return False
        spec = json.loads(self.tok.to_str())
        pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
        fits = (
            spec.get("normalizer") is None
            and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False)
            and model.get("type") == "BPE"
            and model.get("dropout") is None
        )
        if fits:
            self._split = regex.compile(BYTE_LEVEL_SPLIT).findall
            self._chars = _byte_chars()
            self._added = [t["content"] for t in spec.get("added_tokens") or []]
        return fits

    def _library(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def _memo_encode(self, text: str) -> list[int]:
        if any(a in text for a in self._added):
            return self.tok.encode(text, add_special_tokens=False).ids
        memo, chars, model = self._memo, self._chars, self.tok.model
        if len(memo) > MEMO_LIMIT:
            memo.clear()
        ids: list[int] = []
        extend = ids.extend
        for piece in self._split(text):
            got = memo.get(piece)
            if got is None:
                got = memo[piece] = [t.id for t in model.tokenize("".join(chars[b] for b in piece.encode()))]
            extend(got)
        return ids

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        if self._memo is not None and texts:
            cut = texts[0].find("\n", CHECK_CHARS)
            sample = texts[0] if cut < 0 else texts[0][: cut + 1]
            if self._memo_encode(sample) != self._library([sample])[0]:
                logger.warning(
                    "%s: the pre-token memo differs from the library; using the library", self.name
                )
                self._memo = None
        if self._memo is not None:
            lists = [self._memo_encode(t) for t in texts]
        else:
            lists = self._library(texts)
        return [np.asarray(ids, dtype=np.int64) for ids in lists]


def load_tokenizer(path: str | None) -> Tokenizer:
    return FileTokenizer(path) if path else Tokenizer()


def tokenizer_digest(path: str | None) -> str:
    """What names a tokenizer in a token cache's manifest: the SHA-256 of its tokenizer.json, or "bytes"."""
    if not path:
        return "bytes"
    import hashlib

    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    try:
        return hashlib.sha256(p.read_bytes()).hexdigest()
    except OSError as e:
        raise ConfigError(f"tokenizer={path!r} cannot be read ({e.strerror or e})") from e
