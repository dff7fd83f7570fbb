"""Golden bytes of every format that goes on the wire or is signed, stored in ``tests/golden``.

Each format is built here from a fixed instance: identities from fixed seeds, small tensors whose values the
int4 codec holds exactly, fixed times, counters and ids (Ed25519 signatures are deterministic). Per format the
tests check that (a) this commit encodes the instance to exactly the stored bytes, (b) decoding the stored
bytes gives back the instance's fields, its signature verified, and (c) where the decoder verifies a
signature (or a hash), one flipped byte of what it covers is refused with the project's error. A node of this
commit and one of the commit before it therefore read each other's messages byte for byte.

The stored files are written by ``tests/golden/make.py`` (this module's ``FORMATS``), and only when a format
changes on purpose: a new file breaks interoperability with nodes of the commit before (see
``tests/golden/README.md``).

Two things no API fixes, and how they are handled:

- safetensors (0.8) writes a blob's ``__metadata__`` keys in the order of a Rust ``HashMap``, which differs
  from one ``save`` to the next: the same contribution, record or snapshot comes out in one of several byte
  orders, each decoding alike. ``canonical`` puts those keys in sorted order (nothing else moves: the header
  keeps its length, the tensors their bytes); the stored blobs are canonical, and (a) compares canonical
  forms. A contribution's signature covers the bytes as sent, so it is made over the canonical bytes.
- the sealing nonce (``Admission.seal``) comes from ``os.urandom`` and a certificate's times from
  ``time.time`` (``dht.admission.admit``): the builders fix both with ``unittest.mock.patch``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dht.admission import Admission, AdmissionError, Certificate, admit
from dht.identity import Identity
from dht.records import Member, RecordError, parse_member, sign_member
from node.common.status_wire import MAX_REQUEST, decode_body, encode_frame, frame_size
from node.swarm.frames import header_size, parse_header, write_header
from node.swarm.sealed import SealedTransport
from node.swarm.transport import Reply
from node.swarm.trust.audit import PROOF_MESSAGES
from node.swarm.trust.audit_archive import parse_kept_request
from node.swarm.trust.receipts import make_receipt, omits, parse_retry, read_receipt
from node.swarm.wire import (
    FragmentState,
    decode_record,
    decode_snapshot,
    encode_record,
    encode_snapshot,
    pack_list,
    parse_records_request,
    parse_redirect,
    parse_snapshot_request,
    sign_contribution,
    unpack_list,
    unpack_signed_contribution,
    verify_contribution,
)
from protocol.codecs import encode_tensors
from protocol.errors import ConfigError, ProtocolError, RejectCode
from protocol.hashing import tensors_hash
from protocol.messages import ContributionHeader, contribution_id, decode_contribution, encode_contribution
from protocol.replica import MergeRecord
from protocol.schedule import RoundClock

GOLDEN = Path(__file__).parent / "golden"
SWARM = "golden"  # the public swarm of every format but the private swarm's
PRIVATE = "golden-private"
T0 = 1_700_000_000.0  # every time is T0 plus a few seconds


def _identity(name: str) -> Identity:
    return Identity(
        Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"ddiloco golden {name}".encode()).digest())
    )


LEARNER = _identity("learner")  # signs the contribution
SYNC = _identity("synchroniser")  # signs the record, the receipt, its membership records
AUTHORITY = _identity("authority")  # the private swarm's, signs the certificate
PEER = _identity("peer")  # a member the learner found dead: never signs
SECRET = hashlib.sha256(b"ddiloco golden swarm secret").digest()
NONCE_RPC, NONCE_DHT = bytes(range(12)), bytes(range(12, 24))  # the sealing nonces os.urandom would draw

SPEC = {0: {"w": (4, 3), "b": (3,)}, 1: {"e": (2, 2)}}
BLOCK = 4
# Blocks of 4 whose values are their block's max |x| times 0, 2^-6 .. 1: int4 (E3M0) codes them exactly.
DELTA = {
    "w": torch.tensor([[1.0, -0.5, 0.25], [-0.125, 0.5, 0.0625], [-1.0, 0.0, 2.0], [-1.0, 0.5, 0.03125]]),
    "b": torch.tensor([0.5, -0.25, 0.125]),
}
GRAD = {k: v / 4 for k, v in DELTA.items()}  # the record's merged outer gradient (exact too)
THETA_BEFORE = {"w": torch.arange(12.0).reshape(4, 3) / 16, "b": torch.arange(3.0) / 4}  # fragment 0, round 2
THETA = {"w": torch.arange(1.0, 13.0).reshape(4, 3) / 16, "b": torch.arange(1.0, 4.0) / 4}  # round 3
MOMENTUM = {"w": torch.full((4, 3), 0.125), "b": torch.tensor([0.25, -0.25, 0.5])}
THETA_1 = {"e": torch.arange(4.0).reshape(2, 2) / 8}  # fragment 1, round 5
MOMENTUM_1 = {"e": torch.tensor([[0.5, -0.5], [0.0, 1.0]])}
PARENT_HASH, NEW_HASH, HASH_1 = tensors_hash(THETA_BEFORE), tensors_hash(THETA), tensors_hash(THETA_1)

CID = contribution_id(LEARNER.peer_id, 0, 8, T0 + 12.5)
CID_LATER = contribution_id(LEARNER.peer_id, 0, 9, T0 + 13.0)  # receipted, and left out of the record
HEADER = ContributionHeader(LEARNER.peer_id, 0, 2, 8, 2048, 0.25, "int4", BLOCK, CID)
HEADER_INT2 = dataclasses.replace(HEADER, codec="int2")
DEAD = [PEER.peer_id]


# ------------------------------------------------------------------------------------------ safetensors order
def _dump(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def canonical(raw: bytes) -> bytes:
    """A safetensors blob with its ``__metadata__`` keys in sorted order; nothing else moves (the header keeps
    its length and padding, the tensors their bytes). safetensors writes those keys in an order that changes
    from one save to the next: this is one of the orders it writes."""
    n = int.from_bytes(raw[:8], "little")
    text = raw[8 : 8 + n].rstrip(b" ")
    header = json.loads(text)  # dicts keep the order read
    if _dump(header) != text:  # the header is the compact JSON it reads back as: sorting moves only keys
        raise ValueError("a safetensors header that JSON does not write back as it is")
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    return raw[:8] + _dump(header).ljust(n) + raw[8 + n :]


# ------------------------------------------------------------------------------------------------- builders
@functools.cache
def contribution() -> bytes:
    """protocol.messages.encode_contribution: the learner's message, int4, one fragment's tensors."""
    return canonical(encode_contribution(HEADER, encode_tensors(DELTA, "int4", BLOCK)))


def contribution_int2() -> bytes:
    """The same message in int2 (what a learner sends with ``--codec int2``): four codes a byte, the blocks'
    RMS as scales."""
    return canonical(encode_contribution(HEADER_INT2, encode_tensors(DELTA, "int2", BLOCK)))


@functools.cache
def contribution_sig() -> bytes:
    return sign_contribution(SWARM, LEARNER, contribution())


def contribute() -> bytes:
    """The ``contribute`` request as node.swarm.sender sends it: [routing header, message, signature]."""
    return pack_list([json.dumps({"dead": sorted(DEAD)}).encode(), contribution(), contribution_sig()])


def record_instance() -> MergeRecord:
    return MergeRecord(
        0,
        3,
        PARENT_HASH,
        NEW_HASH,
        ((LEARNER.peer_id, CID, 2.0, 8, 2048),),
        GRAD,
        codec="int4",
        block=BLOCK,
        wire=encode_tensors(GRAD, "int4", BLOCK),
        due=T0 + 10.0,
        period=0.3125,
        digests=(hashlib.sha256(contribution()).hexdigest(),),
        scales=(1.0,),
        share=1.0,
    )


@functools.cache
def record() -> bytes:
    """node.swarm.wire.encode_record: the synchroniser's signed merge record of fragment 0, round 3."""
    return canonical(encode_record(SWARM, record_instance(), SYNC))


def snapshot_instance() -> list[FragmentState]:
    credited = (LEARNER.peer_id,)
    return [
        FragmentState(
            0,
            3,
            NEW_HASH,
            1,
            2.0,
            THETA,
            MOMENTUM,
            2048,
            RoundClock(4, T0 + 10.3125, 0.3125),
            (CID,),
            credited,
        ),
        FragmentState(
            1,
            5,
            HASH_1,
            2,
            3.5,
            THETA_1,
            MOMENTUM_1,
            4096,
            RoundClock(6, T0 + 11.0, 0.5),
            ("a:1:2:3", "b:1:2:4"),
            credited,
        ),
    ]


def snapshot() -> bytes:
    """node.swarm.wire.encode_snapshot: both fragments' state, heads, clocks and replay memory."""
    return canonical(encode_snapshot(snapshot_instance()))


@functools.cache
def receipt() -> bytes:
    """node.swarm.trust.receipts.make_receipt(...).packed(): the synchroniser's receipt for the learner's later
    contribution, which the record of the same round and parent leaves out."""
    return make_receipt(SWARM, SYNC, 0, 3, PARENT_HASH, LEARNER.peer_id, CID_LATER).packed()


def omission() -> bytes:
    """The ``omission`` op's proof (node.swarm.trust.receipts.convict_omission): [record, receipt]."""
    return pack_list([record(), receipt()])


def proof() -> bytes:
    """The ``proof`` op's body (node.swarm.trust.audit.Auditor.convict_merge): [record, message, signature, ...]."""
    return pack_list([record(), contribution(), contribution_sig()])


def kept_request() -> bytes:
    """The ``kept`` request (node.swarm.trust.audit.Auditor.fetch_messages): the sha256 of the messages asked for."""
    return json.dumps({"digests": [hashlib.sha256(contribution()).hexdigest()]}).encode()


def kept_reply() -> bytes:
    """The ``kept`` reply (node.swarm.trust.audit.Auditor.on_kept): [message, signature, ...]."""
    return pack_list([contribution(), contribution_sig()])


@functools.cache
def records_request() -> bytes:
    """The ``records`` request (node.swarm.catch_up, node.swarm.trust.vetting)."""
    return json.dumps({"fragment": 0, "from": 3}).encode()


@functools.cache
def records_reply() -> bytes:
    """The ``records`` reply (node.swarm.replication.on_records): the signed records from that round."""
    return pack_list([record()])


def snapshot_request() -> bytes:
    """The ``snapshot`` request (node.swarm.catch_up._fetch_snapshot)."""
    return json.dumps({"fragments": [0, 1]}).encode()


def redirect() -> bytes:
    """The body of a ``not_synchroniser`` refusal (node.swarm.intake): the peer to try instead."""
    return json.dumps({"try": SYNC.peer_id}).encode()


def retry() -> bytes:
    """The body of a ``peer_busy`` refusal (node.swarm.trust.receipts.merging_here): how long to wait."""
    return json.dumps({"retry_s": round(0.2, 3)}).encode()


class _Writer:
    def __init__(self) -> None:
        self.out = bytearray()

    def write(self, data: bytes) -> None:
        self.out += data


def rpc_request_header() -> bytes:
    """node.swarm.transport: the frame header a caller writes before a ``records`` request's body."""
    w = _Writer()
    write_header(w, {"op": "records"}, records_request())
    return bytes(w.out)


def rpc_reply_header() -> bytes:
    """node.swarm.transport: the frame header a server writes before the ``records`` reply's body."""
    w = _Writer()
    write_header(w, {"ok": True, "code": "ok", "message": ""}, records_reply())
    return bytes(w.out)


def membership_instance() -> Member:
    return Member(
        SYNC.peer_id,
        (f"/ip4/192.0.2.1/tcp/31337/p2p/{SYNC.peer_id}",),
        "0.0.0-golden",
        T0 + 20.0,
        T0 + 50.0,
        tokens_per_s=8192.0,
        heads={"0": [3, NEW_HASH, 1, 2.0], "1": [5, HASH_1, 2, 3.5]},
        step=24,
        steps_per_s=4.0,
        leases={"0": 4},
    )


def membership() -> bytes:
    """dht.records.sign_member: the synchroniser's membership record in a public swarm."""
    return sign_member(SWARM, SYNC, membership_instance())


@functools.cache
def certificate() -> bytes:
    """dht.admission.admit: the authority's certificate admitting the synchroniser (times fixed)."""
    with tempfile.TemporaryDirectory() as d:
        doc = {"swarm": PRIVATE, "authority": AUTHORITY.peer_id, "open_learners": False}
        (Path(d) / "swarm.json").write_text(json.dumps(doc))
        AUTHORITY.save(Path(d) / "authority.key")
        with mock.patch("dht.admission.time.time", return_value=T0):
            cert = admit(d, SYNC.peer_id, days=30.0, role="any")
    return cert.to_json().encode()


def membership_private_instance() -> Member:
    m = membership_instance()
    return Member(**{**vars(m), "cert": certificate().decode(), "renounced": {"1": 6}})


@functools.cache
def membership_private() -> bytes:
    """dht.records.sign_member: the synchroniser's record in a private swarm, its certificate inside, a round
    renounced (the field a record has only then)."""
    return sign_member(PRIVATE, SYNC, membership_private_instance())


def admission() -> Admission:
    return Admission(PRIVATE, AUTHORITY.peer_id, SECRET, Certificate.from_json(certificate().decode()))


RPC_CONTEXT = f"req|records|{SYNC.peer_id}"  # node.swarm.sealed: a request for op, callee
DHT_CONTEXT = f"dht|{PRIVATE}|{SYNC.peer_id}"  # dht.swarm: a value for swarm, subkey


def _seal(data: bytes, context: str, nonce: bytes) -> bytes:
    with mock.patch("dht.admission.os.urandom", return_value=nonce):
        return admission().seal(data, context)


def sealed_request() -> bytes:
    """dht.admission.Admission.seal, as node.swarm.sealed seals a ``records`` request for the synchroniser."""
    return _seal(records_request(), RPC_CONTEXT, NONCE_RPC)


def sealed_membership() -> bytes:
    """dht.admission.Admission.seal, as dht.swarm seals a private swarm's membership record in the DHT."""
    return _seal(membership_private(), DHT_CONTEXT, NONCE_DHT)


PEER_SWARM = "ddiloco-local"  # the test swarm's (tests.swarm_util.Swarm), the default model of its nodes
PEER_CID = contribution_id(LEARNER.peer_id, 0, 8, T0 + 20.0)


def peer_contribute() -> bytes:
    """The ``contribute`` request the learner's node sends to fragment 0 of the test swarm's default model
    (``tests.test_wire_refusals._spec``) on base round 0: the stored message of an old-format peer that
    tests/test_old_format_peer.py sends to a node of this commit over the wire. Its outer gradient is small
    (a thousandth, int4), its counters one honest contribution's."""
    from tests.test_wire_refusals import _spec

    g = torch.Generator().manual_seed(7)
    delta = {n: 1e-3 * torch.randn(s, generator=g) for n, s in sorted(_spec()[0].items())}
    header = ContributionHeader(LEARNER.peer_id, 0, 0, 8, 2048, 0.1, "int4", 64, PEER_CID)
    raw = canonical(encode_contribution(header, encode_tensors(delta, "int4", 64)))
    return pack_list([json.dumps({"dead": []}).encode(), raw, sign_contribution(PEER_SWARM, LEARNER, raw)])


def status_request() -> bytes:
    """node.common.status_wire.encode_frame: a ``/ddiloco/status/1`` request carrying a certificate."""
    return encode_frame({"cert": certificate().decode()})


FORMATS = {
    "learner.key": LEARNER.libp2p_private_bytes,  # dht.identity: the key file p2pd reads too
    "synchroniser.key": SYNC.libp2p_private_bytes,
    "authority.key": AUTHORITY.libp2p_private_bytes,
    "contribution.bin": contribution,
    "contribution_int2.bin": contribution_int2,
    "contribute.bin": contribute,
    "record.bin": record,
    "snapshot.bin": snapshot,
    "receipt.bin": receipt,
    "omission.bin": omission,
    "proof.bin": proof,
    "kept_request.json": kept_request,
    "kept_reply.bin": kept_reply,
    "records_request.json": records_request,
    "records_reply.bin": records_reply,
    "snapshot_request.json": snapshot_request,
    "redirect.json": redirect,
    "retry.json": retry,
    "rpc_request_header.bin": rpc_request_header,
    "rpc_reply_header.bin": rpc_reply_header,
    "membership.json": membership,
    "membership_private.json": membership_private,
    "certificate.json": certificate,
    "sealed_request.bin": sealed_request,
    "sealed_membership.bin": sealed_membership,
    "status_request.bin": status_request,
    "peer_contribute.bin": peer_contribute,
}


# -------------------------------------------------------------------------------------------------- helpers
def stored(name: str) -> bytes:
    return (GOLDEN / name).read_bytes()


def flipped(raw: bytes, at: int) -> bytes:
    """``raw`` with the low bit of byte ``at`` flipped (a digit stays a digit, JSON stays JSON)."""
    return raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1 :]


def end_of(raw: bytes, part: bytes) -> int:
    """Where the last byte of ``part`` (found once in ``raw``) is: the digit a test flips."""
    assert raw.count(part) == 1, f"{part!r} is not in the stored bytes exactly once"
    return raw.index(part) + len(part) - 1


def sig_digit(raw: bytes, key: bytes = b'"sig":"') -> int:
    """Where the first decimal digit of the hex signature after ``key`` is (flipped, it stays hex)."""
    start = end_of(raw, key) + 1
    return next(i for i in range(start, start + 128) if raw[i : i + 1].isdigit())


def equal_tensors(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)


def refused(code: RejectCode, fn, *args):
    with pytest.raises(ProtocolError) as e:
        fn(*args)
    assert e.value.code is code, str(e.value)


# --------------------------------------------------------------------------------------------------- (a)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_this_commit_writes_the_stored_bytes(name):
    """Each format, built from its fixed instance, is byte for byte the file stored for it (safetensors
    blobs in their canonical metadata order, see the module's docstring)."""
    assert FORMATS[name]() == stored(name), f"{name} changed: see tests/golden/README.md before regenerating"


@pytest.mark.parametrize("name", ["contribution.bin", "record.bin", "snapshot.bin"])
def test_a_safetensors_blob_differs_from_its_canonical_form_only_in_metadata_order(name):
    """``canonical`` is one of the orders safetensors writes: same length, same header, same tensors."""
    raw = stored(name)
    fresh = {
        "contribution.bin": lambda: encode_contribution(HEADER, encode_tensors(DELTA, "int4", BLOCK)),
        "record.bin": lambda: encode_record(SWARM, record_instance(), SYNC),
        "snapshot.bin": lambda: encode_snapshot(snapshot_instance()),
    }[name]()
    assert len(fresh) == len(raw) and canonical(fresh) == raw == canonical(raw)
    n = int.from_bytes(raw[:8], "little")
    assert json.loads(fresh[8 : 8 + n]) == json.loads(raw[8 : 8 + n]) and fresh[8 + n :] == raw[8 + n :]


# ------------------------------------------------------------------------------------------- (b) and (c)
@pytest.mark.parametrize("name", ["learner.key", "synchroniser.key", "authority.key"])
def test_identity_key_file(name, tmp_path):
    """dht.identity: the libp2p protobuf private key file (``ddiloco keygen``, p2pd's identity) loads as the
    identity that signed every other format; a flipped bit of its public half is refused as corrupt."""
    ident = {"learner.key": LEARNER, "synchroniser.key": SYNC, "authority.key": AUTHORITY}[name]
    assert Identity.load(GOLDEN / name).peer_id == ident.peer_id and ident.peer_id.startswith("12D3KooW")
    (tmp_path / name).write_bytes(flipped(stored(name), 40))
    with pytest.raises(ConfigError, match="corrupt"):
        Identity.load(tmp_path / name)


def test_contribution_message():
    """protocol.messages: the contribution message decodes to its header and its tensors, exactly."""
    h, tensors = decode_contribution(stored("contribution.bin"), SPEC[0])
    assert h == HEADER and equal_tensors(tensors, DELTA)


def test_int2_contribution_message():
    """The int2 message decodes to each block's RMS times one of the four levels, the nearest to each value:
    [1, -0.5, 0.25, -0.125] has RMS 0.5863, and 1 takes the outer level, the rest the inner ones."""
    h, tensors = decode_contribution(stored("contribution_int2.bin"), SPEC[0])
    assert h == HEADER_INT2
    rms = (torch.tensor([1.0, 0.25, 0.0625, 0.015625]).sum() / 4).sqrt()
    want = rms * torch.tensor([1.5104, -0.4528, 0.4528, -0.4528])
    torch.testing.assert_close(tensors["w"].reshape(-1)[:4], want)


def test_contribute_request():
    """node.swarm.wire: the ``contribute`` request [routing, message, signature]; the learner's signature
    covers the whole message, bound to the swarm."""
    raw = stored("contribute.bin")
    dead, msg, sig = unpack_signed_contribution(raw)
    assert dead == set(DEAD) and msg == stored("contribution.bin") and sig == contribution_sig()
    verify_contribution(SWARM, LEARNER.peer_id, msg, sig)
    refused(RejectCode.BAD_SIGNATURE, verify_contribution, "another-swarm", LEARNER.peer_id, msg, sig)
    # the message's last byte (a tensor's), and one of its header (the base round: "base_round": 2)
    for at in (len(raw) - len(sig) - 4 - 1, end_of(raw, b'\\"base_round\\": 2')):
        _, msg, sig = unpack_signed_contribution(flipped(raw, at))
        refused(RejectCode.BAD_SIGNATURE, verify_contribution, SWARM, LEARNER.peer_id, msg, sig)


def test_merge_record():
    """node.swarm.wire: the signed merge record (fields, audit fields, schedule, int4 gradient); a flipped
    byte of its document, its gradient or its signature is refused ``bad_signature``."""
    raw = stored("record.bin")
    sr = decode_record(raw, SWARM, SPEC)
    want = record_instance()
    assert sr.signer == SYNC.peer_id and sr.head == [3, NEW_HASH, 1, 2.0]
    got = sr.record
    for f in (
        "fragment",
        "round",
        "parent_hash",
        "new_hash",
        "contributors",
        "codec",
        "block",
        "due",
        "period",
    ):
        assert getattr(got, f) == getattr(want, f), f
    assert (got.digests, got.scales, got.share) == (want.digests, want.scales, want.share)
    assert equal_tensors(dict(got.grad), GRAD)
    refused(RejectCode.BAD_SIGNATURE, decode_record, raw, "another-swarm", SPEC)
    for at in (end_of(raw, b'\\"round\\":3'), len(raw) - 1, sig_digit(raw)):
        refused(RejectCode.BAD_SIGNATURE, decode_record, flipped(raw, at), SWARM, SPEC)


def test_snapshot():
    """node.swarm.wire: the fragment snapshot (theta, momentum, head, clock, merged ids, credited); not
    signed, but each fragment's tensors must land on the hash its head claims."""
    raw = stored("snapshot.bin")
    got = decode_snapshot(raw, SPEC)
    want = snapshot_instance()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.fragment, g.round, g.hash, g.n, g.weight, g.tokens) == (
            w.fragment,
            w.round,
            w.hash,
            w.n,
            w.weight,
            w.tokens,
        )
        assert (g.clock, g.merged, g.credited) == (w.clock, w.merged, w.credited)
        assert equal_tensors(g.theta, w.theta) and equal_tensors(g.momentum, w.momentum)
    # the last tensor byte: the layout puts fragment 1's theta ("1/theta/e") last among the fp32 tensors
    n = int.from_bytes(raw[:8], "little")
    last = max(json.loads(raw[8 : 8 + n]).items(), key=lambda kv: kv[1].get("data_offsets", [0, 0])[1])[0]
    assert last.split("/")[1] == "theta", last
    with pytest.raises(ProtocolError, match="lands on") as e:
        decode_snapshot(flipped(raw, len(raw) - 1), SPEC)
    assert e.value.code is RejectCode.MALFORMED


def test_receipt():
    """node.swarm.trust.receipts: the synchroniser's signed receipt [document, signature]."""
    raw = stored("receipt.bin")
    rc = read_receipt(SWARM, SYNC.peer_id, raw)
    assert (rc.signer, rc.fragment, rc.round, rc.parent, rc.learner, rc.cid) == (
        SYNC.peer_id,
        0,
        3,
        PARENT_HASH,
        LEARNER.peer_id,
        CID_LATER,
    )
    refused(RejectCode.BAD_SIGNATURE, read_receipt, SWARM, LEARNER.peer_id, raw)  # another signer
    for at in (end_of(raw, b'"round":3'), len(raw) - 1):
        refused(RejectCode.BAD_SIGNATURE, read_receipt, SWARM, SYNC.peer_id, flipped(raw, at))


def test_omission_proof():
    """node.swarm.trust.receipts: the ``omission`` proof [record, receipt] proves the signer left a receipted
    contribution out; a flipped byte of either part is refused ``bad_signature``."""
    raw = stored("omission.bin")
    rec_raw, rc_raw = unpack_list(raw, max_items=2)
    sr = decode_record(rec_raw, SWARM, SPEC)
    assert omits(sr, read_receipt(SWARM, sr.signer, rc_raw))
    rec_bad, _ = unpack_list(flipped(raw, end_of(raw, b'\\"round\\":3')), max_items=2)
    refused(RejectCode.BAD_SIGNATURE, decode_record, rec_bad, SWARM, SPEC)
    _, rc_bad = unpack_list(flipped(raw, len(raw) - 1), max_items=2)
    refused(RejectCode.BAD_SIGNATURE, read_receipt, SWARM, sr.signer, rc_bad)


def test_audit_proof():
    """node.swarm.trust.audit: the ``proof`` [record, message, signature]: each message is the one the record's
    digest names and its learner signed."""
    raw = stored("proof.bin")
    items = unpack_list(raw, max_items=1 + 2 * PROOF_MESSAGES)
    sr = decode_record(items[0], SWARM, SPEC)
    (learner, cid, _, steps, tokens), (msg, sig) = sr.record.contributors[0], items[1:]
    assert hashlib.sha256(msg).hexdigest() == sr.record.digests[0]
    verify_contribution(SWARM, learner, msg, sig)
    h, _ = decode_contribution(msg, SPEC[0])
    assert (h.learner, h.cid, h.c_steps, h.c_tokens) == (learner, cid, steps, tokens)
    bad = unpack_list(flipped(raw, len(raw) - 1), max_items=3)  # the message's signature
    refused(RejectCode.BAD_SIGNATURE, verify_contribution, SWARM, learner, bad[1], bad[2])


def test_kept_request_and_reply():
    """node.swarm.trust.audit_archive / node.swarm.trust.audit: the ``kept`` request (digests) and its reply [message, signature]."""
    assert parse_kept_request(stored("kept_request.json")) == [hashlib.sha256(contribution()).hexdigest()]
    msg, sig = unpack_list(stored("kept_reply.bin"), max_items=2)
    assert hashlib.sha256(msg).hexdigest() == parse_kept_request(stored("kept_request.json"))[0]
    verify_contribution(SWARM, LEARNER.peer_id, msg, sig)


def test_requests_and_refusal_bodies():
    """node.swarm.wire / node.swarm.trust.receipts: the JSON bodies of the ``records`` and ``snapshot`` requests,
    the ``records`` reply (a list of signed records), and the bodies of ``not_synchroniser`` and
    ``peer_busy`` refusals."""
    assert parse_records_request(stored("records_request.json")) == (0, 3)
    assert [decode_record(r, SWARM, SPEC).record.round for r in unpack_list(stored("records_reply.bin"))] == [
        3
    ]
    assert parse_snapshot_request(stored("snapshot_request.json")) == [0, 1]
    assert parse_redirect(stored("redirect.json")) == SYNC.peer_id
    assert parse_retry(stored("retry.json")) == 0.2


def test_rpc_frame_headers():
    """node.swarm.transport: the frame headers (u32 length, JSON) before a request's and a reply's body."""
    for name, body, want in (
        ("rpc_request_header.bin", records_request(), {"op": "records"}),
        ("rpc_reply_header.bin", records_reply(), {"ok": True, "code": "ok", "message": ""}),
    ):
        raw = stored(name)
        assert header_size(raw[:4]) == len(raw) - 4
        assert parse_header(raw[4:], 1 << 20) == ({**want, "nbytes": len(body)}, len(body))


def test_membership_records():
    """dht.records: signed membership records, public and private (a certificate inside, a round renounced);
    a flipped byte is refused (``RecordError``: a record that does not verify is dropped from the view)."""
    for name, swarm, want in (
        ("membership.json", SWARM, membership_instance()),
        ("membership_private.json", PRIVATE, membership_private_instance()),
    ):
        raw = stored(name)
        assert parse_member(swarm, raw, T0 + 21.0) == want
        with pytest.raises(RecordError, match="signature does not match"):
            parse_member("another-swarm", raw, T0 + 21.0)
        with pytest.raises(RecordError, match="signature does not match"):
            parse_member(swarm, flipped(raw, end_of(raw, b'"step": 24')), T0 + 21.0)


def test_certificate():
    """dht.admission: the authority's certificate; a flipped byte is refused (``AdmissionError``, which drops
    the member from a private swarm's view and answers a status request ``not_admitted``)."""
    raw = stored("certificate.json")
    cert = Certificate.from_json(raw.decode())
    assert (cert.swarm, cert.peer_id, cert.role, cert.authority) == (
        PRIVATE,
        SYNC.peer_id,
        "any",
        AUTHORITY.peer_id,
    )
    assert (cert.issued_at, cert.expires_at) == (T0, T0 + 30 * 86400)
    cert.verify(PRIVATE, AUTHORITY.peer_id, SYNC.peer_id, T0 + 1.0)
    member = parse_member(PRIVATE, stored("membership_private.json"), T0 + 21.0)
    assert admission().check(member.peer_id, member.cert, T0 + 21.0) == cert
    bad = Certificate.from_json(flipped(raw, end_of(raw, b'"issued_at":1700000000')).decode())
    with pytest.raises(AdmissionError, match="not signed by the swarm authority"):
        bad.verify(PRIVATE, AUTHORITY.peer_id, SYNC.peer_id, T0 + 1.0)


def test_sealed_request():
    """node.swarm.sealed: a private swarm's request opens only for its op and callee; one flipped byte and
    it is refused ``not_admitted`` before any handler sees it."""

    class Inner:
        def __init__(self):
            self.handlers = {}

        def register(self, op, handler):
            self.handlers[op] = handler

    seen = []

    async def handler(caller, body):
        seen.append(body)
        return Reply(False, RejectCode.UNKNOWN_OP.value, "a refusal is not sealed")

    inner = Inner()
    SealedTransport(inner, admission(), SYNC.peer_id).register("records", handler)
    raw = stored("sealed_request.bin")
    assert raw[:12] == NONCE_RPC and admission().open(raw, RPC_CONTEXT) == stored("records_request.json")
    asyncio.run(inner.handlers["records"](LEARNER.peer_id, raw))
    assert seen == [stored("records_request.json")]
    with pytest.raises(ProtocolError) as e:
        asyncio.run(inner.handlers["records"](LEARNER.peer_id, flipped(raw, 20)))
    assert e.value.code is RejectCode.NOT_ADMITTED and len(seen) == 1


def test_sealed_membership():
    """dht.swarm / dht.admission: a private swarm's membership record as the DHT holds it, sealed for its
    swarm and subkey."""
    raw = stored("sealed_membership.bin")
    opened = admission().open(raw, DHT_CONTEXT)
    assert raw[:12] == NONCE_DHT and opened == stored("membership_private.json")
    assert parse_member(PRIVATE, opened, T0 + 21.0) == membership_private_instance()
    with pytest.raises(AdmissionError, match="not sealed with this swarm's key"):
        admission().open(flipped(raw, 20), DHT_CONTEXT)
    with pytest.raises(AdmissionError):
        admission().open(raw, f"dht|{PRIVATE}|{LEARNER.peer_id}")  # another subkey


def test_status_request():
    """node.common.status_wire: the ``/ddiloco/status/1`` request frame carrying the caller's certificate."""
    raw = stored("status_request.bin")
    assert frame_size(raw[:4], MAX_REQUEST) == len(raw) - 4
    doc = decode_body(raw[4:])
    assert admission().check(SYNC.peer_id, doc["cert"], T0 + 1.0) == Certificate.from_json(doc["cert"])
