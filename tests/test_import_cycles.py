"""No import cycles between the project's modules, counting imports inside functions and under
``TYPE_CHECKING`` too: a cycle is a cycle for the reader even when Python tolerates it."""

import ast
from pathlib import Path

from tests.test_layering import parse

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "dht", "node", "sim")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    files = {
        module_name(f) if root == ROOT else ".".join(f.relative_to(root).with_suffix("").parts): f
        for p in packages
        for f in (root / p).rglob("*.py")
    }
    edges: dict[str, set[str]] = {m: set() for m in files}
    for m, f in files.items():
        for n in ast.walk(parse(f)):
            targets = []
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                targets = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
            for t in targets:
                if t in files and t != m:
                    edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v: str) -> None:
        work = [(v, iter(sorted(edges[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter[0]
                counter[0] += 1
                stack.append(nxt)
                on.add(nxt)
                work.append((nxt, iter(sorted(edges[nxt]))))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import y\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    assert cycles(graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b"]]
