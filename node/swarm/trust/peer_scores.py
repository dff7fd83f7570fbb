"""Defence against peers that lie: scores and bans, and replay memory (docs/design.md, section 5).

Every refusal of a message that an honest peer would not send (malformed, wrong shape, NaN, oversized norm,
bad signature, a replay, ...) lowers the sender's score by one; accepted work raises it back slowly (never
above zero). A peer whose score reaches ``-ban_after`` is banned for ``ban_s`` seconds: everything it sends
is refused with ``banned`` before it is decoded, and it leaves this node's view (never elected, never
pushed to). A forged or oversized merge record counts only against the peer that signed and pushed it;
one that breaks a rule every node checks alike bans its signer at once, here and, as evidence handed on,
on the other members (``node.swarm.trust.evidence``).
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
from collections import OrderedDict

from protocol.errors import ProtocolError, RejectCode

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


class PeerScores:
    """Each peer's score and ban, the peers accused of a lie this node cannot check yet, and the ids of
    contributions already merged (the replay memory)."""

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
        proof accuses it that this node cannot check yet (``node.swarm.trust.audit``), or it took a contribution of
        ours without a receipt (``node.swarm.trust.receipts``)."""
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
