"""Whom this node believes a merge record's signer could be, from its own knowledge: the checks of
``ElectionFence.vouch`` (a signer or contributor never seen as a member, a contribution of ours never sent, a
record naming no signed message where the swarm audits) and, in a public swarm, the election fence: a record
is applied only where its signer is one a view on the chain this node follows could have elected
(``signer_electable``); while nobody is credited yet, a record out of turn waits (``out_of_turn``,
``node.swarm.trust.held``)."""

from __future__ import annotations

import time

from node.swarm.view import ELECT_CREDITED, ELECT_WATCH_ROUNDS
from node.swarm.wire import SignedRecord
from protocol.errors import ProtocolError, RejectCode, UnprovenRefusal


class ElectionFence:
    """``view``: the node's ``SwarmView`` (its members, the peers it has seen, the learners its logs credit,
    the fail-over order); ``work``: the ``WorkBook`` of credits; ``own_cids``: the ids this node sent."""

    def __init__(self, settings, peer_id: str, admission, work, syncs: list, own_cids, view) -> None:
        self.settings, self.peer_id, self.admission = settings, peer_id, admission
        self.work, self.syncs, self.own_cids, self.view = work, syncs, own_cids, view

    def known(self) -> set[str]:
        """Every peer this node has seen as a member (in a view read, or kept for relinking), and itself."""
        return self.view.members.keys() | self.view.peer_book.keys() | {self.peer_id}

    def vouch(self, sr: SignedRecord, fenced: bool = True) -> None:
        """What this node can refute of another's record from its own knowledge: a signer it has never seen
        in the swarm, a contributor it has never seen, a contribution of its own it never sent; where the
        swarm audits, a record that names no signed message (nothing to recompute it from); and in a public
        swarm, a signer no view on this chain could have elected (``signer_electable``)."""
        known = self.known()
        rec = sr.record

        def unseen(why: str) -> ProtocolError:  # refused, but no proof of a lie: we may not have seen it yet
            return UnprovenRefusal(RejectCode.FORGED_RECORD, why)

        if sr.signer not in known:
            raise unseen(f"round {rec.round} signed by {sr.signer}, never a member")
        signer = self.view.members.get(sr.signer)
        if self.admission is not None and signer is not None and signer.client_mode:
            # a learner-role member (an open learner: dht.admission) is never elected; what it signs is a lie
            raise ProtocolError(
                RejectCode.FORGED_RECORD,
                f"round {rec.round} signed by {sr.signer}, admitted as a learner only",
            )
        if self.settings.audit_share > 0 and (not rec.digests or "" in rec.digests):
            # every honest merge names the digest of each message it took (node.swarm.intake), so
            # this is the signer's own doing: scored against it where it pushed the record itself
            raise ProtocolError(
                RejectCode.FORGED_RECORD,
                f"round {rec.round} names no signed message for {len(rec.contributors)} contribution(s): "
                "this swarm audits every record",
            )

        if fenced and not self.signer_electable(rec.fragment, sr.signer, known):
            raise UnprovenRefusal(  # views differ: not proof of a lie, and the sender may only relay it
                RejectCode.UNELECTED,
                f"round {rec.round} of fragment {rec.fragment} signed by {sr.signer}, whose work no record "
                "signed by another member credits: no view on this chain elects it",
            )
        for learner, cid, *_ in rec.contributors:
            if learner not in known:
                raise unseen(f"round {rec.round} names {learner}, never a member, as a contributor")
            if learner == self.peer_id and self.own_cids.refutes(cid):
                raise ProtocolError(
                    RejectCode.FORGED_RECORD,
                    f"round {rec.round} names contribution {cid} of ours, never sent",
                )

    def stands_aside(self, p: int, known) -> bool:
        """Whether the election fence of a public swarm stands aside for fragment p (``signer_electable``):
        this node has not watched the swarm merge for the election's window, or its chain credits fewer than
        ``ELECT_CREDITED`` members. False where the swarm elects anyone (no fence at all)."""
        if not self.settings.elect_workers:
            return False
        return self.stands_aside_of(p, self.work.credited_of(set(known), self.view.logged_learners()))

    def stands_aside_of(self, p: int, credited: frozenset[str]) -> bool:
        watched = self.work.watched_for(time.monotonic(), ELECT_WATCH_ROUNDS * self.syncs[p].due_every)
        return not watched or len(credited) < ELECT_CREDITED

    def out_of_turn(self, sr: SignedRecord) -> bool:
        """Whether a record pushed here for the round after our head merges its signer's work alone and comes
        from a signer this node's view does not put first, while the fence stands aside
        (``stands_aside``): nobody is credited yet, so a member that signs a record of its own work for
        every round the moment the one before it lands (``forge-signed`` in ``bench/hostile_node.py``) would
        win every race. A record that merges another member's work is not held: holding every record out of
        turn parted the chains of a starting swarm (views differ there), and the fence then refused an honest
        signer's record across them (a suite run of the partition test). First by the rendezvous order alone,
        not by leases: a lease is a member's own word in its membership record, and a forger could claim every
        open round. Such a record is held, not refused (``HeldRecords``, ``node.swarm.trust.held``): views differ for a moment at
        start-up, and an honest record from another view's first candidate lands a ``failover_s`` late, or a
        fork decides."""
        if sr.signer == self.peer_id or any(c[0] != sr.signer for c in sr.record.contributors):
            return False  # ours, or it merged another member's work: not a record of the signer's alone
        if not self.stands_aside(sr.record.fragment, self.known()):
            return False
        first = self.view.candidates(sr.record.fragment, leases=False)[:1]
        return bool(first) and first[0] != sr.signer

    def turn_wait_s(self, sr: SignedRecord) -> float:
        """How long a record held out of turn (``out_of_turn``) waits: a ``failover_s`` for each candidate this
        node's view puts before its signer for the fragment's open round (by the rendezvous order; all of them
        where the signer is not one), the time senders take to fail over past each of them. With one
        ``failover_s`` for any place, a forger ranked last got a record in whenever the first candidate's
        round took longer than that (a loaded 2-core host, a suite run)."""
        order = self.view.candidates(sr.record.fragment, leases=False)
        before = order.index(sr.signer) if sr.signer in order else len(order)
        return self.settings.failover_s * max(1, before)

    def signer_electable(self, p: int, signer: str, known) -> bool:
        """The election fence of a public swarm (``elect`` workers): whether a view on the chain this node
        follows could have elected ``signer`` for a round of fragment p. Every view elects among the members
        its chain credits with merged work (``SwarmView.workers``), and a member's own records never credit
        it (``SwarmView.logged_learners``), so a member that signs records naming itself is not electable
        for doing so. Not the rank in the fail-over order: views differ there for a moment (a join, a
        partition healing, heartbeats in flight), and credits do not (they only grow, and nodes on one chain
        hold the same). True where the swarm elects anyone, while this node has not watched the swarm merge
        for the election's window itself, and while its chain credits fewer than ``ELECT_CREDITED`` members."""
        if signer == self.peer_id or not self.settings.elect_workers:
            return True
        logged = self.view.logged_learners()
        credited = self.work.credited_of(set(known) | {signer}, logged)
        # Only once this node has itself watched the swarm merge for the election's window: the credits a
        # snapshot or checkpoint hands a joiner or a restarted node name only some of the workers (one, in a
        # suite run), and a restarted node refused the next honest record of the swarm's synchroniser. And
        # with fewer than ``ELECT_CREDITED`` credited, elections stand aside too (``SwarmView.workers``).
        if self.stands_aside_of(p, credited):
            return True
        return signer in credited
