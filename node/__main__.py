"""``python -m node``: the same CLI as ``ddiloco``."""

import sys

from node.cli import main

sys.exit(main())
