"""The trust policy (``node.swarm.trust.policy``): what each kind of swarm wires, that a private swarm's
policy reaches only the checks a certified member may still fail, and that the accepting, merging and
applying paths reach trust through the policy alone."""

from __future__ import annotations

import ast
import time
from types import SimpleNamespace

import pytest

from node.swarm.settings import NodeSettings
from node.swarm.trust.peer_scores import PeerScores
from node.swarm.trust.policy import TrustChecks, TrustPolicy
from node.swarm.trust.work_book import WorkBook
from protocol.config import ProtocolConfig
from protocol.errors import ProtocolError, RejectCode
from protocol.systems import system_protocol
from tests.test_layering import ROOT, parse

PRIVATE = dict(authority="a" * 64, certificate="member.cert", swarm_secret="swarm.secret")  # swarm init's


def _checks(**settings) -> TrustChecks:
    s = NodeSettings(**settings)
    pcfg, _ = system_protocol(s.system, ProtocolConfig(), 4, trusted=s.trusted)  # as the node resolves it
    return TrustChecks.of(s, pcfg)


def test_each_kind_of_swarm_wires_its_checks_and_flags_add_to_them():
    assert _checks() == TrustChecks(audits=True, receipts=True, distrust=True, fence=True)  # public
    # open learners: certified synchronisers elect among themselves, uncertified learners are checked
    assert _checks(authority="a" * 64, open_learners=True) == TrustChecks(True, True, True, False)
    private = _checks(**PRIVATE)
    assert private == TrustChecks(audits=False, receipts=False, distrust=False, fence=False)
    assert _checks(**PRIVATE, audit="1").audits  # a private swarm that asks for audits has them


class _Refuses:
    """A part a private swarm's policy must never reach: any use of it fails the test."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr):
        raise AssertionError(f"a private swarm's policy reached {self.name}.{attr}")


def _record(signer: str, learners: list[str]):
    rec = SimpleNamespace(
        fragment=0,
        round=4,
        parent_hash="p",
        new_hash="n",
        contributors=[(q, f"{q}:0:1", 1.0, 2, 20) for q in learners],
    )
    return SimpleNamespace(record=rec, signer=signer, raw=b"r")


def _private(tmp_undone=()):
    """A private swarm's policy over real scores and work credits; the parts that judge uncertified members
    (audits, receipts, distrust, the fence's election) are stand-ins that fail if reached. The evidence path
    (``proven_lie``, ``convict``) and the record's vouching stay: a certified member can still sign a lie."""
    convicted, vouched, spawned = [], [], []
    auditor = SimpleNamespace(
        undone=set(tmp_undone),
        proven_lie=lambda sr: (
            ProtocolError(RejectCode.RECORD_TOO_LARGE, "x") if sr.signer == "liar" else None
        ),
        convict=lambda sr, lie, caller: convicted.append((sr.signer, caller)),
        recheck=lambda sr: None,
    )
    fence = SimpleNamespace(vouch=lambda sr, fenced: vouched.append(fenced))
    trust = TrustPolicy(
        TrustChecks(audits=False, receipts=False, distrust=False, fence=False),
        "me",
        PeerScores(),
        WorkBook(),
        _Refuses("agreement"),
        fence,
        auditor,
        _Refuses("receipts"),
        {"s": 1.0},
        {},
        None,
        step_rate=lambda q: 2.0,
        hold_out_of_turn=lambda sr, caller: pytest.fail("held out of turn in a private swarm"),
        hold_unelected=lambda sr, caller: pytest.fail("held as unelected in a private swarm"),
        spawn=spawned.append,
    )
    return trust, convicted, vouched, spawned


def test_a_private_swarms_policy_checks_what_a_certified_member_may_get_wrong_and_nothing_else():
    trust, convicted, vouched, spawned = _private()
    rep = SimpleNamespace(check_record=lambda rec, pcfg: None)
    # accepting: no distrust, no receipts; a replay is still refused, a first resend still answered
    trust.admit_learner("l")
    assert trust.busy("l", 0) is None and not trust.binds("l")
    assert len(trust.digest(b"m", b"sig")) == 64  # named by its sha256, kept for no audit
    trust.peer_scores.merged(["l:0:1"])
    assert trust.resent("l:0:1")  # the first copy since its merge: an honest resend
    with pytest.raises(ProtocolError) as e:
        trust.resent("l:0:1")
    assert e.value.code is RejectCode.REPLAYED
    # merging: every contribution, signed as merged
    cs = (SimpleNamespace(cid="a"), SimpleNamespace(cid="b"))
    assert trust.merged_set(0, 1, cs) is cs and trust.may_sign(0, 1, None, list(cs))
    trust.agreed(None, [0.1])
    # applying: vouched without the election fence, no audit; a signer merging is a suspect no more
    sr = _record("s", ["s", "l"])
    trust.vet(sr, rep, None, turn_waited=False)
    assert vouched == [False] and trust.audit_parent(sr, rep) is None
    trust.applied(sr)
    trust.audit(sr, None)
    assert trust.suspect == {} and spawned == [] and trust.peer_scores.was_merged("s:0:1")
    assert not trust.held_out_of_turn(sr, "s")
    # a banned signer, a chain undone: refused; a signed lie: its signer convicted, the proof handed on
    trust.peer_scores.ban("s", time.monotonic())
    with pytest.raises(ProtocolError) as e:
        trust.vet(sr, rep, None, turn_waited=False)
    assert e.value.code is RejectCode.BANNED
    undone, *_ = _private(tmp_undone={"p"})
    with pytest.raises(ProtocolError) as e:
        undone.vet(_record("t", ["t"]), rep, None, turn_waited=False)
    assert e.value.code is RejectCode.UNDONE
    lie = trust.refute(_record("liar", ["liar"]), "relay")
    assert lie.code is RejectCode.RECORD_TOO_LARGE and convicted == [("liar", "relay")]
    assert trust.refused(_record("liar", ["liar"]), "relay", lie)  # no catch-up on a lie


def test_the_accepting_merging_and_applying_paths_reach_trust_through_the_policy_alone():
    """``node.swarm.intake`` and ``node.swarm.replication`` name no trust part but the policy: read without
    its calls, they are the honest path."""
    parts = {"peer_scores", "auditor", "receipts", "agreement", "fence", "turn_held", "unelected_held"}
    for name in ("intake", "replication"):
        tree = parse(ROOT / "node" / "swarm" / f"{name}.py")
        used = {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
        }
        assert not used & parts, (name, sorted(used & parts))
        imported = {
            n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module is not None
        }
        assert not {m for m in imported if m.startswith("node.swarm.trust")}, (name, imported)
