"""Election by rendezvous hashing and the fork-choice rule."""

from collections import Counter

from protocol.election import candidates, fork_winner, synchroniser

PEERS = [f"peer{i}" for i in range(8)]


def test_every_node_derives_the_same_synchroniser_whatever_order_it_sees():
    a = synchroniser("run", 3, 17, PEERS)
    b = synchroniser("run", 3, 17, list(reversed(PEERS)))
    assert a == b and a in PEERS


def test_role_rotates_and_spreads_load():
    counts = Counter(synchroniser("run", p, r, PEERS) for p in range(24) for r in range(50))
    assert set(counts) == set(PEERS)
    assert max(counts.values()) < 2 * (24 * 50 / len(PEERS))


def test_failover_only_moves_the_dead_peers_rounds():
    before = {(p, r): synchroniser("run", p, r, PEERS) for p in range(4) for r in range(40)}
    dead = "peer3"
    after = {
        (p, r): synchroniser("run", p, r, [x for x in PEERS if x != dead])
        for p in range(4)
        for r in range(40)
    }
    for k in before:
        if before[k] != dead:
            assert after[k] == before[k]
        else:
            assert after[k] == candidates("run", *k, PEERS)[1]


def test_no_eligible_peer():
    assert synchroniser("run", 0, 0, []) is None


def test_fork_choice_is_deterministic_and_total():
    a, b = (3, 10.0, "ab"), (2, 99.0, "00")
    assert fork_winner(a, b) == 0 and fork_winner(b, a) == 1
    c, d = (3, 10.0, "ab"), (3, 10.0, "aa")
    assert fork_winner(c, d) == 1 and fork_winner(d, c) == 0
