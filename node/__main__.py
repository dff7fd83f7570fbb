"""``python -m node``: the same CLI as ``ddiloco``."""

import sys

from node.cli.main import main

sys.exit(main())
