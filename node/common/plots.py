"""The commands' plots, as PNG files; they need matplotlib (the ``plot`` extra; ``scripts/setup.sh`` installs it).

``draw_timeline`` (``ddiloco replay --plot``): a run and its replays, one panel a run, one band a
learner, each step coloured by what ``protocol.goodput`` made of it (useful: 90% of it or more; dropped:
half or more; partly dropped; or still pending when the window closed), its node's outages in grey, and the merges as ticks above the bands (taller: more
learners in the merge). Panels share the time axis, so where an alternative differs from the run is where
their colours and ticks part.

``draw_plan`` (``ddiloco plan --plot``): what one inner step costs each system on the planned link (compute,
and the time a learner blocks on the link), and the simulated goodput of each quorum tried, the chosen one
marked."""

from __future__ import annotations

from pathlib import Path

from protocol.errors import ConfigError

USEFUL, PART, DROPPED, PENDING, DOWN = "#3b8f3b", "#f28e2b", "#d62728", "#f2c94c", "#9e9e9e"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError(
            f"--plot needs matplotlib ({e}); install it with: pip install 'ddiloco[plot]'"
        ) from None
    return plt


def png_path(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ConfigError(f"plot={str(path)!r} is invalid: give a .png file")
    return path


def _save(fig, plt, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_timeline(path: str | Path, t0: float, t1: float, panels: list[tuple[str, dict, object]]) -> Path:
    """``panels``: (title, figures, ``node.chaos.replay.Trace``) in the order drawn, top to bottom."""
    path = png_path(path)
    plt = _pyplot()
    rows = max(len(tr.learners) for _, _, tr in panels)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(12, 1.0 + (0.3 * rows + 0.6) * len(panels)), sharex=True, squeeze=False
    )
    for ax, (title, fig_, tr) in zip(axes[:, 0], panels):
        names = tr.learners
        y_of = {n: i for i, n in enumerate(names)}
        by_colour: dict[str, list[tuple[float, float, int]]] = {
            USEFUL: [],
            PART: [],
            DROPPED: [],
            PENDING: [],
        }
        for (learner, _), (a, b, useful, dropped) in tr.steps.items():
            if learner not in y_of or b <= a:
                continue
            colour = (
                USEFUL
                if useful >= 0.9
                else DROPPED
                if dropped >= 0.5
                else PART
                if dropped > 0.05
                else PENDING
            )
            by_colour[colour].append((a - t0, b - a, y_of[learner]))
        for colour, spans in by_colour.items():
            for y in range(len(names)):
                xs = [(a, w) for a, w, yy in spans if yy == y]
                if xs:
                    ax.broken_barh(xs, (y - 0.4, 0.8), facecolors=colour, linewidth=0)
        for learner, a, b in tr.down:
            if learner in y_of:
                ax.broken_barh([(a - t0, b - a)], (y_of[learner] - 0.45, 0.9), facecolors=DOWN, linewidth=0)
        if tr.merges:
            top = len(names) - 0.4
            most = max(n for _, n in tr.merges) or 1
            ax.vlines([t - t0 for t, _ in tr.merges], top + 0.1, [top + 0.1 + 0.8 * n / most for _, n in tr.merges],
                      colors="black", linewidth=0.4)  # fmt: skip
        ax.set_ylim(-0.6, len(names) + 0.6)
        ax.set_yticks(range(len(names)), [n[-6:] for n in names], fontsize=7)
        ax.set_title(
            f"{title}: goodput {fig_['goodput']:.1%}, {fig_['rounds_merged']} rounds, "
            f"{fig_['learners_per_merge']:.2f} learners a merge",
            fontsize=9,
            loc="left",
        )
    axes[-1, 0].set_xlim(0, t1 - t0)
    axes[-1, 0].set_xlabel("seconds into the measured window")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (USEFUL, PART, DROPPED, PENDING, DOWN)]
    fig.legend(handles, ["useful", "partly dropped", "dropped", "pending at the end", "node out"],
               loc="upper right", ncol=5, fontsize=8)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return _save(fig, plt, path)


def draw_plan(path: str | Path, plan) -> Path:
    """``plan``: a ``sim.plan.Plan``."""
    path = png_path(path)
    plt = _pyplot()
    s = plan.site
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    systems = [("decoupled (ours)", 0.0, plan.traffic.sent_per_step_B)]
    systems += [(b.system, b.blocked_per_step_s, b.sent_per_step_B) for b in plan.baselines]
    ys = range(len(systems))
    left.barh(ys, [s.step_s] * len(systems), color=USEFUL, label="compute")
    left.barh(ys, [w for _, w, _ in systems], left=[s.step_s] * len(systems), color=DROPPED,
              label="blocked on the link")  # fmt: skip
    for y, (_, w, sent) in zip(ys, systems):
        size = f"{sent / 1e9:.3g} GB" if sent >= 1e9 else f"{sent / 1e6:.3g} MB"
        left.text(s.step_s + w, y, f"  {size} sent a step", va="center", fontsize=8)
    left.set_yticks(list(ys), [n for n, _, _ in systems], fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("seconds of one inner step")
    left.set_xlim(0, max(s.step_s + w for _, w, _ in systems) * 1.6)
    left.legend(fontsize=8, loc="lower right")
    left.set_title(
        f"{s.params / 1e9:.3g}B parameters, M = {s.learners}, {s.link_bps / 1e9:g} Gbit/s, "
        f"RTT {s.rtt_s * 1e3:g} ms",
        fontsize=9,
        loc="left",
    )
    ks = sorted(plan.goodput_by_quorum)
    right.bar([str(k) for k in ks], [plan.goodput_by_quorum[k] for k in ks],
              color=[USEFUL if k == plan.quorum else PENDING for k in ks])  # fmt: skip
    right.set_ylim(min(plan.goodput_by_quorum.values()) * 0.98, 1.0)
    right.set_xlabel("quorum K (the chosen one in green)")
    right.set_ylabel("simulated goodput")
    right.set_title(
        f"P = {plan.fragments}, H = {plan.sync_every}, tau = {plan.overlap}", fontsize=9, loc="left"
    )
    fig.tight_layout()
    return _save(fig, plt, path)
