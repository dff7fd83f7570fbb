"""Signed membership records and the live view."""

import json
from dataclasses import replace

import pytest

from dht.identity import Identity
from dht.records import (
    MAX_RECORD_BYTES,
    PACKED,
    Member,
    RecordError,
    eligible,
    live_view,
    pack_member,
    parse_member,
    sign_member,
)


def member(ident, now=100.0, **kw):
    return Member(ident.peer_id, ("/ip4/127.0.0.1/tcp/1",), "0.1.0", now, now + 10, **kw)


def test_round_trip_and_expiry():
    a = Identity.generate()
    raw = sign_member("s", a, member(a, heads={"0": [3, "ab"]}))
    m = parse_member("s", raw, now=105.0)
    assert m.peer_id == a.peer_id and m.head_round(0) == 3 and m.head_round(1) == -1
    with pytest.raises(RecordError, match="expired"):
        parse_member("s", raw, now=111.0)


def test_forged_altered_and_cross_swarm_records_are_refused():
    a, b = Identity.generate(), Identity.generate()
    with pytest.raises(RecordError, match="names"):
        sign_member("s", b, member(a))
    raw = json.loads(sign_member("s", a, member(a)))
    raw["m"]["tokens_per_s"] = 1e9
    with pytest.raises(RecordError, match="signature"):
        parse_member("s", json.dumps(raw).encode(), 101.0)
    with pytest.raises(RecordError, match="signature"):
        parse_member("other-swarm", sign_member("s", a, member(a)), 101.0)
    for junk in (b"", b"{}", b"\xff" * 10, b"x" * 9000):
        with pytest.raises(RecordError):
            parse_member("s", junk, 101.0)


def test_a_packed_record_is_under_half_a_full_ones_bytes_and_parses_as_the_plain_one():
    """What the DHT stores (``pack_member``): a record with 24 heads of 64-hex hashes and two addresses is
    2.8 KB signed, and under half that packed; it parses to the same member, and a plain record still does."""
    import os

    a = Identity.generate()
    heads = {str(p): [1000 + p, os.urandom(32).hex(), 4, 4.0] for p in range(24)}
    addrs = tuple(f"/ip4/10.201.0.{k}/tcp/4000{k}/p2p/{a.peer_id}" for k in range(2))
    m = replace(member(a, heads=heads, step=4321, steps_per_s=2.1, leases={"3": 1004}), addrs=addrs)
    plain = sign_member("s", a, m)
    packed = pack_member(plain)
    assert packed.startswith(PACKED) and len(plain) > 2700 and len(packed) < len(plain) / 2
    assert parse_member("s", packed, 101.0) == parse_member("s", plain, 101.0) == m
    with pytest.raises(RecordError, match="signature"):
        parse_member("other-swarm", packed, 101.0)


def test_a_packed_record_that_does_not_inflate_or_inflates_too_far_is_refused():
    import zlib

    a = Identity.generate()
    packed = pack_member(sign_member("s", a, member(a)))
    bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = PACKED + bomb.compress(b" " * (50 * MAX_RECORD_BYTES)) + bomb.flush()
    assert len(bomb) < MAX_RECORD_BYTES  # small stored, huge inflated
    cases = {
        packed[:-3]: "truncated",
        packed + b"tail": "after its end",
        PACKED + b"\xff" * 40: "does not inflate",
        bomb: "inflates past",
    }
    for raw, why in cases.items():
        with pytest.raises(RecordError, match=why):
            parse_member("s", raw, 101.0)


def test_live_view_drops_bad_and_misfiled_records():
    ids = [Identity.generate() for _ in range(3)]
    raws = {i.peer_id: sign_member("s", i, member(i)) for i in ids}
    raws[ids[0].peer_id] = sign_member("s", ids[1], member(ids[1]))  # stored in another's slot
    raws["junk"] = b"nope"
    live, dropped = live_view("s", raws, 101.0)
    assert [m.peer_id for m in live] == sorted(i.peer_id for i in ids[1:])
    assert set(dropped) == {ids[0].peer_id, "junk"}


def test_eligible_excludes_client_mode_and_heads_over_a_round_behind():
    ids = [Identity.generate() for _ in range(4)]
    ms = [
        member(ids[0], heads={"0": [5, "x"]}),
        member(ids[1], heads={"0": [4, "y"]}),  # a round behind: its record may predate its last apply
        replace(member(ids[2], heads={"0": [5, "x"]}), client_mode=True),
        member(ids[3], heads={"0": [3, "z"]}),
    ]
    assert eligible(ms, 0) == [ids[0].peer_id, ids[1].peer_id]
    assert eligible([ms[2]], 0) == []


def test_a_checked_signature_is_remembered_by_the_records_bytes_and_swarm(monkeypatch):
    import dht.records as records

    ident, checked = Identity.generate(), []
    real = records.verify
    monkeypatch.setattr(records, "verify", lambda *a: checked.append(1) or real(*a))
    raw = sign_member("s", ident, member(ident, now=1000.0))
    for _ in range(3):
        assert parse_member("s", raw, now=1000.0).peer_id == ident.peer_id
    assert len(checked) == 1  # one check for three reads of the same bytes
    with pytest.raises(RecordError, match="expired"):  # the expiry is judged on every read
        parse_member("s", raw, now=1e6)
    with pytest.raises(RecordError, match="signature"):  # the same bytes read for another swarm: checked
        parse_member("other", raw, now=1000.0)
    doc = json.loads(raw)
    doc["m"]["step"] = 7
    with pytest.raises(RecordError, match="signature"):  # other bytes: checked
        parse_member("s", json.dumps(doc).encode(), now=1000.0)
    assert len(checked) == 3
    monkeypatch.setattr(records, "VERIFIED_MAX", 2)  # full: the oldest is forgotten, and checked again
    others = [Identity.generate() for _ in range(2)]
    for o in others:
        parse_member("s", sign_member("s", o, member(o, now=1000.0)), now=1000.0)
    parse_member("s", raw, now=1000.0)
    assert len(checked) == 6


def test_a_renounced_round_travels_signed_and_a_record_without_one_reads_as_before():
    """``Member.renounced`` (``Receipts.renounce``): signed with the rest; left out of the signed bytes while
    empty, so a record that renounces nothing is the record a node wrote before the field existed."""
    a = Identity.generate()
    raw = sign_member("s", a, member(a, renounced={"3": 25}))
    assert parse_member("s", raw, now=105.0).renounced == {"3": 25}
    doc = json.loads(raw)
    doc["m"]["renounced"] = {"3": 26}  # altered: the signature no longer matches
    with pytest.raises(RecordError, match="signature"):
        parse_member("s", json.dumps(doc).encode(), now=105.0)
    plain = json.loads(sign_member("s", a, member(a)))
    assert (
        "renounced" not in plain["m"] and parse_member("s", json.dumps(plain).encode(), 105.0).renounced == {}
    )
    bad = sign_member("s", a, member(a, renounced={"3": "25"}))
    with pytest.raises(RecordError, match="renounced"):
        parse_member("s", bad, now=105.0)
