"""What bench/swarm.py reports: the analytic bytes of the wire formats and the printed report of a run."""

from __future__ import annotations

import math

from protocol.codecs import encoded_nbytes
from protocol.config import ProtocolConfig


# ------------------------------------------------------------------------------------------- analytic part
def codec_bytes(numel: int, codec: str, block: int) -> float:
    """Payload bytes of one tensor of ``numel`` elements under the wire codec (``protocol.codecs``)."""
    return float(encoded_nbytes(numel, codec, block))


DP_BYTES_PER_PARAM = 4  # fp32 gradients
TARGET_BYTES_RATIO = 100.0
TARGET_THROUGHPUT = 0.9
# Paper scale: the paper's 12B model (trained across 4 US regions) and M = 8 learners (its 8-datacenter
# bandwidth result), with P = H = 24, tau = 2, K = 1, int4 outer gradients (the defaults, docs/design.md,
# section 1).
PAPER_PARAMS = 12e9
PAPER_LEARNERS = 8


def analytic(
    name: str,
    params: float,
    learners: int,
    sync_every: int,
    b_codec: float,
    merges: float = 1.0,
    b_record: float | None = None,
) -> dict:
    """``b_codec``/``b_record``: bytes per parameter of contributions and of merge records (default: same)."""
    b_record = b_codec if b_record is None else b_record
    share = (learners - 1) / learners
    contrib = params * share * b_codec / sync_every
    records = params * share * b_record * merges / sync_every
    dp = params * share * 2 * DP_BYTES_PER_PARAM
    return {
        "setting": name,
        "params": params,
        "learners": learners,
        "sync_every": sync_every,
        "codec_bytes_per_param": b_codec,
        "record_bytes_per_param": b_record,
        "merges_per_sync": merges,
        "contributions_B": contrib,
        "records_B": records,
        "ours_B": contrib + records,
        "dp_B": dp,
        "ratio": dp / (contrib + records),
    }


def analytic_rows(
    params: int, exact_b: float, exact_r: float, nodes: int, pcfg: ProtocolConfig
) -> list[dict]:
    """``exact_b``/``exact_r``: this model's contribution and record bytes per parameter."""
    b4 = 0.5 + 4.0 / pcfg.codec_block  # int4 bytes per parameter for large tensors
    H, rc = pcfg.sync_every, pcfg.record_codec
    paper = (PAPER_PARAMS, PAPER_LEARNERS)
    return [
        analytic(
            f"defaults: this model, N={nodes}, P={pcfg.fragments} H={H}, {pcfg.codec}/{rc}",
            params,
            nodes,
            H,
            exact_b,
            b_record=exact_r,
        ),
        analytic("  same, every contribution merged alone (R=N)", params, nodes, H, exact_b, nodes, exact_r),
        analytic("  same, fp32 records", params, nodes, H, exact_b, b_record=4.0),
        analytic(f"paper scale: 12B, M={PAPER_LEARNERS}, P=H=24, int4/int4", *paper, 24, b4),
        analytic(
            f"  same, every contribution merged alone (R=M={PAPER_LEARNERS})", *paper, 24, b4, PAPER_LEARNERS
        ),
        analytic("  same, fp32 records", *paper, 24, b4, b_record=4.0),
        analytic("  same, H=100", *paper, 100, b4),
        analytic("  same, H=500 (DiLoCo paper's H)", *paper, 500, b4),
    ]


# ------------------------------------------------------------------------------------------------ report
def fmt_b(x: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= k:
            return f"{x / k:.2f} {unit}"
    return f"{x:.0f} B"


def report(res: dict) -> str:
    lines = []
    st = res["settings"]
    lines.append(
        f"model: dim {st['dim']}, {st['layers']} layers, {st['params']:,} params; batch {st['tokens_per_step']} "
        f"tokens/step; P={st['fragments']} H={st['sync_every']} tau={st['overlap']} K={st['quorum']}, codec "
        f"{st['codec']} (block {st['codec_block']}: {st['codec_bytes_per_param']:.4f} B/param), records "
        f"{st['record_codec']} ({st['record_bytes_per_param']:.4f} B/param)"
    )
    lines.append("")
    lines.append("== bytes sent per node per inner step, analytic (payload tensors only)")
    hdr = f"{'setting':52s} {'contrib':>10s} {'records':>10s} {'ours':>10s} {'DP fp32':>10s} {'DP/ours':>8s}"
    lines += [hdr, "-" * len(hdr)]
    for r in res["analytic"]:
        lines.append(
            f"{r['setting']:52s} {fmt_b(r['contributions_B']):>10s} {fmt_b(r['records_B']):>10s} "
            f"{fmt_b(r['ours_B']):>10s} {fmt_b(r['dp_B']):>10s} {r['ratio']:7.1f}x"
        )
    b = res["analytic"][0]["codec_bytes_per_param"]
    lines.append(
        f"(DP/ours = 8H/(b_c + b_r R), b_c and b_r the contribution and record codecs' bytes per parameter; "
        f"with fp32 records at R=1 it reaches {TARGET_BYTES_RATIO:.0f}x only for "
        f"H >= {math.ceil(TARGET_BYTES_RATIO * (b + 4) / 8)})"
    )
    m = res["measured"]
    n = len(m["nodes"])
    lines.append("")
    lines.append(
        f"== measured: {n}-node swarm on loopback, {m['seconds']:.0f} s after {m['warm_s']:g} s warm-up"
    )
    hdr = (
        f"{'node':>4s} {'steps':>6s} {'tok/s':>7s} {'sent/step':>10s} {'recv/step':>10s} {'contrib/step':>12s} "
        f"{'merges':>6s} {'recv before':>11s}"
    )
    lines += [hdr, "-" * len(hdr)]
    for x in m["nodes"]:
        lines.append(
            f"{x['node']:4d} {x['steps']:6d} {x['tokens_per_s']:7.0f} {fmt_b(x['sent_B'] / x['steps']):>10s} "
            f"{fmt_b(x['received_B'] / x['steps']):>10s} {fmt_b(x['contribution_B'] / x['steps']):>12s} "
            f"{x['records_made']:6d} {fmt_b(x['join_received_B']):>11s}"
        )
    lines.append(
        f"mean per node per inner step: sent {fmt_b(m['sent_per_step_B'])}, received "
        f"{fmt_b(m['received_per_step_B'])}; DP fp32 ring all-reduce of the same model sends "
        f"{fmt_b(m['dp_B'])} (and receives as much)"
    )
    lines.append(
        f"contributions per merge {m['contributions_per_merge']:.2f} (R = {m['merges_per_sync']:.2f} merges per "
        f"fragment per H steps); analytic at this R: {fmt_b(m['analytic_at_R_B'])} per node per step"
    )
    lines.append(
        f"DHT heartbeats (not counted by the transport): one signed membership record is "
        f"{m['member_record_B']} B; a heartbeat stores it on the other node and reads the key back (~{n} "
        f"records) every {m['heartbeat_s']:g} s, ~{fmt_b(m['heartbeat_per_step_B'])} per node per step, "
        f"before Kademlia/libp2p framing"
    )
    t = res["throughput"]
    lines.append("")
    lines.append("== learner throughput (tokens/s), one torch thread per learner")
    lines.append("alone, before swarm : " + ", ".join(f"{x['tokens_per_s']:.0f}" for x in t["alone_before"]))
    lines.append("alone, after swarm  : " + ", ".join(f"{x['tokens_per_s']:.0f}" for x in t["alone_after"]))
    lines.append(f"alone, mean         : {t['alone_mean']:.0f}")
    lines.append("in the swarm        : " + ", ".join(f"{x['tokens_per_s']:.0f}" for x in m["nodes"]))
    lines.append(
        "CPU cores, alone    : "
        + ", ".join(f"{x['cpu_cores']:.2f}" for x in t["alone_before"] + t["alone_after"])
    )
    for x in m["nodes"]:
        lines.append(
            f"CPU cores, node {x['node']}   : {x['cpu_cores']:.2f} = learner thread {x['learner_cores']:.2f} + "
            f"other threads {x['node_process_cores'] - x['learner_cores']:.2f} + DHT process and p2pd "
            f"{x['cpu_cores'] - x['node_process_cores']:.2f}; tokens/s per learner core "
            f"{x['tokens_per_s'] / x['learner_cores']:.0f}"
            if x["learner_cores"]
            else ""
        )
    alone_eff = [
        x["tokens_per_s"] / x["cpu_cores"] for x in t["alone_before"] + t["alone_after"] if x["cpu_cores"]
    ]
    if alone_eff:
        lines.append(f"tokens/s per core, alone: {sum(alone_eff) / len(alone_eff):.0f}")
    lines.append(f"load average at start/end: {res['loadavg_start']:.2f} / {res['loadavg_end']:.2f}")
    lines.append("")
    lines.append("targets:")
    ok = m["ratio"] >= TARGET_BYTES_RATIO
    lines.append(
        f"  [{'HOLDS ' if ok else 'MISSED'}] bytes on the wire: DP / ours per node per inner step "
        f"{m['ratio']:.1f}x measured, {res['analytic'][0]['ratio']:.1f}x analytic (target >= "
        f"{TARGET_BYTES_RATIO:.0f}x)"
    )
    for x, r in zip(m["nodes"], t["ratios"]):
        ok = r >= TARGET_THROUGHPUT
        lines.append(
            f"  [{'HOLDS ' if ok else 'MISSED'}] node {x['node']} throughput swarm / alone {r:.3f} "
            f"(target >= {TARGET_THROUGHPUT})"
        )
    lines.append("")
    lines.append(f"wall time: {res['wall_s']:.0f} s")
    return "\n".join(lines)
