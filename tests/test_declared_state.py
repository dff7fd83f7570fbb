"""Every attribute of a class under ``node/`` is declared where its object is made: in ``__init__``, in an
``_init_*`` method of one of its parts (the node's mixins, each declaring its own state), in a method the
constructor calls, or at class level (dataclass fields). An attribute first set by some later method, or
through ``self.__dict__.setdefault``, is one a reader of the constructor never finds."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.test_layering import ROOT, parse


def _self_targets(n: ast.AST) -> list[str]:
    if isinstance(n, ast.Assign):
        targets = n.targets
    elif isinstance(n, (ast.AnnAssign, ast.AugAssign)):
        targets = [n.target]
    else:
        return []
    out = []
    for t in targets:
        for e in t.elts if isinstance(t, ast.Tuple) else [t]:
            if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                out.append(e.attr)
    return out


def _self_calls(fn: ast.AST) -> set[str]:
    return {
        n.func.attr
        for n in ast.walk(fn)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
    }


def undeclared(files: list[Path]) -> list[str]:
    """``Class.attribute (file:line, method)`` for each attribute first set outside the constructors; the
    classes of one family (a class and its bases of these files) share one ``self``."""
    declared: dict[str, set[str]] = defaultdict(set)
    late: dict[str, list[tuple[str, str]]] = defaultdict(list)
    bases: dict[str, list[str]] = {}
    for f in files:
        tree, rel = parse(f), f.relative_to(ROOT) if f.is_relative_to(ROOT) else f.name
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases[cls.name] = [b.id for b in cls.bases if isinstance(b, ast.Name)]
            methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for st in cls.body:  # class-level names: dataclass fields, defaults
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    declared[cls.name].add(st.target.id)
                elif isinstance(st, ast.Assign):
                    declared[cls.name].update(t.id for t in st.targets if isinstance(t, ast.Name))
            init = {m for m in methods if m in ("__init__", "__post_init__") or m.startswith("_init")}
            init |= {m for i in list(init) for m in _self_calls(methods[i]) if m in methods}
            for name, fn in methods.items():
                for n in ast.walk(fn):
                    for a in _self_targets(n):
                        if name in init:
                            declared[cls.name].add(a)
                        else:
                            late[cls.name].append((a, f"{rel}:{n.lineno} {name}"))
            for n in ast.walk(cls):
                if (
                    isinstance(n, ast.Attribute)
                    and n.attr in ("setdefault", "get")
                    and isinstance(n.value, ast.Attribute)
                    and n.value.attr == "__dict__"
                    and isinstance(n.value.value, ast.Name)
                    and n.value.value.id == "self"
                ):
                    late[cls.name].append(("__dict__", f"{rel}:{n.lineno}"))

    def family(c: str, seen: set[str]) -> set[str]:
        if c not in seen:
            seen.add(c)
            for b in bases.get(c, []):
                family(b, seen)
        return seen

    users = defaultdict(set)  # a mixin is part of every class that has it among its bases
    for c in bases:
        for member in family(c, set()):
            users[member].add(c)
    bad = []
    for c, items in late.items():
        shared = set().union(*(family(u, set()) for u in users[c] | {c}))
        known = set().union(*(declared[x] for x in shared))
        bad += [f"{c}.{a} ({where})" for a, where in items if a not in known]
    return bad


def test_no_attribute_under_node_is_created_after_its_constructor():
    bad = undeclared(sorted((ROOT / "node").rglob("*.py")))
    assert not bad, "attributes first set outside a constructor (declare them there):\n" + "\n".join(bad)


def test_the_check_sees_a_late_attribute_and_a_dict_setdefault(tmp_path):
    f = tmp_path / "x.py"
    f.write_text(
        "class A:\n"
        "    def __init__(self):\n        self.a = 1\n        self._reset()\n"
        "    def _reset(self):\n        self.b = 2\n"
        "class Part:\n"
        "    def _init_part(self):\n        self.c = 3\n"
        "    def later(self):\n        self.c, self.d = 4, 5\n"
        "        return self.__dict__.setdefault('e', {})\n"
        "class Whole(A, Part):\n"
        "    def go(self):\n        self.a = self.b = 0\n"
    )
    bad = undeclared([f])
    assert sorted(b.split(" ")[0] for b in bad) == ["Part.__dict__", "Part.d"], bad
