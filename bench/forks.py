"""Forks in a fast swarm, one code tree against another, side by side.

Runs ``ddiloco up`` (3 nodes, the tests' tiny model and fast rounds: a round about every 0.5 s with a
0.5 s heartbeat) from each tree in turn, ``--repeats`` times, and counts per node the fork records it saw
(``fork`` events: two records for one round), the snapshots it installed (``resync``) and the merges it
applied, with the run's final eval loss and whether the nodes ended on one hash. A tree is a checkout of
this repository (e.g. ``git worktree add /tmp/base <commit>``); each run imports the node from its tree.

    python bench/forks.py --trees /tmp/base . --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FLAGS = (
    "--dim 32 --layers 2 --heads 2 --seq-len 32 --batch-size 8 --eval-batches 4 --fragments 4 "
    "--sync-every 8 --eval-every-s 4 --heartbeat-s 0.5 --ttl-s 3 --failover-s 6 --rpc-timeout-s 5 "
    "--threads 1 --step-delay-s 0.05 --checkpoint-every-s 3"
)


def _count(events: Path, kind: str) -> int:
    return sum(1 for line in events.read_text().splitlines() if f'"kind":"{kind}"' in line)


def run_once(tree: Path, seconds: int, nodes: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="forks-") as tmp:
        run_dir = Path(tmp) / "up"
        cmd = [sys.executable, "-m", "node", "up", "--nodes", str(nodes), "--duration", str(seconds)]
        cmd += ["--json", "--run-dir", str(run_dir), "--node-flags", FLAGS]
        out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=seconds + 300)
        summary = json.loads(out.stdout) if out.stdout.strip() else {}
        per_node = [
            {k: _count(run_dir / f"node-{i}" / "events.jsonl", k) for k in ("fork", "resync", "merge")}
            for i in range(nodes)
        ]
    losses = [n.get("eval_loss") for n in summary.get("nodes", []) if n.get("eval_loss") is not None]
    return {
        "forks": statistics.mean(n["fork"] for n in per_node),
        "resyncs": statistics.mean(n["resync"] for n in per_node),
        "merges": statistics.mean(n["merge"] for n in per_node),
        "eval_loss": statistics.mean(losses) if losses else float("nan"),
        "one_hash": bool(summary.get("equal_hashes")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs=2, required=True, metavar=("BASELINE", "CANDIDATE"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--nodes", type=int, default=3)
    a = ap.parse_args()
    rows: dict[str, list[dict]] = {t: [] for t in a.trees}
    for r in range(a.repeats):
        for t in a.trees:  # alternate, so a slow moment of the machine hits both
            res = run_once(Path(t).resolve(), a.seconds, a.nodes)
            rows[t].append(res)
            print(f"[{r + 1}/{a.repeats}] {t}: {res}", file=sys.stderr, flush=True)
    print(f"{'tree':<28}{'forks/node':>11}{'resyncs/node':>13}{'merges/node':>12}{'eval':>8}  one hash")
    means = {}
    for t, rs in rows.items():
        means[t] = {k: statistics.mean(x[k] for x in rs) for k in ("forks", "resyncs", "merges", "eval_loss")}
        m = means[t]
        hashes = f"{sum(x['one_hash'] for x in rs)}/{len(rs)}"
        print(
            f"{t[-28:]:<28}{m['forks']:>11.1f}{m['resyncs']:>13.1f}{m['merges']:>12.1f}{m['eval_loss']:>8.3f}  {hashes}"
        )
    base, cand = (means[t] for t in a.trees)
    ratio = cand["forks"] / base["forks"] if base["forks"] else float("nan")
    print(f"forks per node, candidate / baseline: {ratio:.3f}")


if __name__ == "__main__":
    main()
