"""A node's view of its swarm (docs/design.md, section 4, "Membership"): its own signed membership
record, the live members it reads every heartbeat, the heads they publish and the synchroniser each
fragment's open round has in that view, the DHT links it keeps (``Membership.relink``). ``SwarmView`` is a
component the node builds from its state; the parts made when the node runs (its ``Membership``, its loop's
clock, its addresses, the catch-up's reconcile) are handed over by ``start``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection

from dht.launch import peer_ids_of
from dht.records import Member, eligible
from dht.swarm import get_dht_time
from node.common.lifetime import parent_gone
from node.swarm.settings import NodeSettings
from node.swarm.wire import FragmentState
from protocol.election import candidates, head_key
from protocol.errors import ProtocolError, RejectCode
from protocol.synchroniser import on_membership

logger = logging.getLogger(__name__)
VERSION = "ddiloco/0.3"
HEAD_SLACK = 2  # rounds a published head may be ahead of ours without other members' word for it
RELINK_MEMORY_S = 600.0  # a member not seen in any view for this long is no longer relinked


LIFETIME_TTLS = 2.0  # a record counts at most this many ttl_s after it was issued, whatever its expires_at
# a learner counts in a robust round's quorum and share while its work was merged here within this many of
# the fragment's round periods (``protocol.synchroniser.quorum_basis``): a learner on time is merged in every
# fragment about once a period, a Sybil identity with no process behind it never is (at 3 periods, 3 real
# nodes on a loaded machine counted only 2 of themselves at times, and took a lone learner's round as quorum)
WORKING_ROUNDS = 8.0
# a public swarm elects only members whose work was merged once a node has watched it merge this many of a
# fragment's round periods (``workers``): every learner on time is credited in a record by then. Until then
# every member is electable, and 64 identities with no process behind them won most rounds: at 8 periods the
# first 10 s of a bench run failed over past them 73-135 times a node
ELECT_WATCH_ROUNDS = 3.0
# the election fence (``Replication.signer_electable``) refuses records only once the chain credits this many
# members: a member's own records never credit it, so a node that merged alone is credited by its first
# joiner's record alone, and for a moment its view elects no one but itself
ELECT_CREDITED = 2
# a member whose record left this node's view is still answered this many ttl_s (``recent``): on a link its
# own payload fills, a member's stores reach a peer late, its record expires there for a few seconds, and
# every request it made meanwhile (records, snapshots, its contributions, a record it pushed) was refused
# ``unknown_peer`` (410 refusals in 2 minutes at 1 Mbit/s): the catch-ups that would have joined the chains
# failed, and the swarm stayed on 4 hashes with its learners paused
RECENT_TTLS = 8.0
VIEW_HOLD_TTLS = 3.0  # while membership reads fail, the last good view is held this many ttl_s at most


def credits(signer: str, learner: str, me: str) -> bool:
    """Whether a record ``signer`` signed credits its contributor ``learner`` in the view of node ``me``: one
    signed by another member does. A member's own records never credit it, or one that signs records naming
    itself alone (that no one elected) would make itself electable by them; except to itself: this node's
    own records credit this node in its own view, which knows its learner's work is real (a node that merged
    alone beside a member with no process behind it, crediting only that member, elected it, and nobody
    merged)."""
    return learner != signer or signer == me


class SwarmView:
    """Membership, heads and election. ``joining()``: whether this node is still without a state (it then
    publishes no heads); ``renounced()``: the rounds it renounces (``Receipts.renounced_now``);
    ``decide(p, decision)``: a synchroniser's decision carried out (``node.swarm.replication``);
    ``spawn(coro)``: a task of the node's; ``request_stop(why)``: stop the node."""

    def __init__(
        self,
        settings,
        pcfg,
        peer_id: str,
        admission,
        replicas: list,
        heads: list,
        logs: list,
        leases: dict[int, int],
        syncs: list,
        suspect: dict[str, float],
        peer_scores,
        work,
        agreement,
        learner,
        learner_loop,
        events,
        *,
        joining: Callable[[], bool],
        renounced: Callable[[], dict],
        decide: Callable,
        spawn: Callable,
        request_stop: Callable[[str], None],
    ) -> None:
        self.settings, self.pcfg, self.peer_id, self.admission = settings, pcfg, peer_id, admission
        self.replicas, self.heads, self.logs, self.leases, self.syncs = replicas, heads, logs, leases, syncs
        self.suspect, self.peer_scores, self.work, self.agreement = suspect, peer_scores, work, agreement
        self.learner, self.learner_loop, self.events = learner, learner_loop, events
        self.joining, self.renounced, self.decide = joining, renounced, decide
        self.spawn, self.request_stop = spawn, request_stop
        self.members: dict[str, Member] = {}  # the last view read, without this node; replaced whole
        self.last_in_view: dict[str, float] = {}  # member -> when a view last held it (this node's clock)
        self.blocked: set[str] = set()  # test hook: peers treated as unreachable (a partition)
        self.published_self: Member | None = None  # this node's membership record as peers read it
        self._unknown_asked: dict = {}  # unknown caller -> (when we last re-read the view for it, that read)
        # (member, fragment, round) -> (when first seen, the swarm's summed steps then) of the leases published
        self.lease_seen: dict[tuple[str, str, int], tuple[float, int]] = {}
        self.swarm_steps = 0
        # Peers to keep in the DHT's routing table: the initial peers, and members seen in the last views.
        self.peer_book: dict[str, float] = dict.fromkeys(
            peer_ids_of(NodeSettings.split(settings.initial_peers)), float("inf")
        )
        self._relinking: asyncio.Task | None = None
        self._last_good_read = float("-inf")  # DHT time of the last membership read that succeeded
        self._read_failing = False  # the last membership read failed
        # made when the node runs (``start``)
        self.membership = None
        self.clock: Callable[[], float] | None = None
        self.addrs: list[str] = []
        self.reconcile: Callable[[], None] | None = None

    def start(
        self, membership, clock: Callable[[], float], addrs: list[str], reconcile: Callable[[], None]
    ) -> None:
        """The parts made when the node runs: its membership on the DHT, its loop's clock, the addresses it
        publishes and the catch-up's reconcile (each heartbeat)."""
        self.membership, self.clock, self.addrs, self.reconcile = membership, clock, addrs, reconcile

    def _view_horizon(self, now: float) -> float:
        """The time a member's record must outlive to be in the view: now; but while membership reads fail,
        the time of the last good read, held at most ``VIEW_HOLD_TTLS`` x ttl_s (then records expire that
        much late). A read that fails must not empty the view: every node alone would split the swarm."""
        if not self._read_failing:
            return now
        return min(now, max(self._last_good_read, now - VIEW_HOLD_TTLS * self.settings.ttl_s))

    def learner_only(self) -> bool:
        """Admitted to learn, never to synchronise (an open learner, or a ``learner`` certificate): its own
        view and its record say so, as every other member's view does (``dht.records.live_view``). Its own
        view said it was electable: it took rounds that every other member then refused."""
        adm = self.admission
        return adm is not None and (adm.certificate is None or adm.certificate.role == "learner")

    def self_member(self, now: float) -> Member:
        return Member(
            peer_id=self.peer_id,
            addrs=tuple(self.addrs),
            version=VERSION,
            issued_at=now,
            expires_at=now + self.settings.ttl_s,
            tokens_per_s=self.learner_loop.tokens_per_s(),
            client_mode=self.settings.client_mode or self.learner_only(),
            # none while joining: a joiner's round 0 is no state to vouch with, and three nodes that joined
            # at once counted each other's round 0 against a swarm 15 rounds on and all started fresh
            heads={} if self.joining() else {str(p): list(h) for p, h in enumerate(self.heads)},
            step=self.learner.book.step,
            steps_per_s=self.learner_loop.steps_per_s(),
            cert=self.admission.certificate.to_json() if getattr(self.admission, "certificate", None) else "",
            leases={str(p): r for p, r in self.leases.items() if r == self.replicas[p].round + 1},
            renounced=self.renounced(),
        )

    def live_members(self) -> dict[str, Member]:
        now = get_dht_time()
        horizon = self._view_horizon(now)
        banned = self.peer_scores.banned_until
        ttl = self.settings.ttl_s
        view = {
            pid: m
            for pid, m in self.members.items()
            # a record lives ttl_s as published; one that claims more (or an issue time ahead of the clock by
            # over a ttl_s) counts only up to its issue time plus LIFETIME_TTLS x ttl_s
            if min(m.expires_at, m.issued_at + LIFETIME_TTLS * ttl) > horizon
            and m.issued_at <= now + ttl
            and pid not in self.blocked
            and pid not in banned
        }
        view[self.peer_id] = self.self_member(now)
        return view

    def head_key(self, h) -> tuple:
        return head_key(int(h[0]), int(h[2]), float(h[3]), str(h[1]))

    def voters(self, p: int, members: dict[str, Member]) -> dict[str, Member]:
        """Whose head counts in a majority of heads (``backed``, ``outvoted``): in a public swarm whose workers
        this node knows, workers and members with a process behind them (in its DHT routing table), not 32
        free signed records echoing one head; else everyone."""
        workers = self.workers(p, members) if self.settings.elect_workers else members
        if workers is members:  # everyone: a private swarm, or this node cannot tell workers yet
            return members
        alive = self.membership.processes
        return {q: m for q, m in members.items() if q in workers or q in alive}

    def backed(self, p: int, pid: str, round_: int, members: dict[str, Member], voters=None) -> bool:
        """Whether a majority of the other reachable members (not ``pid``, not this node) that publish a head
        of fragment p publish one at most ``HEAD_SLACK`` rounds below ``round_``, counting ``voters`` only
        (given, where the caller took them already).
        With no other member to ask: True. A member that publishes no head of p holds no state of it to
        vouch with: counted, two such records (a hostile member's, in a test) outvoted an honest node's
        word, and a node that fell behind never followed the swarm again."""
        others = [
            m
            for q, m in (self.voters(p, members) if voters is None else voters).items()
            if q not in (pid, self.peer_id) and not m.client_mode and m.heads.get(str(p))
        ]
        backing = sum(1 for m in others if m.head_round(p) >= round_ - HEAD_SLACK)
        return backing >= (len(others) + 1) // 2

    def credible(self, p: int, pid: str, round_: int, members: dict[str, Member]) -> bool:
        """Whether ``pid``'s claim to hold round ``round_`` of fragment p may make it the synchroniser this
        node elects, or give this node a snapshot to install. A membership record is the claimant's word
        alone: a claim within ``HEAD_SLACK`` rounds of our own is taken; one further ahead needs the word of
        a majority of the other members (``backed``). A node that really fell behind finds the rest of the
        swarm agreeing; a lone member claiming a thousand rounds more does not. A head only
        ``history`` rounds ahead may still be followed by records (``within_records``): each is checked."""
        return round_ <= self.replicas[p].round + HEAD_SLACK or self.backed(p, pid, round_, members)

    def within_records(self, p: int, round_: int) -> bool:
        return round_ - self.replicas[p].round <= self.pcfg.history

    def winning_heads(
        self, p: int, members: dict[str, Member], strict: bool = False, refused: Collection = ()
    ) -> tuple[list | None, list[str]]:
        """The best head of fragment p among reachable ``members`` and the peers holding it, if it beats
        ours; else (None, []). A head must be ``credible``, or (unless ``strict``: a snapshot will be
        fetched) close enough to follow by records; not one of ``refused`` (round, hash)."""
        best_key, best_head, holders = self.head_key(self.heads[p]), None, []
        for pid, m in sorted(members.items()):
            h = m.heads.get(str(p))
            if (
                pid == self.peer_id
                or m.client_mode
                or not h
                or len(h) < 4
                or (int(h[0]), str(h[1])) in refused
            ):
                continue
            r = int(h[0])
            if not self.credible(p, pid, r, members) and (strict or not self.within_records(p, r)):
                continue
            k = self.head_key(h)
            if k < best_key:
                best_key, best_head, holders = k, h, [pid]
            elif k == best_key and holders:
                holders.append(pid)
        return best_head, holders

    def outvoted(self, p: int, members: dict[str, Member]) -> tuple[list | None, list[str]]:
        """The majority's head of fragment p when this node's own is a lone outlier on another chain (it raced
        ahead of a majority that then merged rounds of its own): the majority does not follow a head it does
        not back, so this node yields to theirs, or the swarm would stay split (``voters`` counted only).
        (None, []) when our head is backed, when the others are merely behind on our own chain (they catch up
        by records), or with fewer than two others to ask. The head yielded to is one two or more members
        publish: a yield takes a snapshot with no other check, and the best-ranked head of one member was a
        liar's a round past the rest, with an all-zero state behind it. (Counting only members whose work this
        node merged split an unattacked bench run for good: three nodes that joined fresh beside a swarm 15
        rounds on merged rounds of their own, and the two ahead had merged none of their work.)"""
        ours = self.heads[p]
        r = int(ours[0])
        voters = self.voters(p, members)  # once: each ``backed`` below counts the same
        others = {
            q: m for q, m in voters.items() if q != self.peer_id and not m.client_mode and m.heads.get(str(p))
        }
        if len(others) < 2 or self.backed(p, self.peer_id, r, members, voters):
            return None, []
        groups: dict[tuple, list[str]] = {}
        for q, m in sorted(others.items()):
            h = m.heads[str(p)]
            if len(h) < 4 or not self.backed(p, q, int(h[0]), members, voters):
                continue
            mine = self.logs[p].get(int(h[0]))
            if (int(h[0]), str(h[1])) == (r, ours[1]) or (mine is not None and mine.record.new_hash == h[1]):
                continue  # our own chain
            groups.setdefault(tuple(h), []).append(q)
        held = [(self.head_key(h), list(h), qs) for h, qs in groups.items() if len(qs) >= 2]
        return min(held)[1:] if held else (None, [])

    def candidates(self, p: int, dead: Collection[str] = (), leases: bool = True) -> list[str]:
        """Fragment p's synchroniser and its failovers, in order. Eligibility (``dht.records.eligible``) is judged
        without the peers found dead (``dead``, from a sender) or suspected here: a member that claims the
        newest head but takes no contribution (a hung process, or one that answers ``unknown_op``) would
        otherwise stay the only candidate, and the fragment would merge nothing until its record expired.
        ``leases``: a member that claims the open round's lease goes first (False: the rendezvous order)."""
        members = self.live_members()
        open_round = self.replicas[p].round + 1
        # Eligibility from what every peer can read: this node's own record as published, not its fresh
        # head. Right after applying a round, every node is at the newest round in its own fresh view while
        # the others' records still show the round before, so each would elect itself and fork the chain.
        seen = dict(members)
        own = self.published_self
        if own is not None and own.expires_at > get_dht_time():
            seen[self.peer_id] = own
        now = time.monotonic()
        seen = {
            q: m
            for q, m in seen.items()
            if q == self.peer_id
            or (
                q not in dead
                and self.suspect.get(q, 0.0) <= now
                and self.credible(p, q, m.head_round(p), seen)
            )
        }
        if self.settings.elect_workers:
            seen = self.workers(p, seen)
        # those that took this round and will not sign it (``Receipts.renounce``) hand it on, if one is left
        out = {q for q, m in seen.items() if q != self.peer_id and m.renounced.get(str(p)) == open_round}
        # its own from its book, not its record as last published: renounced a moment ago, its own re-sent
        # contribution went back to it until the next heartbeat
        out |= {self.peer_id} if self.renounced().get(str(p)) == open_round else set()
        elig = eligible(list(seen.values()), p)
        elig = [q for q in elig if q not in out] or elig
        order = candidates(self.settings.swarm, p, open_round, elig)
        holders = (
            sorted(pid for pid in elig if members[pid].leases.get(str(p)) == open_round) if leases else []
        )
        if holders:
            order = [holders[0]] + [x for x in order if x != holders[0]]
        return order

    def workers(self, p: int, seen: dict[str, Member]) -> dict[str, Member]:
        """The members of ``seen`` whose learner is credited on the chain this node follows (``elect`` workers,
        ``WorkBook.workers``; against Sybils: 32 free copies of one record won rounds, and senders failed
        over past each 600-1,900 times a run). Nodes on one chain hold the same credits; the set is not
        windowed, so views do not part as learners pause. ``seen`` itself while this node cannot tell yet."""
        window = ELECT_WATCH_ROUNDS * self.syncs[p].due_every
        workers = self.work.workers(seen, time.monotonic(), window, self.logged_learners())
        if not workers:
            return seen
        return {q: m for q, m in seen.items() if q in workers}

    def logged_learners(self) -> set[str]:
        """The learners the records this node's logs hold credit (``WorkBook.workers``; ``credits``)."""
        return {
            c[0]
            for log in self.logs
            for sr in log.values()
            for c in sr.record.contributors
            if credits(sr.signer, c[0], self.peer_id)
        }

    def credit_snapshot(self, st: FragmentState) -> None:
        """On installing snapshot ``st``, before its fragment's log is cleared: the learners its chain credits
        (its merged ids, its donor's credits) settle, and of our log's records, only those too deep for a
        fork the snapshot resolved to undo."""
        deep = [sr for r, sr in self.logs[st.fragment].items() if r <= st.round - self.pcfg.history]
        learners = (
            c[0] for sr in deep for c in sr.record.contributors if credits(sr.signer, c[0], self.peer_id)
        )
        self.work.settle(learners, st.merged, st.credited)

    def rounds_behind(self, p: int) -> int:
        """How many rounds of fragment p the newest published head is ahead of ours (0 if none is)."""
        members = self.members
        heads = [
            m.head_round(p)
            for pid, m in members.items()
            if not m.client_mode and self.credible(p, pid, m.head_round(p), members)
        ]
        return max(0, max(heads, default=0) - self.replicas[p].round)

    def synchroniser_of(self, p: int, dead: Collection[str] = ()) -> str | None:
        """Who should take fragment p's open round in our view, leaving out peers a sender found dead."""
        order = [x for x in self.candidates(p, dead) if x not in dead]
        return order[0] if order else None

    async def heartbeat(self) -> None:
        """Publish our record, then re-read the view whether or not the write went through: a write can
        fail while reads work (one DHT peer that refuses our records, e.g. one holding junk over the key),
        and a view left unread that long lets every record in it expire: the node alone, the swarm split."""
        try:
            await asyncio.to_thread(self.membership.publish, self.self_member(get_dht_time()))
        except Exception as e:  # noqa: BLE001 - the DHT is flaky under load; the next beat retries
            logger.warning("heartbeat failed: %s", e)
        await self.refresh()

    async def refresh(self) -> None:
        """Re-read the membership key: the live view, and the live set each synchroniser counts."""
        try:
            members, dropped = await asyncio.to_thread(self.membership.live)
        except Exception as e:  # noqa: BLE001 - the DHT is flaky under load; the next beat retries
            logger.warning("reading the membership failed (holding the last good view): %s", e)
            self._read_failing = True
            return
        self._read_failing, self._last_good_read = False, get_dht_time()
        self.members = {m.peer_id: m for m in members if m.peer_id != self.peer_id}
        seen = self.clock()
        for pid in self.members:
            self.peer_book[pid] = max(seen, self.peer_book.get(pid, seen))
            self.last_in_view[pid] = seen
        if len(self.last_in_view) > 4 * len(self.members) + 64:
            horizon = seen - RECENT_TTLS * self.settings.ttl_s
            self.last_in_view = {q: t for q, t in self.last_in_view.items() if t >= horizon}
        # when each lease a member publishes was first seen here (``Intake.stalled_here``): the
        # evidence that a member took a round and did not merge it runs from then, not from the round's slot
        # (and the swarm's summed published learner steps then: a round held open while no learner worked,
        # a swarm at rest, is starved, not stalled)
        self.swarm_steps = sum(m.step for m in members)
        old, self.lease_seen = self.lease_seen, {}
        for pid, m in self.members.items():
            for frag, r in m.leases.items():
                self.lease_seen[(pid, frag, r)] = old.get((pid, frag, r), (seen, self.swarm_steps))
        self.published_self = next((m for m in members if m.peer_id == self.peer_id), None)
        for pid, why in dropped.items():
            logger.debug("membership record %s dropped: %s", pid, why)
        live = frozenset(self.live_members())
        now, mono = self.clock(), time.monotonic()
        for p in range(len(self.syncs)):
            st = self.syncs[p]
            working = self.work.working(live, mono, WORKING_ROUNDS * st.due_every)
            if self.pcfg.distrust and self.agreement.out:
                # a learner this node refuses is no part of the quorum it waits for: with 2 of 6 refused,
                # every robust round waited for 5 learners of 4 coming, a period each (protocol.quorum)
                working = (live if working is None else working) - self.agreement.out
            if st.live != live or st.working != working:
                self.decide(p, on_membership(self.pcfg, st, live, now, working))

    async def heartbeat_loop(self) -> None:
        while True:
            if self.settings.exit_with_parent and parent_gone():
                self.request_stop("the launching process is gone")
            t0 = self.clock()
            try:
                await self.heartbeat()
                self.reconcile()
            except Exception:  # noqa: BLE001 - one bad beat must not end them: a node whose heartbeats stop
                # leaves every view and never reconciles again (a race in one beat, ``deque mutated during
                # iteration``, kept a node on its own forks for the rest of a test run)
                logger.exception("heartbeat failed; the next one comes in %.1f s", self.settings.heartbeat_s)
            if self._relinking is None or self._relinking.done():
                self._relinking = self.spawn(self.relink())
            await asyncio.sleep(max(0.05, self.settings.heartbeat_s - (self.clock() - t0)))

    async def relink(self) -> None:
        """Put back into the DHT's routing table the peers it lost (``Membership.relink``): initial peers, and
        members seen within ``RELINK_MEMORY_S`` (in a public swarm, those whose work was merged here, once this
        node can tell: ``workers``). Without it a saturated link can cut a node off for good."""
        now = self.clock()
        self.peer_book = {p: t for p, t in self.peer_book.items() if now - t <= RELINK_MEMORY_S}
        book = list(self.peer_book)
        if self.settings.elect_workers and self.syncs:
            # an identity with no process behind it is never in the routing table, so every beat pinged each
            # one again, and each ping dialled it (64 Sybils: the honest p2p daemons' CPU up 60%)
            book = list(self.workers(0, dict.fromkeys(book)))
        try:
            first = peer_ids_of(NodeSettings.split(self.settings.initial_peers))
            back = await asyncio.to_thread(self.membership.relink, book, first)
        except Exception as e:  # noqa: BLE001 - the DHT is flaky under load; the next beat retries
            logger.warning("relinking the DHT failed: %s", e)
            return
        if back:
            logger.warning("the DHT had lost %d known peer(s); they answered and are linked again", len(back))
            self.events.emit("relink", t=time.time(), peers=back)

    async def known(self, caller: str) -> bool:
        """Whether ``caller`` is a live member, or was one lately (``recent``); raises ProtocolError(BANNED) for
        a banned peer."""
        self.peer_scores.check(caller, time.monotonic())
        if caller in self.blocked:
            return False
        if caller == self.peer_id or self.recent(caller):
            return True
        return await self.look_up(caller)

    def recent(self, peer: str) -> bool:
        """Whether ``peer`` is in the view, or was in one in the last ``RECENT_TTLS`` x ``ttl_s``: who this node
        answers and takes records from. Elections, quorums and live sets read the view alone."""
        if peer in self.members:
            return True
        seen = self.last_in_view.get(peer)
        return seen is not None and self.clock() - seen <= RECENT_TTLS * self.settings.ttl_s

    async def look_up(self, peer: str) -> bool:
        """Whether ``peer``, not in our view, has just joined: re-read the view (no DHT write), at most once a
        heartbeat per peer, so a peer we do not know cannot make us hammer the DHT. Its requests that come
        while that re-read runs wait for it: a restarted node asks for every fragment at once, and all but
        the first were refused as ``unknown_peer``, which put the whole catch-up back by a heartbeat.

        A request waits for that re-read at most half its deadline (``rpc_timeout_s``), then is answered from the
        view as it stands: a DHT slowed by the host's load once held a stranger's request past its deadline,
        and the caller got a broken stream instead of ``unknown_peer``. The re-read itself goes on."""
        now = self.clock()
        asked, read = self._unknown_asked.get(peer, (float("-inf"), None))
        if now - asked >= self.settings.heartbeat_s:
            if len(self._unknown_asked) > 1024:
                self._unknown_asked = {}
            read = asyncio.ensure_future(self.refresh())
            self._unknown_asked[peer] = (now, read)
        if read is not None and not read.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(read), self.settings.rpc_timeout_s / 2)
        return peer in self.members

    async def admit(self, caller: str, op: str) -> None:
        """The transport's admission check, before it reads a request's body: a stranger's upload is refused
        ``unknown_peer`` (a banned peer's ``banned``) without a byte of it being read."""
        if not await self.known(caller):
            raise ProtocolError(
                RejectCode.UNKNOWN_PEER,
                f"{op} from {caller}: not a live member of swarm {self.settings.swarm}",
            )

    def swarm_step(self) -> float | None:
        """Where the peers' fragment schedules are now, in steps (the furthest peer, fractions included), or
        None when no peer has stepped yet.

        Each peer's step is extrapolated from when its membership record was issued at its published step
        rate. Read from the learner thread: ``members`` is only ever replaced whole."""
        now = get_dht_time()
        steps = [
            m.step + max(0.0, now - m.issued_at) * m.steps_per_s for m in self.members.values() if m.step > 0
        ]
        return max(steps, default=None)
