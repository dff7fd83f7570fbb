"""Imports flow one way: protocol <- dht <- node (DESIGN §8); the simulator (sim) drives protocol only.
protocol stays free of I/O."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "protocol": {"dht", "node", "socket", "asyncio", "time", "hivemind", "libp2p", "threading", "subprocess"},
    "dht": {"node"},
    "sim": {"dht", "node", "socket", "asyncio", "hivemind", "torch", "threading", "subprocess"},
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out.update(a.name.split(".")[0] for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module.split(".")[0])
    return out


def test_layering_and_pure_core():
    bad = []
    for pkg, forbidden in FORBIDDEN.items():
        for f in (ROOT / pkg).rglob("*.py"):
            hit = imports_of(f) & forbidden
            if hit:
                bad.append(f"{f.relative_to(ROOT)} imports {sorted(hit)}")
    assert not bad, "imports against the layering protocol <- dht <- node:\n" + "\n".join(bad)


def test_checker_sees_a_violation(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from node.cli.main import main\nimport socket\n")
    assert imports_of(f) == {"node", "socket"}
