"""``python -m node``, and the ``ddiloco`` command (``main``): the CLI of ``node.cli.main``.

What must happen before torch and the node's threads exist happens at import: one malloc heap for the
process (``node.common.heap``), and a torchrun rank tied to its agent's life.
"""

import faulthandler

from node.common.heap import one_arena
from node.common.lifetime import die_with_parent, started_by_torchrun

one_arena()
if started_by_torchrun():
    # Before the imports and the rendezvous, which take seconds: a rank whose torchrun agent is killed
    # meanwhile (the node's process group, kill -9) must not live on, waiting for peers that are gone.
    die_with_parent()

# A crash inside a native library (SIGSEGV, SIGABRT) leaves every thread's Python traceback in the node's log.
faulthandler.enable()


def main() -> None:
    """Run the command, then end the process without the interpreter's teardown (``exit_without_teardown``):
    a stopped node's process is gone a second after its stop, not 10-20 s later."""
    from node.cli.main import main as cli
    from node.common.lifetime import exit_without_teardown

    exit_without_teardown(cli())


if __name__ == "__main__":
    main()
