"""What a snapshot must pass before it enters a replica, unit by unit:
``protocol.chain.snapshot_mismatch``, the state a donor's records reach from a round this replica keeps, and
``SnapshotVetting.unwitnessed``, who must hold a head that no chain checks.
The swarm-level test, a member a round ahead serving an all-zero snapshot and forged records leading to it,
is ``tests/test_hostile_snapshots.py``."""

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dht.records import Member
from node.swarm.trust.vetting import SnapshotVetting, UnwitnessedSnapshot
from node.swarm.trust.work_book import WorkBook
from node.swarm.view import SwarmView
from protocol.chain import snapshot_mismatch
from protocol.codecs import RANGE, Decoded
from protocol.config import ProtocolConfig
from protocol.replica import FragmentReplica
from protocol.synchroniser import Contribution

CFG = ProtocolConfig(fragments=1, sync_every=4, overlap=0, record_codec="fp32", history=4)
LR, MU = CFG.outer_lr, CFG.outer_momentum


def _replica() -> FragmentReplica:
    g = torch.Generator().manual_seed(0)
    return FragmentReplica(
        0, {"w": torch.randn(32, 16, generator=g), "b": torch.randn(16, generator=g)}, False, 4
    )


def _merge(rep: FragmentReplica, seed: int, scale: float = 1e-2, cfg: ProtocolConfig = CFG):
    g = torch.Generator().manual_seed(seed)
    delta = {k: torch.randn(v.shape, generator=g) * scale for k, v in rep.theta.items()}
    rec = rep.make_record(
        rep.round + 1, [Contribution("a", 0, rep.round, 4, 400, 1.0, delta, f"a:0:{seed}")], cfg
    )
    rep.apply_record(rec, cfg)
    return rec


def _fork():
    """Two replicas that share rounds 1-2, then part: ours merges round 3 one way, the donor's rounds 3 and 4
    another. Returns (ours, donor, the donor's records after the common round 2)."""
    ours = _replica()
    for seed in (1, 2):
        _merge(ours, seed)
    donor = copy.deepcopy(ours)
    _merge(ours, 30)
    chain = [_merge(donor, 40), _merge(donor, 41)]
    return ours, donor, chain


def _check(ours: FragmentReplica, chain, theta, momentum):
    forward = [(rec.grad, LR, MU) for rec in chain]
    return snapshot_mismatch(ours.theta, ours.momentum, ours.past_steps(2), forward, theta, momentum)


def test_the_donors_true_state_matches_what_its_records_reach_from_the_common_round():
    ours, donor, chain = _fork()
    assert ours.hash != donor.hash
    assert _check(ours, chain, donor.theta, donor.momentum) is None


def test_a_zero_snapshot_a_scaled_momentum_or_a_small_shift_is_refused():
    ours, donor, chain = _fork()
    zero = {k: torch.zeros_like(v) for k, v in donor.theta.items()}
    assert "parameters" in _check(ours, chain, zero, donor.momentum)
    scaled = {k: v * 100 for k, v in donor.momentum.items()}
    assert "momentum" in _check(ours, chain, donor.theta, scaled)
    # a shift of one round's update on one tensor: small beside the weights, far beside the tolerance
    shifted = dict(donor.theta, b=donor.theta["b"] + LR * chain[-1].grad["b"])
    assert "parameters of b" in _check(ours, chain, shifted, donor.momentum)
    nan = dict(donor.theta, w=donor.theta["w"] * float("nan"))
    assert _check(ours, chain, nan, donor.momentum) is not None
    assert _check(ours, chain, {"w": donor.theta["w"]}, donor.momentum) == "the snapshot names other tensors"


@pytest.mark.slow
def test_records_in_their_int4_wire_form_are_read_a_range_at_a_time_across_a_large_tensor():
    cfg = replace(CFG, record_codec="int4")
    g = torch.Generator().manual_seed(0)
    ours = FragmentReplica(0, {"big": torch.randn(3 * RANGE + 77, generator=g) * 0.02}, False, 4)
    for seed in (1, 2):
        _merge(ours, seed, cfg=cfg)
    donor = copy.deepcopy(ours)
    _merge(ours, 30, cfg=cfg)
    chain = [_merge(donor, 40, cfg=cfg), _merge(donor, 41, cfg=cfg)]
    assert isinstance(chain[0].grad, Decoded)  # the path the node takes: never decoded whole
    assert _check(ours, chain, donor.theta, donor.momentum) is None
    tail = donor.theta["big"].clone()
    tail[-50:] = 0.0  # a lie confined to the last range is still found
    assert "parameters of big" in _check(ours, chain, {"big": tail}, donor.momentum)


def test_the_state_of_another_chain_does_not_match_these_records():
    ours, donor, chain = _fork()
    other = copy.deepcopy(ours)
    _merge(other, 50)  # a state one round past ours, on our own branch: not where the donor's records lead
    assert _check(ours, chain, other.theta, other.momentum) is not None


def test_the_check_leaves_the_replica_as_it_was():
    ours, donor, chain = _fork()
    before = {k: v.clone() for k, v in ours.theta.items()}, {k: v.clone() for k, v in ours.momentum.items()}
    _check(ours, chain, donor.theta, donor.momentum)
    for now, then in zip((ours.theta, ours.momentum), before):
        assert all(torch.equal(now[k], then[k]) for k in then)


def test_evidence_takes_only_lies_every_node_can_check_with_a_margin_over_max_rms():
    """``Auditor.proven_lie``: a record over twice ``max_rms`` or with a weight its counters do not give is
    proof; one a little over ``max_rms`` (the record codec's rounding of an honest merge at the bound) is not,
    nor is one over the local ``refuse_factor`` bound, which depends on what each node has seen."""
    from types import SimpleNamespace

    from node.swarm.trust.audit import Auditor
    from node.swarm.trust.evidence import proof_config

    cfg = replace(CFG, max_rms=1.0)
    rep = _replica()
    for learner in ("a", "b", "c"):  # a learners' typical norm that makes the refuse_factor bound local
        rep.norms.add(learner, 1e-6)
    node = SimpleNamespace(peer_id="me", pcfg=cfg, replicas=[rep], _proof_cfg=proof_config(cfg))
    lie = lambda rec: Auditor.proven_lie(node, SimpleNamespace(signer="x", record=rec))  # noqa: E731
    honest = _merge(copy.deepcopy(rep), 7, scale=1e-3)
    assert lie(honest) is None  # over refuse_factor x this node's reference, but that is not proof
    ones = {k: torch.ones_like(v) for k, v in rep.theta.items()}
    assert lie(replace(honest, grad={k: v * 1.2 for k, v in ones.items()})) is None
    over = lie(replace(honest, grad={k: v * 3 for k, v in ones.items()}))
    assert over is not None and over.code.value == "record_too_large"
    learner, cid, w, steps, tokens = honest.contributors[0]
    inflated = replace(honest, contributors=((learner, cid, w * 9, steps, tokens),))
    assert lie(inflated).code.value == "forged_record"
    assert Auditor.proven_lie(node, SimpleNamespace(signer="me", record=inflated)) is None  # never ourselves


def _vetting(
    members: dict, worked: list[str], head=(5, "x5"), log=None, cls=SnapshotVetting
) -> SnapshotVetting:
    """A vetting handed fakes of what it reads: the view's ``members`` (``live_members``), our head and log
    of fragment 0, the work we merged (``WorkBook.last_merged``), and a transport and event log that take anything."""
    work = WorkBook()
    for q in worked:
        work.merged(q, 0, 1.0)
    return cls(
        SimpleNamespace(heartbeat_s=1000.0, swarm="test"),
        SimpleNamespace(history=4),
        {},
        "me",
        [SimpleNamespace(round=int(head[0]))],
        [head],
        [log or {}],
        work,
        SimpleNamespace(count_refusal=lambda code: None),
        SimpleNamespace(emit=lambda *a, **k: None),
        lambda: members,
        lambda p, members, strict=False, refused=(): (None, []),  # no head beats ours
        lambda peer, code, signed=False: None,
    )


def _member(pid: str, head, client: bool = False) -> Member:
    return Member(pid, (), "ddiloco/0.3", 0.0, 1e12, client_mode=client, heads={"0": list(head)})


def test_a_head_is_unwitnessed_only_when_no_worker_holds_it_and_a_worker_holds_ours():
    liar, ally = _member("liar", (6, "zero")), _member("sybil", (6, "zero"))
    b = _member("b", (5, "x5"))
    # the liar alone a round ahead, an honest worker on our head: refused, whoever else echoes the liar
    assert _vetting({"liar": liar, "b": b}, worked=["b"]).unwitnessed("liar", 0, 6, "zero")
    assert _vetting({"liar": liar, "sybil": ally, "b": b}, worked=["b", "liar"]).unwitnessed(
        "liar", 0, 6, "zero"
    )
    # the other side of a deep split: a member this node merged before holds the donor's head too: taken
    c, d = _member("c", (7, "y7")), _member("d", (7, "y7"))
    assert not _vetting({"c": c, "d": d, "b": b}, worked=["b", "c", "d"]).unwitnessed("c", 0, 7, "y7")
    # a node that merged no one's work yet (a joiner): our head published by B refuses the liar's ...
    assert _vetting({"liar": liar, "b": b}, worked=[]).unwitnessed("liar", 0, 6, "zero")
    # ... and any member that holds state witnesses the swarm's head (two fresh joiners of a running swarm,
    # each the other's witness of round 0, refused the swarm's head for a whole run)
    swarm = {"a": _member("a", (6, "y6")), "c": _member("c", (6, "y6")), "b": _member("b", (0, "x0"))}
    fresh = _vetting(swarm, worked=[], head=(0, "x0"))
    assert not fresh.unwitnessed("a", 0, 6, "y6")
    assert fresh.unwitnessed("a", 0, 6, "y6") == _vetting(swarm, worked=["c"], head=(0, "x0")).unwitnessed(
        "a", 0, 6, "y6"
    )
    # our chain without a witness (a client's record holds no state, or nobody): taken as before
    client_b = _member("b", (5, "x5"), client=True)
    assert not _vetting({"liar": liar, "b": client_b}, worked=["b"]).unwitnessed("liar", 0, 6, "zero")
    assert not _vetting({"liar": liar}, worked=[]).unwitnessed("liar", 0, 6, "zero")
    # a witness a round behind on our chain (its head is our log's round 4) counts as one
    log = {5: SimpleNamespace(record=SimpleNamespace(new_hash="x5", parent_hash="x4"))}
    behind = _member("b", (4, "x4"))
    assert _vetting({"liar": liar, "b": behind}, worked=["b"], log=log).unwitnessed("liar", 0, 6, "zero")
    other_chain = _member("b", (4, "w4"))
    assert not _vetting({"liar": liar, "b": other_chain}, worked=["b"], log=log).unwitnessed(
        "liar", 0, 6, "zero"
    )


def test_a_head_no_member_takes_is_given_up_for_the_one_merged_members_agree_on_after_a_while():
    """A 2-to-1 split at one round where the lone head ranks first but the others refuse it (no chain reaches
    it: ``unwitnessed``): the lone node yields, once the stand-off has lasted ``LONE_HEARTBEATS``."""
    b, c = _member("b", (5, "y5", 2, 1.0)), _member("c", (5, "y5", 2, 1.0))
    members = {"b": b, "c": c}
    node = _vetting(members, worked=["b", "c"], head=(5, "x5", 2, 1.0))
    assert node.unfollowed(0, members) == (None, [])  # the stand-off starts: not yet
    node.settings.heartbeat_s = 0.0  # ... and has lasted long enough
    assert node.unfollowed(0, members) == ([5, "y5", 2, 1.0], ["b", "c"])
    # a member holds ours: nothing to give up
    mine = _member("d", (5, "x5", 2, 1.0))
    assert node.unfollowed(0, {"b": b, "c": c, "d": mine}) == (None, [])
    # identities whose work this node never merged vouch for nothing; one worker is not a majority of two
    assert _vetting({"b": b, "c": c}, worked=[], head=(5, "x5", 2, 1.0)).unfollowed(0, members)[1] == []
    assert node.unfollowed(0, {"b": b, "c": _member("c", (5, "z5", 2, 1.0))}) == (None, [])
    # a head of another round is winning_heads' business (ahead) or theirs to take (behind); a client holds none
    ahead = {"b": _member("b", (6, "y6", 2, 1.0)), "c": _member("c", (6, "y6", 2, 1.0))}
    assert node.unfollowed(0, ahead) == (None, [])
    # a round below ours on another chain (ours a lone head a round past a fork): given up for theirs; on our
    # own chain they are merely behind and follow our records
    node.settings.heartbeat_s = 0.0
    forked = {"b": _member("b", (4, "y4", 2, 1.0)), "c": _member("c", (4, "y4", 2, 1.0))}
    assert node.unfollowed(0, forked) == ([4, "y4", 2, 1.0], ["b", "c"])
    node.logs[0][5] = SimpleNamespace(record=SimpleNamespace(new_hash="x5", parent_hash="y4"))
    assert node.unfollowed(0, forked) == (None, [])
    # rounds below: a lone head two rounds past a fork (the others paused) is given up as well
    node.logs[0][5] = SimpleNamespace(record=SimpleNamespace(new_hash="x5", parent_hash="x4"))
    node.logs[0][4] = SimpleNamespace(record=SimpleNamespace(new_hash="x4", parent_hash="x3"))
    two_below = {"b": _member("b", (3, "y3", 2, 1.0)), "c": _member("c", (3, "y3", 2, 1.0))}
    assert node.unfollowed(0, two_below) == ([3, "y3", 2, 1.0], ["b", "c"])
    on_ours = {"b": _member("b", (3, "x3", 2, 1.0)), "c": _member("c", (3, "x3", 2, 1.0))}
    assert node.unfollowed(0, on_ours) == (None, [])  # behind on our chain: they follow our records
    node.logs[0].clear()
    assert node.unfollowed(0, two_below) == (None, [])  # rounds our log no longer holds: no fork we can see
    node.settings.heartbeat_s = 1000.0
    node.unfollowed(0, members)
    clients = {q: _member(q, (5, "y5", 2, 1.0), client=True) for q in ("b", "c")}
    assert node.unfollowed(0, clients) == (None, [])
    # the stand-off's clock restarts when either head moves
    node.settings.heartbeat_s = 1000.0
    node.heads[0] = (5, "w5", 2, 1.0)
    assert node.unfollowed(0, members) == (None, [])


def test_right_after_a_snapshot_the_member_it_came_from_witnesses_our_head():
    """A node that just took round 5 by snapshot knows no round of its chain but its head; its donor, gone on
    to round 6, witnesses ours: a liar's head a round past ours is refused (0.5 s after a snapshot a node
    took a liar's all-zero head while every honest member was a round past it)."""
    liar, b = _member("liar", (6, "zero")), _member("b", (6, "y6"))
    node = _vetting({"liar": liar, "b": b}, worked=["b"])
    assert not node.unwitnessed("liar", 0, 6, "zero")  # b's round 6 is on no chain this node knows
    node.took_from(0, "b", 5)
    assert node.unwitnessed("liar", 0, 6, "zero")
    node.took_from(0, "liar", 5)  # the liar's own word witnesses nothing
    assert not node.unwitnessed("liar", 0, 6, "zero")
    node.took_from(0, "b", 4)  # a record moved this node on since: its log knows its chain
    assert not node.unwitnessed("liar", 0, 6, "zero")


def test_a_node_alone_on_its_fork_refuses_a_lone_head_while_two_witnesses_agree_on_another():
    """Ours has no witness (no member holds a round of our chain): the donor's head is still refused while two
    or more members whose work we merged agree on another head, and catch-up then looks past it to theirs
    (a node alone on its fork took a liar's all-zero head a round past the rest, 1 install in 2 of 3 runs)."""
    liar = _member("liar", (7, "zero", 9, 9.0))
    b, c = _member("b", (6, "y6", 2, 1.0)), _member("c", (6, "y6", 2, 1.0))
    members = {"liar": liar, "b": b, "c": c}
    assert _vetting(members, worked=["b", "c"], head=(6, "x6", 2, 1.0)).unwitnessed("liar", 0, 7, "zero")
    # one agreeing member, two that disagree, or two we never merged: the three-way split's exemption stands
    assert not _vetting({"liar": liar, "b": b}, worked=["b"], head=(6, "x6")).unwitnessed(
        "liar", 0, 7, "zero"
    )
    split = {"liar": liar, "b": b, "c": _member("c", (6, "z6", 2, 1.0))}
    assert not _vetting(split, worked=["b", "c"], head=(6, "x6")).unwitnessed("liar", 0, 7, "zero")
    assert not _vetting(members, worked=["liar"], head=(6, "x6")).unwitnessed("liar", 0, 7, "zero")
    # members that agree on the donor's own head witness it
    echo = {"liar": liar, "b": _member("b", (7, "zero")), "c": _member("c", (7, "zero"))}
    assert not _vetting(echo, worked=["b", "c"], head=(6, "x6")).unwitnessed("liar", 0, 7, "zero")


def test_catch_up_looks_past_a_head_refused_as_unwitnessed_for_a_while():
    class _View(SwarmView):
        """What ``SwarmView.winning_heads`` reads of a node: its peer id, heads and replicas."""

        def __init__(self, heads: list) -> None:
            self.peer_id, self.heads = "me", heads
            self.replicas, self.pcfg = [SimpleNamespace(round=6)], SimpleNamespace(history=4)

    liar = _member("liar", (7, "zero", 9, 9.0))
    b, c = _member("b", (7, "y7", 2, 1.0)), _member("c", (7, "y7", 2, 1.0))
    members, head = {"liar": liar, "b": b, "c": c}, (6, "x6", 2, 1.0)
    view = _View([head])
    node = _vetting(members, worked=["b", "c"], head=head)
    assert view.winning_heads(0, members, refused=node.refused_heads(0)) == (list(liar.heads["0"]), ["liar"])
    node._unwitnessed_seen(0, "liar", 7, "zero")
    assert node.refused_heads(0) == {(7, "zero")}
    assert view.winning_heads(0, members, refused=node.refused_heads(0)) == ([7, "y7", 2, 1.0], ["b", "c"])
    node.settings.heartbeat_s = 0.0  # the refusal has lapsed: the head is tried again
    node._unwitnessed_seen(0, "liar", 7, "zero")
    assert node.refused_heads(0) == set()


def test_a_head_no_other_member_publishes_needs_the_donors_records_even_where_ours_has_no_witness():
    """Ours has no witness (a node alone on its fork) and nobody agrees on another head: a head only its donor
    publishes is still fetched only where the donor's checked records reach it, or where it serves a signed
    record of it (a fork deeper than the records kept). A liar's all-zero head a round past the rest has
    neither: with the plain merge, nodes alone on their forks installed it 1-7 times a run."""
    import asyncio

    class _Vetting(SnapshotVetting):
        """Its donor's records and signed head as the test sets them, and what it asked for."""

        chain, signed, asked = None, False, []

        async def _donor_chain(self, donor, p, round_, hash_):
            self.asked.append("records")
            return self.chain

        async def signed_head(self, donor, p, head, tries=3):
            self.asked.append("signed")
            return self.signed

    def vouch(node: _Vetting, head) -> bool:
        try:
            asyncio.run(node.vouch_head("liar", 0, head))
        except UnwitnessedSnapshot:
            return False
        return True

    liar, b = _member("liar", (7, "zero", 9, 9.0)), _member("b", (6, "y6", 2, 1.0))
    members = {"liar": liar, "b": b}
    node = _vetting(members, worked=["b"], head=(6, "x6", 2, 1.0), cls=_Vetting)
    assert not node.unwitnessed("liar", 0, 7, "zero")  # the three-way split's exemption, as before ...
    assert not vouch(node, (7, "zero")) and node.asked == ["records", "signed"]  # ... but no record: refused
    assert node.refused_heads(0) == {(7, "zero")}
    node.chain = (6, [])  # the donor's checked records reach it from our round: fetched
    assert vouch(node, (7, "zero"))
    node.chain, node.signed = None, True  # a fork deeper than the records kept, the head merged by the donor
    assert vouch(node, (7, "zero"))
    # another member publishes the same head: the exemption stands, nothing is asked
    node.chain, node.signed, node.asked = None, False, []
    members["c"] = _member("c", (7, "zero", 9, 9.0))
    assert vouch(node, (7, "zero")) and node.asked == []
