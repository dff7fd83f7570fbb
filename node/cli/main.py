"""The ``ddiloco`` command line (also ``python -m node``). One parser, one subcommand per job.

  ddiloco train-local    an in-process swarm of M learners on a virtual clock (this machine, no network)
  ddiloco node           one node of a real swarm (DHT discovery, elected synchronisers)
  ddiloco up             a local swarm of N node processes with a live status table
  ddiloco status         a node's view of the swarm (peers, roles, rounds, loss, bandwidth, goodput)
  ddiloco data prepare   tokenise a corpus once into the token cache its nodes read
  ddiloco doctor         why a node is not contributing (or will not start): checks with evidence and fixes
  ddiloco keygen         create a node identity and print its peer id

Run ``ddiloco SUBCOMMAND --help`` for the flags. ``main(argv)`` returns an exit code so tests can call it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from node.cli import chaos, data, doctor, keygen, node_cmd, sim, status, swarm, train_local, up
from protocol.errors import DDiLoCoError

logger = logging.getLogger(__name__)
# Each subcommand is a module with add_parser(sub) and run(args); in the order --help lists them.
COMMANDS = {
    "train-local": train_local,
    "node": node_cmd,
    "up": up,
    "swarm": swarm,
    "data": data,
    "status": status,
    "doctor": doctor,
    "keygen": keygen,
    "sim": sim,
    "chaos": chaos,
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddiloco", description="Peer-to-peer Decoupled DiLoCo training node.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "node":  # torchrun re-runs the node's own argv
            return node_cmd.run(args, sys.argv[1:] if argv is None else list(argv))
        return COMMANDS[args.command].run(args)
    except DDiLoCoError as e:
        print(f"ddiloco: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ddiloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
