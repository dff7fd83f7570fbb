"""Reading ``bench/parity.py``'s loss curves at equal tokens: trained (``eval_at`` on a (tokens, loss)
curve) and merged (``merged_curve``: the tokens whose work the evaluated model holds)."""

from __future__ import annotations

from pathlib import Path

from node.common.events import read_events


def eval_at(curve: list[tuple[float, float]], tokens: float) -> float | None:
    """Loss at ``tokens`` on a (tokens, loss) curve, linearly between the records around it."""
    curve = sorted(curve)
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return None


def merged_curve(records: list[dict], evals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(tokens merged into the evaluated model, loss) for each (moment, loss) of ``evals``: per fragment the
    ``c_tokens`` of the contributions its merges took up to that moment, weighted by its share of the
    parameters. Read at equal tokens *trained*, a sync-diloco model is a step function of its rounds, and
    each eval lands at another phase of them (the nodes' evals every 10 s, the runner's at its budget); read
    at equal tokens merged, both drivers are compared on what their models hold."""
    shares = next(r["shares"] for r in records if r.get("kind") == "run")
    tokens = {r["cid"]: r["c_tokens"] for r in records if r.get("kind") == "contribute"}
    merges: dict[tuple[int, int], dict] = {}
    for r in records:
        if r.get("kind") == "merge":
            merges.setdefault((r["fragment"], r["round"]), r)
    steps = sorted(
        (r["t"], shares[r["fragment"]] * sum(tokens.get(c, 0) for c in r["cids"])) for r in merges.values()
    )
    out = []
    for t, loss in evals:
        out.append((sum(m for tm, m in steps if tm <= t), loss))
    return out


def real_merged_curve(run_dir: Path, nodes: int) -> list[tuple[float, float]]:
    """``merged_curve`` of a real run: node 0's merges (the model it evaluates) and evals, every node's
    contributions."""
    ev = {i: read_events(run_dir / f"node-{i}" / "events.jsonl") for i in range(nodes)}
    own = [r for r in ev[0] if r.get("kind") in ("run", "merge")]
    contribs = [r for recs in ev.values() for r in recs if r.get("kind") == "contribute"]
    evals = [(r["t"], r["loss"]) for r in ev[0] if r.get("kind") == "eval"]
    return merged_curve(own + contribs, evals)


def at_equal_merged(rows: list[dict]) -> None:
    """Fill ``real_loss_m`` and ``runner_loss_m`` of one seed's rows (one per system): each curve read at
    the fewest tokens merged that every system reached in both drivers."""
    ends = [r["real"]["curve_m"][-1][0] for r in rows if r["real"].get("curve_m")]
    ends += [r["runner"]["curve_m"][-1][0] for r in rows if r["runner"].get("curve_m")]
    m = min(ends) if ends else 0
    for r in rows:
        r["merged"] = m
        r["real_loss_m"] = eval_at(r["real"].get("curve_m", []), m) if m else None
        r["runner_loss_m"] = eval_at(r["runner"].get("curve_m", []), m) if m else None
