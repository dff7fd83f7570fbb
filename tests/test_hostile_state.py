"""Hostile members against the swarm's shared state, with real node processes and an attacker
that has its own identity, DHT and p2p daemon (this test process):

  * a forged merge record (right parent, matching new hash, a merged gradient of RMS 5) is refused as
    ``record_too_large`` and changes nothing; one that names a contribution of the receiver it never sent
    is refused as ``forged_record``;
  * a member publishing heads a thousand rounds ahead, with an all-zero snapshot to serve, is not followed:
    rounds keep merging on the honest nodes, nothing is fetched from it, and they end on one hash;
  * ``POST /control`` without the node's token is refused with 403 and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import stat
import threading
import time
from urllib.parse import urlparse

import pytest
import torch
from hivemind.utils import get_dht_time

from dht.identity import Identity
from dht.launch import SwarmUnreachable, start_dht
from dht.records import Member
from dht.swarm import Membership
from node.swarm.transport import Reply, Transport
from node.swarm.trust.receipts import make_receipt
from node.swarm.wire import (
    FragmentState,
    decode_snapshot,
    encode_record,
    encode_snapshot,
    pack_list,
    unpack_signed_contribution,
)
from protocol.config import ProtocolConfig
from protocol.hashing import tensors_hash
from protocol.merge import contribution_weight, outer_step
from protocol.messages import decode_contribution, peek_fragment
from protocol.replica import MergeRecord
from tests.swarm_util import TINY, Swarm, assert_eval_held, wait_until
from tests.test_wire_refusals import _contribution, _spec

pytestmark = pytest.mark.timeout(400)
SWARM = "ddiloco-local"


class Attacker:
    """A member of the swarm by its own signed record, with a transport of its own on a loop in a thread."""

    def __init__(self, tmp_path, bootstrap: list[str]) -> None:
        self.since = time.time()  # the attack's start, for ``assert_eval_held``
        self.ident = Identity.generate()
        self.dht = start_dht(
            self.ident.save(tmp_path / "bad.key"), ["/ip4/127.0.0.1/tcp/0"], bootstrap, timeout_s=30
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tr: Transport = self.run(self._transport())
        self.calls: dict[str, int] = {}

    async def _transport(self) -> Transport:
        return Transport(await self.dht.replicate_p2p(), timeout_s=20)

    def run(self, coro, timeout_s: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def publish(self, heads: dict | None = None) -> None:
        now = get_dht_time()
        m = Member(self.ident.peer_id, (), "ddiloco/0.3", now, now + 300, heads=heads or {})
        # Right after this DHT starts, the peer it stores to may refuse (no routing yet): SwarmUnreachable. That
        # is the set-up's weather, not the attack: try again for a while (one flaky full-suite run did).
        deadline = time.monotonic() + 30
        while True:
            try:
                Membership(self.dht, SWARM, self.ident).publish(m)
                return
            except SwarmUnreachable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)

    def serve(self, op: str, handler) -> None:
        async def counted(caller: str, raw: bytes) -> Reply:
            self.calls[op] = self.calls.get(op, 0) + 1
            return await handler(caller, raw)

        self.tr.register(op, counted)

    def call(self, peer: str, op: str, payload: bytes) -> Reply:
        return self.run(self.tr.call(peer, op, payload))

    def close(self) -> None:
        """Cancel what its server still runs (a handler that never answers), shut its daemon, close its loop.

        A handler task left pending on a stopped loop is destroyed by the garbage collector later, inside some
        other test: its ``writer.close()`` then raises on the closed loop, and the traceback that pytest
        formats for it (Python 3.11 parses the source line with ``ast``) once ran inside pytest's own
        ``ast.parse`` of a module and failed it with "AST constructor recursion depth mismatch"."""
        try:
            self.run(self._shutdown(), timeout_s=20)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if not self.thread.is_alive():
                self.loop.close()
            self.dht.shutdown()

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.tr.p2p.shutdown()
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
        assert not left, f"tasks still pending after the attacker's shutdown: {left}"


def _nodes_merging(swarm: Swarm, n: int, rounds: int) -> None:
    swarm.start_many(n)
    merged = lambda: all(s["fragments"][0]["round"] >= rounds for s in swarm.status().values())  # noqa: E731
    wait_until(merged, 120, "rounds merging")


@contextlib.contextmanager
def hostile_swarm(tmp_path, n: int, rounds: int):
    """``n`` real nodes merging ``rounds`` rounds, then an ``Attacker`` bootstrapped from node 0; both torn
    down (every node stopped, the attacker's daemon and loop closed) however the test ends."""
    swarm, bad = Swarm(tmp_path / "swarm"), None
    try:
        _nodes_merging(swarm, n, rounds)
        bad = Attacker(tmp_path, swarm.children[0].maddrs)
        yield swarm, bad
    finally:
        swarm.stop()
        if bad is not None:
            bad.close()


def every_fragment_merges(swarm: Swarm, rounds: int, what: str, timeout_s: float = 90) -> None:
    """Wait until every node holds every fragment ``rounds`` rounds past where the slowest node held it."""
    r0 = {p: min(s["fragments"][p]["round"] for s in swarm.status().values()) for p in range(4)}
    wait_until(
        lambda: all(
            s["fragments"][p]["round"] >= r0[p] + rounds for s in swarm.status().values() for p in range(4)
        ),
        timeout_s,
        f"every fragment merging {what}",
    )


def _paused_at_rest(swarm: Swarm, n: int) -> dict[int, dict]:
    for i in range(n):
        swarm.control(i, "pause")
    return swarm.settle()


def _forged(attacker: Attacker, st: FragmentState, grad: dict, contributors) -> bytes:
    cfg = ProtocolConfig()
    theta, _ = outer_step(st.theta, st.momentum, grad, cfg.outer_lr, cfg.outer_momentum)
    rec = MergeRecord(
        fragment=st.fragment,
        round=st.round + 1,
        parent_hash=st.hash,
        new_hash=tensors_hash(theta),
        contributors=tuple(contributors),
        grad=grad,
    )
    return encode_record(SWARM, rec, attacker.ident)


@pytest.mark.slow
def test_forged_merge_records_are_refused_and_change_nothing(tmp_path):
    swarm = Swarm(tmp_path / "swarm")
    bad = None
    try:
        _nodes_merging(swarm, 2, 3)
        before = _paused_at_rest(swarm, 2)
        bad = Attacker(tmp_path, swarm.children[0].maddrs)
        bad.publish()
        node0, node1 = swarm.children[0].peer_id, swarm.children[1].peer_id
        wait_until(lambda: bad.call(node0, "snapshot", b'{"fragments": [0]}').ok, 30, "the attacker admitted")
        spec = _spec()
        st = decode_snapshot(bad.call(node0, "snapshot", b'{"fragments": [0]}').body, spec)[0]
        # a small gradient, but credited to a contribution of node 0's that node 0 never sent: only node 0
        # can refute it, so it costs a point of score there, and is no evidence for the others
        small = {n: torch.randn(t.shape) * 1e-4 for n, t in st.theta.items()}
        late = int((time.time() + 3600) * 1000)  # after node 0's first contribution of this life: it knows
        theirs = [(node0, f"{node0[-10:]}:0:8:{late}", contribution_weight(2048, 8), 8, 2048)]
        forged = bad.call(node0, "record", _forged(bad, st, small, theirs))
        assert not forged.ok and forged.code == "forged_record", forged
        # the attack: a merged gradient of RMS 5 (over max_rms), its own work as the only contribution.
        # Any node can check that: node 0 bans its signer and hands the record to node 1, which bans it too
        huge = {n: torch.randn(t.shape) * 5 for n, t in st.theta.items()}
        own = [(bad.ident.peer_id, "bad:0:1", contribution_weight(2048, 8), 8, 2048)]
        reply = bad.call(node0, "record", _forged(bad, st, huge, own))
        assert reply.code == "record_too_large", reply
        wait_until(
            lambda: all(bad.ident.peer_id in s["guard"]["banned"] for s in swarm.status().values()),
            30,
            "both nodes banning the signer",
        )
        assert bad.call(node1, "record", _forged(bad, st, huge, own)).code == "banned"
        after = swarm.status()
        assert {s["model_hash"] for s in after.values()} == {before[0]["model_hash"]}
        assert after[0]["refused"].get("record_too_large", 0) >= 1
        assert after[0]["refused"].get("forged_record", 0) >= 1
        # each refusal cost the member that signed and pushed the record
        assert after[0]["guard"]["scores"].get(bad.ident.peer_id, 0) <= -2, after[0]["guard"]
        # the honest swarm trains on and agrees
        for i in range(2):
            swarm.control(i, "resume")
        r0 = after[0]["fragments"][0]["round"]
        wait_until(
            lambda: swarm.status()[0]["fragments"][0]["round"] >= r0 + 2, 120, "rounds after the attack"
        )
        final = swarm.settle()
        assert len({s["model_hash"] for s in final.values()}) == 1
        assert_eval_held(swarm, bad.since)
    finally:
        swarm.stop()
        if bad is not None:
            bad.close()


@pytest.mark.slow
def test_a_member_claiming_a_far_head_with_a_zero_snapshot_is_not_followed(tmp_path):
    swarm = Swarm(tmp_path / "swarm")
    bad = None
    try:
        _nodes_merging(swarm, 2, 2)
        bad = Attacker(tmp_path, swarm.children[0].maddrs)
        spec = _spec()
        zero = {
            p: FragmentState(
                p,
                10_000,
                tensors_hash({n: torch.zeros(s) for n, s in shapes.items()}),
                3,
                1e9,
                {n: torch.zeros(s) for n, s in shapes.items()},
                {n: torch.zeros(s) for n, s in shapes.items()},
            )
            for p, shapes in spec.items()
        }

        async def snapshot(caller: str, raw: bytes) -> Reply:
            frags = json.loads(raw)["fragments"]
            return Reply(True, body=encode_snapshot([zero[p] for p in frags]))

        async def records(caller: str, raw: bytes) -> Reply:
            return Reply(True, body=b"")

        bad.serve("snapshot", snapshot)
        bad.serve("records", records)
        self_heads = {str(p): [s.round, s.hash, s.n, s.weight] for p, s in zero.items()}
        bad.publish(self_heads)
        bad.run(bad.tr.start())
        start = swarm.status()
        r0 = min(s["fragments"][0]["round"] for s in start.values())
        # its lie, pushed as well: a record far ahead makes a node look for a way to catch up
        node0 = swarm.children[0].peer_id
        st = decode_snapshot(bad.call(node0, "snapshot", b'{"fragments": [0]}').body, spec)[0]
        ahead = FragmentState(0, 10_000 - 1, st.hash, 1, 1.0, st.theta, st.momentum)
        tiny = {n: torch.zeros_like(t) for n, t in st.theta.items()}
        own = [(bad.ident.peer_id, "bad:0:1", contribution_weight(2048, 8), 8, 2048)]
        bad.call(node0, "record", _forged(bad, ahead, tiny, own))
        # merging goes on (contributions are not routed to the liar) for several more rounds
        wait_until(
            lambda: all(s["fragments"][0]["round"] >= r0 + 4 for s in swarm.status().values()),
            180,
            "rounds merging beside the liar",
        )
        now = swarm.status()
        for s in now.values():
            assert all(f["round"] < 1000 for f in s["fragments"]), "a node followed the lie"
            assert bad.ident.peer_id not in {f["synchroniser"] for f in s["fragments"]}
        assert now[0]["refused"].get("untrusted_head", 0) >= 1
        assert bad.calls.get("snapshot", 0) == 0, bad.calls
        for i in range(2):
            from_liar = [
                e for e in swarm.events(i) if e["kind"] == "resync" and e["donor"] == bad.ident.peer_id
            ]
            assert not from_liar, f"node {i} installed the liar's snapshot: {from_liar}"
        final = swarm.settle()
        assert len({s["model_hash"] for s in final.values()}) == 1
        assert_eval_held(swarm, bad.since)
    finally:
        swarm.stop()
        if bad is not None:
            bad.close()


def _stop_the_liar_and_agree(
    swarm: Swarm, stop: threading.Event, liar: threading.Thread, since: float
) -> None:
    stop.set()
    liar.join(10)
    final = swarm.settle()
    assert len({s["model_hash"] for s in final.values()}) == 1
    assert_eval_held(swarm, since)


def _tear_down(swarm: Swarm, stop: threading.Event, bad: Attacker | None) -> None:
    stop.set()
    swarm.stop()
    if bad is not None:
        bad.close()


@pytest.mark.slow
def test_a_member_a_round_ahead_that_takes_no_contribution_does_not_stop_the_rounds(tmp_path):
    """Issue 31: three honest nodes and a member whose published head stays one round ahead of theirs (inside
    the slack a claim needs no backing for), so that it is the only member at the newest round and wins every
    election, while it serves no op at all. Each sender fails over from it on ``unknown_op``, names it dead to
    the next candidate, and the round is taken by an honest node: merging goes on, and the swarm agrees.
    Electing anyone (``--elect anyone``, as where an authority certifies synchronisers): in a public swarm a
    member whose work is never merged is not elected at all (``test_sybil_election.py``)."""
    swarm = Swarm(tmp_path / "swarm", TINY + ["--elect", "anyone"])
    bad = None
    stop = threading.Event()
    try:
        _nodes_merging(swarm, 3, 2)
        bad = Attacker(tmp_path, swarm.children[0].maddrs)
        spec = _spec()
        zero_hash = {
            p: tensors_hash({n: torch.zeros(s) for n, s in shapes.items()}) for p, shapes in spec.items()
        }

        def ahead() -> None:  # one round past the honest nodes' newest head, every second
            members = Membership(bad.dht, SWARM, bad.ident)
            while not stop.wait(1.0):
                honest = [m for m in members.live()[0] if m.peer_id != bad.ident.peer_id]
                heads = {
                    str(p): [max((m.head_round(p) for m in honest), default=0) + 1, zero_hash[p], 3, 1e9]
                    for p in spec
                }
                bad.publish(heads)

        bad.run(bad.tr.start())
        liar = threading.Thread(target=ahead, daemon=True)
        liar.start()
        wait_until(
            lambda: all(s["counters"]["failovers"] >= 1 for s in swarm.status().values()), 120, "failovers"
        )
        r0 = min(s["fragments"][0]["round"] for s in swarm.status().values())
        wait_until(
            lambda: all(s["fragments"][0]["round"] >= r0 + 4 for s in swarm.status().values()),
            120,
            "rounds merging beside the liar",
        )
        for i in range(3):
            failed_over = [
                e for e in swarm.events(i) if e["kind"] == "failover" and e["dead"] == bad.ident.peer_id
            ]
            assert failed_over, f"node {i} never elected the liar: the test did not test anything"
            merges = [e for e in swarm.events(i) if e["kind"] == "merge" and e["t"] > failed_over[0]["t"]]
            assert merges, f"node {i} merged nothing after it failed over from the liar"
        _stop_the_liar_and_agree(swarm, stop, liar, bad.since)
    finally:
        _tear_down(swarm, stop, bad)


@pytest.mark.slow
def test_a_contribution_naming_every_other_node_dead_is_taken_by_one_node_only(tmp_path):
    """Issue 31, the dead-peer list: one contribution sent to each of three nodes, each copy naming the other
    two dead. Each node the list would make the synchroniser pings the peers it names that stand before it
    in its own view; they answer, so it refuses the role, and only the node every view elects takes it: no
    node opens a round of its own, and no fork follows."""
    swarm = Swarm(tmp_path / "swarm")
    bad = None
    try:
        _nodes_merging(swarm, 3, 2)
        _paused_at_rest(swarm, 3)
        bad = Attacker(tmp_path, swarm.children[0].maddrs)
        bad.publish()
        time.sleep(2.0)  # the nodes' views take in its record
        # and agree on who holds fragment 0's role: the property is about views that agree (a node whose own
        # published record still lagged elected itself, as did another: two `ok`s, once in a full run)
        one = lambda: len({s["fragments"][0]["synchroniser"] for s in swarm.status().values()}) == 1  # noqa: E731
        wait_until(lambda: one() and one(), 30, "the nodes' views to agree on fragment 0's synchroniser")
        peers = {i: swarm.children[i].peer_id for i in range(3)}
        # A swarm at rest often rests with a round held open below its quorum (its synchroniser publishes the
        # lease); that round is starved, not stalled. Made so here: contributions to the synchroniser until it
        # holds one below its quorum of 2 (one it held already makes a quorum with the first), then far more
        # than two due periods with every learner paused. (Taken for stalled, its holder was passed over
        # unpinged by the others: two or three `ok`s, in CI and in 2 of 7 runs here.)
        frag0 = lambda i: swarm.status()[i]["fragments"][0]  # noqa: E731
        for _ in range(3):
            wait_until(lambda: one() and one(), 30, "the nodes' views to agree on fragment 0's synchroniser")
            holder = next(i for i, pid in peers.items() if pid == frag0(0)["synchroniser"])
            base = frag0(holder)["round"]
            assert bad.call(peers[holder], "contribute", _contribution(bad.ident, _spec(), base=base)).ok
            time.sleep(3.0)
            if frag0(holder)["round"] == base and frag0(holder)["collecting"]:
                break
        wait_until(lambda: all(frag0(i)["round"] == base for i in peers), 20, "every node at the held round")
        time.sleep(6.0)  # past four due periods
        assert frag0(holder)["round"] == base and frag0(holder)["collecting"]  # below its quorum: still open
        assert all(frag0(i)["synchroniser"] == peers[holder] for i in peers)
        t0 = time.time()
        _, raw, sig = unpack_signed_contribution(_contribution(bad.ident, _spec(), base=base))
        replies = {}
        for i, pid in peers.items():
            dead = sorted(q for j, q in peers.items() if j != i)
            replies[i] = bad.call(
                pid, "contribute", pack_list([json.dumps({"dead": dead}).encode(), raw, sig])
            )
        codes = sorted((r.ok, r.code) for r in replies.values())
        assert codes == [(False, "not_synchroniser"), (False, "not_synchroniser"), (True, "ok")], replies
        elected = {s["fragments"][0]["synchroniser"] for s in swarm.status().values()}
        taker = [i for i, r in replies.items() if r.ok]
        assert elected == {peers[taker[0]]}, (elected, taker)
        final = swarm.settle()
        assert len({s["model_hash"] for s in final.values()}) == 1
        assert_eval_held(swarm, bad.since)
        forks = [e for i in range(3) for e in swarm.events(i) if e["kind"] == "fork" and e["t"] > t0]
        assert not forks, forks
    finally:
        swarm.stop()
        if bad is not None:
            bad.close()


@pytest.mark.slow
def test_a_member_that_takes_rounds_and_never_merges_them_is_passed_over(tmp_path):
    """Issue 31, a round that never merges: a member that copies the honest nodes' newest heads into its own
    record (so it wins its share of elections), answers ``ok`` to every contribution (with the receipt a public
    swarm's synchroniser signs: ``node.swarm.trust.receipts``; without one it is passed over at once) and to pings,
    and never merges. Each sender watches the rounds it gave a contribution to; one not merged two due periods after
    its due moment makes the sender suspect the member (out of its elections) and send again, so the round
    goes to the next candidate, which knows the member stalled from its own watch. Every fragment keeps
    merging and the swarm ends on one hash. Electing anyone, as the test above."""
    swarm = Swarm(tmp_path / "swarm", TINY + ["--elect", "anyone"])
    bad = None
    stop = threading.Event()
    try:
        _nodes_merging(swarm, 3, 2)
        bad = Attacker(tmp_path, swarm.children[0].maddrs)
        newest, spec = {}, _spec()

        async def ok(caller: str, raw: bytes) -> Reply:
            return Reply(True)

        async def take(caller: str, payload: bytes) -> Reply:  # ok, and a receipt for the open round
            raw = unpack_signed_contribution(payload)[1]
            h = decode_contribution(raw, spec[peek_fragment(raw)], decode=False)[0]
            r, parent = newest.get(str(h.fragment), (0, ""))[:2]
            rc = make_receipt(SWARM, bad.ident, h.fragment, int(r) + 1, parent, h.learner, h.cid)
            return Reply(True, body=rc.packed())

        bad.serve("ping", ok)
        bad.serve("contribute", take)
        bad.run(bad.tr.start())

        def copy_heads() -> None:  # the newest honest head of each fragment, refreshed twice a heartbeat
            members = Membership(bad.dht, SWARM, bad.ident)
            while not stop.wait(0.25):
                honest = [m for m in members.live()[0] if m.peer_id != bad.ident.peer_id]
                heads = {}
                for m in honest:
                    for p, h in m.heads.items():
                        if p not in heads or int(h[0]) > int(heads[p][0]):
                            heads[p] = h
                newest.update(heads)
                bad.publish(heads)

        liar = threading.Thread(target=copy_heads, daemon=True)
        liar.start()
        wait_until(lambda: bad.calls.get("contribute", 0) >= 3, 120, "the member to be elected")
        # A round it takes that no view gave to another node as well: only that one stalls (unchecked,
        # there is no stall event, and the fragments it won froze for 45 to 65 s in a run)
        # (an honest synchroniser slowed by the machine's load can be found stalling first: wait for the member)
        stalled = lambda: any(  # noqa: E731
            e["kind"] == "stall" and e["peer"] == bad.ident.peer_id for i in range(3) for e in swarm.events(i)
        )
        wait_until(stalled, 120, "a round the member took and left unmerged")
        every_fragment_merges(swarm, 6, "beside the member")
        # each incident costs the fragment a bounded wait, then the round moves on: the sender found the round
        # stalled within two due periods of its due moment (at least two heartbeats; ``node.swarm.deadlines``),
        # and the fragment merged again within failover_s (6 s) of that on the sender's node (0.02-1.2 s in
        # three suite runs; 45-65 s freezes before the watch). Stalls after the last merge
        # checked here are left out: the test's end may come before their round.
        t_end = time.time()
        for i in range(3):
            events = swarm.events(i)
            merged_at = {
                p: [e["t"] for e in events if e["kind"] == "merge" and e["fragment"] == p] for p in range(4)
            }
            for s in (e for e in events if e["kind"] == "stall" and e["t"] < t_end - 10):
                after = [t for t in merged_at[s["fragment"]] if t > s["t"]]
                assert after and after[0] - s["t"] <= 6.0, (i, s, after[:1])
        stalls = [e for i in range(3) for e in swarm.events(i) if e["kind"] == "stall"]
        # the member is among those found stalling; an honest synchroniser slowed by the machine's load (two
        # test workers on 2 cores) can be found so once too (one of two stalls in a full-suite run), not more
        # often than the member
        mine = [e for e in stalls if e["peer"] == bad.ident.peer_id]
        assert mine and len(stalls) - len(mine) <= len(mine), stalls
        _stop_the_liar_and_agree(swarm, stop, liar, bad.since)
    finally:
        _tear_down(swarm, stop, bad)


def _post(url: str, body: bytes, token: str | None) -> int:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request("POST", "/control", body=body, headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.slow
def test_control_without_the_token_is_refused_and_changes_nothing(tmp_path):
    swarm = Swarm(tmp_path / "swarm", TINY + ["--eval-every-s", "3600"])
    try:
        swarm.start_many(1)
        c = swarm.children[0]
        token_file = c.state_dir / "control.token"
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        token = token_file.read_text().strip()
        # with the token, "evaluate" brings an evaluation forward (the next was due in an hour); without, 403
        wait_until(lambda: [e for e in swarm.events(0) if e["kind"] == "eval"], 60, "the first evaluation")
        t_asked = time.time()
        for action in ("stop", "pause", "evaluate"):
            body = json.dumps({"action": action}).encode()
            assert _post(c.url, body, None) == 403
            assert _post(c.url, body, "0" * len(token)) == 403
        assert _post(c.url, json.dumps({"action": "evaluate"}).encode(), token) == 200
        wait_until(
            lambda: [e for e in swarm.events(0) if e["kind"] == "eval" and e["t"] >= t_asked],
            60,
            "the evaluation asked for",
        )
        steps = swarm.status()[0]["learner"]["steps"]
        wait_until(
            lambda: swarm.status()[0]["learner"]["steps"] > steps + 5, 60, "the learner still training"
        )
        assert c.proc.poll() is None and not swarm.status()[0]["learner"]["paused"]
        assert _post(c.url, json.dumps({"action": "stop"}).encode(), token) == 200
        deadline = time.monotonic() + 60
        while c.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.proc.returncode == 0
    finally:
        swarm.stop()
