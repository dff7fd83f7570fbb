"""``ddiloco up``: a swarm of N node processes on this machine, with a live status table
(docs/design.md, section 7).

Node 0 starts first and is the others' bootstrap peer; each node is a real ``ddiloco node`` process with its
own identity, p2p daemon, state folder and status endpoint, and the same topology as the docker-compose file.
The run ends on Ctrl+C or after ``--duration``: learners are paused, the swarm gets a quiet period for the
last records to land everywhere, then every node is told to stop (it checkpoints and exports) and the
summary names each node's global-model hash, rounds merged and tokens merged. Children run in their own
session, so a Ctrl+C reaches only this launcher, which then stops them in order; they also exit by
themselves if the launcher dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from node.common.status_client import StatusError, fetch_status, read_control_token, send_control
from node.local.forks import Forked, ForkServer
from protocol.errors import ConfigError, DDiLoCoError


class LaunchError(DDiLoCoError):
    """A node of the local swarm did not start or stop; the message points at its log."""


@dataclass
class Child:
    index: int
    state_dir: Path
    proc: subprocess.Popen | Forked
    log: Path
    url: str = ""
    peer_id: str = ""
    maddrs: list[str] = field(default_factory=list)
    last: dict | None = None
    tmp: str | None = None  # this life's TMPDIR (p2pd sockets, multiprocessing and torchrun folders)

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def start_node(
    index: int, run_dir: Path, flags: list[str], initial_peers: list[str], forks: ForkServer | None = None
) -> Child:
    """Start node ``index`` in ``run_dir/node-index``: a fresh ``python -m node node`` process, or one forked
    by ``forks`` (``node.local.forks``: the same process, without its seconds of imports)."""
    d = run_dir / f"node-{index}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "ready.json").unlink(missing_ok=True)
    log = d / "node.log"
    cmd = [sys.executable, "-m", "node", "node", "--state-dir", str(d), "--exit-with-parent", *flags]
    if initial_peers:
        cmd += ["--initial-peers", ",".join(initial_peers)]
    tmp = private_tmp(index)
    with open(log, "ab") as fh:
        env = dict(os.environ, TMPDIR=tmp)
        if "--threads" in flags:  # OpenMP reads this at start-up, before any torch call
            env.setdefault("OMP_NUM_THREADS", flags[flags.index("--threads") + 1])
        # A process group of its own (a kill -9 takes the node with its DHT process and p2pd), but not a
        # session: Linux's autogroup scheduling makes each session a scheduling group of its own, sharing
        # the CPU equally with the others whatever its threads' niceness, so ``learner_nice`` would not
        # reach across nodes (a restarting node would get a fifth of the cores, not what the learners leave).
        if forks is not None:
            proc = forks.spawn(cmd[3:], env, str(log))
        else:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, process_group=0, env=env)
    return Child(index, d, proc, log, tmp=tmp)


def private_tmp(index: int) -> str:
    """A temporary folder for one life of a node: what it leaves there when it is killed -9 (its p2p
    daemon's unix sockets, ``pymp-*`` and ``torchelastic_*`` folders) goes when ``kill_group`` reaps it."""
    return tempfile.mkdtemp(prefix=f"ddiloco-node{index}-")


def wait_ready(children: list[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for c in children:
        while True:
            ready = c.state_dir / "ready.json"
            if ready.exists():
                doc = json.loads(ready.read_text())
                c.url, c.peer_id, c.maddrs = doc["status_url"], doc["peer_id"], doc["maddrs"]
                break
            if c.proc.poll() is not None:
                raise LaunchError(
                    f"node {c.index} exited with code {c.proc.returncode}; its log:\n{c.tail()}"
                )
            if time.monotonic() > deadline:
                raise LaunchError(f"node {c.index} not ready within {timeout_s:g} s; its log:\n{c.tail()}")
            time.sleep(0.2)


def poll(children: list[Child]) -> None:
    for c in children:
        if c.proc.poll() is not None or not c.url:
            continue
        try:
            c.last = fetch_status(c.url, timeout_s=5)
        except StatusError:
            pass


def table(children: list[Child]) -> str:
    rows = [
        ["node", "peer", "steps", "tok/s", "loss", "eval", "rounds", "MB out", "MB in", "refused", "hash"]
    ]
    for c in children:
        s = c.last
        if c.proc.poll() is not None:
            rows.append([str(c.index), c.peer_id[-8:], f"exited {c.proc.returncode}"] + [""] * 8)
            continue
        if not s:
            rows.append([str(c.index), c.peer_id[-8:], "starting"] + [""] * 8)
            continue
        lr = s["learner"]
        ev = lr.get("eval_history") or []
        rows.append(
            [
                str(c.index),
                s["peer_id"][-8:],
                str(lr["steps"]),
                f"{lr['tokens_per_s']:.0f}",
                f"{lr['loss']:.3f}" if lr["loss"] is not None else "-",
                f"{ev[-1][2]:.3f} {_age(ev[-1][0])}" if ev else "-",
                str(s["rounds_merged"]),
                f"{s['bytes_sent'] / 1e6:.1f}",
                f"{s['bytes_received'] / 1e6:.1f}",
                str(sum(s["refused"].values())),
                s["model_hash"][:10],
            ]
        )
    return columns(rows)


def _age(at: float) -> str:
    return f"{max(0.0, time.time() - at):.0f}s ago"


def global_eval(children: list[Child]) -> str:
    """The newest evaluation of the global model any node has made: loss, which node, how long ago."""
    newest = None
    for c in children:
        hist = (c.last or {}).get("learner", {}).get("eval_history") or []
        if hist and (newest is None or hist[-1][0] > newest[1][0]):
            newest = (c.index, hist[-1])
    if newest is None:
        return "global model: eval loss -"
    i, (at, _steps, loss) = newest
    return f"global model: eval loss {loss:.4f} (node {i}, {_age(at)})"


def columns(rows: list[list[str]]) -> str:
    """Rows of cells as left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in rows)


def quiet_period(children: list[Child], timeout_s: float, quiet: bool) -> tuple[bool, dict]:
    """Learners are paused; wait until every node is idle with no merge under way and all hold one model hash,
    the same on two polls in a row (a hash that still changes means merges are still landing). Returns
    whether that happened, and per node what the last poll saw (hash, learner idle, work in flight)."""
    deadline = time.monotonic() + timeout_s
    streak, last = 0, None
    while True:
        poll(children)
        alive = [c for c in children if c.proc.poll() is None and c.last]
        seen = {
            str(c.index): {
                "model_hash": c.last["model_hash"],
                "idle": c.last["learner"]["idle"],
                "in_flight": c.last.get("in_flight"),
                "fragments": [f"{f['round']}:{f['hash'][:8]}" for f in c.last.get("fragments", [])],
            }
            for c in alive
        }
        hashes = {c.last["model_hash"] for c in alive}
        idle = all(c.last["learner"]["idle"] and not c.last.get("in_flight") for c in alive)
        agreed = alive and idle and len(hashes) == 1
        # the same one hash on consecutive polls: a merge still landing changes it, and starts over
        streak = streak + 1 if agreed and hashes == last else (1 if agreed else 0)
        last = hashes if agreed else None
        if streak >= 2:
            return True, seen
        if time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    _log(f"quiet period: no agreement after {timeout_s:g} s: {json.dumps(seen)}", quiet)
    return False, seen


def stop_all(children: list[Child], timeout_s: float = 60.0) -> None:
    for c in children:
        if c.proc.poll() is not None:
            continue
        asked = False
        if c.url:  # none yet while it joins: no status endpoint known to ask
            with contextlib.suppress(StatusError):
                send_control(c.url, "stop", token=read_control_token(c.state_dir))
                asked = True
        if not asked:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.terminate()
            try:
                c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        kill_group(c)


def kill_group(c: Child) -> None:
    """A node runs in its own process group (its DHT process and p2pd with it): take down what is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(c.proc.pid, signal.SIGKILL)
    if c.tmp is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=10)  # reaped, so nothing of its group writes there any more
        shutil.rmtree(c.tmp, ignore_errors=True)


def prepare_data(flags: list[str], quiet: bool) -> None:
    """Builds the token cache of the nodes' ``--data`` before they start (they then only read it): a node that
    tokenised a large corpus itself would not be ready within the start timeout."""
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    for flag, default in (
        ("--data", None),
        ("--tokenizer", ""),
        ("--text-field", "text"),
        ("--text-column", "text"),
        ("--token-cache", ""),
    ):
        p.add_argument(flag, default=default)
    a, _ = p.parse_known_args(flags)
    if a.data is None:
        return
    from node.common.progress import Bar
    from node.learner.token_cache import CacheSpec, open_cache

    bar = Bar("tokenise", enabled=not quiet)
    try:
        cache = open_cache(
            CacheSpec(a.data, a.tokenizer or None, a.text_field, a.text_column),
            Path(a.token_cache) if a.token_cache else None,
            progress=bar,
        )
    finally:
        bar.close()
    _log(f"data: {cache.tokens:,} tokens in {cache.folder}", quiet)


def _part(i: int, nodes: int, flags: list[str]) -> list[str]:
    """Node i of n reads part i/n of the user's data (--data), unless the flags name a part themselves."""
    given = any(f == "--data-part" or f.startswith("--data-part=") for f in flags)
    data = any(f == "--data" or f.startswith("--data=") for f in flags)
    return ["--data-part", f"{i}/{nodes}"] if data and not given and nodes > 1 else []


def up(
    nodes: int,
    duration: float,
    run_dir: Path,
    node_flags: list[str],
    as_json: bool = False,
    quiet: bool = False,
    refresh_s: float = 2.0,
    start_timeout_s: float = 180.0,
    fork: bool = True,
) -> int:
    """``ddiloco up``. ``fork``: the nodes are forked by a fork server (``node.local.forks``), which imports
    torch and the node once for all of them; each is still a process of its own."""
    if nodes < 1:
        raise ConfigError(f"nodes={nodes} is invalid: need at least 1")
    if duration < 0:
        raise ConfigError(f"duration={duration} is invalid: must be >= 0 (0: until Ctrl+C)")
    run_dir.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // nodes)
    flags = ["--threads", str(threads), *node_flags]
    children: list[Child] = []
    quiet_seen: dict = {}
    quiet = quiet or as_json
    t_start = time.monotonic()
    interrupted = False
    forks = None
    try:
        prepare_data(flags, quiet)
        _log(f"starting {nodes} nodes in {run_dir} (logs: node-*/node.log)", quiet)
        forks = ForkServer() if fork and nodes > 1 else None
        children.append(start_node(0, run_dir, flags + _part(0, nodes, flags), [], forks=forks))
        wait_ready(children[:1], start_timeout_s)
        boot = children[0].maddrs
        for i in range(1, nodes):
            children.append(start_node(i, run_dir, flags + _part(i, nodes, flags), boot, forks=forks))
        wait_ready(children, start_timeout_s)
        _log(f"swarm up: bootstrap {boot[0] if boot else '?'}; status of node 0: {children[0].url}", quiet)
        t_train = time.monotonic()
        is_tty = sys.stderr.isatty()
        while duration <= 0 or time.monotonic() - t_train < duration:
            time.sleep(refresh_s)
            poll(children)
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                raise LaunchError(f"node {dead[0].index} exited unexpectedly; its log:\n{dead[0].tail()}")
            if not quiet:
                text = table(children)
                elapsed = time.monotonic() - t_train
                head = f"t={elapsed:5.0f}s" + (f"/{duration:g}s" if duration > 0 else " (Ctrl+C to stop)")
                head += "   " + global_eval(children)
                if is_tty:
                    print("\x1b[2J\x1b[H" + head + "\n" + text, file=sys.stderr, flush=True)
                else:
                    print(head + "\n" + text, file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        _log("\nCtrl+C: pausing learners, letting the last merges land, then stopping every node", quiet)
    finally:
        try:
            if children and all(c.url for c in children):
                for c in children:
                    if c.proc.poll() is None:
                        try:
                            send_control(c.url, "pause", token=read_control_token(c.state_dir))
                        except StatusError:
                            pass
                settled, quiet_seen = quiet_period(children, 10.0 if interrupted else 45.0, quiet)
            else:
                settled = False
        except KeyboardInterrupt:
            settled = False
        stop_all(children)
        if forks is not None:
            forks.close()
    finals = []
    for c in children:
        f = c.state_dir / "final.json"
        doc = json.loads(f.read_text()) if f.exists() else {"peer_id": c.peer_id, "error": "no final.json"}
        doc.update(node=c.index, exit_code=c.proc.returncode, state_dir=str(c.state_dir))
        finals.append(doc)
    hashes = {d.get("model_hash") for d in finals}
    summary = {
        "nodes": finals,
        "equal_hashes": len(hashes) == 1 and None not in hashes,
        "settled": settled,
        "quiet_period": quiet_seen,
        "model_hash": next(iter(hashes)) if len(hashes) == 1 else None,
        "rounds_merged": min((d.get("rounds_merged", 0) for d in finals), default=0),
        "tokens_merged": min((d.get("tokens_merged", 0) for d in finals), default=0),
        "wall_s": time.monotonic() - t_start,
        "run_dir": str(run_dir),
    }
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        rows = [["node", "peer", "steps", "rounds", "tokens merged", "eval loss", "model hash"]]
        for d in finals:
            loss = d.get("eval_loss")
            rows.append(
                [
                    str(d["node"]),
                    str(d.get("peer_id", ""))[-8:],
                    str(d.get("steps", "-")),
                    str(d.get("rounds_merged", "-")),
                    f"{d.get('tokens_merged', 0):,.0f}",
                    f"{loss:.4f}" if isinstance(loss, float) else "-",
                    str(d.get("model_hash", "-"))[:16],
                ]
            )
        print(columns(rows))
        verdict = "one model hash across all nodes" if summary["equal_hashes"] else "HASHES DIFFER"
        print(f"{verdict}; rounds merged {summary['rounds_merged']}; run folder {run_dir}")
    if interrupted:
        return 130
    return 0 if summary["equal_hashes"] and summary["rounds_merged"] > 0 else 1
