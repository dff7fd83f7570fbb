"""Where the agent and the learner meet: the learner thread is handed a ``LearnerHost``
(``node.learner.loop``), a declared interface, and the node it runs in provides every part of it."""

from __future__ import annotations

import ast
import typing

from node.learner.loop import LearnerHost
from tests.test_layering import ROOT, parse


def _node_class() -> ast.ClassDef:
    tree = parse(ROOT / "node" / "swarm" / "agent.py")
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Node")


def test_the_node_provides_every_part_of_the_learner_host():
    node = _node_class()
    # set where the node is made: its constructor and the ``_init_*`` parts it calls
    inits = [
        n for n in node.body if isinstance(n, ast.FunctionDef) and n.name.startswith(("__init__", "_init"))
    ]
    set_here = {
        t.attr
        for init in inits
        for n in ast.walk(init)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        for t in (t.elts if isinstance(t, ast.Tuple) else [t])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    methods = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    wanted = set(typing.get_type_hints(LearnerHost)) | {
        n for n, v in vars(LearnerHost).items() if callable(v) and not n.startswith("_")
    }
    assert wanted == {
        "peer_id", "settings", "task", "learner", "unit", "blocking", "events", "outbox", "view", "clocks",
        "request_stop",
    }  # fmt: skip
    assert not wanted - set_here - methods, sorted(wanted - set_here - methods)
