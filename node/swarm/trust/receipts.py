"""Signed receipts: a synchroniser that drops contributions it took is found out.

Where learners are not vouched for (a public swarm), a synchroniser's ``ok`` to a contribution carries a
receipt it signs: "fragment p, round r on parent h, learner L's contribution c". An honest synchroniser gives
one only for a contribution that entered the round it holds open (while that round merges it answers
``peer_busy``, and the sender tries again a moment later), and merges every contribution in that round, so
its record of round r on parent h names c, or a later contribution of L's (a learner's second contribution
against the same base replaces its first). A record that names neither, beside the receipt its own signer
gave, proves that the signer took the contribution and left it out: every node checks the two signatures and
the names alone (``omits``), bans the signer and hands the pair on (``omission`` op), as with the other
evidence (``node.swarm.trust.evidence``). The record itself is a faithful merge of what it names and stays applied.

A synchroniser that gives no receipt is as good as one that took nothing: its sender fails over to the next
candidate and suspects it for ``STALL_TTLS`` x ``ttl_s``. The next candidate takes the round only if it
suspects that synchroniser too (``Intake.checked_dead`` believes a dead list naming a peer it suspects
itself, else pings it): a censor that withholds receipts from every learner is passed over by all of them
once each has been refused one, while one that censors a single learner, and takes the next candidate's
contributions with receipts, costs that learner its rounds there (with ``carry`` its work goes out again with
its next contribution; without, it is lost). Neither can sign a record that drops what it promised without the proof of it.

``Receipts`` is a part the node owns (``Node.receipts``), on the node's event loop: the synchroniser's side
(``node.swarm.sender``) asks it for a receipt with every ``ok``, the sender's side checks the one it
gets back, and the record logic (``node.swarm.replication``, ``node.swarm.deadlines``) asks it whether a
record keeps the receipts given here and names the contributions receipted to us.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dht.identity import Identity, verify
from node.swarm.deadlines import STALL_TTLS
from node.swarm.transport import Reply
from node.swarm.wire import SignedRecord, decode_record, pack_list, unpack_list
from protocol.errors import ProtocolError, RejectCode
from protocol.messages import cid_moment
from protocol.replica import MergeRecord
from protocol.synchroniser import Phase, SyncState

if TYPE_CHECKING:
    from node.common.events import EventLog
    from node.swarm.settings import NodeSettings
    from node.swarm.trust.peer_scores import PeerScores
    from protocol.messages import ContributionHeader
    from protocol.replica import FragmentReplica

logger = logging.getLogger(__name__)
_DOMAIN = "ddiloco/receipt/v1"
RECEIPT_MAX = 4096  # bytes of a receipt's document
RECEIPT_AHEAD = 1  # rounds a receipt may name past our open round (its synchroniser's records on their way)
KEEP_ROUNDS = 4096  # (fragment, round, parent) entries a synchroniser remembers the receipts it gave for
RECEIPT_LOG = "receipts.log"  # in the node's state folder: the receipts it gave, a JSON line each
LOG_BYTES = 4 << 20  # past this, the log is written again from what is kept
BUSY_RETRY_S = 0.2  # how long a synchroniser merging its round asks a sender to wait, before it has timed one


@dataclass(frozen=True)
class Receipt:
    signer: str
    fragment: int
    round: int
    parent: str
    learner: str
    cid: str
    doc: bytes  # what was signed, as it came
    sig: bytes

    def packed(self) -> bytes:
        return pack_list([self.doc, self.sig])


def _signed_bytes(swarm: str, doc: bytes) -> bytes:
    return f"{_DOMAIN}|{swarm}|".encode() + doc


def make_receipt(
    swarm: str, ident, fragment: int, round_: int, parent: str, learner: str, cid: str
) -> Receipt:
    doc = json.dumps(
        {"fragment": fragment, "round": round_, "parent": parent, "learner": learner, "cid": cid},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    return Receipt(
        ident.peer_id, fragment, round_, parent, learner, cid, doc, ident.sign(_signed_bytes(swarm, doc))
    )


def read_receipt(swarm: str, signer: str, raw: bytes) -> Receipt:
    """A receipt as it travels (``Receipt.packed``), its signature checked against ``signer``'s key."""
    items = unpack_list(raw, max_items=2)
    if len(items) != 2 or len(items[0]) > RECEIPT_MAX:
        raise ProtocolError(RejectCode.MALFORMED, "a receipt is [document, signature]")
    doc, sig = items
    try:
        d = json.loads(doc)
        if not isinstance(d, dict):
            raise TypeError("not an object")
        fields = (d["fragment"], d["round"], d["parent"], d["learner"], d["cid"])
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in fields[:2]):
            raise TypeError("fragment and round must be integers")
        if not all(isinstance(x, str) and len(x) <= 256 for x in fields[2:]):
            raise TypeError("parent, learner and cid must be short strings")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ProtocolError(RejectCode.MALFORMED, f"bad receipt: {str(e)[:100]}") from e
    if not verify(signer, sig, _signed_bytes(swarm, doc)):
        raise ProtocolError(RejectCode.BAD_SIGNATURE, f"receipt not signed by {signer[-8:]} for this swarm")
    return Receipt(signer, *fields, doc=doc, sig=sig)


def parse_retry(raw: bytes, most_s: float = 10.0) -> float:
    """The seconds a ``peer_busy`` reply asks a sender to wait, ``{"retry_s": x}``, within [0.05, ``most_s``]."""
    try:
        x = json.loads(raw).get("retry_s")
    except (ValueError, AttributeError, RecursionError) as e:
        raise ProtocolError(RejectCode.MALFORMED, f"bad retry: {str(e)[:80]}") from e
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        raise ProtocolError(RejectCode.MALFORMED, f"bad retry: {str(x)[:80]}")
    return min(max(float(x), 0.05), most_s)


def _remember(book: OrderedDict, key: tuple[int, int, str], learner: str, cid: str) -> None:
    book.setdefault(key, set()).add((learner, cid))
    book.move_to_end(key)
    while len(book) > KEEP_ROUNDS:
        book.popitem(last=False)


def _read_log(path: Path) -> list[tuple[int, int, str, str, str]]:
    """The receipts a node gave in its earlier lives, a line each (a torn or foreign line is skipped)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            p, r, h, learner, cid = json.loads(line)
        except (ValueError, TypeError, RecursionError):
            continue
        if isinstance(p, int) and isinstance(r, int) and all(isinstance(x, str) for x in (h, learner, cid)):
            out.append((p, r, h, learner, cid))
    return out


def covers(rec: MergeRecord, learner: str, cid: str) -> bool:
    """Whether ``rec`` names contribution ``cid`` of ``learner``, or one of that learner's taken later (which
    replaced it in the round: ``protocol.synchroniser.on_contribution``)."""
    moment = cid_moment(cid)
    for who, c, *_ in rec.contributors:
        if who != learner:
            continue
        if c == cid:
            return True
        m = cid_moment(c)
        if moment is not None and m is not None and m > moment:
            return True
    return False


def omits(sr: SignedRecord, rc: Receipt) -> bool:
    """Whether the signed record and the receipt its own signer gave prove a contribution left out: the same
    signer, fragment, round and parent, and the record does not ``covers`` the receipted contribution."""
    rec = sr.record
    same = (rc.signer, rc.fragment, rc.round, rc.parent) == (
        sr.signer,
        rec.fragment,
        rec.round,
        rec.parent_hash,
    )
    return same and not covers(rec, rc.learner, rc.cid)


class Receipts:
    """Both ends: the synchroniser's receipts and what it gave (``given``), the learner's check of a receipt and
    of the record that should honour it, and the ``omission`` op.

    Its collaborators: the node's settings (``trusted``, ``swarm``, ``ttl_s``), identity (which signs the
    receipts) and state folder (``receipts.log``); the node's ``replicas`` and ``syncs`` (one entry per
    fragment, replaced in place); its ``spec``, to decode a record handed on; the peer scores (accused and banned
    synchronisers); the node's ``suspect`` dict (peer id -> until when, on the monotonic clock), ``counters``
    and ``events``, which it writes to; ``last_contribution`` (fragment -> our latest (header, encoded)) and
    ``send_again``, which puts that one back in the outbox if it is still the given header
    (``Outbox.send_again``); ``reset_sync``, which starts a fragment's open round over without the
    given contributions (``Replication.reset_sync``); and ``ban_and_hand_on``, which bans a record's
    signer and hands the proof on (``Auditor.ban_and_hand_on``).

    Its own state: the receipts given, read back from the state folder; the round each fragment renounced
    here last, with its parent (``renounced``)."""

    def __init__(
        self,
        settings: NodeSettings,
        identity: Identity,
        state_dir: Path,
        replicas: Sequence[FragmentReplica],
        syncs: Sequence[SyncState],
        spec: dict,
        peer_scores: PeerScores,
        suspect: dict[str, float],
        counters: dict[str, int],
        events: EventLog,
        last_contribution: dict[int, tuple],
        send_again: Callable[[ContributionHeader], None],
        reset_sync: Callable[..., None],
        ban_and_hand_on: Callable[..., bool],
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.peer_id: str = identity.peer_id
        self.state_dir = state_dir
        self.replicas = replicas
        self.syncs = syncs
        self.spec = spec
        self.peer_scores = peer_scores
        self.suspect = suspect
        self.counters = counters
        self.events = events
        self.last_contribution = last_contribution
        self.send_again = send_again
        self.reset_sync = reset_sync
        self.ban_and_hand_on = ban_and_hand_on
        self._given: OrderedDict[tuple[int, int, str], set[tuple[str, str]]] = OrderedDict()
        for p, r, h, learner, cid in _read_log(self.state_dir / RECEIPT_LOG):
            _remember(self._given, (p, r, h), learner, cid)
        self._receipt_fh = None  # the receipt log, opened at the first receipt
        self.renounced: dict[int, tuple[int, str]] = {}

    def receipts_on(self) -> bool:
        return not self.settings.trusted

    def merging_here(self, caller: str, p: int) -> Reply | None:
        """Where receipts bind, a contribution that comes while fragment p's open round merges is not queued
        for the next round (whose parent nobody knows yet, nor who holds it): the sender is told to try again
        once a merge's time (this node's measure of it) has passed."""
        st = self.syncs[p]
        if caller == self.peer_id or not self.receipts_on() or st.phase is not Phase.MERGING:
            return None
        wait = json.dumps({"retry_s": round(st.xi_sync.get(BUSY_RETRY_S), 3)}).encode()
        return Reply(
            False, RejectCode.PEER_BUSY.value, f"fragment {p}'s round {st.open_round} is merging", wait
        )

    def given(self) -> OrderedDict[tuple[int, int, str], set[tuple[str, str]]]:
        """(fragment, round, parent) -> the (learner, cid) this node gave receipts for in that round: read
        back from its state folder after a restart (``receipts.log``), so that a node killed while it held a
        round, and back on the same parent, does not sign that round without what it promised."""
        return self._given

    def give_receipt(self, p: int, learner: str, cid: str) -> bytes:
        """Sign a receipt for a contribution that entered fragment p's open round here; remembered, and
        written to the state folder before the reply leaves (the page cache outlives a killed process)."""
        rep = self.replicas[p]
        if self.syncs[p].global_round != rep.round:  # a record applied and the round not reset yet
            raise ProtocolError(RejectCode.PEER_BUSY, f"fragment {p} is between rounds here")
        _remember(self.given(), (p, rep.round + 1, rep.hash), learner, cid)
        self._log_receipt([p, rep.round + 1, rep.hash, learner, cid])
        rc = make_receipt(self.settings.swarm, self.identity, p, rep.round + 1, rep.hash, learner, cid)
        return rc.packed()

    def _log_receipt(self, entry: list) -> None:
        path = self.state_dir / RECEIPT_LOG
        fh = self._receipt_fh
        if fh is None or fh.tell() > LOG_BYTES:  # started, or grown: written again from what is kept
            if fh is not None:
                fh.close()
            tmp = path.with_suffix(".tmp")
            with open(tmp, "w") as out:
                for (p, r, h), got in self.given().items():
                    out.writelines(json.dumps([p, r, h, learner, cid]) + "\n" for learner, cid in sorted(got))
            os.replace(tmp, path)
            fh = self._receipt_fh = open(path, "a", buffering=1)  # noqa: SIM115 - held for the node's life
        fh.write(json.dumps(entry) + "\n")

    def check_taken(self, p: int, learner: str, cid: str, base: int) -> None:
        """Before a contribution enters fragment p's open round where receipts bind: its id ends with a moment,
        and one that replaces that learner's pending contribution on the same base was taken later. (Replaced
        by an earlier one, a receipt for the later one would stand against a record that names the earlier:
        the honest synchroniser would refuse to sign its round, held by one learner.)"""
        moment = cid_moment(cid)
        if moment is None:
            raise ProtocolError(RejectCode.MALFORMED, f"contribution id {cid[:80]} names no moment")
        held = self.syncs[p].pending.get((learner, base))
        if held is not None and held.cid != cid and moment <= (cid_moment(held.cid) or 0):
            raise ProtocolError(
                RejectCode.STALE_BASE, f"{cid} is older than {held.cid}, which it would replace"
            )

    def receipted(self, p: int, round_: int) -> set[str]:
        """The ids of the contributions this node gave receipts for in fragment p's ``round_`` on its
        replica's current parent."""
        rep = self.replicas[p]
        return {cid for _, cid in self.given().get((p, round_, rep.hash), ())}

    def breaks_receipt(self, rec: MergeRecord) -> list[str]:
        """The receipted contributions that ``rec``, about to be signed here, would leave out."""
        got = self.given().get((rec.fragment, rec.round, rec.parent_hash), ())
        return sorted(cid for learner, cid in got if not covers(rec, learner, cid))

    def holds_receipts(self, rec: MergeRecord) -> bool:
        """An honest node's safety net before it signs ``rec``: True (not signed; the round stays taken, and its
        senders' watches pass it to the next candidate) where it would break a receipt given here. After an
        undo a round can start over on a parent this node gave receipts on, without their contributions."""
        missing = self.breaks_receipt(rec)
        if missing:
            self.counters["receipts_held"] += 1
            logger.warning(
                "merge of fragment %d round %d not signed: it leaves out %s, for which we gave receipts",
                rec.fragment,
                rec.round,
                ", ".join(missing[:4]),
            )
        return bool(missing)

    def renounce(self, p: int, round_: int, dropped: set[str]) -> None:
        """``holds_receipts`` refused to sign fragment p's round ``round_`` here: this node hands the round on.
        Held taken (as it was until 2026-11-29), the round stayed merging here for good: every contribution
        sent to it was refused ``peer_busy`` (772 in a CI run), its lease kept every view electing it, and the
        fragment merged nothing until the node left. Now its record names the round renounced
        (``Member.renounced``, read by ``candidates``: the next candidate takes it), its own round starts over
        without the merge's contributions (``dropped``; their senders' watches send them again when the
        next candidate's record leaves them out), and its own learner's latest goes to the next one. Where
        no other candidate is left, the round stays here, and merges once every learner it gave receipts to
        has contributed again (``SyncState.promised``)."""
        rep = self.replicas[p]
        self.renounced[p] = (round_, rep.hash)
        self.events.emit("renounce", t=time.time(), fragment=p, round=round_, parent=rep.hash)
        logger.warning("fragment %d round %d renounced here: the next candidate takes it", p, round_)
        promised = frozenset(learner for learner, _ in self.given().get((p, round_, rep.hash), ()))
        self.reset_sync(p, merged=dropped, promised=promised)
        latest = self.last_contribution.get(p)
        if latest is not None and latest[0].cid in dropped:
            self.send_again(latest[0])

    def renounced_now(self) -> dict[str, int]:
        """The open rounds this node renounced, on its replicas' parents (published: ``Member.renounced``)."""
        book, reps = self.renounced, self.replicas
        return {str(p): r for p, (r, h) in book.items() if (r, h) == (reps[p].round + 1, reps[p].hash)}

    def check_receipt(self, target: str, header, body: bytes) -> Receipt | None:
        """The receipt in ``target``'s ``ok`` to our contribution ``header``; None (and ``target`` suspected as
        a stalled synchroniser would be) where it is missing or not for this contribution."""
        try:
            rc = read_receipt(self.settings.swarm, target, body)
            if (rc.fragment, rc.learner, rc.cid) != (header.fragment, self.peer_id, header.cid):
                raise ProtocolError(RejectCode.MALFORMED, f"receipt names {rc.learner[-8:]}'s {rc.cid}")
        except ProtocolError as e:
            until = time.monotonic() + STALL_TTLS * self.settings.ttl_s
            self.suspect[target] = max(self.suspect.get(target, 0.0), until)
            # its records applied here do not lift it (``PeerScores.accused``): a censor merges rounds, without us
            self.peer_scores.accuse(target, until)
            self.counters["no_receipt"] += 1
            self.events.emit(
                "no_receipt", t=time.time(), peer=target, fragment=header.fragment, cid=header.cid, why=str(e)
            )
            return None
        return rc

    def watched_round(self, rc: Receipt, open_round: int) -> int:
        """The round whose record ``left_out`` checks for a contribution ``rc`` receipts, ``open_round`` ours:
        the receipt's where it is from a round behind ours to ``RECEIPT_AHEAD`` past it (its synchroniser on
        a fork, or its last record on its way here), ours otherwise (a far round would leave the watch
        waiting for a record that never comes). A receipt on a parent we do not hold is kept all the same:
        forks are common on loaded machines (157 honest receipts on the other side of one in a 4-minute run
        of 6 nodes), and it proves a drop only against a record on its own parent."""
        return rc.round if open_round - 1 <= rc.round <= open_round + RECEIPT_AHEAD else open_round

    def check_omission(self, sr: SignedRecord, rc: Receipt) -> bool:
        """A record applied here, of the round our receipt names: where it leaves our contribution out, ban its
        signer and hand the proof on. True: it did."""
        if not omits(sr, rc):
            return False
        self.convict_omission(sr, rc, self.peer_id)
        return True

    def convict_omission(self, sr: SignedRecord, rc: Receipt, source: str) -> None:
        if self.peer_scores.banned(sr.signer, time.monotonic()):
            return
        body = pack_list([bytes(sr.raw), rc.packed()])
        fields = {"fragment": rc.fragment, "round": rc.round, "cid": rc.cid}
        logger.warning(
            "%s took contribution %s into fragment %d's round %d and merged it without: banned",
            sr.signer,
            rc.cid,
            rc.fragment,
            rc.round,
        )
        self.ban_and_hand_on(sr, "omitted_contribution", source, "omission", body, **fields)

    async def on_omission(self, caller: str, body: bytes) -> Reply:
        """The ``omission`` op: a record and the receipt its signer gave, handed on (``convict_omission``)."""
        items = unpack_list(body, max_items=2)
        if len(items) != 2:
            raise ProtocolError(RejectCode.MALFORMED, "an omission proof is [record, receipt]")
        sr = decode_record(items[0], self.settings.swarm, self.spec)
        rc = read_receipt(self.settings.swarm, sr.signer, items[1])
        if sr.signer == self.peer_id:
            return Reply(True, message="known")
        if not omits(sr, rc):
            raise ProtocolError(RejectCode.MALFORMED, f"the record of {sr.signer} honours the receipt")
        self.convict_omission(sr, rc, caller)
        return Reply(True)
