"""Where ``AUDIT_TOLERANCE`` sits: the gap honest records recompute to, against the gap of a merge biased a little.

For each record codec and merge rule, a replica of one ``--numel`` fragment merges four int4 contributions a
round for five rounds (two of them on an older base, re-anchored), as a synchroniser does. Beside each honest
record, a liar on the same state signs the merge of the same contributions scaled by ``--bias`` (1.001: a
0.1% push in the merge's own direction). An auditor then recomputes every record on the replica walked back
to its parent (the path of a proof, or of an audit after later rounds were applied: the one where ulps
differ). Prints the largest honest gap, the smallest liar's gap, and each against the tolerance.

    python bench/audit_gaps.py [--numel 1048576] [--bias 1.001]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from protocol.audit import AUDIT_TOLERANCE, audit_gap, frozen_view  # noqa: E402
from protocol.codecs import encode_tensors, get_codec  # noqa: E402
from protocol.config import ProtocolConfig  # noqa: E402
from protocol.replica import FragmentReplica  # noqa: E402
from protocol.synchroniser import Contribution  # noqa: E402

ROUNDS = ((1, 0), (2, 1), (3, 1), (4, 3), (5, 3))  # (round, base round of its contributions)


def _round(numel: int, base: int, seed: int) -> list[Contribution]:
    g = torch.Generator().manual_seed(seed)
    mean = 0.003 * torch.randn(numel, generator=g)
    out = []
    for i in range(4):
        d = {"w": mean + 0.003 * torch.randn(numel, generator=g)}
        cid = f"l{i}:{seed}"
        out.append(
            Contribution(f"l{i}", 0, base, 30, 3000 * (i + 1), 0.1, encode_tensors(d, "int4", 64), cid)
        )
    return out


def gaps(record_codec: str, robust: str, numel: int, bias: float) -> tuple[float, float]:
    cfg = ProtocolConfig(robust=robust, clip_factor=3.0, record_codec=record_codec)
    theta = {"w": 0.02 * torch.randn(numel, generator=torch.Generator().manual_seed(0))}
    rep = FragmentReplica(0, theta, False, history=8)
    int4 = get_codec("int4")
    made = []
    for r, base in ROUNDS:
        cs = _round(numel, base, r)
        biased = [replace(c, delta={k: int4.decode(v) * bias for k, v in c.delta.items()}) for c in cs]
        lie = frozen_view(rep).make_record(r, biased, cfg)
        rec = rep.make_record(r, cs, cfg)
        rep.apply_record(rec, cfg)
        made.append((rec, lie, cs))
    honest = max(audit_gap(frozen_view(rep), rec, cs, cfg) for rec, _, cs in made)
    liar = min(audit_gap(frozen_view(rep), lie, cs, cfg) for _, lie, cs in made)
    return honest, liar


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 20, help="parameters of the fragment")
    ap.add_argument("--bias", type=float, default=1.001, help="the liar's scale of the merge")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"AUDIT_TOLERANCE {AUDIT_TOLERANCE:g}; fragment of {args.numel:,} parameters; liar x{args.bias:g}")
    print(
        f"{'record codec':>12} {'merge':>14} {'honest max':>11} {'tol/honest':>10} {'liar min':>9} {'liar/tol':>8}"
    )
    for rc, robust in itertools.product(["fp32", "bf16", "int8", "int4"], ["off", "centered-clip"]):
        h, lie = gaps(rc, robust, args.numel, args.bias)
        ratio = AUDIT_TOLERANCE / h if h > 0 else float("inf")
        print(f"{rc:>12} {robust:>14} {h:11.2g} {ratio:10.0f} {lie:9.2g} {lie / AUDIT_TOLERANCE:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
