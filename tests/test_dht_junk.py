"""Junk under the members key over real hivemind DHT processes: a stranger that stores
subkeys of mixed types or a plain value over the key. Honest DHT nodes refuse to store it (their validator)
and drop it when a peer returns it; a reader whose DHT holds junk anyway still reads the members."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from dht.identity import Identity
from dht.launch import OwnerValidator, start_dht
from dht.records import BUCKETS, Member, bucket_of, members_key, sign_member
from dht.swarm import Membership
from tests.dht_util import LOOPBACK

SWARM = "junk-swarm"


@contextlib.contextmanager
def _nodes(tmp, validators: bool) -> Iterator[list[tuple[Identity, object]]]:
    """Two honest DHT nodes (with our validator, or none) and a stranger's (never one), each publishing."""
    nodes = []
    try:
        for i in range(3):
            ident = Identity.generate()
            peers = [str(a) for a in nodes[0][1].get_visible_maddrs()] if nodes else []
            swarm = SWARM if validators and i < 2 else None
            nodes.append(
                (ident, start_dht(ident.save(tmp / f"{i}.key"), LOOPBACK, peers, timeout_s=30, swarm=swarm))
            )
        now = get_dht_time()
        for ident, dht in nodes[:2]:
            Membership(dht, SWARM, ident).publish(Member(ident.peer_id, (), "t", now, now + 120))
        yield nodes
    finally:
        for _, dht in nodes:
            dht.shutdown()


def _junk(stranger) -> None:
    """What the stranger stored in the issue: an int and a str subkey with one expiry, then a plain value
    over the key with an expiry it chose. Its own DHT node stores what it can (hivemind raises on the second
    subkey there); every DHT node of ours refuses all of it."""
    exp = get_dht_time() + 30
    for key in (members_key(SWARM, b) for b in range(BUCKETS)):  # every bucket
        for subkey in (1, "junk", "12D3KooWnotapeer"):
            with contextlib.suppress(TypeError):
                stranger.store(key, b"x", exp, subkey=subkey)
        with contextlib.suppress(TypeError):
            stranger.store(key, b"plain", get_dht_time() + 600)


def _peer_ids(view: Membership) -> list[str]:
    return [m.peer_id for m in view.live()[0]]


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_our_dht_nodes_refuse_junk_under_the_members_key_and_views_stay_whole(tmp_path):
    with _nodes(tmp_path, validators=True) as nodes:
        honest = sorted(ident.peer_id for ident, _ in nodes[:2])
        (a, dht_a), (b, dht_b), (stranger_id, stranger) = nodes
        _junk(stranger)
        views = [Membership(dht_a, SWARM, a, timeout_s=5), Membership(dht_b, SWARM, b, timeout_s=5)]
        for _ in range(3):  # read after read: each honest node sees both, nothing else, no failure
            for v in views:
                members, dropped = v.live()
                assert [m.peer_id for m in members] == honest and dropped == {}
            time.sleep(0.5)


def test_the_validator_judges_only_the_members_key():
    v = OwnerValidator(SWARM)
    ident = Identity.generate()
    now = get_dht_time()
    rec = sign_member(SWARM, ident, Member(ident.peer_id, (), "t", now, now + 60))
    key = DHTID.generate(source=members_key(SWARM, bucket_of(ident.peer_id))).to_bytes()
    elsewhere = DHTID.generate(source=members_key(SWARM, (bucket_of(ident.peer_id) + 1) % BUCKETS)).to_bytes()
    dumps = MSGPackSerializer.dumps

    def ok(subkey: bytes, value: bytes, k: bytes = key) -> bool:
        return v.validate(DHTRecord(k, subkey, value, now + 60))

    assert ok(dumps(ident.peer_id), dumps(rec))
    assert not ok(dumps(ident.peer_id), dumps(rec), elsewhere)  # a record in another bucket than its peer's
    assert not ok(dumps(None), dumps(b"plain"))  # a plain value over the key (hivemind's regular subkey)
    assert not ok(dumps(1), dumps(rec))  # an int subkey
    assert not ok(dumps("junk"), dumps(rec))  # a str that is not the record's peer
    assert not ok(dumps("x" * 65), dumps(rec))  # longer than any peer id
    assert not ok(b"\xc1", dumps(rec))  # not msgpack
    assert not ok(dumps(ident.peer_id), dumps(b"garbage"))
    other = DHTID.generate(source=members_key("another-swarm", bucket_of(ident.peer_id))).to_bytes()
    assert ok(dumps(1), dumps(b"anything"), other) and ok(dumps(None), b"x", other)  # not ours to judge


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_a_reader_whose_dht_holds_junk_still_reads_the_members(tmp_path):
    """DHT nodes without our validator (an older node, or one the stranger filled before it was fixed): the
    mixed subkeys break hivemind's get; the reader falls back to its own copy, read raw and filtered."""
    with _nodes(tmp_path, validators=False) as nodes:
        honest = sorted(ident.peer_id for ident, _ in nodes[:2])
        (a, dht_a), (b, dht_b), (_, stranger) = nodes
        exp = get_dht_time() + 30
        for dht in (dht_a, dht_b):  # junk in the honest nodes' own storage: an int and a str subkey
            for key in {members_key(SWARM, bucket_of(i.peer_id)) for i in (a, b)}:  # where their records are
                for subkey in (1, "junk"):
                    with contextlib.suppress(TypeError):
                        dht.store(key, b"x", exp, subkey=subkey)
        for ident, dht in ((a, dht_a), (b, dht_b)):
            members, dropped = Membership(dht, SWARM, ident, timeout_s=3).live()
            assert [m.peer_id for m in members] == honest, dropped
            assert "1" in dropped or "the DHT read failed" in dropped.get("", ""), dropped
