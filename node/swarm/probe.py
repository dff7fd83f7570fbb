"""Network probes for ``ddiloco doctor``: can this host listen on a port, and can a fresh p2p daemon dial a
multiaddr (an initial peer, or the address a node announces)? Each answer is the error text, or None.

The dialer is a throwaway hivemind p2p daemon with its own random identity, listening nowhere, so a dial
succeeds only if the address really leads to the peer id it names (the Noise handshake checks the key);
its unix sockets live in a private folder removed afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from dht.launch import DHTStartError, _check_port_free


def port_errors(host_maddrs: Sequence[str]) -> list[tuple[str, str | None]]:
    """Each listen address and why it cannot be bound (None: free, or nothing fixed to check)."""
    out = []
    for a in host_maddrs:
        try:
            _check_port_free(Multiaddr(a))
            out.append((a, None))
        except DHTStartError as e:
            out.append((a, str(e)))
        except ValueError as e:
            out.append((a, f"not a multiaddr: {e}"))
    return out


def _split(maddr: str) -> tuple[Multiaddr, PeerID]:
    m = Multiaddr(maddr)
    if "p2p" not in m:
        raise ValueError("lacks /p2p/<peer id>")
    pid = PeerID.from_base58(str(m["p2p"]))
    return m.decapsulate(Multiaddr(f"/p2p/{m['p2p']}")), pid


async def dial_each(maddrs: Sequence[str], timeout_s: float = 10.0) -> list[tuple[str, str | None]]:
    """Dial every ``/…/p2p/<peer id>`` address from one fresh p2p daemon; the error of each (None: it answered)."""
    sock_dir = tempfile.mkdtemp(prefix="ddiloco-doctor-", dir="/tmp")
    saved = P2P._UNIX_SOCKET_PREFIX
    P2P._UNIX_SOCKET_PREFIX = f"/unix{sock_dir}/hivemind-"
    p2p = None
    out: list[tuple[str, str | None]] = []
    try:
        async with asyncio.timeout(30):
            p2p = await P2P.create(
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                no_listen=True,
                auto_nat=False,
                nat_port_map=False,
                use_relay=False,
                check_if_identity_free=False,
            )
        for a in maddrs:
            try:
                addr, pid = _split(a)
            except ValueError as e:
                out.append((a, f"cannot dial: {e}"))
                continue
            try:
                async with asyncio.timeout(timeout_s):
                    await p2p._client.connect(pid, [addr])
                out.append((a, None))
            except TimeoutError:
                out.append(
                    (a, f"no answer within {timeout_s:g} s (packets dropped by a firewall, or a dead host?)")
                )
            except Exception as e:  # noqa: BLE001 - p2pd reports dial errors as text of several types
                out.append((a, f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"))
    finally:
        P2P._UNIX_SOCKET_PREFIX = saved
        if p2p is not None:
            with contextlib.suppress(Exception):
                await p2p.shutdown()
        shutil.rmtree(sock_dir, ignore_errors=True)
    return out


def dial(maddrs: Sequence[str], timeout_s: float = 10.0) -> list[tuple[str, str | None]]:
    return asyncio.run(dial_each(maddrs, timeout_s)) if maddrs else []
