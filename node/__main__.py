"""``python -m node``: the same CLI as ``ddiloco``."""

import sys

from node.common.lifetime import die_with_parent, started_by_torchrun

if started_by_torchrun():
    # Before the imports and the rendezvous, which take seconds: a rank whose torchrun agent is killed
    # meanwhile (the node's process group, kill -9) must not live on, waiting for peers that are gone.
    die_with_parent()

from node.cli.main import main  # noqa: E402

sys.exit(main())
