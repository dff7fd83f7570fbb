"""What each learner's work earned on the chain this node follows: since when its next contribution's counters
must fit (``protocol.work``), when its work was last merged, and whom the chain credits with merged work (whom a
public swarm elects, ``node.swarm.view``)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable

from protocol.messages import cid_sender, sender_tag


class WorkBook:
    """Per learner and fragment, since when its next contribution's counters must fit (``protocol.work``):
    the moment a contribution of it was last merged here, or this node first heard of it; per learner,
    when its work was last merged here (``last_merged``: whose word counts as a snapshot's witness,
    ``node.swarm.trust.vetting``); and the learners credited on the chain this node follows (``credited_tags``: whom a
    public swarm elects, ``node.swarm.view``). Keeps the ``remember`` newest of each."""

    def __init__(self, remember: int = 8192) -> None:
        self.remember = remember
        self.since: OrderedDict[tuple[str, int], float] = OrderedDict()
        self.last_merged: OrderedDict[str, float] = OrderedDict()
        # keyed as a contribution id names its sender (``protocol.messages.cid_sender``): a snapshot's
        # merged ids name them so
        self.credited_tags: OrderedDict[str, None] = OrderedDict()
        self.first: float | None = None  # when this node first saw work merged
        self.watched = False  # it has watched for a whole window (``watched_for``)
        # the chain's credits came whole, from a snapshot's or a checkpoint's ``credited``: elect by them at once
        self.credits_handed = False

    def working(self, live: Iterable[str], now: float, window_s: float) -> frozenset[str] | None:
        """The learners of ``live`` whose work was merged here within the last ``window_s`` seconds; None
        until this node has watched the swarm merge for that long (a joiner, a restart: it cannot tell a
        learner that merges every few minutes from an identity that never will)."""
        if window_s <= 0 or not self.watched_for(now, window_s):
            return None
        return frozenset(pid for pid in live if now - self.last_merged.get(pid, -math.inf) <= window_s)

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
        (``logged``, learner ids) or in one that settled (``credited_tags``). None until this node has watched the swarm
        merge for ``window_s`` seconds, as ``working``. Not windowed: a set that only grows while members
        live, so that views do not part as learners pause one by one; and not what this node merged, but
        what its chain holds: a joiner's own round that lost a fork credited its learner in its view alone,
        which elected it there and nowhere else while the swarm rested (a CI failure). No wait where the
        credits came whole with a snapshot or checkpoint (``credits_handed``): a joiner that waited to see a merge
        elected among every member, itself too, while the others elected a worker; with ``sync-diloco``'s
        quorum of every learner, each held one learner's contribution and neither merged again (a suite run)."""
        if window_s <= 0:
            return None
        if not self.credits_handed and not self.watched_for(now, window_s):
            return None
        return self.credited_of(live, logged)

    def credited_of(self, ids: Iterable[str], logged: Iterable[str] = ()) -> frozenset[str]:
        """The members of ``ids`` the chain credits: in a record the logs hold (``logged``) or that settled."""
        keys = set(self.credited_tags).union(sender_tag(q) for q in logged)
        return frozenset(pid for pid in ids if sender_tag(pid) in keys)

    def settle(
        self, learners: Iterable[str] = (), cids: Iterable[str] = (), tags: Iterable[str] = ()
    ) -> None:
        """Credit ``learners`` (ids), the senders ``cids`` name and ``tags`` (as ``sender_tag`` makes them), on
        records past a fork's reach: one the log let go of (``history`` rounds deep), or one of the chain a
        snapshot installed here (its merged ids, and the learners its donor's chain credits)."""
        keys = [sender_tag(q) for q in learners] + [cid_sender(c) for c in cids] + list(tags)
        self.credits_handed = self.credits_handed or bool(tags)
        for key in keys:
            self.credited_tags[key] = None
            self.credited_tags.move_to_end(key)
        self._trim()

    def credited(self, logged: Iterable[str], most: int) -> tuple[str, ...]:
        """The ``most`` newest tags of the learners credited on this node's chain (``credited_tags``, then the learners
        of the records its logs hold, ``logged``): what a snapshot it serves names (``settle``'s ``tags``)."""
        tags = dict.fromkeys(self.credited_tags)
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
        self.last_merged[learner] = now
        self.last_merged.move_to_end(learner)
        self._trim()

    def _trim(self) -> None:
        while len(self.since) > self.remember:
            self.since.popitem(last=False)
        while len(self.last_merged) > self.remember:
            self.last_merged.popitem(last=False)
        while len(self.credited_tags) > self.remember:
            self.credited_tags.popitem(last=False)
