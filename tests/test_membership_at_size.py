"""Issue 31, membership at size: three real nodes in a swarm whose members keys hold 2,000 more valid,
signed membership records, kept fresh the way live members keep theirs (re-signed and stored again, all of
them, well within their lifetime). Every node's view takes them in, no DHT process dies, and the nodes keep
merging and end on one hash. Before the records were spread over bucket keys (``dht.records.BUCKETS``) and
their checked signatures remembered, each node's heartbeat write carried the whole crowd back from every DHT
peer it asked: the writes timed out, and views never took the crowd in."""

from __future__ import annotations

import threading
import time

import pytest
from hivemind.utils import get_dht_time

from dht.identity import Identity
from dht.launch import start_dht
from dht.records import Member, bucket_of, members_key, sign_member
from node.swarm.status import PEERS_LISTED
from tests.swarm_util import TINY, Swarm, assert_eval_held, wait_until
from tests.test_hostile_state import SWARM, _nodes_merging

pytestmark = pytest.mark.timeout(420)
CROWD = 2000
TTL_S = 120.0  # the nodes' --ttl-s: a swarm of thousands gives its records a longer life than the tests' 3 s
LIFE_S = 2 * TTL_S  # how long a crowd record counts in a view (``node.swarm.view.LIFETIME_TTLS`` x ttl_s)


class _StoreMany:  # a class, not a closure: DHT.run_coroutine pickles it to the DHT process
    """Runs in the DHT process: store a few membership records in one call; by peer id, whether each was
    taken. Kept to a few records: a message to hivemind's DHT process of tens of kilobytes is read
    before it has all arrived (BlockingIOError), and the process dies."""

    def __init__(self, records: list[tuple[str, bytes, Member]]) -> None:
        self.records = records

    async def __call__(self, _dht, node) -> dict[str, bool]:
        keys = [key for key, _, _ in self.records]
        stored = await node.store_many(
            keys,
            [raw for _, raw, _ in self.records],
            [m.expires_at for _, _, m in self.records],
            subkeys=[m.peer_id for _, _, m in self.records],
        )
        return {m.peer_id: bool(stored.get((key, m.peer_id))) for key, _, m in self.records}


class Crowd(threading.Thread):
    """``n`` members with no process behind them, whose records one DHT node stores and keeps fresh: every
    record is re-signed with a new issue time and stored again, 100 at a time, at half its life. One process
    does the work of 2,000 members here, so a cycle takes a minute or more on a loaded 2-core machine: the
    records are given the longest life a view lets them count for."""

    def __init__(self, dht, n: int) -> None:
        super().__init__(daemon=True)
        self.dht = dht
        # in bucket order, so that most calls of ``_StoreMany`` store under one key (one traversal)
        self.ids = sorted((Identity.generate() for _ in range(n)), key=lambda i: bucket_of(i.peer_id))
        self.stop, self.cycles, self.last_cycle_s, self.refused = threading.Event(), 0, 0.0, 0

    def _store(self, ids: list[Identity]) -> list[Identity]:
        """Store fresh records of ``ids``, 8 to a DHT call (``_StoreMany``) and 10 calls in flight; those the
        DHT did not take. One record a call took twice as long: the crowd's first cycle was most of this
        test's time."""
        failed, pending = [], []

        def collect(chunk, future) -> None:
            try:
                ok = future.result(timeout=60)
            except Exception:  # noqa: BLE001 - not taken: tried again
                ok = {}
            failed.extend(ident for ident in chunk if not ok.get(ident.peer_id))

        for k in range(0, len(ids), 8):
            if self.stop.is_set():
                return []
            now, chunk = get_dht_time(), ids[k : k + 8]
            records = []
            for ident in chunk:
                m = Member(ident.peer_id, (), "ddiloco/0.3", now, now + LIFE_S)
                records.append(
                    (members_key(SWARM, bucket_of(ident.peer_id)), sign_member(SWARM, ident, m), m)
                )
            pending.append((chunk, self.dht.run_coroutine(_StoreMany(records), return_future=True)))
            if len(pending) >= 10:
                collect(*pending.pop(0))
        for chunk, future in pending:
            collect(chunk, future)
        return failed

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            failed = self._store(self.ids)
            self.refused += len(failed)
            self._store(failed)  # once more, at once
            self.cycles, self.last_cycle_s = self.cycles + 1, time.monotonic() - t0
            self.stop.wait(max(0.0, LIFE_S / 2 - self.last_cycle_s))  # fresh again at half their life


def _rounds(swarm: Swarm, wait_s: float = 60) -> list[int] | None:
    """Per fragment, the lowest round any of the three nodes holds, each node's from its first status answer
    (waiting up to ``wait_s`` for all three; None if one never answered). A loaded machine lets a read miss
    one node's 5 s deadline now and then, so a read all three answered at once can be rare (a CI run found
    none in 60 s while every node answered some)."""
    deadline, first = time.monotonic() + wait_s, {}
    while len(first) < 3:
        for i, s in swarm.status().items():
            first.setdefault(i, [f["round"] for f in s["fragments"]])
        if len(first) < 3 and time.monotonic() >= deadline:
            return None
        time.sleep(0.5)
    return [min(r[p] for r in first.values()) for p in range(4)]


@pytest.mark.slow
def test_a_view_of_two_thousand_members_keeps_the_nodes_merging(tmp_path):
    swarm = Swarm(tmp_path / "swarm", TINY + ["--ttl-s", str(TTL_S)])
    dht = crowd = None
    try:
        _nodes_merging(swarm, 3, 2)
        dht = start_dht(
            Identity.generate().save(tmp_path / "crowd.key"),
            ["/ip4/127.0.0.1/tcp/0"],
            swarm.children[0].maddrs,
            timeout_s=30,
        )
        since = time.time()
        crowd = Crowd(dht, CROWD)
        crowd.start()
        wait_until(lambda: crowd.cycles >= 1, 240, "the crowd's records stored once")
        assert crowd.last_cycle_s < LIFE_S, f"one cycle of the crowd took {crowd.last_cycle_s:.0f} s"

        def views() -> list[int]:  # every node's view size (0 for a node whose status did not answer)
            st = swarm.status()
            return [st[i]["peer_count"] if i in st else 0 for i in range(3)]

        # 150 s: on a loaded machine (the other worker running a 5-node test) one CI run missed 60 s
        wait_until(lambda: min(views()) >= 3 + CROWD * 0.99, 150, "every node's view to take in the crowd")
        # a document counts the 2,000 and lists a few: this node and the synchronisers first
        for i, st in swarm.status().items():
            assert len(st["peers"]) == PEERS_LISTED, i
            assert st["peer_id"] in {p["peer_id"] for p in st["peers"]}
            assert {f["synchroniser"] for f in st["fragments"]} - {None} <= {
                p["peer_id"] for p in st["peers"]
            }
        # the crowd has no work merged: a robust round's quorum counts the three nodes (2 of 3; fewer for a
        # moment where one's work was not merged lately), not 1,503 of the 2,003 records (rounds that waited a
        # period each missed the 120 s below on a loaded machine)
        for i, st in swarm.status().items():
            assert all(f["quorum"] <= 2 for f in st["fragments"]), (i, st["fragments"])
        r0 = _rounds(swarm)
        assert r0 is not None, "a node's status did not answer within 60 s"
        # each node's rounds as its latest status read gave them: a read one node missed (a full CI run: the
        # rounds merged on at 1 per fragment every 10 s, while reads that all three answered at once were
        # too rare for the 120 s) still counts for the nodes that answered
        latest: dict[int, list[int]] = {}

        def advanced() -> bool:
            for i, s in swarm.status().items():
                latest[i] = [f["round"] for f in s["fragments"]]
            return len(latest) == 3 and all(min(r[p] for r in latest.values()) >= r0[p] + 3 for p in range(4))

        wait_until(advanced, 120, "every fragment merging beside a crowd of 2,000 members")
        assert all(c.proc.poll() is None for c in swarm.children.values())
        crowd.stop.set()
        crowd.join(timeout=90)
        final = swarm.settle()
        assert len({s["model_hash"] for s in final.values()}) == 1
        assert_eval_held(swarm, since)
        for i in range(3):
            log = swarm.children[i].log.read_text(errors="replace")
            for dead in ("EOFError", "BlockingIOError", "DHT process is not running"):
                assert dead not in log, log[-2000:]
    finally:
        if crowd is not None:
            crowd.stop.set()
            crowd.join(timeout=90)
        swarm.stop()
        if dht is not None:
            dht.shutdown()
