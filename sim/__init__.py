"""Discrete-event simulator: goodput at the paper's scale, in virtual time, with no training
(docs/design.md, section 3).

Millions of chips, failures with a mean time between interruptions per chip, repairs, elastic resizes,
slow learners and transient slowdowns, for three systems: non-elastic data-parallel, elastic data-parallel
and Decoupled DiLoCo (M learners; the fragment synchronisers are ``protocol.synchroniser`` itself). Goodput
is ``protocol.goodput``'s definition, counted in chip-seconds (``sim.accounting``).

    from sim import SimConfig, simulate
    simulate(SimConfig(system="decoupled", chips=1_200_000, learners=8)).goodput.goodput

Command line: ``ddiloco sim --help``; the paper's table: ``python bench/goodput.py``; model and calibration:
docs/chaos.md. Layering: ``sim`` imports ``protocol`` only; ``node`` (the CLI) imports ``sim``.
"""

from sim.engine import SimResult, simulate
from sim.model import DAY_S, HOUR_S, SYSTEMS, YEAR_S, SimConfig

__all__ = ["DAY_S", "HOUR_S", "SYSTEMS", "YEAR_S", "SimConfig", "SimResult", "simulate"]
