"""``ddiloco replay``: a finished run re-decided in virtual time, with its own settings and with others.

    ddiloco replay runs/chaos-20261207-101500
    ddiloco replay runs/up-20261207-101500 --what-if quorum=3,grace=off,sync_every=48 --json
    ddiloco replay RUN_DIR --what-if "quorum=2 grace=off"   # one alternative of two changes

How it reads the tapes and what it assumes: docs/replay.md (``sim/replay.py``, ``node/chaos/tape.py``,
``node/chaos/replay.py``).
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
    sp.add_argument(
        "--plot", metavar="PNG", help="also draw each run's timeline (useful, dropped, down, merges) into PNG"
    )


def run(args: argparse.Namespace) -> int:
    from node.chaos.replay import Trace, describe, parse_what_if, real_figures, replay
    from node.chaos.tape import read_run

    alts = [a for text in args.what_if for a in parse_what_if(text)]  # every bad key refused before the work
    if args.plot:
        from node.common.plots import png_path

        png_path(args.plot)  # a bad name refused before the work
    run_ = read_run(args.run_dir)
    traces = [Trace() for _ in range(2 + len(alts))] if args.plot else [None] * (2 + len(alts))
    real = real_figures(run_, traces[0])
    own = replay(run_, None, traces[1])
    rows = [{"what": describe(a), "settings": a, **replay(run_, a, tr)} for a, tr in zip(alts, traces[2:])]
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
    if args.plot:
        from node.common.plots import draw_timeline

        figs = [("real", real), ("replay", own), *((r["what"], r) for r in rows)]
        draw_timeline(args.plot, run_.t0, run_.t1, [(name, f, tr) for (name, f), tr in zip(figs, traces)])
        doc["plot"] = args.plot
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
    table = [[name for name, _ in cols]]
    for key, _, fmt in ROWS:
        row = []
        for i, (_, fig) in enumerate(cols):
            cell = fmt.format(fig[key])
            if i >= 2:  # a what-if: its difference from the replay of the run's own settings
                d = fig[key] - doc["replay"][key]
                cell += f" ({d * 100:+.1f} pt)" if fmt.endswith("%}") else f" ({d:+.3g})"
            row.append(cell)
        table.append(row)
    widths = [max(len(r[i]) for r in table) + 3 for i in range(len(cols))]
    labels = ["", *(label for _, label, _ in ROWS)]
    for label, row in zip(labels, table):
        lines.append(f"{label:<18}" + "".join(f"{c:>{w}}" for c, w in zip(row, widths)))
    lines.append("(a what-if's difference is against the replay: both re-decided by the same rules)")
    lines.append(
        f"ddiloco plan's byte model for this run's M, P, H and codecs: {doc['real']['plan_kb_per_step']:.1f} KB "
        "a step (payload, as above)"
    )
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
