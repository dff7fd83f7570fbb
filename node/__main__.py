"""``python -m node``, and the ``ddiloco`` command (``main``): the CLI of ``node.cli.main``.

What must happen before torch and the node's threads exist happens at import: one malloc heap for the
process (``node.common.heap``), and a torchrun rank tied to its agent's life.
"""

import faulthandler
import sys

from node.common.heap import one_arena
from node.common.lifetime import die_with_parent, started_by_torchrun

one_arena()
if started_by_torchrun():
    # Before the imports and the rendezvous, which take seconds: a rank whose torchrun agent is killed
    # meanwhile (the node's process group, kill -9) must not live on, waiting for peers that are gone.
    die_with_parent()

# A crash inside a native library (SIGSEGV, SIGABRT) leaves every thread's Python traceback in the node's log.
faulthandler.enable()


def main() -> int:
    from node.cli.main import main as cli

    return cli()


if __name__ == "__main__":
    sys.exit(main())
