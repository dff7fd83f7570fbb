"""A snapshot checked against its donor's own records before it enters a replica
(docs/security.md, "Snapshots"). A snapshot is the donor's word for a fragment's whole state: its
tensors hash to the head it names, but nothing in them shows that head was ever merged. Where this replica
still keeps a round that the donor's chain leaves from (a fork a round or two deep: what a snapshot
usually repairs), the node walks its own outer steps back to that round, takes the donor's signed records
forward, each checked like any record, and compares (``protocol.chain``). A snapshot that is not the state
its donor's own records reach is a lie only the donor can have told: ``forged_snapshot``, scored like a
forged record, and not installed. Where no such chain exists (a join, a node far behind, a fork deeper
than the records kept) the snapshot is taken on the donor's word and its hash, with one exception
(``unwitnessed``, checked before anything is downloaded): no member whose work this node ever merged
publishes the donor's head (an identity that only publishes records vouches for nothing), while another
member publishes a round of this node's own chain. A member a round ahead serving an all-zero state
with no records behind it was installed by every node that caught up from it. The other side of
an honest split deeper than the records kept is made of members this node merged before the split: their
head has witnesses, and is taken as before.

Tried and not kept: requiring, where no chain exists, that other members confirm the head whatever the
state of ours (a ``head`` op). Under load (3 nodes beside a 2,000-member crowd on 2 cores, and the fast
test swarm of ``ddiloco up``) honest splits arose that only one node's head could repair, no other member
could confirm and no chain joined; the nodes ended on three hashes (docs/security.md, "Known limits"). A
node whose own chain has no witness (a joiner, a node restarted, a three-way split) takes such a head as
before, unless two or more witnesses agree on another head: then it looks past the refused head
(``refused_heads``) to the best one it can take.

``SnapshotVetting`` is a part the node owns (``Node.vetting``, made with its transport when the node runs):
catch-up (``node.swarm.catch_up``) asks it which donors a joiner downloads from, whether a head may be
fetched and a fetched snapshot let in, and tells it where each snapshot came from."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from node.swarm.memory import momentum_lent
from node.swarm.transport import TransportError
from node.swarm.wire import FragmentState, decode_record, unpack_list
from protocol.chain import snapshot_mismatch
from protocol.errors import ProtocolError, RejectCode

if TYPE_CHECKING:
    from collections import OrderedDict

    from dht.records import Member
    from node.common.events import EventLog
    from node.swarm.settings import NodeSettings
    from node.swarm.transport import Transport
    from node.swarm.trust.work_book import WorkBook
    from node.swarm.wire import SignedRecord
    from protocol.config import ProtocolConfig
    from protocol.replica import FragmentReplica

logger = logging.getLogger(__name__)
# how long (x heartbeat_s) this node's head may stand with no member taking it while members it merged agree on
# another of the same round (``unfollowed``): a follower takes a head within about two heartbeats
LONE_HEARTBEATS = 8
# how long (x heartbeat_s) catch-up looks past a head refused as unwitnessed, to the best one it can take
REFUSED_HEARTBEATS = 8


class UnwitnessedSnapshot(TransportError):
    """A snapshot not fetched: no record chain checks it, no other member holds its head, ours has a witness."""


class SnapshotVetting:
    """The checks a head passes before its snapshot is fetched, and a snapshot before
    ``CatchUp.install_snapshot`` lets it in; the heads refused lately, and where each fragment's last
    snapshot came from.

    Its collaborators: the node's settings (``swarm``, ``heartbeat_s``), protocol configuration and
    fragment spec; its own peer id; the node's ``replicas``, ``heads`` and ``logs`` (one entry per fragment,
    replaced or cleared in place), which it reads to know its own chain; the node's ``WorkBook`` (whose work
    it merged: the witnesses); the transport, to ask donors for records and count refusals; ``events``,
    which it writes to; ``live_members`` and ``winning_heads`` of the node's membership view
    (``node.swarm.view``); and ``penalise``, which scores a peer for a refused message (a forged snapshot)."""

    def __init__(
        self,
        settings: NodeSettings,
        pcfg: ProtocolConfig,
        spec: dict,
        peer_id: str,
        replicas: Sequence[FragmentReplica],
        heads: Sequence[tuple],
        logs: Sequence[OrderedDict[int, SignedRecord]],
        work: WorkBook,
        transport: Transport,
        events: EventLog,
        live_members: Callable[[], dict[str, Member]],
        winning_heads: Callable[..., tuple[list | None, list[str]]],
        penalise: Callable[..., None],
    ) -> None:
        self.settings = settings
        self.pcfg = pcfg
        self.spec = spec
        self.peer_id = peer_id
        self.replicas = replicas
        self.heads = heads
        self.logs = logs
        self.work = work
        self.transport = transport
        self.events = events
        self.live_members = live_members
        self.winning_heads = winning_heads
        self.penalise = penalise
        self._took_from: dict[int, tuple[str, int]] = {}  # fragment -> (donor, round) of its last snapshot
        self._refused_heads: dict[int, dict[tuple[int, str], float]] = {}  # fragment -> head -> refused until
        # fragment -> ((our head, the head two or more others agree on), since when this node is alone on it)
        self._lone_since: dict[int, tuple[tuple, float]] = {}

    def hash_at(self, p: int, round_: int) -> str | None:
        """Fragment p's hash at ``round_`` on this node's chain, while its head or log holds that round."""
        if self.heads[p][0] == round_:
            return self.heads[p][1]
        sr, after = self.logs[p].get(round_), self.logs[p].get(round_ + 1)
        if sr is not None:
            return sr.record.new_hash
        return after.record.parent_hash if after is not None else None  # the round a snapshot brought

    async def _donor_chain(self, donor: str, p: int, round_: int, hash_: str) -> tuple[int, list] | None:
        """The donor's signed records from a round this replica keeps (the newest its chain leaves from) to
        head (``round_``, ``hash_``), each checked like any record: (that round, the records), or None."""
        rep = self.replicas[p]
        kept = [r for r in range(max(0, rep.round - self.pcfg.history), rep.round + 1) if rep.keeps(r)]
        if not kept or round_ <= kept[0]:
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
        # the newest round of ours the donor's chain leaves from, then its records up to the head
        ours = {r: self.hash_at(p, r) for r in kept}
        starts = [a for a in kept if a + 1 in recs and recs[a + 1].parent_hash == ours[a]]
        if not starts:
            return None
        chain, prev = [], ours[starts[-1]]
        for r in range(starts[-1] + 1, round_ + 1):
            rec = recs.get(r)
            if rec is None or rec.parent_hash != prev or rec.fragment != p:
                return None
            try:
                rep.check_record(rec, self.pcfg)  # a record our checks doubt proves nothing either way
            except ProtocolError:
                return None
            chain.append(rec)
            prev = rec.new_hash
        if prev != hash_ or not rep.keeps(starts[-1]):
            return None
        return starts[-1], chain

    async def _records_reach(self, donor: str, st: FragmentState) -> bool | None:
        """Whether ``st`` is the state the donor's signed records reach from a round this replica keeps:
        True, False (it is not: the donor lied), None (no such chain to check against)."""
        p = st.fragment
        rep = self.replicas[p]
        found = await self._donor_chain(donor, p, st.round, st.hash)
        if found is None:
            return None
        start, chain = found
        if not rep.keeps(start):  # a record applied meanwhile moved the replica past it
            return None
        lr, mu = self.pcfg.outer_lr, self.pcfg.outer_momentum
        back, theta, momentum = rep.past_steps(start), dict(rep.theta), dict(rep.momentum)
        forward = [(rec.grad, lr, mu) for rec in chain]
        with momentum_lent([rep]):  # a record applied meanwhile steps the momentum into new tensors
            why = await asyncio.to_thread(
                snapshot_mismatch, theta, momentum, back, forward, st.theta, st.momentum
            )
        if why is not None:
            logger.warning("fragment %d: the snapshot of %s at round %d: %s", p, donor, st.round, why)
        return why is None

    def _published(self, donor: str, p: int, held, workers: set[str] | None = None) -> bool:
        """Whether a live member other than ``donor`` and this node, one that may hold state (not a client or
        an open learner, as in ``backed``) and, given ``workers``, one of them, publishes a head (round,
        hash) of fragment p that ``held`` accepts."""
        for q, m in self.live_members().items():
            h = m.heads.get(str(p))
            if q in (donor, self.peer_id) or m.client_mode or not h or len(h) < 2:
                continue
            if (workers is None or q in workers) and held(h):
                return True
        return False

    def unwitnessed(self, donor: str, p: int, round_: int, hash_: str) -> bool:
        """The donor's word against the swarm's: no witness publishes the donor's head of fragment p, while
        a member publishes a round of this node's own chain (its head, or a round its log holds). A witness
        is a member whose work this node ever merged (``WorkBook.last_merged``, not only in the rounds its logs
        keep: the other side of a split deeper than those is made of members it merged before the split; an
        identity that only publishes records vouches for nothing); for a node that has merged no one's work
        yet (a joiner, a restart), any member that holds state: two nodes that joined a running swarm fresh
        (round 0) counted each other as witnesses of their round 0 and, with no worker to witness the
        swarm's head, refused it for the whole run. Ours needs no work to be witnessed: a node that had just
        downloaded its state took a liar's head a round ahead, and its neighbours then took it from it."""
        workers = set(self.work.last_merged) or None
        if self._published(donor, p, lambda h: (int(h[0]), str(h[1])) == (round_, hash_), workers):
            return False
        if self._published(donor, p, lambda h: self.hash_at(p, int(h[0])) == str(h[1])):
            return True
        # Right after a snapshot, this node knows no round of its chain but its head: the member it came
        # from, gone on a round, is its witness (a node took a liar's head 0.5 s after a snapshot, before
        # the next record came, while every honest member was one round past ours).
        took = self._took_from.get(p)
        m = self.live_members().get(took[0]) if took and took[0] != donor else None
        if m is not None and not m.client_mode and self.heads[p][0] == took[1] and m.head_round(p) >= took[1]:
            return True
        # Ours has no witness (a three-way split, a node alone on its fork): the donor's word still loses to a
        # head two or more witnesses agree on (this node then takes theirs: ``winning_heads`` passes over the
        # head refused here, ``unfollowed``). A node alone on its fork took a liar's all-zero head a round
        # past the rest, and its neighbours then took it from it.
        agreed: dict[tuple, int] = {}
        for q, m in self.live_members().items():
            h = m.heads.get(str(p))
            if q in (donor, self.peer_id) or m.client_mode or not h or len(h) < 2:
                continue
            if (workers is None or q in workers) and (int(h[0]), str(h[1])) != (round_, hash_):
                agreed[(int(h[0]), str(h[1]))] = agreed.get((int(h[0]), str(h[1])), 0) + 1
        return max(agreed.values(), default=0) >= 2

    def refused_heads(self, p: int) -> set[tuple[int, str]]:
        """Heads (round, hash) of fragment p refused here as unwitnessed lately: catch-up looks past them, to
        the best head it can take."""
        now = time.monotonic()
        return {k for k, until in self._refused_heads.get(p, {}).items() if until > now}

    def took_from(self, p: int, donor: str, round_: int) -> None:
        """Fragment p's state came from ``donor`` at ``round_`` by snapshot (``CatchUp.install_snapshot``)."""
        self._took_from[p] = (donor, round_)

    def unfollowed(self, p: int, members: dict) -> tuple[list | None, list[str]]:
        """The head of fragment p this node yields to (``CatchUp.catch_up``'s ``yielding``) when no other member takes
        its own: no member publishes our head, while two or more members whose work this node merged agree on
        another head of our round, or of an earlier round where our chain holds another hash (a fork), and
        have for ``LONE_HEARTBEATS`` heartbeats. Ours may rank first, but they
        refuse it when it is ``unwitnessed`` and no chain of our records reaches it from a round they keep (a
        fork deeper than the records kept), and ``outvoted`` does not move a node whose round the others
        share: under load a 2-to-1 split at one round stood until the run ended. (None, []) otherwise."""
        r, ours = int(self.heads[p][0]), str(self.heads[p][1])
        groups: dict[tuple, list[str]] = {}
        for q, m in sorted(members.items()):
            h = m.heads.get(str(p))
            if q == self.peer_id or m.client_mode or not h or len(h) < 4:
                continue
            if (int(h[0]), str(h[1])) == (r, ours):
                groups = {}  # a member holds ours
                break
            # ours, or (a lone head rounds past theirs, on another chain: its records are refused as
            # ``wrong_parent``, its snapshot as unwitnessed) a round below where our chain holds another hash
            # (the round just below: or none we know, our head having come by snapshot). Not only the round
            # just below: a node two rounds past a 2-to-1 fork, the others paused, stood until the run ended
            # (test_membership_at_size, one suite run). Further below, a hash we do not know is no fork: they
            # may be catching up on our chain
            k = int(h[0])
            ours_k = self.hash_at(p, k)
            behind = k < r and ours_k != str(h[1]) and (ours_k is not None or k == r - 1)
            if (k == r or behind) and q in self.work.last_merged:
                groups.setdefault(tuple(h), []).append(q)
        best = max(groups.items(), key=lambda kv: (len(kv[1]), kv[0][1]), default=(None, []))
        lone = self._lone_since
        if len(best[1]) < 2:
            lone.pop(p, None)
            return None, []
        key, now = (ours, best[0][1]), time.monotonic()
        if lone.get(p, (None, 0.0))[0] != key:
            lone[p] = (key, now)
        if now - lone[p][1] < LONE_HEARTBEATS * self.settings.heartbeat_s:
            return None, []
        return list(best[0]), best[1]

    async def signed_head(self, donor: str, p: int, head, tries: int = 3) -> bool:
        """Whether ``donor`` serves a signed record whose new hash is ``head`` (round, hash): the head was
        merged by someone who signed for it, not only claimed. (A head a snapshot brought to the donor has
        no record there: False.) A call refused or failed is tried again a heartbeat later, ``tries`` in
        all: a donor that did not know this joiner yet answered ``unknown_peer``, and the joiner started
        fresh beside a swarm 25 rounds on."""
        req = json.dumps({"fragment": p, "from": int(head[0])}).encode()
        for k in range(tries):
            if k:
                await asyncio.sleep(self.settings.heartbeat_s)
            try:
                reply = await self.transport.call(donor, "records", req)
                if not reply.ok:
                    continue
                for raw in unpack_list(reply.body):
                    rec = decode_record(raw, self.settings.swarm, self.spec).record
                    if rec.round == int(head[0]):
                        return rec.new_hash == str(head[1]) and rec.fragment == p
                return False
            except TransportError:
                continue
            except ProtocolError:
                return False
        return False

    def _unwitnessed_seen(self, p: int, donor: str, round_: int, hash_: str) -> None:
        """Count a head not taken (``unwitnessed_snapshot``: status's refusals, and an event); ``refused_heads``
        passes over it for ``REFUSED_HEARTBEATS``."""
        now = time.monotonic()
        refused = self._refused_heads.setdefault(p, {})
        for k in [k for k, until in refused.items() if until <= now]:
            del refused[k]
        refused[(round_, hash_)] = now + REFUSED_HEARTBEATS * self.settings.heartbeat_s
        self.transport.count_refusal("unwitnessed_snapshot")
        self.events.emit("unwitnessed_snapshot", t=time.time(), fragment=p, peer=donor, round=round_)

    async def join_donors(self, p: int, members: dict) -> list[str]:
        """The members a joiner downloads fragment p from: the holders of the best head (``winning_heads``),
        unless one member alone holds it and has no signed record of it: then the holders of the best
        other head, or none (a member a round ahead serving an all-zero state, from a swarm's start, was
        the first donor of every joiner, and they then vouched for it to the rest)."""
        head, holders = self.winning_heads(p, members, strict=True)
        if len(holders) != 1 or await self.signed_head(holders[0], p, head):
            return holders
        _, others = self.winning_heads(p, {q: m for q, m in members.items() if q != holders[0]}, strict=True)
        self._unwitnessed_seen(p, holders[0], int(head[0]), str(head[1]))
        return others  # none: this node starts from its own state, as the swarm's first nodes do

    async def vouch_head(self, donor: str, p: int, head) -> None:
        """Before a snapshot of ``head`` is fetched from ``donor``: raise ``UnwitnessedSnapshot`` (counted,
        not scored: an honest lone head can meet it) where the head is ``unwitnessed`` and no chain of the
        donor's records reaches it from a round this replica keeps (then ``check_snapshot`` compares)."""
        r, h = int(head[0]), str(head[1])
        unwitnessed = self.unwitnessed(donor, p, r, h)
        # Ours without a witness either (a node alone on its fork, in a three-way split) is no reason to take
        # a head no other member publishes on its donor's word alone: it needs the donor's checked records, or
        # (a fork deeper than the records kept: two nodes alone on two chains must still meet) a signed record
        # of the head on the donor, which ``check_snapshot`` then holds the state to where it can. With the
        # plain merge, a node alone on its fork took a liar's all-zero head a round past the rest, which has
        # no record (7 installs in one run of six).
        alone = not unwitnessed and not self._published(donor, p, lambda x: (int(x[0]), str(x[1])) == (r, h))
        if not unwitnessed and not alone:
            return
        chain = None
        if r - self.replicas[p].round <= self.pcfg.history:
            with contextlib.suppress(TransportError, ProtocolError):
                chain = await self._donor_chain(donor, p, r, h)
        if chain is not None or (alone and await self.signed_head(donor, p, head)):
            return
        self._unwitnessed_seen(p, donor, r, h)
        why = "ours has a witness" if unwitnessed else "no other member publishes it"
        raise UnwitnessedSnapshot(
            f"fragment {p}: {donor} holds round {r} alone, no chain of its records reaches it from ours, "
            f"and {why}: not fetched"
        )

    async def check_snapshot(self, donor: str, st: FragmentState) -> None:
        """Let ``st`` in (return), or raise ``forged_snapshot`` (scored against the donor) when the donor's
        own records refute it. Only a fork shallower than the records kept can be checked, so the records
        are asked for only then: a joiner does not download them in vain."""
        p = st.fragment
        rep = self.replicas[p]
        if st.round - rep.round > self.pcfg.history:  # no round of ours within the donor's records
            return
        try:
            checked = await self._records_reach(donor, st)
        except (TransportError, ProtocolError):
            checked = None
        if checked is not False:
            return
        code = RejectCode.FORGED_SNAPSHOT
        self.transport.count_refusal(code.value)
        self.events.emit(code.value, t=time.time(), fragment=p, peer=donor, round=st.round)
        self.penalise(donor, code, signed=True)
        raise ProtocolError(
            code,
            f"snapshot of fragment {p} at round {st.round} from {donor}: not the state its own records reach",
        )
