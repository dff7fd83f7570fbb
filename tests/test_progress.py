"""Progress of long CLI work (``node.common.progress``) and the dashboard's history (``node.swarm.history``):
a line per 10% without a terminal, a redrawn rich bar in one (a real pseudo-terminal); a curve that covers
the whole run in bounded memory."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from node.common.progress import Bar
from node.swarm.history import History

ROOT = Path(__file__).resolve().parent.parent


def test_without_a_terminal_a_line_per_tenth():
    out = io.StringIO()
    bar = Bar("decoupled", stream=out)
    for i in range(201):
        bar(i / 200, f"tokens {i}")
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 and "\r" not in out.getvalue() and "\x1b[" not in out.getvalue()
    assert lines[0].split()[:2] == ["decoupled", "0.0%"] and lines[-1].split()[1:4] == [
        "100.0%",
        "tokens",
        "200",
    ]
    quiet = io.StringIO()
    Bar("x", enabled=False, stream=quiet)(0.5)
    assert quiet.getvalue() == ""


def _read_all(fd: int, sink: bytearray) -> None:
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the other side closed
            return
        if not chunk:
            return
        sink.extend(chunk)


@pytest.mark.slow
def test_in_a_terminal_the_cli_draws_a_rich_bar():
    master, slave = pty.openpty()
    got = bytearray()
    reader = threading.Thread(target=_read_all, args=(master, got), daemon=True)
    reader.start()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    try:
        p = subprocess.run(
            [sys.executable, "-m", "node", "sim", "--days", "0.05"],
            stdout=subprocess.PIPE,
            stderr=slave,
            cwd=ROOT,
            env=env,
            timeout=120,
        )
    finally:
        os.close(slave)
        reader.join(10)
        os.close(master)
    text = got.decode(errors="replace")
    assert p.returncode == 0, text
    assert "decoupled" in text and "100%" in text and "of virtual time" in text
    assert "\x1b[" in text, "a terminal gets rich's control sequences (the bar redrawn in place)"
    assert b"goodput" in p.stdout  # the table still goes to stdout


def test_history_keeps_the_whole_run_in_bounded_points():
    h = History(tokens_per_step=100, max_points=50)
    for s in range(1, 1001):
        h.on_event({"kind": "step", "step": s, "t0": s - 0.5, "t1": float(s), "loss": 10.0 / s})
        if s % 100 == 0:
            h.on_event({"kind": "eval", "t": float(s), "step": s, "tokens": 100 * s, "loss": 5.0 / s})
    h.on_event({"kind": "reject", "t": 1.0, "peer": "p", "code": "not_finite", "why": "NaN"})
    d = h.doc()
    steps = [p["step"] for p in d["steps"]]
    assert len(steps) < 50 and steps[0] <= d["stride"] and steps[-1] > 1000 - 2 * d["stride"]
    assert all(b - a == d["stride"] for a, b in zip(steps, steps[1:])), "thinned evenly"
    assert all(abs(p["tokens_per_s"] - 100.0) < 1e-6 for p in d["steps"][1:]), "one step per second"
    assert [e["step"] for e in d["evals"]] == list(range(100, 1001, 100))
    assert d["refusals"] == [{"t": 1.0, "peer": "p", "code": "not_finite", "why": "NaN"}]
