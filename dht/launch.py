"""Starting a node's DHT: hivemind's DHT process with p2pd inside, on checked addresses, with errors that
say what to check, and the validator that keeps each membership subkey to its owner's signed record."""

from __future__ import annotations

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
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind.dht import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer

from dht.identity import Identity
from dht.records import BUCKETS, bucket_of, members_key, parse_member
from protocol.errors import ConfigError, DDiLoCoError

logger = logging.getLogger(__name__)


class SwarmUnreachable(DDiLoCoError):
    """The DHT or the peers it needs could not be reached; the message says what was tried."""


class DHTStartError(DDiLoCoError):
    """The local DHT (hivemind's p2pd daemon) could not start; the message says why and what to check."""


class NodeDHT(DHT):
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

    async def replicate_p2p(self) -> P2P:
        # The replica's client socket goes in our directory too, not in /tmp (hivemind names it by a class
        # attribute; one node's DHT per process, and a test's several DHTs each set it before replicating).
        P2P._UNIX_SOCKET_PREFIX = f"/unix{self.sock_dir}/hivemind-"
        return await super().replicate_p2p()

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


MAX_PEER_ID = 64  # characters; an Ed25519 peer id in base58 has 52


class OwnerValidator(RecordValidatorBase):
    """Under the swarm's members keys, every DHT node of ours stores (and takes from a peer it asks) only a
    member record under a peer-id subkey, signed by that peer, in the bucket its peer id falls in.

    The subkey is the owner tag: a membership value must be a member record signed by the key behind the
    subkey's peer id (opened first with the swarm key in a private swarm), so nobody can take over another
    peer's slot, even with a later expiration. Anything else under the keys is refused: subkeys that are not
    peer-id strings (an int and a str subkey with the same expiry made hivemind's storage raise TypeError on
    every read), a plain value over a whole key (it would replace every member's record in it until an
    expiry the writer chooses), and a record in another bucket than its peer id's. hivemind validators see
    a key only as its hash: other keys are not ours to judge and pass."""

    def __init__(self, swarm: str, admission=None) -> None:
        self.swarm, self.admission = swarm, admission
        self.key_ids = {DHTID.generate(source=members_key(swarm, b)).to_bytes(): b for b in range(BUCKETS)}

    def validate(self, record: DHTRecord) -> bool:
        bucket = self.key_ids.get(record.key)
        if bucket is None:
            return True
        where = members_key(self.swarm, bucket)
        try:
            owner = MSGPackSerializer.loads(record.subkey)
        except Exception:  # noqa: BLE001 - an undecodable subkey is no member's
            logger.debug("DHT refused a value under an undecodable subkey of %s", where)
            return False
        if not (isinstance(owner, str) and 0 < len(owner) <= MAX_PEER_ID and bucket_of(owner) == bucket):
            logger.debug(
                "DHT refused a value under %s: subkey %s is not a peer id of that bucket",
                where,
                "(plain value)" if owner is None else repr(owner)[:80],
            )
            return False
        try:
            raw = MSGPackSerializer.loads(record.value)
            if self.admission is not None and self.admission.sealed:
                raw = self.admission.open(raw, f"dht|{self.swarm}|{owner}")
            m = parse_member(self.swarm, raw, now=float("-inf"))
        except Exception as e:  # noqa: BLE001 - garbage of any kind is refused
            logger.debug("DHT refused a value under %s: %s", owner, e)
            return False
        return m.peer_id == owner
