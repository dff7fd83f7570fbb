"""``ddiloco replay``: a finished run re-decided in virtual time, with its own settings and with others.

    ddiloco replay runs/chaos-20261207-101500
    ddiloco replay runs/up-20261207-101500 --what-if quorum=3,grace=off,sync_every=48 --json
    ddiloco replay RUN_DIR --what-if "quorum=2 grace=off"   # one alternative of two changes

How it reads the tapes and what it assumes: docs/replay.md (``sim/replay.py``, ``node/chaos/replay.py``).
"""

from __future__ import annotations

import argparse
import json
import sys

ROWS = (
    ("goodput", "goodput", "{:.1%}"),
    ("strict_goodput", "strict goodput", "{:.1%}"),
    ("rounds_merged", "rounds merged", "{}"),
    ("learners_per_merge", "learners a merge", "{:.2f}"),
    ("contributions", "contributions", "{}"),
    ("payload_kb_per_step", "payload KB a step", "{:.1f}"),
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from node.chaos.replay import WHAT_IF

    keys = "; ".join(f"{k}: {v}" for k, v in WHAT_IF.items())
    sp = sub.add_parser(
        "replay",
        help="replay a finished run's tapes in virtual time, with its own settings and what-ifs",
        description="Read every node's events.jsonl in RUN_DIR (a 'ddiloco up' or 'ddiloco chaos' folder), "
        "keep what the run was made of (each learner's step times, its node's outages, the measured "
        "latencies) and re-decide the rounds with the node's own rules; print the real run's goodput, rounds "
        "merged, learners per merge and payload bytes beside the replay's and each what-if's, with the "
        "synchronisers' decisions counted. docs/replay.md says what it assumes.",
    )
    sp.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (its node-N/events.jsonl)")
    sp.add_argument(
        "--what-if",
        action="append",
        default=[],
        metavar="KEY=VALUE,...",
        help="alternatives, comma-separated (several keys in one alternative: separated by spaces); "
        f"repeatable. Keys: {keys}",
    )
    sp.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run(args: argparse.Namespace) -> int:
    from node.chaos.replay import describe, parse_what_if, read_run, real_figures, replay

    alts = [a for text in args.what_if for a in parse_what_if(text)]  # every bad key refused before the work
    run_ = read_run(args.run_dir)
    real = real_figures(run_)
    own = replay(run_)
    rows = [{"what": describe(a), "settings": a, **replay(run_, a)} for a in alts]
    doc = {
        "run_dir": str(run_.folder),
        "window_s": round(run_.t1 - run_.t0, 1),
        "learners": len(run_.nodes),
        "outages": len(run_.outages),
        "settings": {
            k: getattr(run_.protocol, k)
            for k in ("quorum", "grace", "sync_every", "overlap", "carry", "codec")
        },  # fmt: skip
        "notes": run_.notes,
        "real": real,
        "replay": own,
        "what_if": rows,
    }
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    sys.stdout.flush()
    return 0


def render(doc: dict) -> str:
    s = doc["settings"]
    lines = [
        f"{doc['run_dir']}: {doc['learners']} learners, {doc['window_s']:g} s measured, "
        f"{doc['outages']} outage(s); K = {s['quorum']}, grace {'on' if s['grace'] else 'off'}, "
        f"H = {s['sync_every']}, tau = {s['overlap']}, codec {s['codec']}",
        *(f"  ({n})" for n in doc["notes"]),
        "",
    ]
    cols = [("real", doc["real"]), ("replay", doc["replay"]), *((r["what"], r) for r in doc["what_if"])]
    width = max(12, *(len(name) + 2 for name, _ in cols))
    lines.append(f"{'':<20}" + "".join(f"{name:>{width}}" for name, _ in cols))
    for key, label, fmt in ROWS:
        cells = []
        for i, (_, fig) in enumerate(cols):
            cell = fmt.format(fig[key])
            if i >= 2 and isinstance(fig[key], (int, float)):  # a what-if: its difference from the replay
                d = fig[key] - doc["replay"][key]
                cell += f" ({d:+.1%})" if fmt.endswith("%}") else f" ({d:+.3g})"
            cells.append(f"{cell:>{width}}")
        lines.append(f"{label:<20}" + "".join(cells))
    lines += ["", "what the synchronisers decided (replays):"]
    for name, fig in cols[1:]:
        d = fig["decisions"]
        refused = ", ".join(f"{k} {v}" for k, v in d["refused"].items()) or "none"
        lines.append(
            f"  {name}: {d['merged_all_in']} merged with every live learner in, {d['merged_grace_over']} when "
            f"the grace window ran out; {d['queued']} contributions queued behind a merge, "
            f"{d['left_out_behind']} left out (a round behind), {d['replaced']} replaced; refused: {refused}"
        )
    return "\n".join(lines)
