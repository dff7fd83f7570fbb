"""Private swarms: an authority key admits peer ids; a swarm secret seals what members exchange
(docs/design.md, section 5).

``ddiloco swarm init`` writes a swarm folder: the authority's Ed25519 key, a 32-byte secret and
``swarm.json`` (the swarm's name and the authority's peer id). ``ddiloco swarm admit PEER_ID`` signs a
``Certificate``: swarm, peer id, role, issue and expiry times. A node of a private swarm is configured with
the authority's peer id, the secret and its own certificate, and then

- publishes its certificate inside its signed membership record; a record whose certificate does not
  verify (another authority, another swarm, another peer id, expired, revoked) is dropped from the view, so
  its peer can neither be elected nor be heard: every RPC checks the caller's authenticated peer id (from
  the libp2p handshake) against the view;
- seals DHT record values and every RPC payload with AES-256-GCM under a key derived from the secret
  (HKDF-SHA256), bound to what the bytes are for (the DHT key and subkey, or the op and direction), so an
  outsider can neither read the membership nor write a record, a contribution or a state request members
  accept;
- drops peers listed in the revocation file (one peer id per line, re-read when it changes).

A swarm made with ``--open-learners`` (the hybrid that volunteer computing projects run) admits anyone as
a learner: a member without a certificate is in every view as a ``learner`` (it trains and contributes, is
never elected, and a merge record it signs is refused), while synchronisers hold certificates. Nothing is
sealed there (anyone may join, so a secret would be no secret), and the robust merge is on
(``protocol.robust``): its learners are not trusted.

Role ``learner`` admits a peer that trains and contributes but is never elected synchroniser. Role
``observer`` admits a tool, not a node: it may read a member's status over libp2p (``ddiloco status
--peer``), but its membership records are dropped from every view, so it is never elected, its
contributions and state requests are refused (``unknown_peer``), and a node refuses to start with it.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dht.identity import Identity, public_key_of, verify
from protocol.errors import ConfigError, DDiLoCoError

_DOMAIN = "ddiloco/admission/v1"
ROLES = ("any", "learner", "observer")


class AdmissionError(DDiLoCoError):
    """A peer is not admitted to this private swarm, or sealed bytes do not open; the message says why."""


@dataclass(frozen=True)
class Certificate:
    swarm: str
    peer_id: str
    role: str
    issued_at: float
    expires_at: float
    authority: str
    sig: str = ""

    def _payload(self) -> bytes:
        body = {k: v for k, v in asdict(self).items() if k != "sig"}
        return (f"{_DOMAIN}|" + json.dumps(body, sort_keys=True, separators=(",", ":"))).encode()

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Certificate:
        try:
            doc = json.loads(text)
            cert = cls(**doc)
            for name in ("swarm", "peer_id", "role", "authority", "sig"):
                if not isinstance(getattr(cert, name), str) or len(getattr(cert, name)) > 256:
                    raise TypeError(f"{name} is not a string of at most 256 characters")
            for name in ("issued_at", "expires_at"):  # float() let "123" through, to fail in verify()
                if type(getattr(cert, name)) not in (int, float) or not math.isfinite(
                    float(getattr(cert, name))
                ):
                    raise TypeError(
                        f"{name} is not a finite number"
                    )  # float() of a 400-digit int: OverflowError
        # RecursionError: JSON nested deeper than the parser's stack (a certificate is any member's to write)
        except (ValueError, TypeError, RecursionError, OverflowError) as e:
            raise AdmissionError(
                f"malformed admission certificate: {type(e).__name__}: {str(e)[:200]}"
            ) from e
        return cert

    def verify(self, swarm: str, authority: str, peer_id: str, now: float) -> None:
        """Raise AdmissionError unless this certificate admits ``peer_id`` to ``swarm`` at ``now``."""
        if self.authority != authority:
            raise AdmissionError(
                f"certificate of {self.peer_id} was issued by {self.authority}, not {authority}"
            )
        try:
            ok = verify(authority, bytes.fromhex(self.sig), self._payload())
        except ValueError:
            ok = False
        if not ok:
            raise AdmissionError(f"certificate of {self.peer_id} is not signed by the swarm authority")
        if self.swarm != swarm:
            raise AdmissionError(
                f"certificate of {self.peer_id} admits it to swarm {self.swarm!r}, not {swarm!r}"
            )
        if self.peer_id != peer_id:
            raise AdmissionError(f"certificate names {self.peer_id}, but the record is {peer_id}'s")
        if self.role not in ROLES:
            raise AdmissionError(f"certificate of {peer_id} has unknown role {self.role!r}")
        if not self.issued_at - 300 <= now < self.expires_at:
            raise AdmissionError(
                f"certificate of {peer_id} is valid from {self.issued_at:.0f} to {self.expires_at:.0f} (now {now:.0f})"
            )


# ------------------------------------------------------------------------------------------- the authority
def init_swarm(folder: str | Path, swarm: str, open_learners: bool = False) -> dict:
    """Create a swarm folder: authority key, secret (none with ``open_learners``: nothing is sealed),
    swarm.json and an empty revocation list."""
    d = Path(folder)
    if (d / "swarm.json").exists():
        raise ConfigError(f"{d}/swarm.json exists: this folder already holds a swarm (choose another --dir)")
    d.mkdir(parents=True, exist_ok=True)
    authority = Identity.generate()
    authority.save(d / "authority.key")
    if not open_learners:
        fd = os.open(d / "secret.key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(os.urandom(32).hex() + "\n")
    doc = {"swarm": swarm, "authority": authority.peer_id, "open_learners": open_learners}
    (d / "swarm.json").write_text(json.dumps(doc, indent=1) + "\n")
    (d / "revoked.txt").touch()
    return doc


def _swarm_doc(folder: str | Path) -> dict:
    p = Path(folder) / "swarm.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p} cannot be read ({e}); create the swarm with 'ddiloco swarm init'") from e


def _check_peer_id(peer_id: str) -> None:
    try:
        public_key_of(peer_id)
    except ValueError as e:
        raise ConfigError(f"peer id {peer_id!r} is invalid: {e}") from e


def admit(folder: str | Path, peer_id: str, days: float = 365.0, role: str = "any") -> Certificate:
    """Sign a certificate admitting ``peer_id`` (checked to be an Ed25519 libp2p peer id)."""
    _check_peer_id(peer_id)
    if role not in ROLES:
        raise ConfigError(f"role={role!r} is invalid: choose one of {', '.join(ROLES)}")
    if days <= 0:
        raise ConfigError(f"days={days} is invalid: must be > 0")
    doc = _swarm_doc(folder)
    authority = Identity.load(Path(folder) / "authority.key")
    now = time.time()
    cert = Certificate(doc["swarm"], peer_id, role, now, now + days * 86400, authority.peer_id)
    return Certificate(**{**asdict(cert), "sig": authority.sign(cert._payload()).hex()})


def revoke(folder: str | Path, peer_id: str) -> Path:
    _check_peer_id(peer_id)
    p = Path(folder) / "revoked.txt"
    _swarm_doc(folder)
    listed = set(p.read_text().split()) if p.exists() else set()
    if peer_id not in listed:
        with open(p, "a") as fh:
            fh.write(peer_id + "\n")
    return p


# ------------------------------------------------------------------------------------------- a member
class Admission:
    """A node's view of its swarm: who is admitted, and the sealing key (None: an open-learners swarm, not
    sealed). ``certificate``: this node's (None: an open learner)."""

    def __init__(
        self,
        swarm: str,
        authority: str,
        secret: bytes | None,
        certificate: Certificate | None,
        revoked_file: str = "",
        open_learners: bool = False,
    ) -> None:
        self.open_learners = open_learners
        if open_learners and secret is not None:
            raise ConfigError("an open-learners swarm is not sealed: give no swarm secret")
        if not open_learners and (secret is None or certificate is None):
            raise ConfigError("a private swarm needs its secret and this node's certificate")
        if secret is not None and len(secret) < 16:
            raise ConfigError(
                "the swarm secret must be at least 16 bytes (use the file 'ddiloco swarm init' wrote)"
            )
        self.swarm, self.authority, self.certificate = swarm, authority, certificate
        self._aead = None
        if secret is not None:
            self._aead = AESGCM(
                HKDF(
                    algorithm=hashes.SHA256(), length=32, salt=None, info=f"{_DOMAIN}|seal|{swarm}".encode()
                ).derive(secret)
            )
        self.revoked_file = revoked_file
        self._revoked: frozenset[str] = frozenset()
        self._revoked_mtime = -1.0

    @property
    def sealed(self) -> bool:
        return self._aead is not None

    @classmethod
    def load(
        cls,
        swarm: str,
        authority: str,
        secret_file: str,
        certificate_file: str,
        revoked_file: str = "",
        open_learners: bool = False,
    ) -> Admission:
        secret = cert = None
        if secret_file:
            try:
                secret = bytes.fromhex(Path(secret_file).read_text().strip())
            except (OSError, ValueError) as e:
                raise ConfigError(f"swarm_secret={secret_file!r} cannot be read as a hex secret: {e}") from e
        if certificate_file:
            try:
                cert = Certificate.from_json(Path(certificate_file).read_text())
            except OSError as e:
                raise ConfigError(f"certificate={certificate_file!r} cannot be read: {e}") from e
            except AdmissionError as e:
                raise ConfigError(f"certificate={certificate_file!r}: {e}") from e
        return cls(swarm, authority, secret, cert, revoked_file, open_learners)

    @classmethod
    def from_settings(cls, s) -> Admission:
        """From a node's settings (``node.swarm.settings.NodeSettings``: authority, swarm_secret, certificate,
        revoked, open_learners)."""
        return cls.load(s.swarm, s.authority, s.swarm_secret, s.certificate, s.revoked, s.open_learners)

    def check_own(self, peer_id: str) -> None:
        if self.certificate is None:  # an open learner (the constructor refused it elsewhere)
            return
        try:
            self.certificate.verify(self.swarm, self.authority, peer_id, time.time())
        except AdmissionError as e:
            raise ConfigError(f"this node's certificate does not admit it: {e}") from e
        if self.certificate.role == "observer":
            raise ConfigError(
                f"this node's certificate admits {peer_id} as an observer, which reads status but is never a "
                "member; admit it with --role any or learner to run a node"
            )

    def revoked(self) -> frozenset[str]:
        if self.revoked_file:
            try:
                m = os.stat(self.revoked_file).st_mtime
                if m != self._revoked_mtime:
                    self._revoked = frozenset(Path(self.revoked_file).read_text().split())
                    self._revoked_mtime = m
            except OSError:
                pass  # a missing list revokes nobody new; the last one read still holds
        return self._revoked

    def check(self, peer_id: str, cert_json: str, now: float) -> Certificate:
        """The certificate that admits ``peer_id``; AdmissionError with the reason otherwise."""
        if peer_id in self.revoked():
            raise AdmissionError(f"{peer_id} is revoked")
        if not cert_json and self.open_learners:  # anyone may learn; only a certificate synchronises
            return Certificate(self.swarm, peer_id, "learner", 0.0, math.inf, self.authority)
        if not cert_json:
            raise AdmissionError(f"{peer_id} presents no admission certificate")
        cert = Certificate.from_json(cert_json)
        cert.verify(self.swarm, self.authority, peer_id, now)
        return cert

    def seal(self, data: bytes, context: str) -> bytes:
        if self._aead is None:
            raise ConfigError("this swarm is not sealed (open learners)")
        nonce = os.urandom(12)
        return nonce + self._aead.encrypt(nonce, data, context.encode())

    def open(self, data: bytes, context: str) -> bytes:
        if self._aead is None:
            raise ConfigError("this swarm is not sealed (open learners)")
        if len(data) < 28:
            raise AdmissionError(f"sealed {context} is {len(data)} bytes: too short to be sealed")
        try:
            return self._aead.decrypt(data[:12], data[12:], context.encode())
        except InvalidTag:
            raise AdmissionError(f"{context} is not sealed with this swarm's key") from None
