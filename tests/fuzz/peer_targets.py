"""Fuzz targets for membership records, the live view, admission certificates and sealed payloads (``dht``),
and the status endpoint's control requests (``node.swarm.status``; aiohttp parses the HTTP itself)."""

from __future__ import annotations

import functools
import json
import math
import random
from dataclasses import replace
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dht.admission import Admission, AdmissionError, Certificate
from dht.identity import Identity
from dht.records import Member, RecordError, live_view, parse_member, sign_member
from node.swarm import status
from tests.fuzz.harness import (
    BYTE_MUTATORS,
    NOW,
    SWARM,
    Target,
    dumps,
    ident,
    mutate_json_bytes,
    splicer,
)


# membership records ---------------------------------------------------------------------------------------
@functools.cache
def authority() -> Identity:
    return Identity(Ed25519PrivateKey.from_private_bytes(bytes(range(32, 64))))


def certificate_for(peer_id: str) -> Certificate:
    cert = Certificate(SWARM, peer_id, "any", NOW - 60, NOW + 3600, authority().peer_id)
    return replace(cert, sig=authority().sign(cert._payload()).hex())


@functools.cache
def admission() -> Admission:
    return Admission(SWARM, authority().peer_id, b"k" * 32, certificate_for(ident().peer_id))


def _member(**kw: Any) -> Member:
    return Member(ident().peer_id, ("/ip4/127.0.0.1/tcp/31337",), "0.1.0", NOW - 1, NOW + 10, **kw)


@functools.cache
def member_seeds() -> list[bytes]:
    full = _member(
        tokens_per_s=123.5,
        heads={"0": [3, "ab" * 32, 2, 7.5], "1": [0, "00" * 32, 0, 0.0]},
        step=40,
        steps_per_s=2.5,
        leases={"0": 4},
        cert=certificate_for(ident().peer_id).to_json(),
    )
    return [sign_member(SWARM, ident(), m) for m in (_member(), full, _member(client_mode=True))]


def resign_member(rng: random.Random, raw: bytes) -> bytes:
    doc = json.loads(raw)
    body = doc["m"]
    payload = f"ddiloco/membership/v1|{SWARM}|" + json.dumps(body, sort_keys=True, separators=(",", ":"))
    doc["sig"] = ident().sign(payload.encode("utf-8", "surrogatepass")).hex()
    return dumps(doc).encode("utf-8", "surrogatepass")


def _check_member(m: Member) -> None:
    assert isinstance(m.peer_id, str) and all(isinstance(a, str) for a in m.addrs)
    for f in ("issued_at", "expires_at", "tokens_per_s", "steps_per_s"):
        v = getattr(m, f)
        assert isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v), f"{f}={v!r}"
    assert m.expires_at > NOW, f"expired {m.expires_at}"
    assert type(m.step) is int and m.step >= 0 and type(m.client_mode) is bool
    for p, h in m.heads.items():
        assert isinstance(p, str) and isinstance(h, list) and h, f"head {p}: {h!r}"
        m.head_round(int(p)) if p.isdigit() else None
    for p, r in m.leases.items():
        assert type(r) is int, f"lease {p}: {r!r}"


MEMBER = Target(
    "member",
    member_seeds,
    lambda raw: parse_member(SWARM, raw, NOW),
    (RecordError,),
    _check_member,
    [mutate_json_bytes] * 6 + BYTE_MUTATORS,
    finish=resign_member,
    reasons=("exceeds", "malformed", "signature", "expired"),
)


def _live_seeds() -> list[dict[str, bytes]]:
    return [{ident().peer_id: raw, "other": member_seeds()[0]} for raw in member_seeds()]


def _mutate_live(rng: random.Random, raws: dict[str, bytes]) -> dict[str, bytes]:
    raws = dict(raws)
    k = rng.choice(sorted(raws))
    raws[k] = MEMBER.mutate(rng, raws[k])
    if rng.random() < 0.2:
        raws[rng.choice(["", "x" * 100, ident().peer_id + "x"])] = raws.pop(k)
    return raws


def _check_live(result: tuple[list[Member], dict[str, str]]) -> None:
    members, dropped = result
    for m in members:
        _check_member(m)
    assert all(isinstance(v, str) and v for v in dropped.values())


LIVE = Target(
    "live_view",
    _live_seeds,
    lambda raws: live_view(SWARM, raws, NOW, admission()),  # private swarm: certificates are checked too
    (),  # never raises: bad records are dropped with a reason
    _check_live,
    [_mutate_live],
    arbitrary=lambda rng: {rng.choice(["a", ident().peer_id]): rng.randbytes(rng.randrange(200))},
    describe=lambda r: f"{len(r[0])} kept, {len(r[1])} dropped",
)


# admission certificates and sealed payloads (private swarms) ---------------------------------------------
@functools.cache
def certificate_seeds() -> list[bytes]:
    return [certificate_for(ident().peer_id).to_json().encode()]


def resign_certificate(rng: random.Random, raw: bytes) -> bytes:
    """What the authority would sign: the (mutated) certificate with a fresh signature."""
    doc = json.loads(raw)
    doc.pop("sig", None)
    payload = "ddiloco/admission/v1|" + json.dumps(doc, sort_keys=True, separators=(",", ":"))
    doc["sig"] = authority().sign(payload.encode("utf-8", "surrogatepass")).hex()
    return dumps(doc).encode("utf-8", "surrogatepass")


def _check_certificate(cert: Certificate) -> None:
    assert cert.peer_id == ident().peer_id and cert.swarm == SWARM and cert.role in ("any", "learner")
    assert cert.issued_at - 300 <= NOW < cert.expires_at


CERTIFICATE = Target(
    "certificate",
    certificate_seeds,
    lambda raw: admission().check(ident().peer_id, raw.decode("utf-8", "replace"), NOW),
    (AdmissionError,),
    _check_certificate,
    [mutate_json_bytes] * 6 + BYTE_MUTATORS,
    finish=resign_certificate,
    reasons=(
        "malformed",
        "issued by",
        "not signed",
        "admits it to",
        "certificate names",
        "role",
        "valid from",
        "revoked",
        "no admission",
    ),
)

SEAL_CONTEXT = "req|contribute|fuzz"


@functools.cache
def sealed_seeds() -> list[bytes]:
    return [
        admission().seal(b"", SEAL_CONTEXT),
        admission().seal(b"\x00" * 64 + json.dumps({"dead": []}).encode(), SEAL_CONTEXT),
    ]


SEALED = Target(
    "sealed_payload",
    sealed_seeds,
    lambda raw: admission().open(raw, SEAL_CONTEXT),
    (AdmissionError,),
    lambda body: None,
    BYTE_MUTATORS + [splicer(sealed_seeds)],
    reasons=("too short", "not sealed"),
)


# status endpoint ------------------------------------------------------------------------------------------
@functools.cache
def control_seeds() -> list[bytes]:
    docs = [{"action": a} for a in ("pause", "resume", "stop")] + [{"action": "block", "peers": ["a", "b"]}]
    return [json.dumps(d).encode() for d in docs]


def _check_control(result: tuple[str, list[str]]) -> None:
    action, peers = result
    assert action in status.ACTIONS and all(isinstance(p, str) for p in peers)


CONTROL = Target(
    "status_control",
    control_seeds,
    status.parse_control,
    (status.BadRequest,),
    _check_control,
    [mutate_json_bytes] * 4 + BYTE_MUTATORS,
    reasons=("expected JSON", "unknown action", "peers"),
)
