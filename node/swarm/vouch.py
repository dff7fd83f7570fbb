"""A snapshot checked against its donor's own records before it enters a replica (issue 31, item 3, in
part; docs/security.md, "Snapshots"). A snapshot is the donor's word for a fragment's whole state: its
tensors hash to the head it names, but nothing in them shows that head was ever merged. Where this replica
still keeps a round that the donor's chain leaves from (a fork a round or two deep: what a snapshot
usually repairs), the node walks its own outer steps back to that round, takes the donor's signed records
forward, each checked like any record, and compares (``protocol.chain``). A snapshot that is not the state
its donor's own records reach is a lie only the donor can have told: ``forged_snapshot``, scored like a
forged record, and not installed. Where no such chain exists (a join, a node far behind, a fork deeper
than the records kept) the snapshot is taken on the donor's word and its hash, with one exception
(``unwitnessed``): where no other member publishes the donor's head while another member does publish a
state of this node's own chain, the snapshot is not taken. A member a round ahead serving an all-zero state
with no records behind it was installed by every node that caught up from it (issue 31); an honest lone
head with no chain to it (a fork deeper than the records kept) is left for fork choice to settle: the
others merge on, and whichever side falls behind takes the other's head, which has witnesses by then.

Tried and not kept: requiring, where no chain exists, that other members confirm the head whatever the
state of ours (a ``head`` op). Under load (3 nodes beside a 2,000-member crowd on 2 cores, and the fast
test swarm of ``ddiloco up``) honest splits arose that only one node's head could repair, no other member
could confirm and no chain joined; the nodes ended on three hashes (docs/security.md, "Known limits"). A
node whose own chain nobody else publishes takes such a head as before.

A mixin of ``node.swarm.agent.Node``, like ``node.swarm.catch_up``."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from node.swarm.memory import momentum_lent
from node.swarm.transport import TransportError
from node.swarm.wire import FragmentState, decode_record, unpack_list
from protocol.chain import snapshot_mismatch
from protocol.errors import ProtocolError, RejectCode

logger = logging.getLogger(__name__)


class UnwitnessedSnapshot(TransportError):
    """A snapshot not taken: no record chain checks it, no other member holds its head, and ours has a witness."""


class Vouching:
    """The check a snapshot passes before ``CatchUp._install_snapshot``."""

    def hash_at(self, p: int, round_: int) -> str | None:
        """Fragment p's hash at ``round_`` on this node's chain, while its head or log holds that round."""
        if self.heads[p][0] == round_:
            return self.heads[p][1]
        sr, after = self.logs[p].get(round_), self.logs[p].get(round_ + 1)
        if sr is not None:
            return sr.record.new_hash
        return after.record.parent_hash if after is not None else None  # the round a snapshot brought

    async def _records_reach(self, donor: str, st: FragmentState) -> bool | None:
        """Whether ``st`` is the state the donor's signed records reach from a round this replica keeps:
        True, False (it is not: the donor lied), None (no such chain to check against)."""
        p = st.fragment
        rep = self.replicas[p]
        kept = [r for r in range(max(0, rep.round - self.pcfg.history), rep.round + 1) if rep.keeps(r)]
        if not kept or st.round <= kept[0]:
            return None
        req = json.dumps({"fragment": p, "from": kept[0] + 1}).encode()
        reply = await self.transport.call(donor, "records", req)
        if not reply.ok:
            return None
        try:
            recs = {}
            for raw in unpack_list(reply.body):
                sr = decode_record(raw, self.settings.swarm, self.spec)
                recs[sr.record.round] = sr.record
        except ProtocolError:
            return None
        # the newest round of ours the donor's chain leaves from, then its records up to the snapshot's head
        ours = {r: self.hash_at(p, r) for r in kept}
        starts = [a for a in kept if a + 1 in recs and recs[a + 1].parent_hash == ours[a]]
        if not starts:
            return None
        chain, prev = [], ours[starts[-1]]
        for r in range(starts[-1] + 1, st.round + 1):
            rec = recs.get(r)
            if rec is None or rec.parent_hash != prev or rec.fragment != p:
                return None
            try:
                rep.check_record(rec, self.pcfg)  # a record our checks doubt proves nothing either way
            except ProtocolError:
                return None
            chain.append(rec)
            prev = rec.new_hash
        if prev != st.hash or not rep.keeps(starts[-1]):
            return None
        lr, mu = self.pcfg.outer_lr, self.pcfg.outer_momentum
        back, theta, momentum = rep.past_steps(starts[-1]), dict(rep.theta), dict(rep.momentum)
        forward = [(rec.grad, lr, mu) for rec in chain]
        with momentum_lent([rep]):  # a record applied meanwhile steps the momentum into new tensors
            why = await asyncio.to_thread(
                snapshot_mismatch, theta, momentum, back, forward, st.theta, st.momentum
            )
        if why is not None:
            logger.warning("fragment %d: the snapshot of %s at round %d: %s", p, donor, st.round, why)
        return why is None

    def workers(self) -> set[str]:
        """Members whose work this node merged: the contributors to the records its logs hold (each
        fragment's last ``history`` rounds on its chain). An identity that only publishes a record has none."""
        return {c[0] for log in self.logs for sr in log.values() for c in sr.record.contributors}

    def _publishes(self, donor: str, p: int, held) -> bool:
        """Whether a live member other than ``donor`` and this node, one that may hold state (not a client
        or an open learner, as in ``backed``) and whose work this node merged (``workers``), publishes a
        head (round, hash) of fragment p that ``held`` accepts."""
        workers = self.workers()
        for q, m in self.live_members().items():
            h = m.heads.get(str(p))
            if q in (donor, self.peer_id) or m.client_mode or q not in workers or not h or len(h) < 2:
                continue
            if held(h):
                return True
        return False

    def unwitnessed(self, donor: str, st: FragmentState) -> bool:
        """No other member publishes the snapshot's head, while one publishes a round of this node's own
        chain (its head, or a round its log holds): the donor's word against the swarm's."""
        p = st.fragment
        if self._publishes(donor, p, lambda h: (int(h[0]), str(h[1])) == (st.round, st.hash)):
            return False
        return self._publishes(donor, p, lambda h: self.hash_at(p, int(h[0])) == str(h[1]))

    async def _check_snapshot(self, donor: str, st: FragmentState, yielding: bool = False) -> None:
        """Let ``st`` in (return), or raise ``forged_snapshot`` (scored against the donor) when the donor's
        own records refute it, or ``UnwitnessedSnapshot`` (not scored: an honest lone head can meet it)
        when nothing checks it and the swarm does not hold it (``unwitnessed``; never when ``yielding`` to
        the majority's head). Only a fork shallower than the records kept can be checked, so the records
        are asked for only then: a joiner does not download them in vain."""
        p = st.fragment
        rep = self.replicas[p]
        checked = None
        if st.round - rep.round <= self.pcfg.history:  # a round of ours may be within the donor's records
            try:
                checked = await self._records_reach(donor, st)
            except (TransportError, ProtocolError):
                checked = None
        if checked is None and not yielding and self.unwitnessed(donor, st):
            self.transport._count("unwitnessed_snapshot")
            self.events.emit("unwitnessed_snapshot", t=time.time(), fragment=p, peer=donor, round=st.round)
            raise UnwitnessedSnapshot(
                f"snapshot of fragment {p} at round {st.round} from {donor}: no chain of records reaches it "
                "and no other member holds it, while ours has a witness"
            )
        if checked is not False:
            return
        code = RejectCode.FORGED_SNAPSHOT
        self.transport._count(code.value)
        self.events.emit(code.value, t=time.time(), fragment=p, peer=donor, round=st.round)
        self.penalise(donor, code, signed=True)
        raise ProtocolError(
            code,
            f"snapshot of fragment {p} at round {st.round} from {donor}: not the state its own records reach",
        )
