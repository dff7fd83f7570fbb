"""What a node checks of another's merge record and of a published head, unit by unit:
``FragmentReplica.check_record``, ``OwnCids`` (contributions of ours a record may name) and
``SwarmView.credible`` (a head far ahead needs the rest of the swarm's word)."""

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hivemind.utils import get_dht_time

from dht.identity import Identity
from dht.records import Member
from node.swarm.replication import Replication
from node.swarm.sender import OwnCids
from node.swarm.signed_files import SignedFiles
from node.swarm.transport import Reply
from node.swarm.trust.audit import Auditor
from node.swarm.trust.fence import ElectionFence
from node.swarm.trust.work_book import WorkBook
from node.swarm.view import HEAD_SLACK, SwarmView
from node.swarm.wire import decode_record, encode_record
from protocol.config import ProtocolConfig
from protocol.errors import ProtocolError
from protocol.merge import contribution_weight
from protocol.messages import contribution_id, sender_tag
from protocol.replica import FragmentReplica
from protocol.synchroniser import Contribution, Merge
from tests.trust_util import trust_of

CFG = ProtocolConfig(fragments=1, sync_every=4, overlap=0, record_codec="fp32")


def _replica() -> FragmentReplica:
    return FragmentReplica(0, {"w": torch.randn(16, 16, generator=torch.Generator().manual_seed(0))}, False)


def _record(rep: FragmentReplica, scale: float = 1e-3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    delta = {"w": torch.randn(16, 16, generator=g) * scale}
    c = Contribution("a", 0, rep.round, 4, 400, 1.0, delta, f"a:0:{seed}")
    return rep.make_record(rep.round + 1, [c], CFG)


def _check(rep, rec) -> str:
    with pytest.raises(ProtocolError) as e:
        rep.check_record(rec, CFG)
    return e.value.code.value


def test_an_honest_record_passes_and_forged_ones_are_refused_by_their_codes():
    maker, checker = _replica(), _replica()
    rec = _record(maker)
    checker.check_record(rec, CFG)  # an honest merge passes
    huge = replace(rec, grad={"w": rec.grad["w"] * 0 + 5.0})  # the attack: RMS 5
    assert _check(checker, huge) == "record_too_large"
    nan = replace(rec, grad={"w": rec.grad["w"] * float("nan")})
    assert _check(checker, nan) == "record_too_large"
    assert _check(checker, replace(rec, contributors=())) == "forged_record"
    learner, cid, w, steps, tokens = rec.contributors[0]
    inflated = replace(
        rec, contributors=((learner, cid, w * 100, steps, tokens),)
    )  # a weight it did not earn
    assert _check(checker, inflated) == "forged_record"
    assert _check(checker, replace(rec, contributors=((learner, cid, w, 0, tokens),))) == "forged_record"
    assert contribution_weight(tokens, steps) == pytest.approx(w)


def test_an_honest_round_far_above_the_recent_ones_passes_and_one_beyond_the_learners_bound_does_not():
    rep = _replica()
    for seed in range(4):  # quiet rounds (a warm-up), then one 300x larger: measured in a parity run
        rec = _record(rep, scale=1e-6, seed=seed + 1)
        rep.check_record(rec, CFG)
        rep.apply_record(rec, CFG)
    rep.check_record(_record(rep, scale=3e-4, seed=9), CFG)
    for learner in ("a", "b", "c"):  # the learners' typical outer gradient: RMS 1e-4
        rep.norms.add(learner, 1e-4)
    honest = _record(rep, scale=1e-4, seed=10)
    rep.check_record(honest, CFG)
    beyond = replace(honest, grad={"w": honest.grad["w"] * CFG.refuse_factor * 2})  # no merge clips it so
    assert _check(rep, beyond) == "record_too_large"


def test_own_cids_refute_only_what_this_life_knows_it_never_sent():
    me = "12D3KooW" + "x" * 44
    own = OwnCids(me, keep=3)
    mine = f"{me[-10:]}:0:"
    assert not own.refutes(mine + "5")  # nothing sent yet in this life: cannot tell
    for step in (10, 11, 12):
        own.add(mine + str(step))
    assert not own.refutes(mine + "11")
    assert own.refutes(mine + "13") and own.refutes(mine + "999")
    assert not own.refutes(mine + "9")  # before this life's first: sent before a restart, perhaps
    own.add(mine + "14")  # 10 falls out of the kept window: no longer refutable
    assert not own.refutes(mine + "10") and own.refutes(mine + "13")
    assert own.refutes("someone-else:0:12") and own.refutes(mine + "notastep")


def test_a_node_restored_from_an_older_checkpoint_neither_repeats_ids_nor_disowns_its_old_ones():
    """A node killed at step 120 and restored from its checkpoint at step 100 steps through 101-120 again.
    Its ids carry the moment each step ended, so the new ones differ from the old (not replays of merged
    contributions) and records naming the old ones are not called forged."""
    me = "12D3KooW" + "y" * 44
    first = OwnCids(me)
    before = [contribution_id(me, 3, step, 1000.0 + 0.5 * step) for step in range(101, 121)]
    for cid in before:
        first.add(cid)
    restarted = OwnCids(me)  # the next life: 10 s later, from step 100 again
    after = [contribution_id(me, 3, step, 1070.0 + 0.5 * step) for step in range(101, 121)]
    assert not set(before) & set(after)
    for cid in after[:5]:
        restarted.add(cid)
    assert not any(restarted.refutes(cid) for cid in before)  # its records from before the restart
    assert not any(restarted.refutes(cid) for cid in after[:5])
    assert restarted.refutes(contribution_id(me, 3, 106, 2000.0))  # after this life's first: it would know


def _member(pid: str, round_: int) -> Member:
    now = get_dht_time()
    return Member(pid, (), "v", now, now + 5, heads={"0": [round_, "h", 1, 1.0]})


def test_a_head_far_ahead_is_credible_only_with_the_majoritys_word():
    node = SimpleNamespace(peer_id="me", replicas=[SimpleNamespace(round=10)], voters=lambda p, ms: ms)
    node.backed = lambda p, pid, r, ms, vs=None: SwarmView.backed(node, p, pid, r, ms, vs)
    credible = lambda pid, r, ms: SwarmView.credible(node, 0, pid, r, ms)  # noqa: E731
    liar = {"liar": _member("liar", 1010), "a": _member("a", 11), "b": _member("b", 12)}
    assert not credible("liar", 1010, liar)
    assert credible("a", 11, liar) and credible("b", 10 + HEAD_SLACK, liar)
    # this node fell behind (a restart): the others agree they are far ahead, so it follows them
    behind = {"a": _member("a", 50), "b": _member("b", 51), "c": _member("c", 49)}
    assert credible("b", 51, behind) and credible("a", 50, behind)
    # one other member only: nobody else to ask, the claimant is believed
    assert credible("a", 500, {"a": _member("a", 500)})
    # members that publish no head of the fragment hold nothing to vouch with: they do not outvote the one
    # that does (two such records kept a node that fell behind from ever following the swarm again)
    now = get_dht_time()
    bare = {q: Member(q, (), "v", now, now + 5) for q in ("x", "y")}
    assert credible("b", 51, {**behind, **bare}) and credible(
        "a", 50, {"a": _member("a", 50), "c": _member("c", 49), **bare}
    )
    assert not credible("liar", 1010, {**liar, **bare})


def test_a_lone_node_on_another_chain_yields_to_the_majority_but_not_to_a_liar():
    rec = lambda h: SimpleNamespace(record=SimpleNamespace(new_hash=h))  # noqa: E731
    node = SimpleNamespace(
        peer_id="me",
        replicas=[SimpleNamespace(round=20)],
        heads=[(20, "mine20", 1, 1.0)],
        logs=[{14: rec("mine14"), 15: rec("mine15")}],
        head_key=lambda h: (-int(h[0]), str(h[1])),
        voters=lambda p, ms: ms,
    )
    node.backed = lambda p, pid, r, ms, vs=None: SwarmView.backed(node, p, pid, r, ms, vs)
    outvoted = lambda ms: SwarmView.outvoted(node, 0, ms)  # noqa: E731

    def member(pid: str, r: int, h: str) -> Member:
        now = get_dht_time()
        return Member(pid, (), "v", now, now + 5, heads={"0": [r, h, 1, 1.0]})

    # the other two merged rounds of their own while this node raced ahead: it takes their head, once two
    # of them hold it
    split = {"a": member("a", 15, "theirs15"), "b": member("b", 15, "theirs15")}
    head, holders = outvoted(split)
    assert head[:2] == [15, "theirs15"] and holders == ["a", "b"]
    assert outvoted({"a": member("a", 15, "theirs15"), "b": member("b", 14, "theirs14")}) == (None, [])
    # a member a round past them, alone on a head of its own (an all-zero state behind it): not yielded to
    liar = {**split, "liar": member("liar", 16, "zero")}
    assert outvoted(liar)[0][:2] == [15, "theirs15"]
    assert outvoted({"a": split["a"], "liar": liar["liar"]}) == (None, [])
    # the same two merely behind on this node's own chain: they catch up by records, nothing to yield
    assert outvoted({"a": member("a", 15, "mine15"), "b": member("b", 14, "mine14")}) == (None, [])
    # this node's head is backed (one of the others is near it): no yielding, whatever a third claims
    assert outvoted({"a": member("a", 19, "x"), "liar": member("liar", 5, "zero")}) == (None, [])
    # one other member only: nobody to outvote this node
    assert outvoted({"a": member("a", 15, "theirs15")}) == (None, [])


def _public_view(round_: int, head: str, credited: list[str], processes: set[str]) -> SimpleNamespace:
    """A public swarm's view at fragment 0's round ``round_`` (its head named ``head``) whose chain credits
    ``credited`` and whose DHT routing table holds ``processes``: ``SwarmView``'s own majority methods."""
    work = WorkBook()
    if credited:
        work.settle(tags=[sender_tag(q) for q in credited])  # as a snapshot's credits come: known at once
    node = SimpleNamespace(
        peer_id="me",
        replicas=[SimpleNamespace(round=round_)],
        heads=[(round_, head, 1, 1.0)],
        logs=[{}],
        head_key=lambda h: (-int(h[0]), str(h[1])),
        settings=SimpleNamespace(elect_workers=True),
        syncs=[SimpleNamespace(due_every=1.0)],
        work=work,
        logged_learners=set,
        membership=SimpleNamespace(processes=frozenset(processes)),
    )
    node.workers = lambda p, ms: SwarmView.workers(node, p, ms)
    node.voters = lambda p, ms: SwarmView.voters(node, p, ms)
    node.backed = lambda p, pid, r, ms, vs=None: SwarmView.backed(node, p, pid, r, ms, vs)
    return node


def test_identities_with_neither_work_nor_a_process_are_not_counted_in_a_majority_of_heads():
    """Issue 32, item 4: whether a head far ahead is believed (``credible``) and whether a node yields its
    chain (``outvoted``) is a majority of members' heads. 32 signed records with no process and no work
    behind them, echoing a hostile worker's head, are not counted where the node knows its chain's workers:
    nor made an honest head unbelievable, nor made the node yield to the hostile member's fork. A member with
    a process behind it counts though not credited (fresh honest nodes on a chain of their own still
    outvote a lone node); where the node cannot tell workers yet, every record counts, as before."""

    def member(pid: str, r: int, h: str) -> Member:
        now = get_dht_time()
        return Member(pid, (), "v", now, now + 5, heads={"0": [r, h, 1, 1.0]})

    honest, bad = ["peer-honest-aaaa", "peer-honest-bbbb"], "peer-hostile-hhhh"
    sybils = [f"peer-sybil-{i:05d}" for i in range(32)]
    table = {*honest, bad}
    # behind by 4 rounds: the two honest heads are believed, whatever 33 records of a stale head say
    ms = {q: member(q, 14, "h14") for q in honest} | {q: member(q, 10, "h10") for q in [bad, *sybils]}
    node = _public_view(10, "h10", [*honest, bad], table)
    assert SwarmView.credible(node, 0, honest[0], 14, ms)
    assert not SwarmView.credible(_public_view(10, "h10", [], table), 0, honest[0], 14, ms)  # cannot tell
    # on our chain at 20 with one honest member; the hostile one and its 32 echoes on a fork at 16: no yield
    ms = {honest[0]: member(honest[0], 20, "mine20")} | {q: member(q, 16, "fork16") for q in [bad, *sybils]}
    node = _public_view(20, "mine20", [honest[0], bad], table)
    assert SwarmView.outvoted(node, 0, ms) == (None, [])
    # the same echoes with processes behind them count: the node yields to the majority's head, as it does
    # before it can tell workers
    node = _public_view(20, "mine20", [honest[0], bad], table | set(sybils))
    assert SwarmView.outvoted(node, 0, ms)[0][:2] == [16, "fork16"]
    assert SwarmView.outvoted(_public_view(20, "mine20", [], table), 0, ms)[0][:2] == [16, "fork16"]
    # fresh honest nodes on a chain of their own, none credited here but each in the routing table: a lone
    # node ahead of them on another chain still yields to them
    fresh = [f"peer-fresh-{i:05d}" for i in range(3)]
    ms = {honest[0]: member(honest[0], 30, "ahead30")} | {q: member(q, 15, "theirs15") for q in fresh}
    node = _public_view(30, "ahead30", [honest[0]], {honest[0], *fresh})
    assert SwarmView.outvoted(node, 0, ms)[0][:2] == [15, "theirs15"]


class _Receiver(Replication):
    """The record handler of a node, over a view in which ``joiner`` has published its membership but the
    node has not read it yet (it joined after the node's last read of the view)."""

    def __init__(self, signer: str, joiner: str) -> None:
        self.peer_id, self.members, self.peer_book = "me", {signer: object()}, {}
        self.admission = None  # a public swarm
        self.joiner, self.reads, self.applied = joiner, 0, []
        self.settings = SimpleNamespace(swarm="s", audit_share=0.0, elect_workers=False)
        self.spec = {0: {"w": (16, 16)}}
        self.events = SimpleNamespace(emit=lambda *a, **k: None)
        self.penalise = lambda *a, **kw: None
        self.fence = ElectionFence(self.settings, self.peer_id, None, None, None, None, self)

    view = property(lambda self: self)  # the replication's view: this fake's own members
    trust = property(lambda self: trust_of(self))  # the policy as the node wires it from these parts

    async def known(self, caller: str) -> bool:
        return caller in self.members

    def recent(self, peer: str) -> bool:  # in the view, or in one lately (``SwarmView.recent``)
        return peer in self.members

    async def look_up(self, peer: str) -> bool:  # the view's re-read: the DHT has the joiner by now
        self.reads += 1
        self.members[self.joiner] = object()
        return peer in self.members

    replicas = [SimpleNamespace(round=0, hash="")]  # records of round 1 on another parent: not applied here

    # node.swarm.trust.evidence: these records break no rule (tests/test_evidence.py)
    auditor = SimpleNamespace(proven_lie=lambda sr: None)

    def take_record(self, sr, caller):
        self.fence.vouch(sr)  # what calls a contributor never seen a forgery
        self.applied.append(sr.record.round)
        return Reply(True)


def test_a_record_naming_a_peer_that_joined_since_our_last_view_read_is_not_called_forged():
    """At start-up the first rounds hold every node, and one may reach a node before that node has read
    the newest joiner's membership: it reads the view again before judging (a parity run refused one such
    honest record as ``forged_record`` before)."""
    signer, joiner = Identity.generate(), Identity.generate()
    rep = _replica()
    g = {"w": torch.randn(16, 16, generator=torch.Generator().manual_seed(3)) * 1e-3}
    c = Contribution(joiner.peer_id, 0, 0, 4, 400, 1.0, g, f"{joiner.peer_id}:0:1")
    raw = encode_record("s", rep.make_record(1, [c], CFG), signer)
    node = _Receiver(signer.peer_id, joiner.peer_id)
    reply = asyncio.run(node.on_record(signer.peer_id, raw))
    assert reply.ok and node.applied == [1] and node.reads == 1, reply
    # A contributor that never joined is still refused, after the one read.
    stranger = Identity.generate().peer_id
    c2 = Contribution(stranger, 0, 0, 4, 400, 1.0, g, f"{stranger}:0:1")
    node = _Receiver(signer.peer_id, joiner.peer_id)
    reply = asyncio.run(
        node.on_record(signer.peer_id, encode_record("s", rep.make_record(1, [c2], CFG), signer))
    )
    assert not reply.ok and reply.code == "forged_record" and node.reads == 1 and node.applied == []


class _Restarted(Replication):
    """The apply path of a node restarted from a checkpoint older than a round it synchronised and signed
    in its previous life: the record comes back from a peer during the catch-up."""

    def __init__(self, me: str, rep: FragmentReplica, folder) -> None:
        self.peer_id, self.members, self.peer_book = me, {"a": object()}, {}
        self.view = self  # the replication's view: this fake's own members
        self.admission = None  # a public swarm
        self.settings = SimpleNamespace(audit_share=0.0, elect_workers=False)
        self.signed_files = SignedFiles(folder / "records")
        self.pcfg, self.replicas, self.heads, self.merged_tokens = CFG, [rep], [None], [0]
        self.logs, self.suspect = [{}], {}
        self.peer_scores = SimpleNamespace(
            merged=lambda cids: None, banned=lambda peer, now: False, accused=lambda peer, now: False
        )
        self.work = WorkBook()
        self.own_cids = OwnCids(me)
        self.fence = ElectionFence(self.settings, me, None, self.work, None, self.own_cids, self)
        self.counters = {"records_applied": 0}
        self.events = SimpleNamespace(emit=lambda *a, **k: None)
        self.learner_loop = SimpleNamespace(is_alive=lambda: False)
        self.resets: list[int] = []
        self.plan = SimpleNamespace(total_numel=rep.numel)
        self.clocks = SimpleNamespace(schedule_unclocked=lambda: None)  # no schedule (node.swarm.clocks)
        self.deadlines = SimpleNamespace(left_out=lambda sr: None)  # no contribution of ours taken
        self.auditor = Auditor(
            self.settings,
            self.pcfg,
            self.peer_id,
            {0: {"w": (16, 16)}},
            rep.numel,
            self.replicas,
            self.logs,
            self.heads,
            self.signed_files,
            self.peer_scores,
            self.suspect,
            self.counters,
            self.events,
            self.learner_loop,
            call=None,  # no network: the record comes in by ``apply``
            live_members=dict,
            learner_only=lambda: False,
            agreed=lambda rec, cosines: None,
            reset_sync=self.reset_sync,
            spawn=lambda coro: coro.close(),
        )
        self.trust = trust_of(self)

    def reset_sync(self, p: int, merged=frozenset()) -> None:
        self.resets.append(self.replicas[p].round)


def test_a_record_our_previous_life_signed_resets_our_synchroniser_like_anyone_elses(tmp_path):
    me = Identity.generate()
    maker = _replica()
    rec = _record(maker)
    sr = decode_record(encode_record("s", rec, me), "s", {0: {"w": (16, 16)}})
    assert sr.signer == me.peer_id
    node = _Restarted(me.peer_id, _replica(), tmp_path / "a")
    node.apply(sr)  # from a peer, during the catch-up
    assert node.replicas[0].round == 1 and node.resets == [1]  # the synchroniser follows the replica
    assert bytes(node.logs[0][1].raw) == sr.raw  # the log's record, read back from its file
    node = _Restarted(me.peer_id, _replica(), tmp_path / "b")
    node.apply(sr, made_here=True)  # our synchroniser made it now: its state machine moves on by itself
    assert node.replicas[0].round == 1 and node.resets == []


def test_a_stopping_node_merges_no_round():
    """A round whose slot comes while the node stops is left unmerged: merged then, it would land after the
    members stopping with it wrote their final state (two hashes at the end of a 124M `ddiloco up`)."""

    class _Stopping(Replication):
        def __init__(self) -> None:
            self._stop = asyncio.Event()
            self._stop.set()

        @property
        def replicas(self):  # a merge would start here
            raise AssertionError("a stopping node began a merge")

    assert _Stopping()._merge(0, Merge(3, ())) is None
