"""Numbers and tables of ``bench/wan.py``: from each run's step and eval records and link counters to
tokens/s, bytes per step, eval loss at the end and at equal tokens, and the targets (tokens/s at least
``TARGET_DP`` times data-parallel's and ``TARGET_SYNC`` times synchronous DiLoCo's)."""

from __future__ import annotations

import bisect

TARGET_DP = 10.0  # ours / data-parallel tokens/s
TARGET_SYNC = 2.0  # ours / synchronous DiLoCo tokens/s
SYNCS = ("sync", "sync-ar")  # synchronous DiLoCo: on our nodes (a star through one synchroniser), and gloo's
LABEL = {
    "ours": "ours (decoupled)",
    "ours-q": "ours, K=M-1",
    "sync": "sync DiLoCo",
    "sync-ar": "sync DiLoCo, all-reduce",
    "dp-fp32": "DP fp32 grads",
    "dp-bf16": "DP bf16 grads",
}


def credit(steps: list[tuple[float, float, int]], t_a: float, t_b: float) -> float:
    """Tokens trained in [t_a, t_b]: each step's tokens times the share of its span inside the window."""
    total = 0.0
    for t0, t1, k in steps:
        if t1 <= t_a or t0 >= t_b:
            continue
        span = t1 - t0
        total += k if span <= 0 else k * (min(t1, t_b) - max(t0, t_a)) / span
    return total


def overlap(spans: list[tuple[float, float]], t_a: float, t_b: float) -> float:
    return sum(max(0.0, min(t1, t_b) - max(t0, t_a)) for t0, t1 in spans)


def eval_curve(learners: list[dict]) -> list[tuple[int, float]]:
    """(tokens every learner had trained when the evaluation ran, eval loss), by tokens; ties averaged."""
    ends = sorted((t1, k) for lr in learners for _, t1, k in lr["steps"])
    times = [t for t, _ in ends]
    cum = [0]
    for _, k in ends:
        cum.append(cum[-1] + k)
    by_tokens: dict[int, list[float]] = {}
    for lr in learners:
        for t, loss in lr["evals"]:
            by_tokens.setdefault(cum[bisect.bisect_right(times, t)], []).append(loss)
    return sorted((k, sum(v) / len(v)) for k, v in by_tokens.items())


def loss_at(curve: list[tuple[int, float]], x: float) -> dict | None:
    """Eval loss at ``x`` tokens, linear between the evaluations around it; None past the last one."""
    for (a, la), (b, lb) in zip(curve, curve[1:]):
        if a <= x <= b:
            loss = la if b == a else la + (lb - la) * (x - a) / (b - a)
            return {"tokens": x, "loss": loss, "between": [a, b]}
    if curve and curve[-1][0] == x:
        return {"tokens": x, "loss": curve[-1][1], "between": [x, x]}
    return None


def analyze(raw: dict, nodes: int) -> dict:
    t_a, t_b = raw["t_a"], raw["t_b"]
    span = t_b - t_a
    learners = raw["learners"]
    tps = raw["tokens_per_step"]  # per learner stream: a node's learner, or the whole DP group
    win_tokens = sum(credit(lr["steps"], t_a, t_b) for lr in learners)
    steps = win_tokens / (tps * len(learners)) if tps else 0.0  # inner steps per learner in the window
    sent = sum(raw["sent_B"]) / nodes
    received = sum(raw["received_B"]) / nodes
    curve = eval_curve(learners)
    finals = [lr["final"] for lr in learners if lr["final"]]
    final_losses = [f["eval_loss"] for f in finals if f.get("eval_loss") is not None]
    total = sum(k for lr in learners for _, _, k in lr["steps"])
    first = min((t0 for lr in learners for t0, _, _ in lr["steps"]), default=t_a)
    return {
        "window_s": span,
        "tokens_per_s": win_tokens / span,
        "steps_per_learner": steps,
        "step_s": span / steps if steps else None,
        "sent_B_per_node": sent,
        "received_B_per_node": received,
        "sent_mbit_s_per_node": sent * 8 / span / 1e6,
        "max_sent_mbit_s": max(raw["sent_B"]) * 8 / span / 1e6,
        "sent_B_per_step_per_node": sent / steps if steps else None,
        # nodes only: what their transports sent (contributions, records, pulls), no DHT traffic or framing
        "payload_B_per_step_per_node": sum(raw["payload_sent_B"]) / nodes / steps
        if raw.get("payload_sent_B") and steps
        else None,
        # nodes only: of the link bytes, what each op's calls put on the transport (both ends), and what the
        # TCP sockets carried (libp2p's framing and the DHT's traffic on top of the transport's)
        "by_op_B_per_step_per_node": {
            op: n / nodes / steps for op, n in sorted(raw["by_op_sent_B"].items(), key=lambda kv: -kv[1])
        }
        if raw.get("by_op_sent_B") and steps
        else None,
        # link bytes a node sends a second with every learner paused (membership, heartbeats, the DHT)
        "idle_sent_B_per_s_per_node": sum(raw["idle_sent_B_per_s"]) / nodes
        if raw.get("idle_sent_B_per_s")
        else None,
        "idle_by_op_B_per_s_per_node": {
            op: n / nodes for op, n in sorted(raw["idle_by_op_B_per_s"].items(), key=lambda kv: -kv[1])
        }
        if raw.get("idle_by_op_B_per_s")
        else None,
        "tcp_B_per_step_per_node": raw["tcp_sent_B"] / nodes / steps
        if raw.get("tcp_sent_B") and steps
        else None,
        "tcp_retrans_B_per_step_per_node": raw["tcp_retrans_B"] / nodes / steps
        if raw.get("tcp_retrans_B") is not None and steps
        else None,
        "tcp_segs_per_step_per_node": raw["tcp_segs_out"] / nodes / steps
        if raw.get("tcp_segs_out") and steps
        else None,
        # packets out of the interface (each with its Ethernet, IP and TCP headers)
        "packets_per_step_per_node": sum(raw["sent_packets"]) / nodes / steps
        if raw.get("sent_packets") and steps
        else None,
        # learner time in the window outside training steps: waiting for merges, evaluating, adopting (a DP
        # step holds its own all-reduce, so there it is evaluation alone)
        "outside_steps_share": 1.0
        - sum(overlap([(t0, t1) for t0, t1, _ in lr["steps"]], t_a, t_b) for lr in learners)
        / (span * len(learners)),
        "cpu_cores_per_node": sum(raw["cpu_s"]) / nodes / span if raw.get("cpu_s") else None,
        "train_thread_cores_per_node": sum(raw["train_thread_cpu_s"]) / nodes / span
        if raw.get("cpu_s")
        else None,
        "merges_in_window": max((lr["merges"] for lr in learners), default=0),
        "tokens_total": total,
        # nodes: tokens trained before the synchronised start (node 0's step or two before its pause)
        "tokens_before_start": sum(k for lr in learners for _, t1, k in lr["steps"] if t1 <= raw["t_start"])
        if raw.get("t_start")
        else 0,
        "trained_s": t_b - first,
        "final_loss": sum(final_losses) / len(final_losses) if final_losses else float("nan"),
        "final_hashes": len({f.get("model_hash") for f in finals}),
        "settled": raw["settled"],
        "curve": curve,
        "load_avg": raw["load_avg"],  # 1-minute load average when the window opened and closed
    }


# ------------------------------------------------------------------------------------------------ tables
def _cols(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(r, widths))) for r in rows
    )


def _b(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, k in (("MB", 1e6), ("KB", 1e3)):
        if x >= k:
            return f"{x / k:.1f} {unit}"
    return f"{x:.0f} B"


def _k(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.0f}k"


def ok(row: dict) -> dict:
    """The runs of one cap that produced numbers (a failed run carries only its error)."""
    return {s: r for s, r in row.items() if "error" not in r}


def _missing(row: dict, system: str) -> str:
    return "failed" if system in row else "-"  # a saved run still under way has no entry yet


def best_dp(row: dict) -> str | None:
    dps = [s for s in ok(row) if s.startswith("dp")]
    return max(dps, key=lambda s: row[s]["tokens_per_s"]) if dps else None


def compare(row: dict, other: str, ours: str = "ours", reference: dict | None = None) -> dict:
    """``ours`` against ``other`` at one cap: tokens/s ratio, and eval loss at their common token count.
    With ``reference`` (other's eval curve from the uncapped run of the same arithmetic), the loss is
    compared at the most tokens both curves cover instead, past where the capped run of ``other`` stopped."""
    o, x = row[ours], row[other]
    curve = x["curve"]
    common = min(o["tokens_total"], x["tokens_total"])
    if reference and reference.get("curve") and o["curve"]:
        curve = reference["curve"]
        common = max(common, min(o["curve"][-1][0], curve[-1][0]))
    lo, lx = loss_at(o["curve"], common), loss_at(curve, common)
    return {
        "ratio": o["tokens_per_s"] / x["tokens_per_s"] if x["tokens_per_s"] else float("inf"),
        "tokens": common,
        "ours_loss": lo["loss"] if lo else None,
        "other_loss": lx["loss"] if lx else None,
        "reference": curve is not x["curve"],
    }


def ours_keys(row: dict) -> list[str]:
    return [s for s in ("ours", "ours-q") if s in row]


def wire_line(label: str, r: dict) -> str:
    """Where a node system's link bytes a step went: each transport op's (both ends of its calls, headers
    included), the rest (DHT, libp2p's framing, TCP/IP headers and acknowledgements), and the idle swarm's."""
    ops = r["by_op_B_per_step_per_node"]
    rest = r["sent_B_per_step_per_node"] - sum(ops.values())
    parts = ", ".join(f"{op} {_b(n)}" for op, n in ops.items() if n >= 1)
    idle = r.get("idle_sent_B_per_s_per_node")
    return (
        f"  {label} link bytes a step: {parts}; the rest {_b(rest)} (DHT, framing, TCP/IP); "
        f"link/payload {r['sent_B_per_step_per_node'] / r['payload_B_per_step_per_node']:.2f}x"
        + (
            f"; sent again by TCP {_b(r['tcp_retrans_B_per_step_per_node'])}"
            if r.get("tcp_retrans_B_per_step_per_node") is not None
            else ""
        )
        + (f"; learners paused, {_b(idle)}/s a node" if idle else "")
        + (
            " (" + ", ".join(f"{op} {_b(n)}/s" for op, n in r["idle_by_op_B_per_s_per_node"].items()) + ")"
            if r.get("idle_by_op_B_per_s_per_node")
            else ""
        )
    )


def render(res: dict) -> str:
    cfg, results = res["config"], res["results"]
    out = [
        f"WAN comparison: {cfg['nodes']} nodes, one network namespace each, every link capped both ways by tc "
        f"tbf; {cfg['duration_s']:g} s measured after {cfg['warm_s']:g} s warm-up; batch {cfg['batch_size']} "
        f"sequences per learner, one torch thread per process, H={cfg['sync_every']}, eval every "
        f"{cfg['eval_every_s']:g} s; {res['cpus']} CPUs"
        + (
            f", each node (or DP worker) held to {cfg['cpu_per_node']:g} of them by a cgroup quota"
            if cfg.get("cpu_per_node")
            else ", shared by all nodes (no quota)"
        )
        + (
            f"; {cfg['rtt_ms']:g} ms round trip between every two nodes (a delay line for packets, in user space)"
            if cfg.get("rtt_ms")
            else ""
        ),
    ]
    head = ["system", "tokens/s", "ours/this", "steps", "s/step", "out Mbit/s", "out/step", "payload/step",
            "outside steps", "CPU/node", "eval end", "at tokens"]  # fmt: skip
    for cap, row in results.items():
        good = ok(row)
        common = min((r["tokens_total"] for r in good.values()), default=0)
        ours = good.get("ours")
        out += ["", f"== cap {cap} per link and direction"]
        rows = [[*head, f"eval @ {_k(common)}"]]
        for s, r in row.items():
            if "error" in r:
                rows.append([LABEL[s], "failed"] + [""] * (len(head) - 1))
                continue
            at = loss_at(r["curve"], common)
            rows.append(
                [
                    LABEL[s],
                    f"{r['tokens_per_s']:,.0f}",
                    f"{ours['tokens_per_s'] / r['tokens_per_s']:.2f}x" if ours and r["tokens_per_s"] else "-",
                    f"{r['steps_per_learner']:.0f}",
                    f"{r['step_s']:.2f}" if r["step_s"] else "-",
                    f"{r['sent_mbit_s_per_node']:.2f}",
                    _b(r["sent_B_per_step_per_node"]),
                    _b(r.get("payload_B_per_step_per_node")),
                    f"{100 * r['outside_steps_share']:.0f}%",
                    f"{r['cpu_cores_per_node']:.2f} ({r['train_thread_cores_per_node']:.2f})"
                    if r.get("cpu_cores_per_node") is not None
                    else "-",
                    f"{r['final_loss']:.3f}"
                    + (f" ({r['final_hashes']} hashes)" if r["final_hashes"] > 1 else ""),
                    _k(r["tokens_total"]),
                    f"{at['loss']:.3f}" if at else "-",
                ]
            )
        out.append(_cols(rows))
        out += [f"  {LABEL[s]} failed: {r['error'].splitlines()[0]}" for s, r in row.items() if "error" in r]
        out += [wire_line(LABEL[s], r) for s, r in row.items() if r.get("by_op_B_per_step_per_node")]
    systems = list(next(iter(results.values()), {}))
    mine = [s for s in ("ours", "ours-q") if s in systems]
    refs = res.get("reference", {})
    for s, ref in refs.items():
        if "error" in ref:
            out += ["", f"{LABEL[s]} reference run (uncapped) failed: {ref['error'].splitlines()[0]}"]
            continue
        gap = "none compared" if ref["max_gap"] is None else f"largest difference {ref['max_gap']:.2g}"
        out += ["", f"{LABEL[s]} reference run (uncapped, to {_k(ref['tokens_total'])} tokens): repeated "
                f"{ref['compared_evals']} evaluations of the capped runs at the same steps, {gap}"]  # fmt: skip
    out += ["", "== tokens/s against the cap"]
    rows = [["cap", *[LABEL[s] for s in systems]]]
    syncs = [s for s in SYNCS if s in systems]
    rows[0] += [h for m in mine for h in (*(f"{m}/{s}" for s in syncs), f"{m}/best DP")]
    for cap, row in results.items():
        good = ok(row)
        cells = [
            cap,
            *[f"{good[s]['tokens_per_s']:,.0f}" if s in good else _missing(row, s) for s in systems],
        ]
        dp = best_dp(good)
        for m in mine:
            ok_m = m in good
            for sy in syncs:
                cells.append(f"{compare(good, sy, m)['ratio']:.2f}x" if ok_m and sy in good else "-")
            cells.append(f"{compare(good, dp, m)['ratio']:.2f}x ({LABEL[dp][3:7]})" if dp and ok_m else "-")
        rows.append(cells)
    out.append(_cols(rows))
    out += ["", "targets: tokens/s ours >= 10x data-parallel's (its faster variant) and >= 2x sync DiLoCo's, at "
            "equal or better eval loss at equal tokens (the two runs' common token count; against DP, where "
            "its uncapped reference run exists, the most tokens both reached)"]  # fmt: skip
    for cap, row in results.items():
        good = ok(row)
        pairs = [
            (m, o, t)
            for m in ours_keys(good)
            for o, t in (*((sy, TARGET_SYNC) for sy in SYNCS), (best_dp(good), TARGET_DP))
        ]
        for ours, other, target in pairs:
            if other not in good:
                continue
            c = compare(good, other, ours, refs.get(other))
            fast = c["ratio"] >= target
            if c["ours_loss"] is None or c["other_loss"] is None:
                lq, better = "no eval loss at the common token count", False
            else:
                better = c["ours_loss"] <= c["other_loss"]
                lq = (
                    f"eval loss at {_k(c['tokens'])} tokens {c['ours_loss']:.3f} vs {c['other_loss']:.3f} "
                    f"({100 * (c['ours_loss'] / c['other_loss'] - 1):+.1f}%)"
                )
            verdict = "HOLDS " if fast and better else "MISSED"
            ref = " (DP: uncapped reference)" if c["reference"] else ""
            out.append(
                f"  [{verdict}] {cap:>8s} {LABEL[ours]:16s} vs {LABEL[other]:14s} {c['ratio']:6.2f}x (target "
                f"{target:g}x: {'met' if fast else 'missed'}); {lq}{ref} "
                f"({'ours equal or better' if better else 'ours worse'})"
            )
    out += ["", f"wall time: {res['wall_s']:.0f} s; run folders under {cfg['run_dir']}"]
    return "\n".join(out)
