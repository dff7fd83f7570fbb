"""Read a node's status through libp2p with py-libp2p: ``python -m node.cli.remote_status --peer MADDR``.

``ddiloco status --peer`` runs this module in a process of its own: it imports py-libp2p and never
hivemind (both register a protobuf package ``crypto.pb``, and one process cannot import both without a
workaround), starts no Go daemon and opens no listening port. It dials the node, speaks
``/ddiloco/status/1`` (``node.common.status_wire``) and prints the node's reply as one JSON line on stdout:
``{"ok": true, "status": {...}}`` or a refusal ``{"ok": false, "code", "message"}`` (exit code 0 either
way: the node answered). When no answer comes it prints what failed on stderr and exits with 2.

``--identity KEY`` (a ``ddiloco keygen`` file) is who the caller is; without it a throwaway key is used.
``--certificate CERT`` is sent along; a private swarm answers only a caller its authority admitted
(``ddiloco swarm admit PEER_ID --role observer`` admits a reader that is never a member).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from node.common.status_wire import (
    MAX_REPLY,
    PROTOCOL,
    StatusWireError,
    decode_body,
    encode_frame,
    frame_size,
)
from protocol.errors import DDiLoCoError


class RemoteStatusError(DDiLoCoError):
    """The node's status could not be read over libp2p; the message says what was tried and what failed."""


def _key_pair(identity: str | None):
    from libp2p.crypto.ed25519 import Ed25519PrivateKey, create_new_key_pair
    from libp2p.crypto.keys import KeyPair

    if not identity:
        return create_new_key_pair()
    from cryptography.hazmat.primitives import serialization

    from dht.identity import Identity

    seed = Identity.load(identity).key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    priv = Ed25519PrivateKey.from_bytes(seed)
    return KeyPair(priv, priv.get_public_key())


async def _read_exactly(stream, n: int) -> bytes:
    from libp2p.network.stream.exceptions import StreamEOF

    buf = b""
    try:
        while len(buf) < n:
            chunk = await stream.read(n - len(buf))
            if not chunk:
                break
            buf += chunk
    except StreamEOF:
        pass
    if len(buf) < n:
        raise RemoteStatusError(f"the stream ended after {len(buf)} of {n} bytes")
    return buf


async def _fetch(peer: str, identity: str | None, cert: str, timeout_s: float) -> dict:
    import multiaddr
    import trio
    from libp2p import new_host
    from libp2p.peer.peerinfo import info_from_p2p_addr

    try:
        info = info_from_p2p_addr(multiaddr.Multiaddr(peer))
    except Exception as e:  # noqa: BLE001 - multiaddr and peer id parsing raise several types
        raise RemoteStatusError(
            f"--peer {peer!r} is not a multiaddr with /p2p/<peer id> ({e}); expected e.g. "
            "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."
        ) from e
    host = new_host(key_pair=_key_pair(identity))
    step = "connecting"
    try:
        async with host.run(listen_addrs=[]):
            with trio.fail_after(timeout_s):
                await host.connect(info)
                step = f"opening {PROTOCOL}"
                stream = await host.new_stream(info.peer_id, [PROTOCOL])
                step = "reading the reply"
                await stream.write(encode_frame({"cert": cert}))
                n = frame_size(await _read_exactly(stream, 4), MAX_REPLY)
                reply = decode_body(await _read_exactly(stream, n))
                await stream.close()
                return reply
    except trio.TooSlowError as e:
        raise RemoteStatusError(f"{peer}: no answer within {timeout_s:g} s while {step}") from e
    except (RemoteStatusError, StatusWireError):
        raise
    except Exception as e:  # noqa: BLE001 - py-libp2p's dial and negotiation errors have many types
        raise RemoteStatusError(
            f"{peer}: {step} failed ({type(e).__name__}: {e}); is the node running, is its address and "
            "peer id current, and does it serve the status protocol?"
        ) from e


def fetch_remote_status(
    peer: str, identity: str | None = None, cert: str = "", timeout_s: float = 15.0
) -> dict:
    import trio

    return trio.run(_fetch, peer, identity, cert, timeout_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m node.cli.remote_status", description=__doc__.split("\n")[0])
    p.add_argument("--peer", required=True, help="/ip4/HOST/tcp/PORT/p2p/PEER_ID of the node")
    p.add_argument("--identity", default=None, help="the caller's key file (default: a throwaway key)")
    p.add_argument("--certificate", default=None, help="the caller's admission certificate (private swarms)")
    p.add_argument("--timeout-s", type=float, default=15.0, help="deadline for the whole exchange")
    args = p.parse_args(argv)
    try:
        cert = Path(args.certificate).read_text().strip() if args.certificate else ""
        reply = fetch_remote_status(args.peer, args.identity, cert, args.timeout_s)
    except OSError as e:
        print(f"remote status: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except DDiLoCoError as e:
        print(f"remote status: {e}", file=sys.stderr)
        return 2
    print(json.dumps(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main())
