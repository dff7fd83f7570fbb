"""Ed25519 identities and libp2p peer ids."""

import pytest

from dht.identity import Identity, b58decode, b58encode, public_key_of, verify
from protocol.errors import ConfigError


def test_peer_id_is_libp2p_ed25519_and_round_trips():
    ident = Identity.generate()
    assert ident.peer_id.startswith("12D3KooW") and len(ident.peer_id) == 52
    assert public_key_of(ident.peer_id) is not None
    assert b58decode(b58encode(b"\0\0abc")) == b"\0\0abc"


def test_signatures_bind_to_the_peer_id():
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"hello")
    assert verify(a.peer_id, sig, b"hello")
    assert not verify(a.peer_id, sig, b"hellO")
    assert not verify(b.peer_id, sig, b"hello")
    assert not verify("not-a-peer-id", sig, b"hello")


def test_save_load_and_bad_files(tmp_path):
    a = Identity.generate()
    p = a.save(tmp_path / "id.key")
    assert (p.stat().st_mode & 0o777) == 0o600
    assert Identity.load(p).peer_id == a.peer_id
    assert (
        Identity.load_or_create(tmp_path / "new.key").peer_id == Identity.load(tmp_path / "new.key").peer_id
    )
    (tmp_path / "bad.key").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="not an Ed25519"):
        Identity.load(tmp_path / "bad.key")
    with pytest.raises(ConfigError, match="cannot be read"):
        Identity.load(tmp_path / "missing.key")
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    (tmp_path / "flip.key").write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="corrupt"):
        Identity.load(tmp_path / "flip.key")
