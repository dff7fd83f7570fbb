"""Records held for one more try, as their signed bytes in files of the state folder (``SignedFiles``; a
decoded record's gradient is a whole fp32 fragment). The node holds two kinds, each a ``HeldRecords``:

- out of turn (``ElectionFence.out_of_turn``): while nobody is credited yet, a record of its signer's work
  alone from a signer this node's view does not put first is tried again a ``failover_s`` later for each
  candidate the view puts before it (``ElectionFence.turn_wait_s``), the time senders take to re-route
  past those synchronisers had they died; by then the first candidate's record has usually landed, and this
  one is moot;
- refused by the election fence: tried once more a heartbeat later. Each fragment's chain moves on its own,
  so the record that credits a newly elected member (in another fragment) can reach this node a moment after
  that member's first record; it is refused for good only if its signer is still not credited then.

One record per signer and fragment is held (its newest), ``cap`` in all; the retry takes it only where it
still follows this node's head."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from node.swarm.wire import SignedRecord, decode_record
from protocol.errors import ProtocolError

logger = logging.getLogger(__name__)
HELD_CAP = 16  # records of one kind held at once (signed bytes, one per signer and fragment)


@dataclass(frozen=True)
class Held:
    round: int
    new_hash: str
    raw: object  # the signed bytes, or the ``SignedFile`` that holds them
    caller: str


class HeldRecords:
    """``wait_s(record)``: how long a record waits; ``retry(record, caller)``: what is done with one that still
    follows the head then; ``refused(error, caller)``: a retry that raised; ``on_held()`` and ``on_full()``: a
    record newly held, and one dropped because ``cap`` are held; ``call_later(seconds, fn, *args)``: the
    node's loop's; ``stopped()``: whether the node is stopping (nothing is retried then)."""

    def __init__(
        self,
        name: str,
        swarm: str,
        spec: dict,
        replicas: list,
        signed_files,
        *,
        wait_s: Callable[[SignedRecord], float],
        retry: Callable[[SignedRecord, str], object],
        refused: Callable[[ProtocolError, str], None],
        on_held: Callable[[], None],
        on_full: Callable[[], None],
        call_later: Callable,
        stopped: Callable[[], bool],
        cap: int = HELD_CAP,
    ) -> None:
        self.name, self.swarm, self.spec, self.replicas = name, swarm, spec, replicas
        self.signed_files, self.cap = signed_files, cap
        self.wait_s, self.retry, self.refused = wait_s, retry, refused
        self.on_held, self.on_full, self.call_later, self.stopped = on_held, on_full, call_later, stopped
        self.held: dict[tuple[int, str], Held] = {}  # (fragment, signer) -> its newest record held

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, sr: SignedRecord, caller: str) -> None:
        rec = sr.record
        key = (rec.fragment, sr.signer)
        held = self.held.get(key)
        if held is not None and (held.round, held.new_hash) == (rec.round, rec.new_hash):
            return  # the same record again (a relay): its retry decides
        if held is None and len(self.held) >= self.cap:
            self.on_full()  # dropped (the sender's own heads and our catch-up still reach its chain)
            return
        self.on_held()
        # on disk, where it can be (a disk that refuses the write leaves the bytes in memory)
        raw = self.signed_files.keep(bytes(sr.raw), f"held-{rec.fragment}-{rec.round}")
        self.held[key] = Held(rec.round, rec.new_hash, raw, caller)
        self.call_later(self.wait_s(sr), self._retry, key, rec.new_hash)

    def _retry(self, key: tuple[int, str], new_hash: str) -> None:
        held = self.held.get(key)
        if held is None or held.new_hash != new_hash or self.stopped():
            return  # replaced by a newer record of its signer, whose own retry decides
        del self.held[key]
        rep = self.replicas[key[0]]
        if held.round != rep.round + 1:
            return  # the round landed from elsewhere, or the chain moved on: moot here
        try:
            sr = decode_record(bytes(held.raw), self.swarm, self.spec)
            if sr.record.parent_hash != rep.hash:
                return
            self.retry(sr, held.caller)
        except ProtocolError as e:
            self.refused(e, held.caller)
            logger.info("fragment %d, a record of %s held (%s), refused: %s", *key, self.name, e)
