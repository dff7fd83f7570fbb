"""Vouching for a snapshot (issue 31): before a node installs a fragment's state that it did not reach by
checked records, other live members say, each for itself over its own connection, which state they hold at
that round. A membership record is its signer's word alone: a member that published a head one round ahead
of everyone and served an all-zero state with the matching hash was installed by every node it asked. Now a
state must be at a round another member has reached, and held by as many members as any rival state at
that round (``judge``); a member that does not answer at all (killed, not yet expired from the view) is
left out of the count. A mixin of
``node.swarm.agent.Node`` through ``node.swarm.catch_up.CatchUp``."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter

from node.swarm.transport import Reply, TransportError
from node.swarm.wire import FragmentState
from protocol.errors import ProtocolError, RejectCode

logger = logging.getLogger(__name__)
VOUCH_ASK_AT_MOST = 8  # members asked about one snapshot, drawn at random when more are live
LONE_LEAD, OUTNUMBERED = "a lone lead", "outnumbered"
VOUCH_WAIT_S = 1.0  # a member asked about a round it has not reached yet waits this long for its record
VOUCH_TIMEOUT_S = VOUCH_WAIT_S + 2.0  # a member that does not answer within this is left out of the count


def parse_vouch_request(raw: bytes, fragments: int) -> tuple[int, int]:
    """``{"fragment": p, "round": r}`` with p a fragment of this run and r a round >= 0, else ProtocolError."""
    try:
        req = json.loads(raw)
        p, r = req["fragment"], req["round"]
    except (ValueError, TypeError, KeyError) as e:
        raise ProtocolError(RejectCode.MALFORMED, f"vouch request is not {{fragment, round}}: {e}") from None
    if type(p) is not int or type(r) is not int or r < 0:
        raise ProtocolError(
            RejectCode.MALFORMED, f"vouch request: fragment {p!r}, round {r!r} are not ints >= 0"
        )
    if not 0 <= p < fragments:
        raise ProtocolError(RejectCode.WRONG_FRAGMENT, f"fragment {p} not in 0..{fragments - 1}")
    return p, r


def judge(
    state_hash: str, round_: int, said: list[tuple[str | None, int]], asked: int, ours: tuple[str | None, int]
) -> str | None:
    """Whether a donor's state (``state_hash`` at ``round_``) may be installed, from what ``asked`` other
    members ``said``, each (its hash at that round or None, its head round), and this node's own ``ours``:
    None when it may, else why not.

    - No other member to ask: the donor's word stands (a swarm of two, or a lone survivor once the records
      of the dead expire). Others asked and none answering is no vouch: wait.
    - A state at a round no member that answered has reached is a lone claim to lead the swarm: refused.
      (Every node installed a liar's all-zero state one round ahead of everyone.)
    - Else the donor's state needs as many holders, the donor included, as any other state at that round.
      A tie is a swarm split evenly between chains: the best head wins, as before; refusing it would leave
      a three-way split with no way out."""
    if asked == 0:
        return None
    if not said:
        return f"none of the {asked} other members asked answered"
    said = [*said, ours]
    if not any(h is not None or head >= round_ for h, head in said):  #
        return f"{LONE_LEAD}: no other member of the {len(said) - 1} that answered has reached round {round_}"
    support = 1 + sum(1 for h, _ in said if h == state_hash)
    rivals = Counter(h for h, _ in said if h is not None and h != state_hash)
    best = max(rivals.values(), default=0)
    if support < best:
        return f"{OUTNUMBERED}: {support} member(s) with the donor hold it, {best} hold another state at that round"
    return None


class Vouching:
    """The ``vouch`` op and the check ``CatchUp._fetch_snapshot`` makes before installing a state."""

    def hash_at(self, p: int, round_: int) -> str | None:
        """The hash of fragment p after round ``round_`` as this node holds it: its head, or a record still
        in its log; None when it holds neither (behind, or that round left its log)."""
        r, h, _, _ = self.heads[p]
        if int(r) == round_:
            return str(h)
        sr = self.logs[p].get(round_)
        return sr.record.new_hash if sr is not None else None

    async def _h_vouch(self, caller: str, raw: bytes) -> Reply:
        if not await self._known(caller):
            return Reply(False, RejectCode.UNKNOWN_PEER.value, f"{caller} is not a live member")
        try:
            p, r = parse_vouch_request(raw, len(self.replicas))
        except ProtocolError as e:
            return Reply(False, e.code.value, str(e))
        # The donor holds the newest head: the member asked usually trails it by a record in flight. Wait
        # for it a moment, or a node far behind could find no vouch for a swarm that merges every second.
        deadline = time.monotonic() + VOUCH_WAIT_S
        while self.replicas[p].round < r and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return Reply(
            True, body=json.dumps({"hash": self.hash_at(p, r), "head": self.replicas[p].round}).encode()
        )

    async def _held_by(self, q: str, p: int, round_: int) -> tuple[str | None, int] | None:
        """What ``q`` answers of fragment p: (its hash at round ``round_`` or None, its head round); None
        when it gave no usable answer (down, too old to know the op, a malformed reply)."""
        try:
            req = json.dumps({"fragment": p, "round": round_}).encode()
            reply = await self.transport.call(q, "vouch", req, timeout_s=VOUCH_TIMEOUT_S)
        except TransportError:
            return None
        if not reply.ok:
            return None
        try:
            body = json.loads(reply.body)
            h, head = body["hash"], body["head"]
        except (ValueError, TypeError, KeyError):
            return None
        if (h is not None and not isinstance(h, str)) or type(head) is not int:
            return None
        return h, head

    async def _vouch_for(self, st: FragmentState, donor: str) -> None:
        """Raise ProtocolError(unvouched) unless enough other live members hold ``st``'s round and hash."""
        members = self.live_members()
        voters = sorted(q for q, m in members.items() if q not in (self.peer_id, donor) and not m.client_mode)
        if len(voters) > VOUCH_ASK_AT_MOST:
            voters = random.sample(voters, VOUCH_ASK_AT_MOST)
        got = await asyncio.gather(*(self._held_by(q, st.fragment, st.round) for q in voters))
        said = [a for a in got if a is not None]
        ours = self.hash_at(st.fragment, st.round), self.replicas[st.fragment].round
        why = judge(st.hash, st.round, said, len(voters), ours)
        if why is None:
            return
        if why.startswith(LONE_LEAD):
            # A member alone ahead of everyone that answered, with a state nobody holds, wins every election
            # it is credible in; each failover from it forked the swarm, and a three-way split then gave
            # the liar's state a tie. Out of this node's elections for a ttl_s (a stalled round's rule).
            self.suspect[donor] = max(self.suspect.get(donor, 0.0), time.monotonic() + self.settings.ttl_s)
        self.transport._count("unvouched")
        self.events.emit("unvouched", t=time.time(), fragment=st.fragment, round=st.round, hash=st.hash,
                         donor=donor, why=why)  # fmt: skip
        raise ProtocolError(
            RejectCode.UNVOUCHED,
            f"fragment {st.fragment}: {donor}'s state at round {st.round} ({st.hash[:12]}) not installed: {why}",
        )
