"""``ddiloco plan``: the schedule and link a run across sites needs, before it starts (``sim.plan``).

    ddiloco plan --params 12e9 --learners 4 --link-gbps 2.5
    ddiloco plan --hf-config path/to/config.json --learners 8 --link-gbps 5 --rtt-ms 80 --step-s 4 --json

What it assumes and how it chooses: docs/plan.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from protocol.errors import ConfigError
from sim.model import HOUR_S


def add_parser(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser(
        "plan",
        help="choose P, H, tau, K and the codec for a model, M sites and a link; bytes, link share, goodput",
        description="Plan a run across sites: from the model's size, M learners (one a site), the inner "
        "step's time, the link between sites and a failure rate, choose the schedule (P, H, tau, K, grace, "
        "codec) and print the bytes a node sends per inner step, the share of the link they take, one "
        "round's transfer time, the simulator's goodput, and what data-parallel training and synchronous "
        "DiLoCo would block on the same link. docs/plan.md says what it assumes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    size = sp.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=float, help="the model's parameter count, e.g. 12e9")
    size.add_argument(
        "--hf-config", metavar="PATH", help="a Hugging Face config.json to count the parameters of"
    )
    sp.add_argument("--learners", "-M", type=int, required=True, help="M: learners, one a site")
    sp.add_argument("--step-s", type=float, default=1.0, help="one inner step of a learner, seconds")
    sp.add_argument(
        "--link-gbps", type=float, default=2.5, help="the link between two sites, Gbit/s each way"
    )
    sp.add_argument("--rtt-ms", type=float, default=50.0, help="round trip between sites, milliseconds")
    sp.add_argument(
        "--mtbf-h", type=float, default=math.inf, help="mean hours between failures of one site ('inf': none)"
    )
    sp.add_argument(
        "--codec", default="int4", help="contributions' outer gradients on the wire: fp32|bf16|int8|int4|int2"
    )
    sp.add_argument(
        "--record-codec",
        help="the merged outer gradient in merge records, as the node's --record-codec (default: --codec's, "
        "int4 where that is int2: a node's records stay int4 unless told)",
    )
    sp.add_argument("--target-util", type=float, default=0.5, help="share of the link the schedule may take")
    sp.add_argument("--overlap", type=int, default=2, help="tau: steps a round's transfers may take")
    sp.add_argument("--sync-every", type=int, help="H: fix it rather than choose it")
    sp.add_argument("--fragments", type=int, help="P: fix it rather than choose it")
    sp.add_argument("--quorum", "-K", type=int, help="K: fix it rather than choose it")
    sp.add_argument(
        "--audit",
        type=float,
        default=0.0,
        help="share of merge records an auditor recomputes, as the node's --audit: 0 in a private swarm, 1 in "
        "a public one (its auditors fetch the contributions: link bytes)",
    )
    sp.add_argument("--heartbeat-s", type=float, default=2.0, help="the nodes' membership refresh period")
    sp.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    sp.add_argument(
        "--plot",
        metavar="PNG",
        help="also draw each system's step on the link and goodput by quorum into PNG",
    )


def hf_params(path: str) -> float:
    """Parameters of a decoder-only transformer from its Hugging Face ``config.json``: embeddings (and an
    untied head), per layer attention with grouped key/value heads and a gated MLP, and the norms."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"hf-config={path!r} is invalid: cannot read it as JSON ({e})") from e
    try:
        h, layers, vocab = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
        inter = int(cfg.get("intermediate_size", 4 * h))
        heads = int(cfg.get("num_attention_heads", 1))
        kv = int(cfg.get("num_key_value_heads", heads))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"hf-config={path!r} is invalid: it needs hidden_size, num_hidden_layers and vocab_size ({e})"
        ) from e
    head_dim = int(cfg.get("head_dim", h // max(1, heads)))
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    mlp = 3 * h * inter
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return float(embed + layers * (attn + mlp + 2 * h) + h)


def _gb(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def _link_share(t, s) -> str:
    share = t.link_per_step_B * 8 / (s.link_bps * s.step_s)
    if share <= 1:
        return f"{share:.1%} of the link"
    return f"{share:.0%} of the link: more than it carries (contributions are dropped for want of room)"


def render(p) -> str:
    s, t = p.site, p.traffic
    mtbf = "no failures" if math.isinf(s.mtbf_s) else f"a failure every {s.mtbf_s / HOUR_S:g} h per site"
    lines = [
        f"model {s.params / 1e9:.3g}B parameters, M = {s.learners} sites, step {s.step_s:g} s, link "
        f"{s.link_bps / 1e9:g} Gbit/s, RTT {s.rtt_s * 1e3:g} ms, {mtbf}",
        "",
        f"schedule   P = {p.fragments}  H = {p.sync_every}  tau = {p.overlap}  K = {p.quorum}  grace on  "
        f"codec {s.codec} (records {s.record_codec})",
        f"fragment   {_gb(t.contribution_B)} a contribution, {_gb(t.record_B)} a record",
        f"per step   {_gb(t.sent_per_step_B)} sent by a node: {t.link_util:.1%} of the link "
        f"({p.needed_gbps:.3g} Gbit/s at 100%)",
        f"on the link {_gb(t.link_per_step_B)} a step, {t.link_per_step_B / max(t.sent_per_step_B, 1e-9):.2f}x: "
        f"audits {_gb(t.audit_B)}, membership {_gb(t.membership_B)}, frames and {t.packets_per_step:.3g} "
        f"packets' headers; {_link_share(t, s)}",
        f"round      {t.round_s:.2f} s of transfers, against tau x step = {max(p.overlap, 1) * s.step_s:g} s",
        f"goodput    {p.goodput:.1%} (simulated; by K: "
        + ", ".join(f"{k}: {g:.1%}" for k, g in p.goodput_by_quorum.items())
        + ")",
        "",
        "baselines on the same link (what a learner blocks on):",
    ]
    for b in p.baselines:
        lines.append(
            f"  {b.system:<12} {_gb(b.sent_per_step_B):>9} a step, blocked {b.blocked_per_step_s:.3g} s a step "
            f"({b.blocked_share:.1%} of its time); needs {b.needed_gbps:.3g} Gbit/s not to block"
        )
    lines += ["", "what binds:"] + [f"  - {b}" for b in p.binding or ["nothing: the link is ample"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from sim.plan import Site, plan

    params = args.params if args.params is not None else hf_params(args.hf_config)
    for name in ("link_gbps", "rtt_ms", "mtbf_h"):
        v = getattr(args, name)
        if v != v:  # NaN
            raise ConfigError(f"{name}={v!r} is invalid: give a number")
    site = Site(
        params=params,
        learners=args.learners,
        step_s=args.step_s,
        link_bps=args.link_gbps * 1e9,
        rtt_s=args.rtt_ms / 1e3,
        mtbf_s=args.mtbf_h * HOUR_S,
        codec=args.codec,
        record_codec=args.record_codec or ("int4" if args.codec == "int2" else args.codec),
        target_util=args.target_util,
        overlap=args.overlap,
        sync_every=args.sync_every,
        fragments=args.fragments,
        quorum=args.quorum,
        audit=args.audit,
        heartbeat_s=args.heartbeat_s,
    )
    if args.plot:
        from node.common.plots import png_path

        png_path(args.plot)
    p = plan(site)
    if args.plot:
        from node.common.plots import draw_plan

        draw_plan(args.plot, p)
    if args.json:
        print(json.dumps(p.as_dict(), indent=2))
    else:
        print(render(p))
    sys.stdout.flush()
    return 0
