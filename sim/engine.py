"""The discrete-event simulator's entry point, and the data-parallel systems
(docs/design.md, section 3, driver 1).

``simulate(cfg)`` runs one system for ``cfg.duration_s`` of virtual time and returns its goodput, counted
as ``protocol.goodput`` counts it (``sim.accounting``). Nothing trains; the cluster is described in
``sim.model``. Decoupled DiLoCo is driven through the real synchroniser in ``sim.decoupled``; this module
runs the two data-parallel baselines, which are one job over every block:

  * a step takes as long as its slowest block; a faster block's chips wait (blocked) for the rest;
  * every step's work reaches the model in that step's all-reduce (one contribution per block, merged);
  * a failure aborts the step in progress. ``dp`` stops every chip for ``spare_s + restart_s`` and comes
    back at full size on a spare host; ``elastic-dp`` pauses for ``resize_s`` and trains on without the
    failed host until it is repaired (``repair_s``), when it joins at a step boundary.

Run it from the command line with ``ddiloco sim`` (``node/cli/sim.py``) or ``python bench/goodput.py``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol.goodput import Goodput
from sim.accounting import RecordSink, Tally
from sim.blocks import (
    Counts,
    advance_slowdowns,
    close_downs,
    fail_host,
    failure_in,
    make_blocks,
    pause,
    pick_host,
    return_hosts,
    seed_repairs,
    spend,
    step_factor,
)
from sim.model import DAY_S, YEAR_S, SimConfig


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    goodput: Goodput
    block_goodput: tuple[float, ...]  # each block's (learner's) own useful / allocated chip-seconds
    failures: int
    steps: int  # block steps (decoupled: summed over learners; data-parallel: job steps)
    contributions: int
    merges: int
    rejected: int
    lost_s: float  # chip-seconds of steps aborted by failures
    wall_s: float

    def as_dict(self) -> dict:
        cfg, g = self.config, self.goodput
        alloc = g.allocated_s or 1.0
        return {
            "system": cfg.system,
            "chips": cfg.chips,
            "learners": cfg.learners,
            "quorum": cfg.quorum,
            "grace": cfg.grace,
            "mtbi_years": None if cfg.mtbi_s == float("inf") else cfg.mtbi_s / YEAR_S,
            "days": cfg.duration_s / DAY_S,
            "seed": cfg.seed,
            "goodput": g.goodput,
            "down_frac": g.down_s / alloc,
            "blocked_frac": g.blocked_s / alloc,
            "dropped_frac": g.dropped_s / alloc,
            "lost_frac": self.lost_s / alloc,
            "useful_chip_s": g.useful_s,
            "allocated_chip_s": g.allocated_s,
            "down_chip_s": g.down_s,
            "blocked_chip_s": g.blocked_s,
            "dropped_chip_s": g.dropped_s,
            "pending_chip_s": g.pending_s,
            "lost_chip_s": self.lost_s,
            "learner_goodput": list(self.block_goodput),
            "failures": self.failures,
            "steps": self.steps,
            "contributions": self.contributions,
            "merges": self.merges,
            "rejected": self.rejected,
            "wall_s": self.wall_s,
            "config": cfg.as_dict(),
        }


Progress = Callable[[float], None]  # called now and then with the share of virtual time done


def simulate(
    cfg: SimConfig, records: RecordSink | None = None, progress: Progress | None = None
) -> SimResult:
    """Run ``cfg``. With ``records``, also write per-chip event records there (small runs only)."""
    t_wall = time.perf_counter()
    rng = random.Random(cfg.seed)
    if cfg.system == "decoupled":
        from sim.decoupled import DecoupledDriver

        drv = DecoupledDriver(cfg, rng, records)
        drv.run(progress)
        tally, blocks, counts, shares = drv.tally, drv.blocks, drv.counts, drv.shares
    else:
        shares = [1.0]
        tally = Tally(cfg.learners, shares)
        blocks = make_blocks(cfg, rng)
        if cfg.system == "elastic-dp":
            for blk in blocks:
                seed_repairs(cfg, rng, blk, records, cfg.chips)
        counts = _run_data_parallel(cfg, rng, blocks, tally, records, progress)
    close_downs(blocks, cfg.duration_s, tally)
    if records is not None:
        records.run(cfg.system, cfg.duration_s, shares)
    g, per_block = tally.finish(cfg.duration_s, [b.chips for b in blocks])
    return SimResult(
        config=cfg,
        goodput=g,
        block_goodput=tuple(per_block),
        failures=counts.failures,
        steps=counts.steps,
        contributions=tally.contributions,
        merges=counts.merges,
        rejected=counts.rejected,
        lost_s=tally.lost_s,
        wall_s=time.perf_counter() - t_wall,
    )


def _run_data_parallel(
    cfg: SimConfig,
    rng: random.Random,
    blocks: list,
    tally: Tally,
    rec: RecordSink | None,
    progress: Progress | None = None,
) -> Counts:
    elastic = cfg.system == "elastic-dp"
    end = cfg.duration_s
    counts = Counts()
    hazard = rng.expovariate(1.0)  # one failure clock for the whole job
    t = 0.0
    while t < end:
        for blk in blocks:
            if blk.returns and blk.returns[0][0] <= t:
                return_hosts(blk, t, tally, rec)
        present = sum(blk.present for blk in blocks)
        if present == 0:  # every chip is away: wait for the first replacement
            t = min(blk.returns[0][0] for blk in blocks if blk.returns)
            continue
        durs = [cfg.step_s * step_factor(cfg, rng, blk, t) for blk in blocks]
        d = max(durs)
        if t + d > end:
            break
        tf = failure_in(cfg, hazard, present, t, d)
        if tf is not None:
            hazard = rng.expovariate(1.0)
            counts.failures += 1
            tally.lost_s += present * (tf - t)
            x = rng.random() * present
            for blk in blocks:
                x -= blk.present
                if x < 0:
                    break
            host = pick_host(rng, blk)
            resume = tf + (cfg.resize_s if elastic else cfg.spare_s + cfg.restart_s)
            # dp restarts at full size on a spare host; elastic-dp gets its host back when it is repaired
            fail_host(blk, host, tf, tf + cfg.repair_s if elastic else resume, rec)
            for b in blocks:
                pause(b, tf, min(resume, end), tally, rec)
            t = resume
            continue
        hazard = spend(cfg, hazard, present, d)
        counts.steps += 1
        cids = []
        for blk, db in zip(blocks, durs):
            advance_slowdowns(cfg, rng, blk, t, d)
            n = blk.present
            tally.step(blk.index, n * db, n * (d - db))
            cid = f"{counts.steps}.{blk.index}"
            tally.contribute(blk.index, 0, cid)
            tally.merged(cid)
            cids.append(cid)
            if rec is not None:
                rec.step(blk.index, counts.steps, t, t + db, t + d, blk.away_slots())
                rec.contribute(blk.index, 0, counts.steps, cid)
        if rec is not None:
            rec.merge(0, counts.steps, cids, t + d)
        counts.merges += 1
        t += d
        if progress is not None and counts.steps % 8192 == 0:
            progress(t / end)
    if progress is not None:
        progress(1.0)
    return counts
