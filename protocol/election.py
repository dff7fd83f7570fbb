"""Who synchronises fragment p in round r, and which of two merge records wins (docs/design.md, section 4).

Election is rendezvous (highest-random-weight) hashing of (run, fragment, round) over the eligible peers:
every node that sees the same live set derives the same ordered candidate list without talking, the role
moves from round to round and fragment to fragment (spreading aggregation load), and when a candidate dies
only the rounds it held move, to the next candidate on each list.

Fork choice: two merge records for the same (fragment, round) — a split brain — are ordered by one rule
every node applies alike: more contributors first, then more total weight, then the lower new hash. Two
replicas whose fragment heads differ are ordered by the same rule extended on the left by the round: the
further head wins (``head_key``), so after a partition heals every side converges on one chain.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def _score(run: str, fragment: int, round_: int, peer: str) -> bytes:
    return hashlib.sha256(f"{run}\x1f{fragment}\x1f{round_}\x1f{peer}".encode()).digest()


def candidates(run: str, fragment: int, round_: int, eligible: Iterable[str]) -> list[str]:
    """Eligible peers in the order they should take the role: first is the synchroniser, then failovers."""
    return sorted(set(eligible), key=lambda p: (_score(run, fragment, round_, p), p), reverse=True)


def synchroniser(run: str, fragment: int, round_: int, eligible: Iterable[str]) -> str | None:
    c = candidates(run, fragment, round_, eligible)
    return c[0] if c else None


def fork_key(n_contributors: int, total_weight: float, new_hash: str) -> tuple:
    """Sort key; the record with the *smallest* key wins."""
    return (-n_contributors, -total_weight, new_hash)


def fork_winner(a: tuple[int, float, str], b: tuple[int, float, str]) -> int:
    """0 if record a wins, 1 if b wins; each given as (contributors, total weight, new hash)."""
    return 0 if fork_key(*a) <= fork_key(*b) else 1


def head_key(round_: int, n_contributors: int, total_weight: float, new_hash: str) -> tuple:
    """Sort key of a fragment head (its latest record); the *smallest* key is the chain everyone adopts."""
    return (-round_, *fork_key(n_contributors, total_weight, new_hash))
