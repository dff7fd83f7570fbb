"""Print the peer id that ``ddiloco node ARGS`` will run as, creating its identity file if it is missing.

Used by deploy/entrypoint.sh (installed in the image as /usr/local/lib/ddiloco/peer_id.py) so the bootstrap
node can publish its peer id before it starts. The arguments are the node's own (``[node] --config FILE
[flags]``) and are resolved exactly as the node resolves them: defaults < TOML < flags, then the identity is
``[node] identity`` or, when that is empty, ``STATE_DIR/identity.key``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dht.identity import Identity
from node.cli.config import add_config_args, build_config
from node.swarm.settings import NodeConfig
from protocol.errors import DDiLoCoError


def identity_path(argv: list[str]) -> Path:
    p = argparse.ArgumentParser(prog="peer_id.py")
    p.add_argument("--config")
    add_config_args(p, root=NodeConfig)
    args = p.parse_args(argv[1:] if argv[:1] == ["node"] else argv)
    s = build_config(args, args.config, root=NodeConfig).node
    return Path(s.identity) if s.identity else Path(s.state_dir) / "identity.key"


def main(argv: list[str]) -> int:
    try:
        print(Identity.load_or_create(identity_path(argv)).peer_id)
    except DDiLoCoError as e:
        print(f"peer_id.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
