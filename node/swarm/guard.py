"""Defence against peers that lie: scores and bans, and replay memory (docs/design.md, section 5).

Every refusal of a message that an honest peer would not send (malformed, wrong shape, NaN, oversized norm,
bad signature, a replay, ...) lowers the sender's score by one; accepted work raises it back slowly (never
above zero). A peer whose score reaches ``-ban_after`` is banned for ``ban_s`` seconds: everything it sends
is refused with ``banned`` before it is decoded, and it leaves this node's view (never elected, never
pushed to). A forged or oversized merge record counts only against the peer that signed and pushed it;
one that breaks a rule every node checks alike bans its signer at once, here and, as evidence handed on,
on the other members (``node.swarm.evidence``).
Refusals that honest peers meet in normal operation (routing, a stale or future base, a record
that does not follow ours yet) cost nothing.

Replays: a contribution id that a merge record already merged is refused with ``replayed``; every node
learns merged ids from the records it applies, so a replay is refused by whichever node it is sent to.
The first copy of a merged id is an honest sender's re-send (its synchroniser merged, then the stream broke
before the reply, and the sender had not applied the record yet): it is answered as landed and costs its
sender nothing. Only a second copy is refused and counted.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Iterable

from protocol.errors import ProtocolError, RejectCode
from protocol.messages import cid_sender, sender_tag

logger = logging.getLogger(__name__)

HOSTILE = frozenset(
    {
        RejectCode.MALFORMED,
        RejectCode.WRONG_FRAGMENT,
        RejectCode.WRONG_SHAPE,
        RejectCode.NOT_FINITE,
        RejectCode.BAD_COUNTERS,
        RejectCode.TOO_LARGE,
        RejectCode.UNKNOWN_CODEC,
        RejectCode.BAD_SIGNATURE,
        RejectCode.REPLAYED,
        RejectCode.FORGED_SNAPSHOT,
    }
)


# Refusals only a liar earns, but only from the peer that signed the record: a record's signer pushes it
# (``RecordPush.broadcast``), and one fetched by catch-up may come from an honest holder.
SIGNED_LIES = frozenset({RejectCode.FORGED_RECORD, RejectCode.RECORD_TOO_LARGE})


class Guard:
    def __init__(self, ban_after: float = 10.0, ban_s: float = 300.0, remember: int = 65536) -> None:
        self.ban_after, self.ban_s, self.remember = ban_after, ban_s, remember
        self.scores: dict[str, float] = {}
        self.banned_until: dict[str, float] = {}
        self.bans = 0
        self._merged: OrderedDict[str, bool | None] = OrderedDict()  # merged id -> re-sent once already
        self._accused: dict[str, float] = {}  # peer -> until when its records do not lift its suspicion

    # ---------------------------------------------------------------- scores and bans
    def banned(self, peer: str, now: float) -> bool:
        until = self.banned_until.get(peer)
        if until is None:
            return False
        if now >= until:
            del self.banned_until[peer]
            self.scores[peer] = 0.0
            logger.warning("ban of %s ended", peer)
            return False
        return True

    def check(self, peer: str, now: float) -> None:
        if self.banned(peer, now):
            raise ProtocolError(
                RejectCode.BANNED, f"{peer} is banned for {self.banned_until[peer] - now:.0f} s more"
            )

    def penalise(self, peer: str, code: RejectCode, now: float, signed: bool = False) -> bool:
        """Count a refusal against ``peer`` (``signed``: of a record ``peer`` signed); True if this one got
        it banned."""
        if code not in HOSTILE and not (signed and code in SIGNED_LIES):
            return False
        score = self.scores.get(peer, 0.0) - 1.0
        self.scores[peer] = score
        return score <= -self.ban_after and self.ban(peer, now, f"score {score:.1f} after refused messages")

    def ban(self, peer: str, now: float, why: str = "evidence of a lie it signed") -> bool:
        """Ban ``peer`` for ``ban_s`` from ``now``; True if it was not banned already."""
        if self.banned(peer, now):
            return False
        self.banned_until[peer] = now + self.ban_s
        self.bans += 1
        logger.warning("banned %s for %.0f s: %s", peer, self.ban_s, why)
        return True

    def accuse(self, peer: str, until: float) -> None:
        """Suspect ``peer`` until ``until`` (``time.monotonic``) whatever records of it this node applies: a
        proof accuses it that this node cannot check yet (``node.swarm.audit``), or it took a contribution of
        ours without a receipt (``node.swarm.receipts``)."""
        self._accused[peer] = max(self._accused.get(peer, 0.0), until)

    def accused(self, peer: str, now: float) -> bool:
        if self._accused.get(peer, 0.0) > now:
            return True
        self._accused.pop(peer, None)
        return False

    def reward(self, peer: str) -> None:
        if self.scores.get(peer, 0.0) < 0:
            self.scores[peer] = min(0.0, self.scores[peer] + 0.1)

    # ---------------------------------------------------------------- replays
    def merged(self, cids) -> None:
        for cid in cids:
            self._merged.setdefault(cid, None)
            self._merged.move_to_end(cid)
        while len(self._merged) > self.remember:
            self._merged.popitem(last=False)

    def was_merged(self, cid: str) -> bool:
        return cid in self._merged

    def first_resend(self, cid: str) -> bool:
        """True once for a merged id: the first copy that comes again, which the sender may resend
        honestly (its reply was lost); later copies are replays."""
        if self._merged.get(cid, True) is not None:  # not merged, or already re-sent once
            return False
        self._merged[cid] = True
        return True

    def check_replay(self, cid: str) -> None:
        if self.was_merged(cid):
            raise ProtocolError(RejectCode.REPLAYED, f"contribution {cid} was already merged")

    def status(self) -> dict:
        return {
            "scores": {p: round(s, 2) for p, s in self.scores.items() if s < 0},
            "banned": sorted(self.banned_until),
            "bans": self.bans,
        }


class WorkBook:
    """Per learner and fragment, since when its next contribution's counters must fit (``protocol.work``):
    the moment a contribution of it was last merged here, or this node first heard of it; per learner,
    when its work was last merged here (``worked``: whose word counts as a snapshot's witness,
    ``node.swarm.vetting``); and the learners credited on the chain this node follows (``settled``: whom a
    public swarm elects, ``node.swarm.view``). Keeps the ``remember`` newest of each."""

    def __init__(self, remember: int = 8192) -> None:
        self.remember = remember
        self.since: OrderedDict[tuple[str, int], float] = OrderedDict()
        self.worked: OrderedDict[str, float] = OrderedDict()
        # keyed as a contribution id names its sender (``protocol.messages.cid_sender``): a snapshot's
        # merged ids name them so
        self.settled: OrderedDict[str, None] = OrderedDict()
        self.first: float | None = None  # when this node first saw work merged
        self.watched = False  # it has watched for a whole window (``watched_for``)
        # the chain's credits came whole, from a snapshot's or a checkpoint's ``credited``: elect by them at once
        self.handed = False

    def working(self, live: Iterable[str], now: float, window_s: float) -> frozenset[str] | None:
        """The learners of ``live`` whose work was merged here within the last ``window_s`` seconds; None
        until this node has watched the swarm merge for that long (a joiner, a restart: it cannot tell a
        learner that merges every few minutes from an identity that never will)."""
        if window_s <= 0 or not self.watched_for(now, window_s):
            return None
        return frozenset(pid for pid in live if now - self.worked.get(pid, -math.inf) <= window_s)

    def watched_for(self, now: float, window_s: float) -> bool:
        """Whether this node has watched the swarm merge for ``window_s`` seconds, or for a window it was asked
        about before: once it has, a window that grows with the rounds' period (a loaded machine) does not
        take it back to knowing nothing (beside 2,000 records with no process behind them, a node whose round
        period grew counted all of them in its quorum again, and its rounds waited a period each)."""
        if self.first is None:
            return False
        if now - self.first >= window_s:
            self.watched = True
        return self.watched

    def workers(
        self, live: Iterable[str], now: float, window_s: float, logged: Iterable[str] = ()
    ) -> frozenset[str] | None:
        """The learners of ``live`` credited on the chain this node follows: in a record its logs hold
        (``logged``, learner ids) or in one that ``settled``. None until this node has watched the swarm
        merge for ``window_s`` seconds, as ``working``. Not windowed: a set that only grows while members
        live, so that views do not part as learners pause one by one; and not what this node merged, but
        what its chain holds: a joiner's own round that lost a fork credited its learner in its view alone,
        which elected it there and nowhere else while the swarm rested (a CI failure). No wait where the
        credits came whole with a snapshot or checkpoint (``handed``): a joiner that waited to see a merge
        elected among every member, itself too, while the others elected a worker; with ``sync-diloco``'s
        quorum of every learner, each held one learner's contribution and neither merged again (a suite run)."""
        if window_s <= 0:
            return None
        if not self.handed and not self.watched_for(now, window_s):
            return None
        return self.credited_of(live, logged)

    def credited_of(self, ids: Iterable[str], logged: Iterable[str] = ()) -> frozenset[str]:
        """The members of ``ids`` the chain credits: in a record the logs hold (``logged``) or that settled."""
        keys = set(self.settled).union(sender_tag(q) for q in logged)
        return frozenset(pid for pid in ids if sender_tag(pid) in keys)

    def settle(
        self, learners: Iterable[str] = (), cids: Iterable[str] = (), tags: Iterable[str] = ()
    ) -> None:
        """Credit ``learners`` (ids), the senders ``cids`` name and ``tags`` (as ``sender_tag`` makes them), on
        records past a fork's reach: one the log let go of (``history`` rounds deep), or one of the chain a
        snapshot installed here (its merged ids, and the learners its donor's chain credits)."""
        keys = [sender_tag(q) for q in learners] + [cid_sender(c) for c in cids] + list(tags)
        self.handed = self.handed or bool(tags)
        for key in keys:
            self.settled[key] = None
            self.settled.move_to_end(key)
        self._trim()

    def credited(self, logged: Iterable[str], most: int) -> tuple[str, ...]:
        """The ``most`` newest tags of the learners credited on this node's chain (``settled``, then the learners
        of the records its logs hold, ``logged``): what a snapshot it serves names (``settle``'s ``tags``)."""
        tags = dict.fromkeys(self.settled)
        tags.update(dict.fromkeys(sender_tag(q) for q in logged))
        return tuple(tags)[-most:] if most > 0 else ()

    def heard(self, learner: str, p: int, now: float) -> float:
        since = self.since.setdefault((learner, p), now)
        self._trim()
        return since

    def merged(self, learner: str, p: int, now: float, span_s: float = 0.0) -> None:
        """A contribution of ``learner`` to fragment p merged at ``now``, holding ``span_s`` seconds of its work
        (its steps at its published rate). The next one's counters are bounded from the start of that work,
        not from the merge: a learner that has not yet seen its last contribution merged counts those steps
        again in the one it sends next (with ``carry``), so an honest contribution arriving just after an
        older one merged late ("44 steps in 0 s", a head-zero run) was refused and scored."""
        if self.first is None:
            self.first = now
        self.since[(learner, p)] = now - max(0.0, span_s)
        self.since.move_to_end((learner, p))
        self.worked[learner] = now
        self.worked.move_to_end(learner)
        self._trim()

    def _trim(self) -> None:
        while len(self.since) > self.remember:
            self.since.popitem(last=False)
        while len(self.worked) > self.remember:
            self.worked.popitem(last=False)
        while len(self.settled) > self.remember:
            self.settled.popitem(last=False)
