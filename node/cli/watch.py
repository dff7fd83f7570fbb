"""``ddiloco status --watch``: a live view of a node's status document, redrawn in place with rich.

In a terminal the view is redrawn every ``--interval`` seconds (rich ``Live``) until Ctrl+C; without one
(a pipe, a log file) it prints one frame per interval. A node that does not answer shows the error in the
frame and is asked again at the next interval, so the view survives a node's restart.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from node.common.status_client import StatusError


def _fmt(v, f: str) -> str:
    return "-" if v is None else format(v, f)


def _short(pid: str | None) -> str:
    return "-" if not pid else f"{pid[:8]}…{pid[-6:]}"


def render(s: dict, url: str) -> Group:
    """One frame: a summary, the peers with their roles, and the fragments with their synchronisers."""
    lr = s["learner"]
    head = Text()
    head.append(f"{_short(s['peer_id'])}", style="bold")
    head.append(f"  swarm {s['swarm']}  up {s['uptime_s']:.0f}s  {url}\n")
    head.append(
        f"steps {lr['steps']}  tokens {lr['tokens']:,}  {lr['tokens_per_s']:.0f} tok/s  loss "
        f"{_fmt(lr['loss'], '.3f')}  eval loss {_fmt(lr['eval_loss'], '.3f')}  rounds merged "
        f"{s['rounds_merged']}  goodput {_fmt(s['goodput'], '.1%')}  sent {s['bytes_sent'] / 1e6:.2f} MB  "
        f"received {s['bytes_received'] / 1e6:.2f} MB  refused {s['refused'] or 'none'}"
    )
    if lr["paused"]:
        head.append("  PAUSED", style="bold yellow")
    count = s.get("peer_count", len(s["peers"]))
    title = f"peers ({count})" if count == len(s["peers"]) else f"peers ({count}, {len(s['peers'])} listed)"
    peers = Table(title=title, title_justify="left")
    for col in ("peer", "role", "reachable", "step", "tok/s", "rounds"):
        peers.add_column(col, justify="right" if col in ("step", "tok/s", "rounds") else "left")
    for m in s["peers"]:
        role = "client learner" if m["client_mode"] else "learner"
        if m.get("synchronises"):
            role += ", synchroniser of " + ", ".join(map(str, m["synchronises"]))
        me = " (this node)" if m["peer_id"] == s["peer_id"] else ""
        reach = m.get("reachable", True)
        peers.add_row(
            m["peer_id"] + me,
            role,
            Text("yes" if reach else "no", style="green" if reach else "red"),
            str(m["step"]),
            f"{m['tokens_per_s']:.0f}",
            str(m["rounds"]),
        )
    frags = Table(title="fragments", title_justify="left")
    for col in ("fragment", "round", "hash", "synchroniser"):
        frags.add_column(col, justify="right" if col in ("fragment", "round") else "left")
    for f in s["fragments"]:
        me = " (this node)" if f["synchroniser"] == s["peer_id"] else ""
        frags.add_row(str(f["fragment"]), str(f["round"]), f["hash"], (f["synchroniser"] or "-") + me)
    return Group(head, peers, frags)


def _frame(fetch: Callable[[], dict], url: str):
    try:
        return render(fetch(), url)
    except StatusError as e:
        return Text(f"{time.strftime('%H:%M:%S')}  {e}", style="red")


def watch(
    fetch: Callable[[], dict], url: str, interval_s: float, count: int = 0, console: Console | None = None
) -> int:
    """Show frames every ``interval_s`` until Ctrl+C, or ``count`` frames when count > 0."""
    console = console or Console()
    if not console.is_terminal and console.width < 160:
        console.width = 160  # a log line per table row: peer ids are 52 characters
    shown = 0
    try:
        if console.is_terminal:
            with Live(_frame(fetch, url), console=console, auto_refresh=False) as live:
                shown = 1
                while not count or shown < count:
                    time.sleep(interval_s)
                    live.update(_frame(fetch, url), refresh=True)
                    shown += 1
        else:
            while not count or shown < count:
                if shown:
                    time.sleep(interval_s)
                console.print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}")
                console.print(_frame(fetch, url))
                shown += 1
                sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    return 0
