"""Write the golden bytes of ``tests/test_golden_wire.py`` into this folder: one file per format in its
``FORMATS``, each built from that module's fixed instance.

    .venv/bin/python tests/golden/make.py           # write every file
    .venv/bin/python tests/golden/make.py --check   # write nothing; list the files that would change

Run it only when a format changes on purpose. The files stand for what the commit before wrote: a new file
means nodes of this commit and of the commit before no longer read each other's messages byte for byte.
Say so in the commit (and bump the format's domain tag, e.g. ``ddiloco/merge/v1``, where the change is to
what is signed). The test never runs this script.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    golden = importlib.import_module("tests.test_golden_wire")
    check = "--check" in argv
    changed = []
    for name, build in golden.FORMATS.items():
        path = golden.GOLDEN / name
        data = build()
        if not path.exists() or path.read_bytes() != data:
            changed.append(name)
            if not check:
                path.write_bytes(data)
        print(f"{'changed' if name in changed else 'same   '} {len(data):6d} {name}")
    print(f"{len(changed)} of {len(golden.FORMATS)} {'would change' if check else 'written'}")
    return 1 if check and changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
