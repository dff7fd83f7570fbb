"""What bench/quality.py prints and checks: the targets, the tables, the plot and the report."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from quality_systems import SYSTEMS, _fmt_s, _log


def check_targets(results: dict[str, dict[str, dict]]) -> list[dict]:
    """The issue's targets, per scenario where the rows exist."""
    out = []

    def loss(scen: str, key: str) -> float | None:
        r = results.get(scen, {}).get(key)
        return r["final_loss"] if r and r.get("final_loss") is not None else None

    for scen in results:
        g, dp, sync, k1 = (loss(scen, k) for k in ("dec-k1-grace", "dp", "sync", "dec-k1"))
        if g is not None and dp is not None:
            out.append(
                {
                    "scenario": scen,
                    "target": "Decoupled K=1+grace within 2% of DP",
                    "value": g / dp,
                    "limit": 1.02,
                    "holds": g / dp <= 1.02,
                    "detail": f"{g:.4f} vs {dp:.4f}",
                }
            )
        if g is not None and sync is not None:
            out.append(
                {
                    "scenario": scen,
                    "target": "Decoupled K=1+grace within 1% of Sync DiLoCo",
                    "value": g / sync,
                    "limit": 1.01,
                    "holds": g / sync <= 1.01,
                    "detail": f"{g:.4f} vs {sync:.4f}",
                }
            )
        if scen == "heterogeneous" and g is not None and k1 is not None:
            out.append(
                {
                    "scenario": scen,
                    "target": "Decoupled K=1+grace beats K=1",
                    "value": g / k1,
                    "limit": 1.0,
                    "holds": g < k1,
                    "detail": f"{g:.4f} vs {k1:.4f}",
                }
            )
    return out


def format_table(scen: str, rows: dict[str, dict]) -> str:
    head = f"{'system':<22} {'final loss':>10} {'vs DP':>7} {'goodput':>8} {'tok/s (virt)':>13} {'virt s':>8} {'merges':>7}"
    lines = [f"== {scen}", head, "-" * len(head)]
    dp = rows.get("dp", {}).get("final_loss")
    for r in rows.values():
        if r.get("error"):
            lines.append(f"{r['label']:<22} FAILED: {r['error']}")
            continue
        ratio = f"{r['final_loss'] / dp:7.4f}" if dp else f"{'-':>7}"
        lines.append(
            f"{r['label']:<22} {r['final_loss']:10.4f} {ratio} {r['goodput']:8.3f} "
            f"{r['tokens_per_virtual_s']:13.1f} {r['virtual_s']:8.1f} {r['merges']:7d}"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {s.key: f"C{i}" for i, s in enumerate(SYSTEMS)}  # one colour per system in every panel
    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.2), squeeze=False)
    for ax, (scen, rows) in zip(axes[0], results.items()):
        lo, hi = math.inf, -math.inf
        failed = []
        for r in rows.values():
            if r.get("error") or not r.get("evals"):
                failed.append(r["label"])
                continue
            toks = [e[0] / 1e6 for e in r["evals"]]
            losses = [e[2] for e in r["evals"]]
            style = "-" if r["key"].startswith("dec") else "--"
            ax.plot(toks, losses, style, marker=".", color=colours.get(r["key"]), label=r["label"])
            lo = min(lo, min(losses))
            hi = max(hi, losses[min(2, len(losses) - 1)])  # zoom past the first drop
        if lo < hi:
            ax.set_ylim(lo - 0.02 * (hi - lo), hi)
        ax.set_title(scen)
        if failed:
            ax.text(
                0.98,
                0.97,
                "failed: " + ", ".join(failed),
                transform=ax.transAxes,
                ha="right",
                va="top",
                fontsize=8,
                color="crimson",
            )
        ax.set_xlabel("tokens (M)")
        ax.set_ylabel("eval loss (nats/byte)")
        ax.grid(alpha=0.3)
    handles = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    order = [s.label for s in SYSTEMS if s.label in handles]
    axes[0][0].legend([handles[lab] for lab in order], order, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(payload: dict, args: argparse.Namespace) -> None:
    """Plot, then print the tables and targets (or the JSON object) of a finished or saved benchmark."""
    st, results, targets = payload["settings"], payload["results"], payload["targets"]
    m = st["model"]
    if args.plot:
        try:
            plot(
                results,
                args.plot,
                f"eval loss vs tokens, M={st['learners']}, {m['params'] / 1e6:.2f}M params, "
                f"P={st['fragments']} H={st['sync_every']} tau={st['overlap']}",
            )
            _log(f"plot: {args.plot}")
        except ImportError:
            _log("plot skipped: matplotlib is not installed (pip install -e '.[bench]')")
    if args.json:
        print(json.dumps(payload, indent=2))
        return
    print(f"data: {st['data']}")
    print(
        f"model: dim {m['dim']}, {m['layers']} layers, {m['heads']} heads, seq {m['seq_len']}, "
        f"{m['params']:,} params; batch {st['batch_size']} x {m['seq_len']} = {st['tokens_per_batch']} tokens"
    )
    print(
        f"budget: {st['token_budget']:,} tokens ({st['steps_per_learner']} steps per speed-1 learner, "
        f"M = {st['learners']}); P={st['fragments']} H={st['sync_every']} tau={st['overlap']}, "
        f"codec {st['codec']}, outer lr {st['outer_lr']} momentum {st['outer_momentum']}"
    )
    for scen, rows in results.items():
        print()
        print(format_table(scen, rows))
    print()
    print("targets:")
    for t in targets:
        print(
            f"  [{'HOLDS ' if t['holds'] else 'MISSED'}] {t['scenario']:<13} {t['target']:<46} "
            f"ratio {t['value']:.4f} (limit {t['limit']:.2f}; {t['detail']})"
        )
    print(f"\nwall time: {_fmt_s(payload['wall_s'])}")
