"""Swarm membership over hivemind's DHT: start a node's DHT, publish its signed record, read the live view.

Sits in ``dht/`` between the pure record logic (``dht.records``) and the node: it does the DHT I/O and
nothing else (DESIGN §4, "Discovery and membership"). Every record lives under one DHT key,
``f"{swarm}/members"``, with the signer's peer id as subkey and the record's ``expires_at`` as the DHT
expiration; all times are ``hivemind.utils.get_dht_time()``. Every wait on the DHT has a timeout, and a
failure says what was tried and what to check.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer

from dht.identity import Identity
from dht.records import Member, RecordError, live_view, parse_member, sign_member
from protocol.errors import ConfigError, DDiLoCoError

logger = logging.getLogger(__name__)


class SwarmUnreachable(DDiLoCoError):
    """The DHT or the peers it needs could not be reached; the message says what was tried."""


class DHTStartError(DDiLoCoError):
    """The local DHT (hivemind's p2pd daemon) could not start; the message says why and what to check."""


class NodeDHT(hivemind.DHT):
    """``hivemind.DHT`` whose p2pd unix sockets live in a private directory, removed on shutdown.

    p2pd leaves its control socket in /tmp when it exits on its own (e.g. unreachable bootstrap peers);
    with a directory of our own we can clean up without touching other processes' sockets.
    """

    def __init__(self, *args: Any, sock_dir: str, **kwargs: Any) -> None:
        self.sock_dir = sock_dir
        self._cleanup = weakref.finalize(self, shutil.rmtree, sock_dir, True)
        super().__init__(*args, **kwargs)

    def run(self) -> None:  # runs in the forked DHT process
        P2P._UNIX_SOCKET_PREFIX = f"/unix{self.sock_dir}/hivemind-"
        threading.Thread(target=_orphan_watchdog, args=(os.getppid(),), daemon=True).start()
        super().run()

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._cleanup()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _orphan_watchdog(parent: int) -> None:
    """In the DHT process: if the node that forked us dies (kill -9), take our p2pd down and exit, so a killed
    node leaves nothing running (hivemind's DHT process and its daemon would otherwise live on)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            if os.path.isdir("/proc"):
                for child in _children(os.getpid()):
                    with contextlib.suppress(OSError):
                        os.kill(child, signal.SIGKILL)
            os._exit(1)


def _parse_maddrs(what: str, addrs: Sequence[str], need_peer_id: bool = False) -> list[Multiaddr]:
    out = []
    for i, s in enumerate(addrs):
        example = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..." if need_peer_id else "/ip4/0.0.0.0/tcp/31337"
        try:
            m = Multiaddr(str(s))
        except ValueError as e:
            raise ConfigError(
                f"{what}[{i}]={str(s)!r} is not a valid multiaddr ({e}); expected e.g. {example}"
            ) from e
        if need_peer_id and "p2p" not in m:
            raise ConfigError(
                f"{what}[{i}]={str(s)!r} lacks the peer's /p2p/<peer id>; expected e.g. {example}"
            )
        out.append(m)
    return out


def peer_ids_of(maddrs: Sequence[str]) -> list[str]:
    """The peer ids (``/p2p/<id>``) of the multiaddrs that name one; the others are skipped."""
    out = []
    for m in _parse_maddrs("initial_peers", maddrs):
        if "p2p" in m:
            out.append(str(m["p2p"]))
    return out


def _check_port_free(m: Multiaddr) -> None:
    """p2pd listens with SO_REUSEPORT, so two daemons on one host can silently share a port; refuse that."""
    family = socket.AF_INET if "ip4" in m else socket.AF_INET6 if "ip6" in m else None
    if family is None or "tcp" not in m or int(m["tcp"]) == 0:
        return
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((m["ip4" if family == socket.AF_INET else "ip6"], int(m["tcp"])))
        except OSError as e:
            hint = {
                errno.EADDRINUSE: "another node on this host? pick another port, or tcp/0 for any free one",
                errno.EADDRNOTAVAIL: "not an address of this machine; behind NAT, listen on 0.0.0.0 and "
                "pass the public address as announce_maddrs",
            }.get(e.errno, "check the address and port")
            raise DHTStartError(f"cannot listen on {m}: {e.strerror} ({hint})") from e


def _explain(e: BaseException, tried: str, initial_peers: Sequence[str], timeout_s: float) -> DDiLoCoError:
    text = str(e)
    if "bootstrap" in text:  # p2pd: "failed to connect to bootstrap peers"; DHTNode: "bootstrap failed"
        return SwarmUnreachable(
            f"{tried}: none of the initial peers {list(initial_peers)} answered ({text}); check that one of them "
            "is running, that its address, port and /p2p/ peer id are current, and that TCP to it is allowed"
        )
    if "address already in use" in text or "failed to listen" in text:
        return DHTStartError(f"{tried}: cannot listen ({text}); pick another port, or tcp/0 for any free one")
    if isinstance(e, FutureTimeout):
        hint = (
            "check that the initial peers answer (a firewall may drop packets), or " if initial_peers else ""
        )
        return DHTStartError(
            f"{tried}: not ready within {timeout_s:g} s; {hint}raise timeout_s if the host is busy"
        )
    return DHTStartError(f"{tried}: {type(e).__name__}: {text}")


def start_dht(
    identity_path: str | Path,
    host_maddrs: Sequence[str],
    initial_peers: Sequence[str] = (),
    announce_maddrs: Sequence[str] | None = None,
    client_mode: bool = False,
    timeout_s: float = 30.0,
    swarm: str | None = None,
    admission=None,
) -> NodeDHT:
    """Start this node's DHT under its own identity; call ``shutdown()`` on the result when done.

    Create it before starting threads: hivemind forks a process for it. Raises ``ConfigError`` for a
    malformed address or identity file, ``SwarmUnreachable`` when no initial peer answers, and
    ``DHTStartError`` for anything else (port in use, timeout).
    """
    return launch_dht(
        identity_path, host_maddrs, initial_peers, announce_maddrs, client_mode, timeout_s, swarm, admission
    ).wait()


@dataclass
class DHTLaunch:
    """A DHT process forked and starting (p2pd, bootstrap) while the caller does other work; ``wait()``."""

    dht: NodeDHT
    peer_id: str
    identity_path: str
    tried: str
    initial_peers: Sequence[str]
    timeout_s: float
    hosts: list

    def wait(self) -> NodeDHT:
        """The started DHT, or the error ``start_dht`` documents (the process is shut down then)."""
        try:
            self.dht.wait_until_ready(self.timeout_s)
            got = self.dht.peer_id.to_base58()
        except BaseException as e:
            self.dht.shutdown()
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            raise _explain(e, self.tried, self.initial_peers, self.timeout_s) from e
        if got != self.peer_id:
            self.dht.shutdown()
            raise DHTStartError(
                f"{self.tried}: the DHT runs as {got}, not as {self.peer_id} from {self.identity_path}"
            )
        logger.info("DHT started as %s on %s", got, [str(m) for m in self.hosts])
        return self.dht


def launch_dht(
    identity_path: str | Path,
    host_maddrs: Sequence[str],
    initial_peers: Sequence[str] = (),
    announce_maddrs: Sequence[str] | None = None,
    client_mode: bool = False,
    timeout_s: float = 30.0,
    swarm: str | None = None,
    admission=None,
) -> DHTLaunch:
    """Fork the DHT process and return at once; arguments and errors as ``start_dht`` (bad addresses and
    identity files are refused here, before anything starts)."""
    ident = Identity.load(identity_path)
    hosts = _parse_maddrs("host_maddrs", host_maddrs)
    _parse_maddrs("initial_peers", initial_peers, need_peer_id=True)
    _parse_maddrs("announce_maddrs", announce_maddrs or ())
    for m in hosts:
        _check_port_free(m)
    tried = f"starting the DHT on {[str(m) for m in hosts]} with initial peers {list(initial_peers)}"
    base = tempfile.gettempdir() if len(tempfile.gettempdir()) <= 40 else "/tmp"  # unix socket path limit
    dht = NodeDHT(
        initial_peers=[str(p) for p in initial_peers] or None,
        start=False,
        sock_dir=tempfile.mkdtemp(prefix=f"ddiloco-dht-{os.getpid()}-", dir=base),
        identity_path=str(identity_path),
        check_if_identity_free=False,  # hivemind's check parses the key as RSA and fails on Ed25519
        host_maddrs=[str(m) for m in hosts],
        announce_maddrs=list(announce_maddrs) if announce_maddrs else None,
        client_mode=client_mode,
        no_listen=client_mode,  # client mode: p2pd opens no listening socket; the node only dials out
        record_validators=[OwnerValidator(swarm, admission)] if swarm else (),
    )
    try:
        dht.run_in_background(await_ready=False)
    except BaseException as e:
        dht.shutdown()
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        raise _explain(e, tried, initial_peers, timeout_s) from e
    return DHTLaunch(dht, ident.peer_id, str(identity_path), tried, list(initial_peers), timeout_s, hosts)


class OwnerValidator(RecordValidatorBase):
    """Every DHT node of ours stores a value under a peer-id subkey only if that peer signed it.

    The subkey is the owner tag: a membership value must be a member record signed by the key behind the
    subkey's peer id (opened first with the swarm key in a private swarm), so nobody can take over another
    peer's slot, even with a later expiration. Values under other subkeys are left to other validators."""

    def __init__(self, swarm: str, admission=None) -> None:
        self.swarm, self.admission = swarm, admission

    def validate(self, record: DHTRecord) -> bool:
        try:
            owner = MSGPackSerializer.loads(record.subkey)
        except Exception:  # noqa: BLE001 - any undecodable subkey is not ours to judge
            return True
        if not (isinstance(owner, str) and owner.startswith("12D3KooW")):
            return True
        try:
            raw = MSGPackSerializer.loads(record.value)
            if self.admission is not None:
                raw = self.admission.open(raw, f"dht|{self.swarm}|{owner}")
            m = parse_member(self.swarm, raw, now=float("-inf"))
        except Exception as e:  # noqa: BLE001 - garbage of any kind is refused
            logger.debug("DHT refused a value under %s: %s", owner, e)
            return False
        return m.peer_id == owner


class Membership:
    """Publish this node's signed record and read the swarm's live view through a started DHT."""

    def __init__(
        self, dht: hivemind.DHT, swarm: str, identity: Identity, timeout_s: float = 10.0, admission=None
    ) -> None:
        self.dht, self.swarm, self.identity, self.timeout_s = dht, swarm, identity, timeout_s
        self.admission = admission  # private swarm: values sealed with the swarm key, certificates checked
        self.key = f"{swarm}/members"

    def _wait(self, what: str, call: Any, **kwargs: Any) -> Any:
        tried = f"{what} key {self.key!r} of swarm {self.swarm!r}"
        return self._result(tried, lambda: call(self.key, return_future=True, **kwargs))

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
        raw = sign_member(self.swarm, self.identity, member)
        if self.admission is not None:
            raw = self.admission.seal(raw, f"dht|{self.swarm}|{member.peer_id}")
        ok = self._wait(
            "storing", self.dht.store, value=raw, expiration_time=member.expires_at, subkey=member.peer_id
        )
        if not ok:
            raise SwarmUnreachable(
                f"storing key {self.key!r}: no DHT peer accepted the record of {member.peer_id} (none reachable, "
                "or a record for this peer id with a later expiration is already stored)"
            )

    def live(self, now: float | None = None) -> tuple[list[Member], dict[str, str]]:
        """Members with a valid unexpired record, sorted by peer id, and why each other subkey was dropped."""
        now = get_dht_time() if now is None else now
        found = self._wait("reading", self.dht.get, latest=True)
        if found is None:
            return [], {}
        if not isinstance(found.value, dict):
            return [], {"": f"key holds a plain {type(found.value).__name__}, not per-peer records"}
        raws, dropped = {}, {}
        for subkey, item in found.value.items():
            value = getattr(item, "value", item)
            if isinstance(subkey, str) and isinstance(value, bytes):
                if self.admission is None:
                    raws[subkey] = value
                    continue
                try:
                    raws[subkey] = self.admission.open(value, f"dht|{self.swarm}|{subkey}")
                except DDiLoCoError as e:
                    dropped[subkey] = f"not admitted: {e}"
            else:
                dropped[str(subkey)] = (
                    f"not a record: subkey {type(subkey).__name__}, value {type(value).__name__}"
                )
        members, bad = live_view(self.swarm, raws, now, self.admission)
        return members, {**dropped, **bad}

    def relink(self, peer_ids: Sequence[str]) -> list[str]:
        """Ping every peer of ``peer_ids`` that the DHT's routing table has lost; return those that answered.

        hivemind drops a peer from its routing table when one request to it times out, and the peer drops
        us the same way. Under a saturated link both sides can lose each other for good: nothing is left
        that would make either side call the other again, and a bootstrap node, which has no initial peers
        to fall back on, then sees only its own record. A ping that is answered puts the peer back in our
        table, and puts us back in the peer's (hivemind adds the caller of every ping it answers).
        """
        wanted = sorted({p for p in peer_ids if p})
        if not wanted:
            return []
        tried = f"relinking the DHT of swarm {self.swarm!r} to {len(wanted)} known peers"
        return list(
            self._result(tried, lambda: self.dht.run_coroutine(_RelinkInDHT(wanted), return_future=True))
        )


class _RelinkInDHT:  # a class, not a closure: DHT.run_coroutine pickles it to the DHT process
    """Runs in the DHT process: ping the listed peers missing from the routing table, all at once."""

    def __init__(self, peer_ids: list[str]) -> None:
        self.peer_ids = peer_ids

    async def __call__(self, _dht, node) -> list[str]:
        table = node.protocol.routing_table

        async def one(raw: str) -> str | None:
            try:
                pid = PeerID.from_base58(raw)
            except Exception:  # noqa: BLE001 - not a peer id: nothing to ping
                return None
            if pid == node.peer_id or table.get(peer_id=pid) is not None:
                return None
            if await node.protocol.call_ping(pid) is None:
                return None
            node.blacklist.register_success(pid)  # answered: lift any back-off ban at once
            return raw

        return [r for r in await asyncio.gather(*(one(p) for p in self.peer_ids)) if r is not None]
