"""Swarm membership over hivemind's DHT: start a node's DHT, publish its signed record, read the live view.

Sits in ``dht/`` between the pure record logic (``dht.records``) and the node: it does the DHT I/O and
nothing else (docs/design.md, section 4, "Membership"). A record lives under one of ``BUCKETS`` DHT keys,
``f"{swarm}/members/{bucket_of(peer_id)}"``, with the signer's peer id as subkey and the record's
``expires_at`` as the DHT expiration; a view reads every bucket in one traversal. All times are
``hivemind.utils.get_dht_time()``. Every wait on the DHT has a timeout, and a
failure says what was tried and what to check.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from hivemind.dht import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from dht.identity import Identity
from dht.launch import MAX_PEER_ID, SwarmUnreachable
from dht.records import (
    BUCKETS,
    Member,
    RecordError,
    bucket_of,
    live_view,
    members_key,
    pack_member,
    sign_member,
)
from protocol.errors import DDiLoCoError

logger = logging.getLogger(__name__)
# hivemind hands each call to its DHT process over a pipe that the process reads without blocking: a message
# larger than the pipe can hold at once (64 KiB) is read in part, the read raises BlockingIOError, and the
# process is lost from then on. Relinking 2,000 members in one call (106 KB of peer ids) did that.
RELINK_CHUNK = 64  # peer ids a call carries (about 3.5 KB)
RELINK_MAX = 256  # peers one relink tries: the initial peers, then a random sample of the others
RELINK_AT_ONCE = 16  # pings in flight at once in the DHT process
# A swarm whose DHT routing tables each hold every member (fewer than one k-bucket, hivemind's 20 peers) needs
# no Kademlia traversal to find where a record goes: a record is stored straight on the REPLICAS members
# nearest its key by the table, and a node that is one of those for a key reads that key from its own storage.
# A traversal's lookups carry peer lists with their addresses: on a link capped at 3 Mbit/s, four idle nodes
# sent 47 KB/s each of heartbeats and reads, more than their training's payload a step.
REPLICAS = 8
FULL_READ_EVERY_S = 120.0  # even so, a read of the whole DHT this often (and when a member drops out of view)
WARN_EVERY_S = 60.0  # a read that keeps failing is logged as a warning this often, and at debug level between
TABLE_MAX = 1024  # peer ids of the DHT's routing table a read returns (``Membership.processes``): about 55 KB


class Membership:
    """Publish this node's signed record and read the swarm's live view through a started DHT."""

    def __init__(
        self, dht: DHT, swarm: str, identity: Identity, timeout_s: float = 10.0, admission=None
    ) -> None:
        self.dht, self.swarm, self.identity, self.timeout_s = dht, swarm, identity, timeout_s
        self.admission = admission  # private swarm: values sealed with the swarm key, certificates checked
        self.keys = [members_key(swarm, b) for b in range(BUCKETS)]
        self.key = f"{swarm}/members/*"  # in messages: every bucket
        self._warned_at = float("-inf")  # when a failed read was last logged as a warning
        self._full_read_at = float("-inf")  # when the last read of the whole DHT worked (monotonic)
        self._last_ids: frozenset[str] = frozenset()  # the members of the last view read
        self.last_read = ""  # how the last view was read: "full" (the whole DHT) or "own copy"
        # the peers in this node's DHT routing table at the last read that worked: each answered or sent a
        # DHT call under its own key, so a process stands behind it (a signed record alone proves none)
        self.processes: frozenset[str] = frozenset()

    def _result(self, tried: str, start: Callable[[], Future]) -> Any:
        if not self.dht.is_alive():
            raise SwarmUnreachable(f"{tried}: the local DHT process is not running (shut down or crashed)")
        future: Future | None = None
        try:
            future = start()
            return future.result(timeout=self.timeout_s)
        except FutureTimeout as e:
            if future is not None:
                future.cancel()
            raise SwarmUnreachable(f"{tried}: no answer within {self.timeout_s:g} s") from e
        except (OSError, RuntimeError, ValueError) as e:
            raise SwarmUnreachable(f"{tried} failed: {type(e).__name__}: {e}") from e

    def publish(self, member: Member) -> None:
        """Store ``member`` (signed) under our peer id until ``member.expires_at``."""
        now = get_dht_time()
        if member.expires_at <= now:
            raise RecordError(
                f"record of {member.peer_id} already expired at {member.expires_at:.1f} (now {now:.1f})"
            )
        raw = pack_member(sign_member(self.swarm, self.identity, member))  # packed, then sealed
        if self.admission is not None and self.admission.sealed:
            raw = self.admission.seal(raw, f"dht|{self.swarm}|{member.peer_id}")
        key = members_key(self.swarm, bucket_of(member.peer_id))
        ok = self._result(
            f"storing key {key!r} of swarm {self.swarm!r}",
            lambda: self.dht.run_coroutine(
                _StoreNear(key, member.peer_id, raw, member.expires_at), return_future=True
            ),
        )
        if not ok:
            raise SwarmUnreachable(
                f"storing key {key!r}: the record of {member.peer_id} was refused by the DHT peer that "
                "answered last, or by all (none reachable, a later record of this peer id already stored, or "
                "something other than per-peer records held under the key); other peers may hold it"
            )

    def live(self, now: float | None = None) -> tuple[list[Member], dict[str, str]]:
        """Members with a valid unexpired record, sorted by peer id, and why each other subkey was dropped.

        Keys this node holds itself are read from its own storage, except every ``FULL_READ_EVERY_S`` and
        whenever that read lost a member the last view had: then the whole DHT is read, so a member whose
        records stopped reaching this node is not dropped while the others still hold them."""
        now = get_dht_time() if now is None else now
        full = time.monotonic() - self._full_read_at >= FULL_READ_EVERY_S
        members, dropped, read_all = self._read(now, full)
        if not read_all and self._last_ids - {m.peer_id for m in members}:
            members, dropped, read_all = self._read(now, True)
        self._last_ids = frozenset(m.peer_id for m in members)
        self.last_read = "full" if read_all else "own copy"
        return members, dropped

    def _read(self, now: float, full: bool) -> tuple[list[Member], dict[str, str], bool]:
        try:
            found = self._result(
                f"reading key {self.key!r} of swarm {self.swarm!r}",
                lambda: self.dht.run_coroutine(_ReadBuckets(self.keys, full), return_future=True),
            )
        except Exception as e:  # noqa: BLE001 - junk under a key makes hivemind's get raise (an int and a str
            # subkey with one expiry: TypeError) or never answer. Read this node's own copy instead, raw
            # (which raises SwarmUnreachable in turn if the DHT process is gone).
            return *self._local(now, f"the DHT read failed: {type(e).__name__}: {str(e)[:200]}"), True
        items, plain, table, read_all = found
        if read_all:
            self._full_read_at = time.monotonic()
        self.processes = frozenset(table)
        if plain:  # a plain value over a key: not ours, whoever stored it
            return *self._local(now, f"key holds a plain {plain}, not per-peer records"), True
        return *self._view(dict(items), now, {}), read_all

    def _local(self, now: float, why: str) -> tuple[list[Member], dict[str, str]]:
        """The view from this DHT node's own copy of the key, read raw, when a read of the DHT was unusable."""
        if time.monotonic() - self._warned_at >= WARN_EVERY_S:
            self._warned_at = time.monotonic()
            logger.warning("reading key %r: %s; using this DHT node's own copy of it", self.key, why)
        items = self._result(
            f"reading this node's copy of key {self.key!r}",
            lambda: self.dht.run_coroutine(_LocalRecords(self.keys, now), return_future=True),
        )
        return self._view(dict(items), now, {"": why})

    def _view(self, items: dict, now: float, dropped: dict[str, str]) -> tuple[list[Member], dict[str, str]]:
        """The live members among ``items`` (subkey -> value as read); what is not a record is dropped."""
        raws = {}
        for subkey, value in items.items():
            if isinstance(subkey, str) and len(subkey) <= MAX_PEER_ID and isinstance(value, bytes):
                if self.admission is None or not self.admission.sealed:
                    raws[subkey] = value
                    continue
                try:
                    raws[subkey] = self.admission.open(value, f"dht|{self.swarm}|{subkey}")
                except DDiLoCoError as e:
                    dropped[subkey] = f"not admitted: {e}"
            else:
                dropped[subkey[:80] if isinstance(subkey, str) else repr(subkey)[:80]] = (
                    f"not a record: subkey {type(subkey).__name__}, value {type(value).__name__}"
                )
        members, bad = live_view(self.swarm, raws, now, self.admission)
        return members, {**dropped, **bad}

    def relink(self, peer_ids: Sequence[str], first: Sequence[str] = ()) -> list[str]:
        """Ping the peers of ``peer_ids`` that the DHT's routing table has lost; return those that answered.

        hivemind drops a peer from its routing table when one request to it times out, and the peer drops
        us the same way. Under a saturated link both sides can lose each other for good: nothing is left
        that would make either side call the other again, and a bootstrap node, which has no initial peers
        to fall back on, then sees only its own record. A ping that is answered puts the peer back in our
        table, and puts us back in the peer's (hivemind adds the caller of every ping it answers).

        At most ``RELINK_MAX`` peers a call (``first`` always, e.g. the initial peers, then a random sample of
        the rest), sent to the DHT process ``RELINK_CHUNK`` at a time: a swarm of thousands is relinked a
        sample a heartbeat, and no message to the DHT process grows with the swarm.
        """
        first_set = {p for p in first if p}
        rest = sorted({p for p in peer_ids if p} - first_set)
        wanted = sorted(first_set)[:RELINK_MAX]
        wanted += random.sample(rest, min(len(rest), RELINK_MAX - len(wanted)))
        back: list[str] = []
        for k in range(0, len(wanted), RELINK_CHUNK):
            chunk = wanted[k : k + RELINK_CHUNK]
            tried = f"relinking the DHT of swarm {self.swarm!r} to {len(chunk)} known peers"
            back += self._result(
                tried, lambda c=chunk: self.dht.run_coroutine(_RelinkInDHT(c), return_future=True)
            )
        return back


def _nearest(node, key_id: DHTID) -> list[tuple[DHTID, PeerID | None]] | None:
    """The ``REPLICAS`` nodes nearest ``key_id`` by this node's routing table, this one among them (its peer
    None), where the table knows the whole swarm (under one k-bucket, and not a client); None where only a
    traversal finds them."""
    table, proto = node.protocol.routing_table, node.protocol
    if proto.client_mode or len(table.uid_to_peer_id) >= proto.bucket_size:
        return None
    near = table.get_nearest_neighbors(key_id, REPLICAS, exclude=node.node_id)
    return sorted([(node.node_id, None), *near], key=lambda x: key_id.xor_distance(x[0]))[:REPLICAS]


def _replica_here(node, key_id: DHTID) -> bool:
    """Whether this DHT node holds ``key_id``'s records itself (one of the nearest by a whole-swarm table)."""
    ranked = _nearest(node, key_id)
    return ranked is not None and any(uid == node.node_id for uid, _ in ranked)


class _StoreNear:  # a class, not a closure: DHT.run_coroutine pickles it to the DHT process
    """Runs in the DHT process: store ``value`` under ``key`` / ``subkey`` until ``expires``. Where the routing
    table knows the whole swarm, on the ``REPLICAS`` nodes nearest the key by it, this one included, with no
    traversal; else by hivemind's traversal. True where any of them took it."""

    def __init__(self, key: str, subkey: str, value: bytes, expires: float) -> None:
        self.key, self.subkey, self.value, self.expires = key, subkey, value, expires

    async def __call__(self, _dht, node) -> bool:
        key_id = DHTID.generate(source=self.key)
        proto, ranked = node.protocol, _nearest(node, key_id)
        if ranked is None:
            return bool(await node.store(self.key, self.value, self.expires, subkey=self.subkey))
        value = proto.serializer.dumps(self.value)
        record = DHTRecord(key_id.to_bytes(), proto.serializer.dumps(self.subkey), value, self.expires)
        if proto.record_validator is not None:
            value = proto.record_validator.sign_value(record)
            record = DHTRecord(record.key, record.subkey, value, record.expiration_time)
        stored = False
        if any(uid == node.node_id for uid, _ in ranked) and (
            proto.record_validator is None or proto.record_validator.validate(record)
        ):
            stored = proto.storage.store(key_id, value, self.expires, subkey=self.subkey)
        calls = [
            proto.call_store(peer, [key_id], [value], [self.expires], subkeys=[self.subkey])
            for uid, peer in ranked
            if uid != node.node_id
        ]
        for got in await asyncio.gather(*calls):
            stored = stored or bool(got and got[0])
        return stored


class _ReadBuckets:  # a class, not a closure: DHT.run_coroutine pickles it to the DHT process
    """Runs in the DHT process: the newest value of every bucket key, as the (subkey, value) pairs of all of
    them, the type of any plain value found over a key ('' if none), the peer ids in the routing table
    (``TABLE_MAX`` at most), and whether the whole DHT was read. A key this node holds itself
    (``_replica_here``) is read from its own storage unless ``full``; the rest are found in one traversal."""

    def __init__(self, keys: list[str], full: bool = True) -> None:
        self.keys, self.full = keys, full

    async def __call__(self, _dht, node) -> tuple[list[tuple[Any, Any]], str, list[str], bool]:
        table = [pid.to_base58() for pid in list(node.protocol.routing_table.peer_id_to_uid)[:TABLE_MAX]]
        here = [] if self.full else [k for k in self.keys if _replica_here(node, DHTID.generate(source=k))]
        away = [k for k in self.keys if k not in here]
        found = await node.get_many(away, sufficient_expiration_time=float("inf")) if away else {}
        pairs: list[tuple[Any, Any]] = _own_copy(node, here, get_dht_time())
        for key in away:
            got = found.get(key)
            if got is None:
                continue
            if not isinstance(got.value, dict):
                return [], type(got.value).__name__, table, False
            pairs += [(k, getattr(v, "value", v)) for k, v in got.value.items()]
        return pairs, "", table, not here


class _LocalRecords:  # a class, not a closure: DHT.run_coroutine pickles it to the DHT process
    """Runs in the DHT process: the (subkey, value) pairs this node itself holds under ``keys``, unexpired,
    read from its storage's dictionaries without touching hivemind's expiry heaps (junk in one can make
    every operation on it raise). Only string subkeys and byte values; the caller checks the records."""

    def __init__(self, keys: list[str], now: float) -> None:
        self.keys, self.now = keys, now

    async def __call__(self, _dht, node) -> list[tuple[str, bytes]]:
        return _own_copy(node, self.keys, self.now)


def _own_copy(node, keys: list[str], now: float) -> list[tuple[str, bytes]]:
    """The (subkey, value) pairs this DHT node itself holds under ``keys``, unexpired, newest per subkey of its
    storage and cache, read from their dictionaries without touching hivemind's expiry heaps (junk in one can
    make every operation on it raise). Only string subkeys and byte values; the caller checks the records."""
    out: dict[str, tuple[bytes, float]] = {}
    for key in keys:
        key_id = DHTID.generate(source=key)
        for storage in (node.protocol.storage, node.protocol.cache):
            entry = storage.data.get(key_id)
            if entry is None or not isinstance(entry.value, DictionaryDHTValue):
                continue
            for subkey, item in list(entry.value.data.items()):
                if not (isinstance(subkey, str) and isinstance(item.value, bytes)):
                    continue
                if item.expiration_time > now and item.expiration_time > out.get(subkey, (b"", -1e300))[1]:
                    out[subkey] = (item.value, item.expiration_time)
    serializer = node.protocol.serializer
    pairs = []
    for subkey, (raw, _) in sorted(out.items()):
        try:
            value = serializer.loads(raw)
        except Exception:  # noqa: BLE001 - not a record; dropped
            continue
        pairs.append((subkey, value))
    return pairs


class _RelinkInDHT:  # a class, not a closure: DHT.run_coroutine pickles it to the DHT process
    """Runs in the DHT process: ping the listed peers missing from the routing table, RELINK_AT_ONCE at a time."""

    def __init__(self, peer_ids: list[str]) -> None:
        self.peer_ids = peer_ids

    async def __call__(self, _dht, node) -> list[str]:
        table = node.protocol.routing_table

        at_once = asyncio.Semaphore(RELINK_AT_ONCE)

        async def one(raw: str) -> str | None:
            try:
                pid = PeerID.from_base58(raw)
            except Exception:  # noqa: BLE001 - not a peer id: nothing to ping
                return None
            if pid == node.peer_id or table.get(peer_id=pid) is not None:
                return None
            async with at_once:
                if await node.protocol.call_ping(pid) is None:
                    return None
            node.blacklist.register_success(pid)  # answered: lift any back-off ban at once
            return raw

        return [r for r in await asyncio.gather(*(one(p) for p in self.peer_ids)) if r is not None]
