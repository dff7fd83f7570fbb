"""What auditing a merge record costs a member at 85M parameters (gpt2-125m's sizes), against the merge the
record's synchroniser made.

For two fragments of gpt2-125m (its token embedding, 38.6M parameters merged by the weighted mean, and one
transformer block's weights, 7.1M, RDA), under the plain and the robust merge: a replica merges ``--learners``
int4 contributions into round 1 and applies it (the synchroniser's work), then into round 2 on top; an
auditor then recomputes round 1 from its contributions on that replica walked back through round 2 and
round 1 (``protocol.audit``: what a member does when it audits a record after the next was applied), and,
``--child FRAGMENT RULE parent``, recomputes round 1 at its parent, with no walk back (what a drawn auditor
does, on a view of its replica from before it applied the record).
Each (fragment, rule, role) runs in a process of its own, one thread: wall time (best of ``--repeats``) and
peak RSS above what the process held once its inputs and records were built (``VmHWM``, reset first).

    python bench/audit_cost.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from robust_cost import FRAGMENTS, inputs  # noqa: E402


def _hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak RSS starts again from now


def one(fragment: str, rule: str, role: str, learners: int, repeats: int) -> dict:
    from node.common.heap import AUTO_MMAP_MIB, tune_allocator
    from protocol.audit import audit_gap, frozen_view
    from protocol.config import ProtocolConfig
    from protocol.replica import FragmentReplica

    # the allocator as a node of this size sets it: freed fragments go back to the system, so a peak is not
    # hidden by what the inputs' making left in the heap
    tune_allocator(int(AUTO_MMAP_MIB * (1 << 20)))

    theta, cs = inputs(fragment, learners)
    _, cs2 = inputs(fragment, learners, base_round=1, seed=1)
    cfg = ProtocolConfig(robust=rule, clip_factor=0.0)
    rep = FragmentReplica(0, theta, is_embedding=fragment == "embedding")
    best, gap = float("inf"), None
    if role == "merge":
        _reset_hwm()
        before = _hwm_mb()
        for _ in range(repeats):
            t0 = time.perf_counter()
            rep.make_record(1, cs, cfg)
            best = min(best, time.perf_counter() - t0)
            rep._made = None  # noqa: SLF001 - let the merge's outcome go before the next one
    else:
        rec = rep.make_record(1, cs, cfg)
        if role == "parent":  # a drawn auditor: a view of its replica from before the record, no walk back
            rep._made = None  # noqa: SLF001 - the record is not applied: the view is the state before it
        else:
            rep.apply_record(rec, cfg)
            rep.apply_record(rep.make_record(2, cs2, cfg), cfg)
        _reset_hwm()
        before = _hwm_mb()
        for _ in range(repeats):
            t0 = time.perf_counter()
            gap = audit_gap(frozen_view(rep), rec, cs, cfg)
            best = min(best, time.perf_counter() - t0)
    params = sum(t.numel() for t in theta.values())
    return {
        "params": params,
        "s": best,
        "peak_mb": _hwm_mb() - before,
        "gap": gap,
        "fp32_mb": params * 4 / 2**20,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(*a.child, a.learners, a.repeats)))
        return 0
    print(f"{a.learners} int4 contributions, 1 thread, best of {a.repeats}; peak RSS above the inputs")
    print(
        f"{'fragment':10s}{'rule':>15s}{'merge s':>9s}{'audit s':>9s}{'ratio':>7s}{'merge MB':>10s}{'audit MB':>10s}{'gap':>10s}"
    )
    for frag in FRAGMENTS:
        for rule in ("off", "centered-clip"):
            res = {}
            for role in ("merge", "audit"):
                cmd = [sys.executable, __file__, "--child", frag, rule, role, "--learners", str(a.learners)]
                cmd += ["--repeats", str(a.repeats)]
                res[role] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            m, u = res["merge"], res["audit"]
            print(
                f"{frag:10s}{rule:>15s}{m['s']:>9.2f}{u['s']:>9.2f}{u['s'] / m['s']:>7.2f}"
                f"{m['peak_mb']:>10.0f}{u['peak_mb']:>10.0f}{u['gap']:>10.1e}   (fp32 weights {m['fp32_mb']:.0f} MB)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
