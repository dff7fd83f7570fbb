"""Signed membership records and the live view derived from them (docs/design.md, section 4, "Membership").

Each node refreshes its record every few seconds under the swarm's membership key, with a short expiration;
the live set is whatever has a valid, unexpired record. A record is canonical JSON signed with the node's
Ed25519 key, bound to the swarm id by a domain tag, and only counts when the signature matches the peer id it
names — a node cannot speak for another. Pure functions: time is passed in.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import zlib
from dataclasses import asdict, dataclass, field, replace

from dht.identity import Identity, verify

MAX_RECORD_BYTES = 8192
_DOMAIN = "ddiloco/membership/v1"
# A swarm's records are spread over this many DHT keys by their peer id: hivemind returns a key's whole
# dictionary to every lookup of it, a store's included, so with one key each heartbeat's write carried every
# member's record (2,000 members: 860 KB a lookup, from each DHT peer asked). A reader asks for every bucket
# in one traversal.
BUCKETS = 16


def bucket_of(peer_id: str) -> int:
    """The bucket of the members keys that holds ``peer_id``'s record."""
    return hashlib.sha256(peer_id.encode()).digest()[0] % BUCKETS


def members_key(swarm: str, bucket: int) -> str:
    """The DHT key of one bucket of a swarm's membership records, one subkey per member."""
    return f"{swarm}/members/{bucket}"


class RecordError(ValueError):
    """A record is malformed, unsigned, forged, expired or too large; the message says which."""


@dataclass(frozen=True)
class Member:
    peer_id: str
    addrs: tuple[str, ...]
    version: str
    issued_at: float
    expires_at: float
    tokens_per_s: float = 0.0
    client_mode: bool = False  # accepts no inbound connections: never elected synchroniser
    heads: dict[str, list] = field(default_factory=dict)  # fragment -> [round, hash, contributors, weight]
    step: int = 0  # the learner's inner step: a joining node starts its fragment schedule in phase with it
    steps_per_s: float = 0.0  # the learner's recent rate, to extrapolate ``step`` from ``issued_at``
    cert: str = ""  # private swarms: the admission certificate (JSON) the swarm authority signed
    leases: dict[str, int] = field(default_factory=dict)  # fragment -> round this node is collecting
    # fragment -> open round this node took and will not sign (``Receipts.renounce``): elect the next one
    renounced: dict[str, int] = field(default_factory=dict)

    def head_round(self, fragment: int) -> int:
        h = self.heads.get(str(fragment))
        return int(h[0]) if h else -1


# What a node stores in the DHT is its signed record packed (``pack_member``): raw deflate against a preset
# dictionary of the record's own keys and framing, behind the tag byte ``PACKED``. A record is stored on every
# member every heartbeat (at 8 members, 7 copies of 2.8 KB every 2 s from each node), and half of it is keys,
# addresses spelled twice and hex: packed, 1.27 KB. A record is signed unpacked (the signature and the golden
# bytes do not depend on zlib), and a plain signed record (JSON, first byte ``{``) still parses.
PACKED = b"Z"
_ZDICT = (
    b'", "/p2p/12D3KooW"], "cert": "", "client_mode": false, "expires_at": 1796637404.6, "heads": {"0": '
    b'[1234, "", 4, 1.0], "1": [1, "", 4, 4.0], "10": [1244, "", 3, 3.0]}, "issued_at": 1796637404.6, '
    b'"leases": {"0": 1}, "peer_id": "12D3KooW", "step": 5432, "steps_per_s": 2.13, "tokens_per_s": '
    b'12345.6, "version": "0.1.0"}, "sig": "'
)  # part of the wire format: a change to it is a new tag


def pack_member(raw: bytes) -> bytes:
    """A signed record (``sign_member``) as the DHT stores it: ``PACKED`` and its raw deflate."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_DEFAULT_STRATEGY, zdict=_ZDICT)
    return PACKED + c.compress(raw) + c.flush()


def unpack_member(raw: bytes) -> bytes:
    """The signed record in stored bytes, packed or plain; at most ``MAX_RECORD_BYTES`` unpacked (a deflate
    bomb is refused, not inflated). Raises RecordError."""
    if not raw.startswith(PACKED):
        return raw
    d = zlib.decompressobj(-15, zdict=_ZDICT)
    try:
        out = d.decompress(raw[1:], MAX_RECORD_BYTES + 1)
    except zlib.error as e:
        raise RecordError(f"packed membership record does not inflate: {e}") from e
    if len(out) > MAX_RECORD_BYTES or d.unconsumed_tail:
        raise RecordError(f"packed membership record inflates past {MAX_RECORD_BYTES} bytes")
    if not d.eof or d.unused_data:
        raise RecordError("packed membership record is truncated or has bytes after its end")
    return out


def _payload(swarm: str, m: Member) -> bytes:
    body = asdict(m)
    body["addrs"] = list(m.addrs)
    if not m.renounced:  # rare: a record without one reads (and verifies) as before it existed
        del body["renounced"]
    return (f"{_DOMAIN}|{swarm}|" + json.dumps(body, sort_keys=True, separators=(",", ":"))).encode()


def sign_member(swarm: str, ident: Identity, m: Member) -> bytes:
    if m.peer_id != ident.peer_id:
        raise RecordError(f"record names {m.peer_id}, but the key is {ident.peer_id}")
    payload = _payload(swarm, m)
    return json.dumps({"m": json.loads(payload.split(b"|", 2)[2]), "sig": ident.sign(payload).hex()}).encode()


_MAX_TIME = 1e12  # seconds since the epoch (year ~33,700), and the largest rate: products stay finite


def _finite(x: object, lo: float, hi: float) -> bool:
    return type(x) in (int, float) and lo <= x <= hi  # NaN fails both comparisons


def _check_types(m: Member) -> None:
    """The types and ranges a node writes. A signed record is its signer's claim, not a proof of shape: one
    with a NaN expiry (never expires), a string step or a head of the wrong shape must not reach the code
    that elects and schedules with it. Raises TypeError naming the field."""
    bad = []
    if not all(isinstance(x, str) for x in (m.peer_id, m.version, m.cert, *m.addrs)):
        bad.append("peer_id/version/cert/addrs must be strings")
    for f in ("issued_at", "expires_at"):
        if not _finite(getattr(m, f), -_MAX_TIME, _MAX_TIME):
            bad.append(f"{f}={getattr(m, f)!r:.40}")
    for f in ("tokens_per_s", "steps_per_s"):
        if not _finite(getattr(m, f), 0, _MAX_TIME):
            bad.append(f"{f}={getattr(m, f)!r:.40}")
    if type(m.client_mode) is not bool or type(m.step) is not int or m.step < 0:
        bad.append(f"client_mode={m.client_mode!r:.10} step={m.step!r:.40}")
    if not isinstance(m.heads, dict) or not all(_is_head(h) for h in m.heads.values()):
        bad.append(f"heads={m.heads!r:.80}")
    for f in ("leases", "renounced"):
        v = getattr(m, f)
        if not isinstance(v, dict) or not all(type(r) is int for r in v.values()):
            bad.append(f"{f}={v!r:.80}")
    if bad:
        raise TypeError("; ".join(bad))


def _is_head(h: object) -> bool:
    """[round, hash, contributors, weight], or a prefix of it (at least the round)."""
    if not isinstance(h, list) or not 1 <= len(h) <= 4:
        return False
    kinds = (
        lambda r: type(r) is int and r >= 0,
        lambda x: isinstance(x, str),
        lambda n: type(n) is int and n >= 0,
        lambda w: _finite(w, 0, sys.float_info.max),
    )
    return all(ok(x) for ok, x in zip(kinds, h))


VERIFIED_MAX = 8192  # records whose signature was checked, remembered by their bytes (per process)
_verified: dict[bytes, Member] = {}
_verified_lock = threading.Lock()


def parse_member(swarm: str, raw: bytes, now: float) -> Member:
    """Decode and verify one record. Raises RecordError with the reason.

    A record that verified once is remembered by a digest of its swarm and bytes (at most ``VERIFIED_MAX``,
    the oldest forgotten first): a view of thousands of members is read every heartbeat, and each read
    would otherwise check every signature again (0.24 ms each; 2,000 records took half a second of CPU per
    read in the DHT process and as much again here). Only the expiry is judged anew."""
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"record of {len(raw)} bytes exceeds {MAX_RECORD_BYTES}")
    tag = swarm.encode()
    digest = hashlib.blake2b(len(tag).to_bytes(8, "big") + tag + raw, digest_size=20).digest()
    m = _verified.get(digest)
    if m is None:
        m = _verify_member(swarm, unpack_member(raw))
        with _verified_lock:
            while len(_verified) >= VERIFIED_MAX:
                del _verified[next(iter(_verified))]
            _verified[digest] = m
    if m.expires_at <= now:
        raise RecordError(f"record of {m.peer_id} expired at {m.expires_at:.1f} (now {now:.1f})")
    return m


def _verify_member(swarm: str, raw: bytes) -> Member:
    try:
        doc = json.loads(raw)
        body, sig = doc["m"], bytes.fromhex(doc["sig"])
        if not isinstance(body["addrs"], list):
            raise TypeError(f"addrs is a {type(body['addrs']).__name__}, not a list")
        m = Member(**{**body, "addrs": tuple(body["addrs"])})
        _check_types(m)
    # RecursionError: JSON nested deeper than the parser's stack
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise RecordError(f"malformed membership record: {type(e).__name__}: {str(e)[:200]}") from e
    if not verify(m.peer_id, sig, _payload(swarm, m)):
        raise RecordError(f"signature does not match peer {m.peer_id[:80]} (forged, altered or other swarm)")
    return m


def live_view(
    swarm: str, raws: dict[str, bytes], now: float, admission=None
) -> tuple[list[Member], dict[str, str]]:
    """Valid members (sorted by peer id) from ``subkey -> record`` and the reason each other one was dropped.

    The DHT subkey must be the record's own peer id, so one peer cannot overwrite another's slot. With an
    ``admission`` (``dht.admission.Admission``, private swarms) a record must also carry a certificate that
    admits its peer, a ``learner``-role peer is seen as never electable (as if in client mode), and an
    ``observer``-role peer is dropped (it may read status, never take part).
    """
    members, dropped = [], {}
    for key, raw in raws.items():
        try:
            m = parse_member(swarm, raw, now)
        except RecordError as e:
            dropped[key] = str(e)
            continue
        if m.peer_id != key:
            dropped[key] = f"stored under {key} but signed by {m.peer_id}"
            continue
        if admission is not None:
            from dht.admission import AdmissionError

            try:
                cert = admission.check(m.peer_id, m.cert, now)
            except AdmissionError as e:
                dropped[key] = f"not admitted: {e}"
                continue
            if cert.role == "observer":  # reads status, never a member (``dht.admission``)
                dropped[key] = f"{m.peer_id} is admitted as an observer, not as a member"
                continue
            if cert.role == "learner" and not m.client_mode:
                m = replace(m, client_mode=True)
        members.append(m)
    return sorted(members, key=lambda m: m.peer_id), dropped


def eligible(members: list[Member], fragment: int) -> list[str]:
    """Peers that may synchronise ``fragment``: reachable (not client mode) and at most one round behind the
    newest published head. A published head lags its node by up to a heartbeat; where rounds come about
    as often as heartbeats, "the newest round only" left each node's view with a different set (the others'
    records a round stale, at different moments), each elected another synchroniser, and the test swarm of
    ``ddiloco up`` forked about 95 times in 15 s; with the round of slack, none. A candidate that really is a
    round behind has had the record pushed to it by the round's due moment, one period after the merge."""
    reachable = [m for m in members if not m.client_mode]
    if not reachable:
        return []
    newest = max(m.head_round(fragment) for m in reachable)
    return [m.peer_id for m in reachable if m.head_round(fragment) >= newest - 1]
