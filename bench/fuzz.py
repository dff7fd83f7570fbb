"""The long fuzzing run: N fuzzed inputs per message type against every decoder of network
or disk bytes, with the targets of ``tests/fuzz`` (a quarter arbitrary bytes, the rest structure-aware
mutations of valid messages, half of those re-signed or re-hashed).

For each type it prints how many inputs were accepted, how many refused (by error code or type), how many
crashed — any other exception, an accepted value that breaks the decoder's invariants, or a decode still
running after 10 s — with the first traceback of each kind, and the slowest single decode. It exits 1 if
anything crashed or any decode took over 1 s.

    python bench/fuzz.py                                   # 10,000 per type, seed 0 (~3 min on two cores)
    python bench/fuzz.py --per-type 1000 --seed 7 --types record,member
"""

from __future__ import annotations

import argparse
import collections
import logging
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.fuzz lives beside the packages

from tests.fuzz import TARGETS, Outcome, Target, outcome  # noqa: E402

HANG_S = 10.0  # a decode still running after this is reported as a hang
SLOW_S = 1.0  # a decode slower than this fails the run


class Hang(BaseException):
    """Raised by the alarm inside a decode that runs too long (BaseException: decoders catch Exception)."""


def _alarm(signum: int, frame: object) -> None:
    raise Hang


@dataclass
class Tally:
    name: str
    count: int = 0
    accepted: collections.Counter = field(default_factory=collections.Counter)
    refused: collections.Counter = field(default_factory=collections.Counter)
    crashes: collections.Counter = field(default_factory=collections.Counter)
    first_trace: dict[str, str] = field(default_factory=dict)
    slowest_s: float = 0.0


def run_target(target: Target, n: int, seed: int, progress: str) -> Tally:
    rng = random.Random(f"{seed}:{target.name}")
    tally = Tally(target.name)
    for i in range(n):
        value = target.sample(rng)
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, HANG_S)
        try:
            o = outcome(target, value)
        except Hang:
            o = Outcome("crash", f"hang: still decoding after {HANG_S:.0f} s")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        tally.slowest_s = max(tally.slowest_s, time.perf_counter() - t0)
        tally.count += 1
        if o.kind == "accepted":
            tally.accepted[o.label] += 1
        elif o.kind == "refused":
            tally.refused[o.reason] += 1
        else:
            tally.crashes[o.label] += 1
            if o.label not in tally.first_trace:
                tb = "".join(traceback.format_exception(o.error)) if o.error else o.label + "\n"
                tally.first_trace[o.label] = f"input: {repr(value)[:300]}\n{tb}"
        if i % 250 == 0 or i == n - 1:
            print(f"\r{progress} {target.name:<20} {i + 1:>6}/{n}", end="", file=sys.stderr, flush=True)
    return tally


def table(tallies: list[Tally]) -> str:
    head = f"{'type':<20} {'count':>6} {'accepted':>8} {'refused':>7} {'crashes':>7} {'slowest ms':>10}  outcomes"
    lines = [head, "-" * len(head)]
    for t in tallies:
        refused = ", ".join(f"{k} {v}" for k, v in t.refused.most_common())
        accepted = ", ".join(f"{k} {v}" for k, v in t.accepted.most_common() if k != "accepted")
        what = "; ".join(f"{k}: {v}" for k, v in (("refused", refused), ("accepted", accepted)) if v)
        lines.append(
            f"{t.name:<20} {t.count:>6} {sum(t.accepted.values()):>8} {sum(t.refused.values()):>7} "
            f"{sum(t.crashes.values()):>7} {t.slowest_s * 1000:>10.1f}  {what}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-type", type=int, default=10_000, help="fuzzed inputs per message type")
    ap.add_argument("--seed", type=int, default=0, help="seed of the input generator")
    ap.add_argument("--types", default="", help=f"comma-separated subset of: {', '.join(TARGETS)}")
    args = ap.parse_args(argv)
    names = [x for x in args.types.split(",") if x] or list(TARGETS)
    unknown = [x for x in names if x not in TARGETS]
    if unknown or args.per_type < 1:
        ap.error(
            f"--types {unknown} unknown (choose from {', '.join(TARGETS)})" if unknown else "--per-type < 1"
        )
    logging.disable(logging.CRITICAL)  # load_latest logs a warning for every damaged file it skips
    signal.signal(signal.SIGALRM, _alarm)

    print(
        f"fuzz: {len(names)} message types x {args.per_type} inputs, seed {args.seed} "
        "(1/4 arbitrary bytes, 3/4 structure-aware mutations of valid messages)"
    )
    t0 = time.monotonic()
    tallies = [
        run_target(TARGETS[name], args.per_type, args.seed, f"[{i + 1}/{len(names)}]")
        for i, name in enumerate(names)
    ]
    print(file=sys.stderr)
    print(table(tallies))
    crashed = [t for t in tallies if t.crashes]
    slow = [t for t in tallies if t.slowest_s > SLOW_S]
    total = sum(t.count for t in tallies)
    worst = max(tallies, key=lambda t: t.slowest_s)
    print(
        f"\n{total} inputs in {time.monotonic() - t0:.0f} s; crashes: {sum(sum(t.crashes.values()) for t in tallies)}; "
        f"slowest decode {worst.slowest_s * 1000:.1f} ms ({worst.name})"
    )
    for t in crashed:
        for label, n in t.crashes.most_common():
            print(f"\nCRASH {t.name}: {label} (x{n}); first one:\n{t.first_trace[label]}")
    for t in slow:
        print(f"\nSLOW {t.name}: a decode took {t.slowest_s:.2f} s (limit {SLOW_S:.0f} s)")
    return 1 if crashed or slow else 0


if __name__ == "__main__":
    sys.exit(main())
