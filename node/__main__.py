"""``python -m node``: the same CLI as ``ddiloco``."""

import faulthandler
import sys

from node.common.lifetime import die_with_parent, started_by_torchrun

if started_by_torchrun():
    # Before the imports and the rendezvous, which take seconds: a rank whose torchrun agent is killed
    # meanwhile (the node's process group, kill -9) must not live on, waiting for peers that are gone.
    die_with_parent()

# A crash inside a native library (SIGSEGV, SIGABRT) leaves every thread's Python traceback in the node's log.
faulthandler.enable()

from node.cli.main import main  # noqa: E402

sys.exit(main())
