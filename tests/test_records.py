"""Signed membership records and the live view."""

import json
from dataclasses import replace

import pytest

from dht.identity import Identity
from dht.records import Member, RecordError, eligible, live_view, parse_member, sign_member


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


def test_live_view_drops_bad_and_misfiled_records():
    ids = [Identity.generate() for _ in range(3)]
    raws = {i.peer_id: sign_member("s", i, member(i)) for i in ids}
    raws[ids[0].peer_id] = sign_member("s", ids[1], member(ids[1]))  # stored in another's slot
    raws["junk"] = b"nope"
    live, dropped = live_view("s", raws, 101.0)
    assert [m.peer_id for m in live] == sorted(i.peer_id for i in ids[1:])
    assert set(dropped) == {ids[0].peer_id, "junk"}


def test_eligible_excludes_client_mode_and_stale_heads():
    ids = [Identity.generate() for _ in range(3)]
    ms = [
        member(ids[0], heads={"0": [5, "x"]}),
        member(ids[1], heads={"0": [4, "y"]}),
        replace(member(ids[2], heads={"0": [5, "x"]}), client_mode=True),
    ]
    assert eligible(ms, 0) == [ids[0].peer_id]
    assert eligible([ms[2]], 0) == []
