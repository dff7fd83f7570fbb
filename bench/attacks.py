"""Hostile members against a public swarm of real nodes: lying learners and lying
synchronisers, and members that sign records nobody elected (``forge-*``).

Each run starts ``--honest`` honest nodes (``python -m node node``, the tests' tiny model and fast rounds) and
``--hostile`` members running ``bench/hostile_node.py`` (the project's node with its learner's contributions,
or its merges when it is elected, tampered with: see that file for the attacks), all in one public swarm on
loopback. After ``--seconds`` of training (or, with ``--steps``, once the honest learners have made that many
inner steps each on average: the same honest work in every run) it reads the honest nodes' wire bytes and
steps, pauses every learner, waits for one model hash, stops the nodes and reads each honest node's final eval loss
(``final.json``). The unattacked run (``none``) has the same number of nodes, all honest, for the same time;
``absent`` has the honest nodes alone: what a defence that threw away exactly the hostile members' work would
reach. Rows: attack; columns: the merge rule (``--robust``; ``auto`` is what a public swarm runs:
``centered-clip``) and the audit share (``--audit``; ``auto``: every record where learners are not vouched
for). Cells: the honest nodes' eval loss, mean over ``--repeats`` runs (each a fresh swarm: new identities,
so new data orders), its ratio to the unattacked run of the same column, the tokens the swarm merged, and how
many runs ended on one hash. Then the wire bytes per inner step of each column's unattacked runs, and for
the synchroniser attacks how many of the liar's records got in, how many were convicted, and how long until
every honest node had banned it; for ``sybil`` (32 more identities per hostile member, no process behind
them) how many contributions the honest nodes sent past a candidate that did not answer; for
``sync-stall`` (a working member that takes rounds and never merges them) the forks the honest nodes met
against the unattacked run's, and the rounds its senders found stalled.

    python bench/attacks.py                              # 4 honest + 1 hostile, every attack, 3 repeats
    python bench/attacks.py --hostile 2 --rules auto     # 4 + 2, the public swarm's rule only
    python bench/attacks.py --attacks sync-flip --rules auto --audits auto,0   # audits on and off
    python bench/attacks.py --attacks flip --repeats 1 --seconds 30   # a smoke run
    python bench/attacks.py --hostile 2 --rules auto --steps 600 --seconds 240   # equal honest work
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from node.common.events import read_events
from node.common.status_client import StatusError, read_control_token, send_control
from node.local.forks import ForkServer
from node.local.hostile import alie_z
from node.local.launcher import Child, poll, private_tmp, quiet_period, start_node, stop_all, wait_ready

ROOT = Path(__file__).resolve().parents[1]
FLAGS = (
    "--dim 32 --layers 2 --heads 2 --seq-len 32 --batch-size 8 --eval-batches 8 --fragments 4 "
    "--sync-every 8 --eval-every-s 30 --heartbeat-s 0.5 --ttl-s 3 --failover-s 6 --rpc-timeout-s 5 "
    "--threads 1 --step-delay-s 0.05 --checkpoint-every-s 10"
).split()
ATTACKS = (
    "none", "absent", "flip", "flip-x2.5", "inflate", "inflate-1e6", "random", "alie", "alie-z1", "alie-z0", "sync-flip", "sync-x1.5", "sync-x1.001", "sync-share",
    "sync-drop", "sync-censor", "head-zero", "sybil", "sybil-noise", "sync-stall", "sync-late", "forge-self", "forge-signed",
    "forge-unserved",
)  # fmt: skip


def start_hostile(
    index: int,
    run_dir: Path,
    attack: str,
    flags: list[str],
    peers: list[str],
    z: float = 0.25,
    forks: ForkServer | None = None,
) -> Child:
    """Node ``index`` running ``bench/hostile_node.py attack``: a fresh process, or one forked by ``forks``
    (``node.local.forks``)."""
    d = run_dir / f"node-{index}"
    d.mkdir(parents=True, exist_ok=True)
    log = d / "node.log"
    script = str(ROOT / "bench" / "hostile_node.py")
    argv = [attack, "--state-dir", str(d), "--exit-with-parent", *flags, "--initial-peers", ",".join(peers)]
    tmp = private_tmp(index)
    env = dict(os.environ, TMPDIR=tmp, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.update(DDILOCO_ALIE_Z=str(z), DDILOCO_COLLUDERS=str(run_dir / "colluders.txt"))
    if forks is not None:
        return Child(index, d, forks.spawn(argv, env, str(log), cwd=str(ROOT), script=script), log, tmp=tmp)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [sys.executable, script, *argv],
            stdout=fh,
            stderr=subprocess.STDOUT,
            process_group=0,
            env=env,
            cwd=ROOT,
        )
    return Child(index, d, proc, log, tmp=tmp)


PROOFS = ("unfaithful_merge", "omitted_contribution")  # bans on a proof: an audit's, a receipt's


def _liar_rounds(run_dir: Path, honest: range, liars: set[str]) -> dict:
    """What the hostile synchronisers got in: the distinct records of theirs the honest nodes applied, how many
    of those were convicted (``PROOFS``), and the seconds from the first to the last honest node's ban of
    them."""
    applied, convicted, first, bans = set(), set(), None, {}
    for i in honest:
        for e in read_events(run_dir / f"node-{i}" / "events.jsonl"):
            if e["kind"] == "merge" and e.get("signer") in liars:
                applied.add((e["fragment"], e["round"]))
                first = e["t"] if first is None else min(first, e["t"])
            elif e["kind"] == "ban" and e.get("last") in PROOFS and e["peer"] in liars:
                convicted.add((e["fragment"], e["round"]))
                bans[i] = min(bans.get(i, e["t"]), e["t"])
    every = max(bans.values()) - first if first is not None and len(bans) == len(honest) else None
    return {"liar_records": len(applied), "convicted": len(applied & convicted), "all_banned_s": every}


def _liar_snapshots(run_dir: Path, honest: range, liars: set[str]) -> dict:
    """What a member serving forged snapshots got in: the snapshots of theirs the honest nodes installed, and
    the heads of theirs refused before fetching (``unwitnessed_snapshot``)."""
    taken = refused = 0
    for i in honest:
        for e in read_events(run_dir / f"node-{i}" / "events.jsonl"):
            taken += e["kind"] == "resync" and e.get("donor") in liars
            refused += e["kind"] == "unwitnessed_snapshot" and e.get("peer") in liars
    return {"liar_snapshots": taken, "unwitnessed": refused}


def run_once(args, attack: str, rule: str, audit: str = "auto") -> dict:
    flags = FLAGS + ["--robust", rule, "--audit", audit] + (["--data", args.data] if args.data else [])
    flags += args.node_flags.split()
    n_hostile = 0 if attack in ("none", "absent") else args.hostile
    keep = args.keep and Path(tempfile.mkdtemp(prefix=f"{rule}-{attack}-", dir=args.keep))
    with contextlib.nullcontext(str(keep)) if keep else tempfile.TemporaryDirectory(prefix="attacks-") as tmp:
        run_dir = Path(tmp)
        children = [start_node(0, run_dir, flags, [])]
        try:
            wait_ready(children, 120)
            peers = children[0].maddrs
            for i in range(1, args.honest + (args.hostile if attack == "none" else 0)):
                children.append(start_node(i, run_dir, flags, peers))
            z = alie_z(args.honest + args.hostile, args.hostile)
            for _ in range(n_hostile):
                children.append(start_hostile(len(children), run_dir, attack, flags, peers, z))
            wait_ready(children, 120)
            honest_now = children[: len(children) - n_hostile]
            if args.steps:  # the same honest work in every run, however the 2 cores were shared
                deadline = time.monotonic() + args.seconds
                while time.monotonic() < deadline and _mean_steps(honest_now) < args.steps:
                    time.sleep(0.5)
            else:
                time.sleep(args.seconds)
            poll(children)  # wire bytes and steps of the honest nodes, before the pause
            wire = [(c.last or {}) for c in honest_now]
            for c in children:
                try:
                    send_control(c.url, "pause", token=read_control_token(c.state_dir))
                except StatusError:
                    pass
            # the honest nodes' agreement: a banned lying synchroniser stays on a chain of its own
            settled, _ = quiet_period(children[: len(children) - n_hostile], 60.0, quiet=True)
        finally:
            stop_all(children)
        honest = range(len(children) - n_hostile)
        # a node that did not stop in time writes no final state (one did, beside a Sybil flood): left out, counted
        paths = [run_dir / f"node-{i}" / "final.json" for i in honest]
        finals = [json.loads(f.read_text()) for f in paths if f.exists()]
        hashes = {f.get("model_hash") for f in finals}
        steps = sum(w.get("learner", {}).get("steps", 0) for w in wire)
        liars = {c.peer_id for c in children[len(children) - n_hostile :]}
        events = [e for i in honest for e in read_events(run_dir / f"node-{i}" / "events.jsonl")]
        return {
            "eval_loss": statistics.mean(f["eval_loss"] for f in finals),
            "tokens": min(f.get("tokens_merged", 0) for f in finals),
            "one_hash": len(hashes) == 1 and settled and len(finals) == len(paths),
            "no_final": len(paths) - len(finals),
            "bytes_per_step": sum(w.get("bytes_sent", 0) for w in wire) / steps if steps else None,
            "steps": steps / len(wire) if wire else 0,
            **(_liar_rounds(run_dir, honest, liars) if attack.startswith(("sync-", "forge-")) else {}),
            # records refused for naming no signed message where audits run, or for a signer nobody elected
            "forged_refused": sum(
                e["kind"] == "reject" and e.get("code") in ("forged_record", "unelected") for e in events
            ),
            # a ban of an honest node by another is a defect, whatever the attack
            "honest_banned": sum(e["kind"] == "ban" and e["peer"] not in liars for e in events),
            **(_liar_snapshots(run_dir, honest, liars) if attack == "head-zero" else {}),
            # contributions sent past a candidate that did not answer (a Sybil flood's cost)
            "failovers": sum(e["kind"] == "failover" for e in events),
            "forks": sum(e["kind"] == "fork" for e in events),  # two records of one round met
            # rounds merged, summed over the fragments, the fewest of the honest nodes (their final replicas)
            "rounds": min(f.get("rounds_merged", 0) for f in finals),
            "slow": sum(e["kind"] == "slow" and e.get("peer") in liars for e in events),
            # rounds a member took and left unmerged, found by their senders' watch
            "stalls": sum(e["kind"] == "stall" and e.get("peer") in liars for e in events),
            # the work bounds' counters (protocol.work): the liars' contributions refused for claiming more work
            # than they could do, and the honest merges any liar's contribution was in
            "bad_counters": sum(e["kind"] == "reject" and e.get("code") == "bad_counters" for e in events),
            "liar_in_merges": sum(e["kind"] == "merge" and bool(liars & set(e["learners"])) for e in events),
        }


def _beside(xs: list[dict], base: list[dict], key: str) -> str:
    """Per run, ``key`` of the attacked runs with the unattacked runs' beside them."""
    return f"{[x[key] for x in xs]} (unattacked {[x[key] for x in base]})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/attacks.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--honest", type=int, default=4)
    p.add_argument("--hostile", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--seconds", type=float, default=90.0, help="training time of each run (with --steps: at most)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help="train until the honest nodes' learners have made this many inner steps each, on average: runs "
        "of the same honest work (6 nodes on 2 cores made 15%% more or fewer steps in 60 s from run to run)",
    )
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--rules", default="auto,off", help="--robust values to compare (auto: a public swarm's)")
    p.add_argument(
        "--audits", default="auto", help="--audit values to compare (auto: a public swarm's, every record)"
    )
    p.add_argument("--keep", help="make each run's folder under this one, and keep it (default: removed)")
    p.add_argument("--data", help="a text file for every node (default: the nodes' generated text)")
    p.add_argument("--node-flags", default="", help="more flags for every node, e.g. --node-flags=--distrust")
    args = p.parse_args(argv)
    attacks = [a for a in args.attacks.split(",") if a != "none"]
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:  # before any run, not after the first ones
        p.error(f"unknown attack {', '.join(unknown)}: choose among {', '.join(ATTACKS)}")
    cols = [(r, a) for r in args.rules.split(",") for a in args.audits.split(",")]
    rows: dict[tuple[str, str, str], list[dict]] = {}
    t0 = time.monotonic()
    for r in range(args.repeats):
        for rule, audit in cols:
            for attack in ["none", *attacks]:
                res = run_once(args, attack, rule, audit)
                rows.setdefault((rule, audit, attack), []).append(res)
                print(
                    f"[{time.monotonic() - t0:6.0f}s] repeat {r} --robust {rule} --audit {audit} {attack}: "
                    f"{json.dumps(res)}",
                    file=sys.stderr,
                    flush=True,
                )
    length = f"{args.steps} honest steps" if args.steps else f"{args.seconds:g} s"
    print(
        f"\n{args.honest} honest + {args.hostile} hostile nodes, {length} each, {args.repeats} repeats; "
        f"eval loss of the honest nodes (x the unattacked run of the same column), tokens merged, runs on one hash"
    )
    print(f"{'attack':12s}" + "".join(f"{'--robust ' + r + ' --audit ' + a:>40s}" for r, a in cols))
    for attack in ["none", *attacks]:
        cells = []
        for rule, audit in cols:
            xs = rows[(rule, audit, attack)]
            loss = statistics.mean(x["eval_loss"] for x in xs)
            base = statistics.mean(x["eval_loss"] for x in rows[(rule, audit, "none")])
            tokens = statistics.mean(x["tokens"] for x in xs)
            one = sum(x["one_hash"] for x in xs)
            cells.append(f"{loss:8.4f} ({loss / base:6.3f}x) {tokens / 1e3:6.0f}k {one}/{len(xs)}")
        print(f"{attack:12s}" + "".join(f"{c:>40s}" for c in cells))
    print("\nwire bytes sent per inner step, honest nodes (x the first column's, unattacked)")
    ref = _mean([x["bytes_per_step"] for x in rows[(*cols[0], "none")]])
    for rule, audit in cols:
        b = _mean([x["bytes_per_step"] for x in rows[(rule, audit, "none")]])
        print(
            f"  --robust {rule} --audit {audit}: {b:,.0f} B/step ({b / ref:.3f}x)" if b and ref else "  n/a"
        )
    for attack in attacks:
        for rule, audit in cols:
            line = _attack_line(attack, rows[(rule, audit, attack)], rows[(rule, audit, "none")])
            if line:
                print(f"{attack} --robust {rule} --audit {audit}: {line}")
    return 0


def _attack_line(attack: str, xs: list[dict], base: list[dict]) -> str | None:
    """What an attack's runs counted beyond the loss, per run (None: nothing more for it)."""
    per = lambda key: [x[key] for x in xs]  # noqa: E731
    if attack.startswith("sync-"):
        records = (
            f"records of the liar applied per run {per('liar_records')}, convicted {per('convicted')}, "
            f"seconds from its first record to every honest node's ban {per('all_banned_s')}"
        )
        if attack == "sync-late":
            return (
                f"{records}; rounds merged per run {_beside(xs, base, 'rounds')}, the liar passed over as "
                f"slow {per('slow')} times"
            )
        if attack != "sync-stall":
            return records
        return f"{records}; forks per run {_beside(xs, base, 'forks')}, rounds found stalled {per('stalls')}"
    if attack.startswith("forge-"):
        return (
            f"records of the forger applied per run {per('liar_records')}, refused (forged_record or unelected) "
            f"{per('forged_refused')}, honest nodes banned {per('honest_banned')}"
        )
    if attack.startswith("sybil"):
        return f"contributions failed over past a candidate per run {_beside(xs, base, 'failovers')}"
    if attack.startswith(("inflate", "flip", "random", "alie")):
        return (
            f"contributions refused as bad_counters per run {per('bad_counters')}, honest merges holding a "
            f"liar's contribution {per('liar_in_merges')}"
        )
    if attack == "head-zero":
        return (
            f"the liar's snapshots installed per run {per('liar_snapshots')}, its heads refused before "
            f"fetching {per('unwitnessed')}"
        )
    return None


def _mean_steps(children: list[Child]) -> float:
    """The honest nodes' learners' mean inner steps now (a node that does not answer counts 0)."""
    poll(children)
    return statistics.mean((c.last or {}).get("learner", {}).get("steps", 0) for c in children)


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


if __name__ == "__main__":
    sys.exit(main())
