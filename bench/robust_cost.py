"""What the robust merge costs a synchroniser at 85M parameters (gpt2-125m's sizes), against the plain merge.

One merge of ``--learners`` int4 contributions into one fragment, as ``FragmentReplica.make_record`` does it,
for two fragments of gpt2-125m: its token embedding (50257 x 768, merged with the weighted mean a range at a
time) and one transformer block's weights (about 7.1M parameters, RDA). Each (fragment, rule) runs in a
process of its own: wall time of the merge (best of ``--repeats``) and peak RSS above what the process held
once its inputs were built, side by side with the plain merge's.

    python bench/robust_cost.py                # 4 contributions
    python bench/robust_cost.py --learners 6
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

FRAGMENTS = {
    "embedding": {"wte": (50257, 768)},
    "block": {"attn": (768, 2304), "proj": (768, 768), "fc": (768, 3072), "fc_proj": (3072, 768)},
}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def inputs(fragment: str, learners: int, base_round: int = 0, seed: int = 0):
    """One thread; the fragment's fp32 parameters and ``learners`` int4 contributions on ``base_round``."""
    import torch

    from protocol.codecs import encode_tensors
    from protocol.synchroniser import Contribution

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    shapes = FRAGMENTS[fragment]
    theta = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    cs = []
    for i in range(learners):
        delta = {k: torch.randn(s, generator=g) * 1e-3 for k, s in shapes.items()}
        wire = encode_tensors(delta, "int4", 64)
        del delta
        cid = f"l{i}:{base_round}:8"
        cs.append(Contribution(f"l{i}", 0, base_round, 8, 800 * (i + 1), 0.1, wire, cid))
    return theta, cs


def one(fragment: str, rule: str, learners: int, repeats: int) -> dict:
    from protocol.config import ProtocolConfig
    from protocol.replica import FragmentReplica

    theta, cs = inputs(fragment, learners)
    cfg = ProtocolConfig(robust=rule, clip_factor=0.0)
    emb = fragment == "embedding"
    rep = FragmentReplica(0, theta, is_embedding=emb)
    before = _rss_mb()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        rep.make_record(1, cs, cfg)
        best = min(best, time.perf_counter() - t0)
        rep._made = None  # noqa: SLF001 - let the merge's outcome go before the next one
    params = sum(t.numel() for t in theta.values())
    return {
        "params": params,
        "s": best,
        "peak_above_inputs_mb": _rss_mb() - before,
        "fp32_mb": params * 4 / 2**20,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(*a.child, a.learners, a.repeats)))
        return 0
    print(f"{a.learners} int4 contributions, one merge, 1 thread; best of {a.repeats}")
    print(
        f"{'fragment':10s}{'params':>11s}{'plain s':>9s}{'robust s':>10s}{'ratio':>7s}{'plain MB':>10s}{'robust MB':>11s}"
    )
    for frag in FRAGMENTS:
        res = {}
        for rule in ("off", "centered-clip"):
            cmd = [sys.executable, __file__, "--child", frag, rule, "--learners", str(a.learners)]
            cmd += ["--repeats", str(a.repeats)]
            res[rule] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        p, r = res["off"], res["centered-clip"]
        print(
            f"{frag:10s}{p['params']:>11,d}{p['s']:>9.2f}{r['s']:>10.2f}{r['s'] / p['s']:>7.2f}"
            f"{p['peak_above_inputs_mb']:>10.0f}{r['peak_above_inputs_mb']:>11.0f}"
            f"   (fp32 weights {p['fp32_mb']:.0f} MB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
