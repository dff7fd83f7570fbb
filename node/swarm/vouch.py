"""Whether a snapshot may enter a replica (issue 31, item 3; docs/security.md, "Snapshots"). A snapshot is
the donor's word for a fragment's whole state: its tensors hash to the head it names, but nothing in them
shows that head was ever merged. So a node installs one only when

* other members, each answering for itself over its own authenticated stream (the ``head`` op), hold or
  held that head: in a private swarm one other member; in a public swarm a majority of those asked; or
* nobody else publishes a head of the fragment (a swarm of two: the donor's word is all there is); or
* the snapshot is the state the donor's own signed records reach from a round this replica still keeps
  (``protocol.chain``): the fork that a snapshot usually repairs. A snapshot that is *not* the state its
  donor's records reach is a lie only its donor can have told: ``forged_snapshot``, scored like a forged
  record.

A mixin of ``node.swarm.agent.Node``, like ``node.swarm.catch_up``."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

from node.swarm.memory import momentum_lent
from node.swarm.transport import Reply, TransportError
from node.swarm.wire import FragmentState, decode_record, parse_records_request, unpack_list
from protocol.chain import snapshot_mismatch
from protocol.errors import ProtocolError, RejectCode

logger = logging.getLogger(__name__)
WITNESSES_MAX = 8  # members asked about one snapshot's head
WITNESS_TRIES = 3  # rounds of asking, half a heartbeat apart (a witness may apply the round a moment late)


def enough_witnesses(confirmed: int, asked: int, public: bool) -> bool:
    """Whether ``confirmed`` of ``asked`` other members holding a snapshot's head let it in."""
    if asked == 0:
        return True
    return confirmed >= (max(1, (asked + 1) // 2) if public else 1)


def parse_head_reply(body: bytes) -> str | None:
    """The hash in a ``head`` reply, ``{"hash": "..." | null}``; None for anything else."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    h = doc.get("hash") if isinstance(doc, dict) else None
    return h if isinstance(h, str) and len(h) <= 128 else None


class Vouching:
    """The ``head`` op and the checks a snapshot passes before ``CatchUp._install_snapshot``."""

    def hash_at(self, p: int, round_: int) -> str | None:
        """Fragment p's hash at ``round_`` on this node's chain, while its head or log holds that round."""
        if self.heads[p][0] == round_:
            return self.heads[p][1]
        sr, after = self.logs[p].get(round_), self.logs[p].get(round_ + 1)
        if sr is not None:
            return sr.record.new_hash
        return after.record.parent_hash if after is not None else None  # the round a snapshot brought

    async def _h_head(self, caller: str, raw: bytes) -> Reply:
        """``{"fragment": p, "from": r}`` -> ``{"hash": h}``: the hash this node holds or held at round r of
        fragment p (null: not a round of its chain that it still knows)."""
        if not await self._known(caller):
            return Reply(False, RejectCode.UNKNOWN_PEER.value, f"{caller} is not a live member")
        try:
            p, r = parse_records_request(raw)
        except ProtocolError as e:
            return Reply(False, e.code.value, str(e))
        if p not in self.spec:
            return Reply(False, RejectCode.WRONG_FRAGMENT.value, f"fragment {p} does not exist")
        return Reply(True, body=json.dumps({"hash": self.hash_at(p, r)}).encode())

    async def _witnesses(self, st: FragmentState, donor: str) -> tuple[int, int]:
        """(members that confirm ``st``'s head, members asked): the live members other than this node and
        the donor that publish a head of the fragment, at most ``WITNESSES_MAX`` of them, asked at once."""
        p = st.fragment
        asked = [
            q
            for q, m in self.live_members().items()
            if q not in (self.peer_id, donor) and not m.client_mode and m.heads.get(str(p))
        ]
        asked = random.sample(asked, min(len(asked), WITNESSES_MAX))
        req = json.dumps({"fragment": p, "from": st.round}).encode()
        deadline = min(2.0, self.settings.rpc_timeout_s)

        async def one(q: str) -> bool:
            try:
                reply = await self.transport.call(q, "head", req, timeout_s=deadline)
            except TransportError:
                return False
            return reply.ok and parse_head_reply(reply.body) == st.hash

        return sum(await asyncio.gather(*(one(q) for q in asked))), len(asked)

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

    async def _check_snapshot(self, donor: str, st: FragmentState) -> None:
        """Let ``st`` in (return) or raise ProtocolError: ``forged_snapshot`` (scored against the donor) when
        its own records refute it, ``unvouched`` otherwise (not scored: a catch-up tries again later)."""
        public = self.admission is None
        checked = None
        for attempt in range(WITNESS_TRIES):
            confirmed, asked = await self._witnesses(st, donor)
            if enough_witnesses(confirmed, asked, public):
                return
            if attempt == 0:
                try:
                    checked = await self._records_reach(donor, st)
                except (TransportError, ProtocolError):
                    checked = None
                if checked is not None:
                    break
            await asyncio.sleep(self.settings.heartbeat_s / 2)
        if checked:
            return
        p = st.fragment
        code = RejectCode.FORGED_SNAPSHOT if checked is False else RejectCode.UNVOUCHED
        self.transport._count(code.value)
        self.events.emit(code.value, t=time.time(), fragment=p, peer=donor, round=st.round)
        if checked is False:
            self.penalise(donor, code, signed=True)
        raise ProtocolError(
            code,
            f"snapshot of fragment {p} at round {st.round} from {donor}: "
            + (
                "not the state its own records reach"
                if checked is False
                else f"{confirmed} of {asked} other members hold it, and no record chain leads to it"
            ),
        )
