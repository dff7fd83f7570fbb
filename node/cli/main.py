"""The ``ddiloco`` command line (also ``python -m node``). One parser, one subcommand per job.

  ddiloco train-local    an in-process swarm of M learners on a virtual clock (this machine, no network)
  ddiloco node           one node of a real swarm (DHT discovery, elected synchronisers)
  ddiloco up             a local swarm of N node processes with a live status table
  ddiloco status         a node's view of the swarm (peers, roles, rounds, loss, bandwidth, goodput)
  ddiloco data prepare   tokenise a corpus once into the token cache its nodes read
  ddiloco doctor         why a node is not contributing (or will not start): checks with evidence and fixes
  ddiloco keygen         create a node identity and print its peer id
  ddiloco sim            goodput at scale from the discrete-event simulator (no training)
  ddiloco plan           the schedule and link a run across sites needs, before it starts
  ddiloco replay         a finished run's tapes re-decided in virtual time, with its settings and what-ifs
  ddiloco chaos          a local swarm under a seeded failure plan, scored from the nodes' tapes

Run ``ddiloco SUBCOMMAND --help`` for the flags. ``main(argv)`` returns an exit code so tests can call it.
``train-local`` and ``node`` import torch (2-3 s); they are imported only when they run or are asked for
help, so ``keygen``, ``swarm``, ``status``, ``up`` and the others start in a tenth of a second.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

from protocol.errors import DDiLoCoError

logger = logging.getLogger(__name__)
# Each subcommand is a module of node.cli with add_parser(sub) and run(args); in the order --help lists
# them. Those given a help line here import torch, and are imported only for their own command.
COMMANDS: dict[str, tuple[str, str | None]] = {
    "train-local": ("train_local", "train M learners in one process on a virtual clock, and compare systems"),
    "node": ("node_cmd", "run one node of a swarm: a learner plus its network agent"),
    "up": ("up", None),
    "swarm": ("swarm", None),
    "data": ("data", None),
    "status": ("status", None),
    "doctor": ("doctor", None),
    "keygen": ("keygen", None),
    "sim": ("sim", None),
    "plan": ("plan", None),
    "replay": ("replay", "replay a finished run's tapes in virtual time, with its own settings and what-ifs"),
    "chaos": ("chaos", None),
}


def command_module(name: str) -> ModuleType:
    return importlib.import_module(f"node.cli.{COMMANDS[name][0]}")


def _chosen(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not a flag), if it is one."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def _parser(argv: list[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddiloco", description="Peer-to-peer Decoupled DiLoCo training node.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _chosen(argv)
    for name, (_, lazy_help) in COMMANDS.items():
        if lazy_help is not None and name != chosen:
            sub.add_parser(name, help=lazy_help)  # listed in --help; its flags are read when it is chosen
        else:
            command_module(name).add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    args = _parser(words).parse_args(words)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "node":  # torchrun re-runs the node's own argv
            return command_module("node").run(args, words)
        return command_module(args.command).run(args)
    except DDiLoCoError as e:
        print(f"ddiloco: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ddiloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
