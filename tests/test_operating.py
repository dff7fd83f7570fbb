"""Operating a swarm (docs/operating.md) against real node processes: ``ddiloco status --watch``
with and without a terminal, the dashboard in a real headless browser, and ``/metrics`` parsed with
prometheus_client agreeing with ``/status`` at a paused node.

One two-node swarm serves the module; the tests run in file order and the last one pauses it.
"""

from __future__ import annotations

import os
import pty
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.cli.main import main
from node.common.events import read_events
from node.common.status_client import fetch_status
from tests.swarm_util import Swarm, wait_until

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    sw = Swarm(tmp_path_factory.mktemp("operating"))
    try:
        sw.start_many(2)

        def trained() -> bool:
            st = sw.status()
            return len(st) == 2 and all(
                s["rounds_merged"] >= 8 and len(s["learner"]["eval_history"]) >= 2 and len(s["peers"]) == 2
                for s in st.values()
            )

        wait_until(trained, 150, "both nodes merging rounds, evaluated twice, each seeing the other")
        yield sw
    finally:
        sw.stop()


def _short(pid: str) -> str:
    return f"{pid[:6]}…{pid[-6:]}"  # as the dashboard writes a peer id


@pytest.mark.slow
def test_status_watch_without_a_terminal_prints_a_frame_per_interval(swarm, capsys):
    c = swarm.children[0]
    peers = {s["peer_id"] for s in swarm.status().values()}
    assert main(["status", "--url", c.url, "--watch", "--interval", "0.3", "--count", "2"]) == 0
    out = capsys.readouterr().out
    frames = out.split("\n--- ")
    assert len(frames) == 2 and out.startswith("--- "), out[:400]
    for frame in frames:
        assert all(p in frame for p in peers), "every peer listed in every frame"
        assert "(this node)" in frame and "synchroniser of" in frame and "fragments" in frame
        rows = re.findall(r"^│\s+(\d)\s+│\s+(\d+)\s+│", frame, re.M)  # fragment, round
        assert [int(f) for f, _ in rows] == [0, 1, 2, 3] and all(int(r) > 0 for _, r in rows)


@pytest.mark.slow
def test_status_watch_in_a_terminal_redraws_in_place(swarm):
    c = swarm.children[1]
    master, slave = pty.openpty()
    got = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "node",
                "status",
                "--url",
                c.url,
                "--watch",
                "--interval",
                "0.3",
                "--count",
                "3",
            ],
            stdout=slave,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "COLUMNS": "200", "LINES": "50", "TERM": "xterm"},
            timeout=60,
        )
    finally:
        os.close(slave)
        reader.join(10)
        os.close(master)
    text = got.decode(errors="replace")
    assert p.returncode == 0, p.stderr.decode()
    assert c.peer_id in text and "fragments" in text
    assert "\x1b[" in text and "\x1b[2K" in text, "rich moves the cursor back and clears lines to redraw"
    assert "---" not in text, "a terminal gets the live view, not frames one after another"


@pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: apt-get install -y chromium (.ci/run does)"
)
@pytest.mark.slow
def test_dashboard_in_a_headless_browser(swarm, tmp_path):
    c = swarm.children[0]
    peers = {s["peer_id"] for s in swarm.status().values()}
    # chromium's own temporary files (its singleton socket, whose path must be short) in a folder removed
    # at the end, so the suite's TMPDIR is left as found
    browser_tmp = tempfile.TemporaryDirectory(prefix="cr")
    common = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000",  # lets the page's fetches and timers run before the DOM is read
    ]
    env = {**os.environ, "TMPDIR": browser_tmp.name, "HOME": str(tmp_path)}
    try:
        _check_dashboard(common, env, c.url, peers, tmp_path)
    finally:
        browser_tmp.cleanup()


def _check_dashboard(common: list[str], env: dict, url: str, peers: set[str], tmp_path: Path) -> None:
    r = subprocess.run(
        [*common, "--dump-dom", url + "/"], capture_output=True, text=True, timeout=120, env=env
    )
    dom = r.stdout
    rendered = re.search(r'<body data-rendered="(\d+)"', dom)
    assert rendered and int(rendered.group(1)) >= 1, f"rc {r.returncode}: {dom[:2000]} {r.stderr[-2000:]}"
    peer_table = dom[dom.index('id="peers"') : dom.index('id="fragments"')]
    assert all(_short(p) in peer_table for p in peers), "both peers listed"
    assert "synchroniser of" in peer_table and "(this node)" in peer_table
    for chart, series in (
        ("loss-chart", "training loss"),
        ("loss-chart", "eval loss"),
        ("rate-chart", "tokens/s"),
    ):
        svg = dom[dom.index(f'id="{chart}"') :]
        svg = svg[: svg.index("</svg>")]
        m = re.search(rf'<path d="(M[^"]+)"[^>]*data-series="{re.escape(series)}" data-points="(\d+)"', svg)
        assert m and int(m.group(2)) >= 2 and m.group(1).count("L") == int(m.group(2)) - 1, (chart, series)
    png = Path(os.environ.get("DDILOCO_DASHBOARD_PNG") or tmp_path / "dashboard.png")
    subprocess.run(
        [*common, f"--screenshot={png}", "--window-size=1280,900", url + "/"],
        capture_output=True,
        timeout=120,
        env=env,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _metrics(url: str) -> dict[str, dict[tuple, float]]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


@pytest.mark.slow
def test_metrics_agree_with_status_at_a_paused_node(swarm):
    swarm.settle()
    c = swarm.children[0]
    before = fetch_status(c.url)
    m = _metrics(c.url)
    after = fetch_status(c.url)
    one = lambda name: m[name][()]  # noqa: E731
    lr, lr2 = before["learner"], after["learner"]
    assert lr["paused"] and one("ddiloco_learner_paused") == 1
    for name, a, b in [
        ("ddiloco_learner_steps", lr["steps"], lr2["steps"]),
        ("ddiloco_learner_tokens", lr["tokens"], lr2["tokens"]),
        ("ddiloco_learner_tokens_per_second", lr["tokens_per_s"], lr2["tokens_per_s"]),
        ("ddiloco_learner_loss", lr["loss"], lr2["loss"]),
        ("ddiloco_learner_eval_loss", lr["eval_loss"], lr2["eval_loss"]),
        ("ddiloco_rounds_merged", before["rounds_merged"], after["rounds_merged"]),
        ("ddiloco_tokens_merged", before["tokens_merged"], after["tokens_merged"]),
        ("ddiloco_bytes_sent_total", before["bytes_sent"], after["bytes_sent"]),
        ("ddiloco_bytes_received_total", before["bytes_received"], after["bytes_received"]),
        ("ddiloco_peers", len(before["peers"]), len(after["peers"])),
    ]:
        assert a == b, f"{name}: /status changed at a paused node ({a} -> {b})"
        assert one(name) == pytest.approx(a), name
    assert (
        before["goodput"] <= one("ddiloco_goodput") + 1e-9
        or after["goodput"] >= one("ddiloco_goodput") - 1e-9
    )
    assert (
        min(before["goodput"], after["goodput"]) - 0.01
        <= one("ddiloco_goodput")
        <= max(before["goodput"], after["goodput"]) + 0.01
    )
    assert {dict(k)["fragment"]: v for k, v in m["ddiloco_fragment_round"].items()} == {
        str(f["fragment"]): f["round"] for f in before["fragments"]
    }
    for name, value in before["counters"].items():
        assert one(f"ddiloco_{name}_total") == value == after["counters"][name], name
    assert {dict(k)["code"]: v for k, v in m.get("ddiloco_refusals_total", {}).items()} == before["refused"]
    assert m["ddiloco_node_info"] == {(("peer_id", before["peer_id"]), ("swarm", before["swarm"])): 1.0}
    # the histograms, from the node's events: one observation per record of this node's life
    events = read_events(c.state_dir / "events.jsonl")
    merges = [e for e in events if e["kind"] == "merge"]
    contributions = [e for e in events if e["kind"] == "contribute"]
    assert one("ddiloco_merge_learners_count") == len(merges) > 0
    assert one("ddiloco_merge_learners_sum") == sum(len(set(e["learners"])) for e in merges)
    assert one("ddiloco_contribution_bytes_count") == len(contributions) > 0
    assert one("ddiloco_contribution_bytes_sum") == sum(e["bytes"] for e in contributions)
    own = {e["cid"]: e["t"] for e in contributions}
    merged_own = [(e["t"], own[cid]) for e in merges for cid in e["cids"] if cid in own]
    assert one("ddiloco_merge_latency_seconds_count") == len(merged_own) > 0
    assert one("ddiloco_merge_latency_seconds_sum") == pytest.approx(sum(t - t0 for t, t0 in merged_own))
    assert "ddiloco_relinks_total" in m
