"""Imports flow one way (docs/design.md, section 8): protocol <- dht <- node, and inside node each subpackage
imports only the ones below it (the rule stated in each package's ``__init__``). protocol stays free of I/O;
the simulator (sim) drives protocol only."""

import ast
import functools
import gc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "protocol": {"dht", "node", "socket", "asyncio", "time", "hivemind", "libp2p", "threading", "subprocess"},
    "dht": {"node"},
    "sim": {"dht", "node", "socket", "asyncio", "hivemind", "torch", "threading", "subprocess"},
}
# What each node subpackage may import of the project (besides itself). ``swarm`` and ``local`` are
# siblings: the launcher reads its nodes through their status endpoints, as an operator would.
PROJECT = ("protocol", "dht", "sim", "node")
ALLOWED = {
    "node.common": {"protocol"},
    "node.learner": {"protocol", "node.common"},
    "node.swarm": {"protocol", "dht", "node.common", "node.learner"},
    "node.local": {"protocol", "node.common", "node.learner"},
    "node.chaos": {"protocol", "sim", "node.common", "node.local"},
    "node.cli": {
        "protocol",
        "dht",
        "sim",
        "node.common",
        "node.learner",
        "node.swarm",
        "node.local",
        "node.chaos",
    },
}


def parse(path: Path) -> ast.Module:
    """``ast.parse`` with the garbage collector held off: CPython 3.11 raises "SystemError: AST constructor
    recursion depth mismatch" when a finaliser (an earlier test's closed event loop) runs mid-conversion.
    Each file is parsed once per session (the checks only read the trees): a full collection before each
    parse, late in the suite, made the import checks take 2.5 minutes."""
    return _parse(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _parse(path: str, mtime_ns: int) -> ast.Module:
    gc.disable()
    try:
        return ast.parse(Path(path).read_text(), filename=path)
    finally:
        gc.enable()


def imports_of(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports (absolute imports)."""
    return {m.split(".")[0] for m in modules_of(path)}


def modules_of(path: Path) -> set[str]:
    tree = parse(path)
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module)
    return out


def layer_of(module: str) -> str | None:
    """The layer a project module belongs to: ``node.swarm.agent`` -> ``node.swarm``, ``dht.records`` -> dht."""
    parts = module.split(".")
    if parts[0] not in PROJECT:
        return None
    if parts[0] == "node" and len(parts) > 1 and f"node.{parts[1]}" in ALLOWED:
        return f"node.{parts[1]}"
    return parts[0]


def violations(path: Path, own: str) -> list[str]:
    bad = []
    for m in modules_of(path):
        layer = layer_of(m)
        if layer is not None and layer != own and layer not in ALLOWED[own]:
            bad.append(f"{path} imports {m} ({own} may import {sorted(ALLOWED[own])})")
    return bad


def test_layering_and_pure_core():
    bad = []
    for pkg, forbidden in FORBIDDEN.items():
        for f in (ROOT / pkg).rglob("*.py"):
            hit = imports_of(f) & forbidden
            if hit:
                bad.append(f"{f.relative_to(ROOT)} imports {sorted(hit)}")
    assert not bad, "imports against the layering protocol <- dht <- node:\n" + "\n".join(bad)


def test_node_subpackages_import_only_the_layers_below():
    bad = []
    for own in ALLOWED:
        for f in (ROOT / own.replace(".", "/")).rglob("*.py"):
            bad += violations(f, own)
    assert not bad, "upward or sideways imports inside node/:\n" + "\n".join(bad)


def test_every_node_module_lives_in_a_subpackage_with_a_stated_rule():
    loose = [f.name for f in (ROOT / "node").glob("*.py") if f.name not in ("__init__.py", "__main__.py")]
    assert not loose, f"modules directly in node/ (put each in the subpackage of its concern): {loose}"
    for own in ALLOWED:
        doc = ast.get_docstring(parse(ROOT / own.replace(".", "/") / "__init__.py"))
        assert doc and "May import" in doc, (
            f"{own}/__init__.py must say what the package holds and may import"
        )


def test_checker_sees_a_violation(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from node.cli.main import main\nimport socket\n")
    assert imports_of(f) == {"node", "socket"}
    assert layer_of("node.swarm.agent") == "node.swarm" and layer_of("torch.nn") is None
    g = tmp_path / "y.py"  # as if it were in node/learner/: reaching up into the swarm is refused
    g.write_text("from node.swarm.agent import Node\nfrom node.common.events import EventLog\n")
    bad = violations(g, "node.learner")
    assert len(bad) == 1 and "node.swarm.agent" in bad[0]
