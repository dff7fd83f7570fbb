"""``ddiloco swarm init | admit | revoke``: the authority side of a private swarm (``dht.admission``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    sw = sub.add_parser(
        "swarm",
        help="swarms with an authority (private, or open learners): create it, admit and revoke peers",
        description="The authority of a private swarm, or of a public one whose synchronisers it certifies "
        "('init --open-learners'). 'init' creates a folder with the authority key, the swarm secret (none with "
        "--open-learners) and swarm.json; 'admit PEER_ID' signs an admission certificate for a node's peer id "
        "(from 'ddiloco keygen'); 'revoke PEER_ID' lists a peer id in revoked.txt, which nodes read through "
        "--revoked. Nodes run with --swarm NAME --authority AUTHORITY_PEER_ID --swarm-secret DIR/secret.key "
        "--certificate CERT.",
    )
    ss = sw.add_subparsers(dest="swarm_command", required=True, metavar="ACTION")
    i = ss.add_parser("init", help="create a swarm folder (authority key, secret, swarm.json)")
    i.add_argument("--dir", required=True, help="folder to create; keep authority.key and secret.key private")
    i.add_argument("--name", required=True, help="the swarm's name (every node's --swarm)")
    i.add_argument(
        "--open-learners",
        action="store_true",
        help="a public swarm with certified synchronisers: anyone may join as a learner without a "
        "certificate (never elected), only admitted peers synchronise; nothing is sealed (no secret), and "
        "merges are robust. The way to run a public swarm (docs/security.md)",
    )
    a = ss.add_parser("admit", help="sign an admission certificate for a peer id")
    a.add_argument("peer_id", help="the node's peer id (12D3KooW...)")
    a.add_argument("--dir", required=True, help="the swarm folder made by 'swarm init'")
    a.add_argument("--days", type=float, default=365.0, help="validity in days (default 365)")
    a.add_argument(
        "--role",
        default="any",
        help="any (learner and synchroniser, default), learner (never elected) or observer (reads status "
        "with 'ddiloco status --peer', never a member)",
    )
    a.add_argument("--out", required=True, help="certificate file to write (give it to the node)")
    r = ss.add_parser("revoke", help="list a peer id in the swarm's revocation file")
    r.add_argument("peer_id", help="the peer id to refuse from now on (12D3KooW...)")
    r.add_argument("--dir", required=True, help="the swarm folder made by 'swarm init'")


def run(args: argparse.Namespace) -> int:
    from dht.admission import admit, init_swarm, revoke

    d = Path(args.dir)
    if args.swarm_command == "init":
        doc = init_swarm(d, args.name, open_learners=args.open_learners)
        print(f"swarm {doc['swarm']!r} created in {d}; authority {doc['authority']}")
        if args.open_learners:
            flags = f"--swarm {doc['swarm']} --authority {doc['authority']} --open-learners"
            print(
                f"synchronisers: {flags} --certificate CERT (from 'ddiloco swarm admit PEER_ID --dir {d} "
                f"--out CERT')\nlearners, anyone: {flags}"
            )
            return 0
        print(
            f"nodes: --swarm {doc['swarm']} --authority {doc['authority']} --swarm-secret {d / 'secret.key'} "
            f"--certificate CERT (from 'ddiloco swarm admit PEER_ID --dir {d} --out CERT')"
        )
        return 0
    if args.swarm_command == "admit":
        cert = admit(d, args.peer_id, args.days, args.role)
        Path(args.out).write_text(cert.to_json() + "\n")
        print(
            f"admitted {cert.peer_id} to {cert.swarm!r} as {cert.role} until {cert.expires_at:.0f}: {args.out}"
        )
        return 0
    path = revoke(d, args.peer_id)
    print(f"revoked {args.peer_id}: listed in {path}; nodes that read it with --revoked drop the peer")
    return 0
