"""A bootstrap node that lost its peers from the DHT's routing table gets them back (``Membership.relink``).

hivemind removes a peer from its routing table after one request to it times out. On a saturated link the
bootstrap node and its peers can lose each other both ways; nothing then makes either side call the other,
and the bootstrap node (no initial peers of its own) sees only its own record for the rest of the run. These
tests cut the tables of three real DHT processes the way such timeouts leave them and check that the view
stays cut until ``relink`` pings the lost peers, and is whole again after it.
"""

from __future__ import annotations

import time
import uuid

import pytest

from dht.identity import Identity
from dht.launch import SwarmUnreachable
from dht.records import Member
from dht.swarm import Membership, get_dht_time
from tests.dht_util import dht_chain


class _Forget:
    """Runs in a DHT process: drop the listed peers (all of them with ``None``) from its routing table."""

    def __init__(self, peer_ids: list[str] | None) -> None:
        self.peer_ids = peer_ids

    async def __call__(self, _dht, node) -> int:
        table = node.protocol.routing_table
        gone = 0
        for node_id, pid in list(table.uid_to_peer_id.items()):
            if self.peer_ids is None or pid.to_base58() in self.peer_ids:
                del table[node_id]
                gone += 1
        return gone


class _Known:
    """Runs in a DHT process: the peer ids in its routing table."""

    async def __call__(self, _dht, node) -> list[str]:
        return sorted(p.to_base58() for p in node.protocol.routing_table.uid_to_peer_id.values())


@pytest.fixture
def swarm3(tmp_path):
    """Three DHT nodes; the second and third bootstrap from the first. Yields [(identity, dht), ...]."""
    with dht_chain(tmp_path) as nodes:
        yield nodes


def _publish(ms: Membership, ident: Identity, ttl: float) -> None:
    now = get_dht_time()
    ms.publish(Member(ident.peer_id, ("/ip4/127.0.0.1/tcp/1",), "0.1.0", now, now + ttl))


def _seen(ms: Membership) -> set[str]:
    return {m.peer_id for m in ms.live()[0]}


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_a_cut_off_bootstrap_node_sees_its_peers_again_after_relink(swarm3):
    swarm = f"test-{uuid.uuid4().hex[:8]}"
    views = [Membership(dht, swarm, ident, timeout_s=10) for ident, dht in swarm3]
    ids = [ident.peer_id for ident, _ in swarm3]
    (_, d0), (_, d1), (_, d2) = swarm3
    assert set(d1.run_coroutine(_Known())) >= {ids[0]}

    # The tables as timeouts on a saturated link leave them: the bootstrap node knows nobody, and nobody
    # knows the bootstrap node.
    assert d0.run_coroutine(_Forget(None)) == 2
    for d in (d1, d2):
        assert d.run_coroutine(_Forget([ids[0]])) == 1
    assert d0.run_coroutine(_Known()) == []

    for ms, (ident, _) in zip(views, swarm3, strict=True):
        _publish(ms, ident, ttl=60)
    time.sleep(1.0)
    assert _seen(views[0]) == {ids[0]}  # cut off: its own record only
    assert _seen(views[1]) == _seen(views[2]) == {ids[1], ids[2]}
    assert views[0].relink([]) == []  # nothing asked, nothing done

    # A peer calls the bootstrap node (its initial peer): the ping it answers puts the caller back in its
    # table. Then the bootstrap node calls the peers it knows of (from earlier views or requests).
    assert views[1].relink([ids[0], ids[1]]) == [ids[0]]  # itself is skipped
    assert d0.run_coroutine(_Known()) == [ids[1]]
    assert views[1].relink([ids[0]]) == []  # linked already: no ping
    assert views[0].relink(ids) == [ids[2]]
    assert d0.run_coroutine(_Known()) == sorted(ids[1:])

    for ms, (ident, _) in zip(views, swarm3, strict=True):
        _publish(ms, ident, ttl=60)
    deadline = time.monotonic() + 20
    while _seen(views[0]) != set(ids) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _seen(views[0]) == set(ids)
    for ms in views[1:]:
        assert _seen(ms) == set(ids)


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_relink_skips_bad_ids_and_refuses_through_a_stopped_dht(swarm3, tmp_path):
    (i0, d0), (i1, _), _ = swarm3
    ms = Membership(d0, "test-relink", i0, timeout_s=10)
    assert ms.relink(["not-a-peer-id", i1.peer_id]) == []  # i1 is linked already; the bad id is skipped
    stranger = Identity.generate().peer_id  # valid id, no such peer anywhere
    assert ms.relink([stranger]) == []
    d0.shutdown()
    with pytest.raises(SwarmUnreachable, match="not running"):
        ms.relink([i1.peer_id])


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_relinking_2000_members_keeps_the_dht_process_answering(swarm3):
    (i0, d0), (i1, _), _ = swarm3
    ms = Membership(d0, f"test-{uuid.uuid4().hex[:8]}", i0, timeout_s=30)
    ids = [Identity.generate().peer_id for _ in range(2000)]
    # 2,000 peer ids in one message to the DHT process broke its command pipe (BlockingIOError, then no
    # later call answered); now at most RELINK_MAX are tried, RELINK_CHUNK to a message, the first always
    assert ms.relink(ids, first=[i1.peer_id]) == []  # i1 is linked already; the others run no DHT
    assert d0.is_alive()
    _publish(ms, i0, ttl=60)  # the process still answers: a write and a read
    assert _seen(ms) == {i0.peer_id}


def test_peer_ids_of_initial_peers():
    from dht.launch import peer_ids_of
    from protocol.errors import ConfigError

    pid = Identity.generate().peer_id
    assert peer_ids_of([f"/ip4/10.0.0.1/tcp/4001/p2p/{pid}", "/ip4/10.0.0.2/tcp/4001"]) == [pid]
    assert peer_ids_of([]) == []
    with pytest.raises(ConfigError, match="not a valid multiaddr"):
        peer_ids_of(["10.0.0.1:4001"])
