"""``ddiloco keygen``: a new node identity (Ed25519, libp2p key format) and its peer id."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    kg = sub.add_parser(
        "keygen",
        help="create a node identity (Ed25519 key; prints its libp2p peer id)",
        description="Write a new Ed25519 node identity in the libp2p key format that the "
        "node's DHT daemon reads, and print its peer id.",
    )
    kg.add_argument("--out", default="identity.key", help="key file to write (default: identity.key)")
    kg.add_argument("--force", action="store_true", help="overwrite an existing key file")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dht.identity import Identity
    from protocol.errors import ConfigError

    if Path(args.out).exists() and not args.force:
        raise ConfigError(
            f"out={args.out!r} already exists; it is a node's identity, so it is not replaced "
            "unless you pass --force"
        )
    ident = Identity.generate()
    ident.save(args.out)
    print(ident.peer_id)
    return 0
