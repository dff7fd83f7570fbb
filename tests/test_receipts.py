"""Signed receipts (``node.swarm.trust.receipts``): what proves a synchroniser left out a contribution it took, and
what does not. The real-node checks are in ``tests/test_left_out.py``."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import MappingProxyType, SimpleNamespace

import pytest
import torch

from dht.identity import Identity
from node.common.events import EventLog
from node.swarm.dispatch import Dispatcher
from node.swarm.trust.peer_scores import PeerScores
from node.swarm.trust.receipts import BUSY_RETRY_S, Receipts, make_receipt, omits, parse_retry, read_receipt
from node.swarm.wire import decode_record, encode_record, pack_list, unpack_list
from protocol.errors import ProtocolError
from protocol.merge import contribution_weight
from protocol.messages import sender_tag
from protocol.replica import MergeRecord
from protocol.synchroniser import Phase, SyncState
from tests.test_wire_refusals import _spec

SWARM = "receipts-test"
PARENT = "a" * 64


def receipts_of(identity, folder, replicas, syncs, settings=None, cls=Receipts, **parts) -> Receipts:
    """A node's receipts (``cls``) handed fakes of the rest of the node: ``parts`` names any collaborator to
    give instead (``Receipts``'s arguments); the rest take anything and change nothing."""
    given = dict(
        spec={},
        peer_scores=PeerScores(),
        suspect={},
        counters={"receipts_held": 0},
        events=EventLog(),
        last_contribution={},
        send_again=lambda header: None,
        reset_sync=lambda p, merged=frozenset(): None,
        ban_and_hand_on=lambda sr, why, source, op, body, **fields: True,
    )
    settings = settings or SimpleNamespace(swarm=SWARM, trusted=False, ttl_s=6.0)
    return cls(settings, identity, folder, replicas, syncs, **{**given, **parts})


def _dispatch(node, handler, op: str, caller: str, body: bytes):
    """A request as the node's transport hands it on to ``handler``: through its dispatcher (admission,
    refusal, score)."""
    return Dispatcher(node.view.known, getattr(node, "penalise", lambda *a: None), {op: handler})(
        op, caller, body
    )


def _record(sync: Identity, spec, contributors, round_=5, parent=PARENT):
    grad = {n: torch.full(s, 1e-4) for n, s in spec[0].items()}
    people = tuple((who, cid, contribution_weight(512, 8), 8, 512) for who, cid in contributors)
    rec = MergeRecord(0, round_, parent, "b" * 64, people, grad)
    return decode_record(encode_record(SWARM, rec, sync), SWARM, spec)


@pytest.fixture(scope="module")
def spec():
    return _spec()


def test_a_record_without_the_receipted_contribution_proves_the_drop(spec):
    sync, learner, other = Identity.generate(), Identity.generate(), Identity.generate()
    cid = "L:0:1000"
    rc = make_receipt(SWARM, sync, 0, 5, PARENT, learner.peer_id, cid)
    got = read_receipt(SWARM, sync.peer_id, rc.packed())
    assert (got.fragment, got.round, got.parent, got.learner, got.cid) == (0, 5, PARENT, learner.peer_id, cid)
    dropped = _record(sync, spec, [(other.peer_id, "O:0:999")])
    assert omits(dropped, got)
    # the same record honours it where it names the contribution, or a later one of the same learner (which
    # replaced it in the round), but not an earlier one
    assert not omits(_record(sync, spec, [(other.peer_id, "O:0:999"), (learner.peer_id, cid)]), got)
    assert not omits(_record(sync, spec, [(learner.peer_id, "L:0:1500")]), got)
    assert omits(_record(sync, spec, [(learner.peer_id, "L:0:500")]), got)


def test_a_receipt_proves_nothing_about_another_round_parent_or_signer(spec):
    sync, learner, other = Identity.generate(), Identity.generate(), Identity.generate()
    rc = make_receipt(SWARM, sync, 0, 5, PARENT, learner.peer_id, "L:0:1000")
    without = [(other.peer_id, "O:0:999")]
    assert not omits(_record(sync, spec, without, round_=6), rc)  # the round after: the sender sends again
    assert not omits(_record(sync, spec, without, parent="c" * 64), rc)  # another chain
    assert not omits(_record(other, spec, without), rc)  # another synchroniser took the round


def test_a_receipt_that_is_forged_or_malformed_is_refused():
    sync, liar = Identity.generate(), Identity.generate()
    rc = make_receipt(SWARM, liar, 0, 5, PARENT, liar.peer_id, "L:0:1")
    with pytest.raises(ProtocolError, match="not signed"):  # a learner that signs its own "receipt"
        read_receipt(SWARM, sync.peer_id, rc.packed())
    good = make_receipt(SWARM, sync, 0, 5, PARENT, liar.peer_id, "L:0:1")
    with pytest.raises(ProtocolError, match="not signed"):  # another swarm's
        read_receipt("elsewhere", sync.peer_id, good.packed())
    doc, sig = unpack_list(good.packed())
    edited = doc.replace(b'"round":5', b'"round":4')
    with pytest.raises(ProtocolError, match="not signed"):
        read_receipt(SWARM, sync.peer_id, pack_list([edited, sig]))
    for junk in (
        b"",
        b"\x01\x00\x00\x00",
        pack_list([b"{}", sig]),
        pack_list([b"[1]", sig]),
        pack_list([doc]),
    ):
        with pytest.raises(ProtocolError):
            read_receipt(SWARM, sync.peer_id, junk)


def test_junk_that_is_not_a_receipt_is_refused_before_its_signature_is_read():
    sync = Identity.generate()
    sig = make_receipt(SWARM, sync, 0, 5, PARENT, "L", "L:0:1").sig
    for doc in (
        b"{}",
        b"[1]",
        b'{"fragment":1e999,"round":5,"parent":"p","learner":"L","cid":"c"}',
        b'{"fragment":true,"round":5,"parent":"p","learner":"L","cid":"c"}',
        b'{"fragment":0,"round":5,"parent":["p"],"learner":"L","cid":"c"}',
        b"[" * 2000 + b"]" * 2000,
    ):
        with pytest.raises(ProtocolError, match="bad receipt"):
            read_receipt(SWARM, sync.peer_id, pack_list([doc, sig]))


def _synchroniser(ident: Identity, folder) -> Receipts:
    """A synchroniser's receipts: its identity and state folder, one fragment's replica and round."""
    return receipts_of(
        ident, folder, [SimpleNamespace(round=4, hash=PARENT)], [SyncState(fragment=0, global_round=4)]
    )


def test_a_synchroniser_restarted_on_the_parent_it_gave_receipts_on_does_not_sign_without_them(
    tmp_path, spec
):
    """The receipts a node gave are in its state folder before its reply leaves: killed while it held a round
    and back on the same parent, it refuses to sign a record of that round that leaves one out (else the
    learner holding the receipt would get it banned everywhere)."""
    sync, learner, other = Identity.generate(), Identity.generate(), Identity.generate()
    cid = f"{sender_tag(learner.peer_id)}:0:8:1000"
    node = _synchroniser(sync, tmp_path)
    rc = read_receipt(SWARM, sync.peer_id, node.give_receipt(0, learner.peer_id, cid))
    assert (rc.round, rc.parent, rc.cid) == (5, PARENT, cid)
    assert node.receipted(0, 5) == {cid}
    again = _synchroniser(sync, tmp_path)  # a new life, same folder
    (tmp_path / "receipts.log").open("a").write('["torn line\n')  # a write the kill cut short
    without = _record(sync, spec, [(other.peer_id, "O:0:999")]).record
    assert again.breaks_receipt(without) == [cid] and again.holds_receipts(without)
    assert again.counters["receipts_held"] == 1
    with_it = _record(sync, spec, [(other.peer_id, "O:0:999"), (learner.peer_id, cid)]).record
    assert not again.holds_receipts(with_it)


def test_a_contribution_must_name_its_moment_and_replace_only_an_older_one(tmp_path):
    sync, learner = Identity.generate(), Identity.generate()
    node = _synchroniser(sync, tmp_path)
    tag = sender_tag(learner.peer_id)
    with pytest.raises(ProtocolError, match="names no moment"):
        node.check_taken(0, learner.peer_id, f"{tag}:0:8:soon", 4)
    held = SimpleNamespace(cid=f"{tag}:0:8:1000")
    node.syncs[0] = replace(node.syncs[0], pending=MappingProxyType({(learner.peer_id, 4): held}))
    node.check_taken(0, learner.peer_id, f"{tag}:0:8:1000", 4)  # the same one again
    node.check_taken(0, learner.peer_id, f"{tag}:0:16:2000", 4)  # a later one replaces it
    node.check_taken(0, learner.peer_id, f"{tag}:0:16:500", 3)  # on another base: both merge
    with pytest.raises(ProtocolError, match="older than"):
        node.check_taken(0, learner.peer_id, f"{tag}:0:4:500", 4)


def test_a_synchroniser_merging_its_round_asks_senders_to_wait_a_merges_time(tmp_path):
    """Where receipts bind, a contribution that comes while the round merges is not queued for a round whose
    parent nobody knows yet: the sender is told how long a merge takes here, and tries again then (each try
    carries the whole contribution)."""
    node = _synchroniser(Identity.generate(), tmp_path)
    assert node.merging_here("learner", 0) is None  # collecting: taken
    node.syncs[0] = replace(node.syncs[0], phase=Phase.MERGING)
    assert node.merging_here(node.peer_id, 0) is None  # its own learner's: queued, as ever
    busy = node.merging_here("learner", 0)
    assert (busy.ok, busy.code) == (False, "peer_busy") and parse_retry(busy.body) == BUSY_RETRY_S
    node.syncs[0] = replace(node.syncs[0], xi_sync=node.syncs[0].xi_sync.update(1.5, 0.5))
    assert parse_retry(node.merging_here("learner", 0).body) == 1.5
    node.settings.trusted = True  # a private swarm: no receipts, queued as before
    assert node.merging_here("learner", 0) is None
    assert parse_retry(b'{"retry_s": 1e9}') == 10.0 and parse_retry(b'{"retry_s": 0}') == 0.05
    for junk in (b"", b"[]", b'{"retry_s": "soon"}', b'{"retry_s": true}', b'{"retry_s": NaN}'):
        with pytest.raises(ProtocolError):
            parse_retry(junk)


def test_a_proof_of_a_drop_bans_its_signer_and_a_proof_that_proves_nothing_is_refused_and_scored(tmp_path):
    """The ``omission`` op: each node checks the record and the receipt alone (two signatures, the names)."""
    from tests.test_audit import SPEC, _Member

    sync, learner, other = Identity.generate(), Identity.generate(), Identity.generate()
    judge = _Member(tmp_path)  # its dispatcher: admission, and the score of a refused proof
    receipts = receipts_of(
        SimpleNamespace(peer_id=judge.peer_id),
        tmp_path,
        judge.replicas,
        [SyncState(fragment=0)],
        settings=judge.settings,
        spec=judge.spec,
        peer_scores=judge.peer_scores,
        ban_and_hand_on=lambda sr, why, source, op, body, **f: judge.peer_scores.ban(sr.signer, 0.0, why),
    )
    cid = f"{sender_tag(learner.peer_id)}:0:8:1000"

    def record(people, signer=sync):
        grad = {n: torch.full(s, 1e-4) for n, s in SPEC[0].items()}
        rows = tuple((who, c, contribution_weight(512, 8), 8, 512) for who, c in people)
        return encode_record("s", MergeRecord(0, 5, PARENT, "b" * 64, rows, grad), signer)

    def prove(rec: bytes, rc) -> tuple:
        reply = asyncio.run(
            _dispatch(judge, receipts.on_omission, "omission", "relay", pack_list([rec, rc.packed()]))
        )
        return reply.ok, reply.code

    receipt = make_receipt("s", sync, 0, 5, PARENT, learner.peer_id, cid)
    honours = record([(other.peer_id, "O:0:8:999"), (learner.peer_id, cid)])
    assert prove(honours, receipt) == (False, "malformed")
    assert prove(
        record([(other.peer_id, "O:0:8:999")]), make_receipt("s", other, 0, 5, PARENT, learner.peer_id, cid)
    ) == (
        False,
        "bad_signature",
    )  # a receipt its signer never gave
    reply = asyncio.run(_dispatch(judge, receipts.on_omission, "omission", "relay", b"\x00\x01"))
    assert (reply.ok, reply.code) == (False, "malformed")
    assert judge.penalised == ["malformed", "bad_signature", "malformed"]
    assert not judge.peer_scores.banned(sync.peer_id, 1.0)
    assert prove(record([(other.peer_id, "O:0:8:999")]), receipt) == (True, "ok")
    assert judge.peer_scores.banned(sync.peer_id, 1.0)
