"""Node identity: an Ed25519 key (``cryptography``) and the libp2p peer id it maps to
(docs/design.md, sections 4 and 5).

The peer id is libp2p's: the identity multihash of the protobuf-encoded public key, in base58btc, so an
Ed25519 id starts with ``12D3KooW``. The key file holds libp2p's protobuf-encoded private key, the format
hivemind's p2pd daemon reads as its identity, so the DHT peer id and the signing key are one identity.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import ConfigError

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_KEYTYPE_ED25519 = 1


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = _B58[r] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def b58decode(s: str) -> bytes:
    n = 0
    for ch in s:
        i = _B58.find(ch)
        if i < 0:
            raise ValueError(f"not base58: {ch!r}")
        n = n * 58 + i
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * (len(s) - len(s.lstrip("1"))) + body


def _pb_key(keytype: int, data: bytes) -> bytes:
    # message { KeyType Type = 1; bytes Data = 2; } — two fields, lengths < 128
    return bytes([0x08, keytype, 0x12, len(data)]) + data


def _raw_public(pub: Ed25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def peer_id_of(pub: Ed25519PublicKey) -> str:
    encoded = _pb_key(_KEYTYPE_ED25519, _raw_public(pub))
    return b58encode(bytes([0x00, len(encoded)]) + encoded)  # identity multihash


def public_key_of(peer_id: str) -> Ed25519PublicKey:
    """Recover the Ed25519 public key embedded in an ``12D3KooW...`` peer id."""
    # An Ed25519 peer id is 52 characters; base58 decoding is quadratic, so a megabyte "peer id" from the
    # wire must be refused before it is decoded, not after.
    if not isinstance(peer_id, str) or len(peer_id) > 64:
        raise ValueError(f"peer id {repr(peer_id)[:70]} is not an Ed25519 libp2p peer id")
    try:
        raw = b58decode(peer_id)
    except ValueError as e:
        raise ValueError(f"peer id {peer_id!r} is not base58") from e
    if len(raw) != 38 or raw[:2] != b"\x00\x24" or raw[2:6] != bytes([0x08, 1, 0x12, 32]):
        raise ValueError(f"peer id {peer_id!r} is not an Ed25519 libp2p peer id")
    return Ed25519PublicKey.from_public_bytes(raw[6:])


class Identity:
    def __init__(self, key: Ed25519PrivateKey) -> None:
        self.key = key
        self.public = key.public_key()
        self.peer_id = peer_id_of(self.public)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data)

    def libp2p_private_bytes(self) -> bytes:
        seed = self.key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return _pb_key(_KEYTYPE_ED25519, seed + _raw_public(self.public))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(self.libp2p_private_bytes())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ConfigError(
                f"identity={str(path)!r} cannot be read: {e}; create one with 'ddiloco keygen'"
            ) from e
        if len(data) != 68 or data[:4] != bytes([0x08, 1, 0x12, 64]):
            raise ConfigError(
                f"identity={str(path)!r} is not an Ed25519 libp2p private key file "
                "(expected 68 bytes written by 'ddiloco keygen')"
            )
        ident = cls(Ed25519PrivateKey.from_private_bytes(data[4:36]))
        if _raw_public(ident.public) != data[36:]:
            raise ConfigError(
                f"identity={str(path)!r} is corrupt: its public half does not match its private key"
            )
        return ident

    @classmethod
    def load_or_create(cls, path: str | Path) -> Identity:
        return cls.load(path) if Path(path).exists() else cls.generate().save(path) and cls.load(path)


def verify(peer_id: str, signature: bytes, data: bytes) -> bool:
    """True when ``signature`` over ``data`` was made by the key behind ``peer_id``."""
    try:
        public_key_of(peer_id).verify(signature, data)
        return True
    except (InvalidSignature, ValueError):
        return False
