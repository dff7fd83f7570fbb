"""``ddiloco replay`` (``sim.replay``, ``node.chaos.tape``, ``node.chaos.replay``): a run folder's tapes read, refused by name where
they cannot be trusted, and re-decided. The tapes here are written by the replay's own rules (what a node of
those rules would have recorded), so replaying them with the same settings must give the same figures; the
what-ifs must move them the way the rule they change says. A real swarm's tapes are replayed in
``tests/test_swarm.py`` (``ddiloco up``)."""

import json
import random
from pathlib import Path

import pytest

from node.chaos.replay import parse_what_if, real_figures, replay
from node.chaos.report import WINDOW_FILE
from node.chaos.tape import TapeError, learner_tapes, measured_links, read_run
from node.cli.main import main
from protocol.config import TAPE_SETTINGS, ProtocolConfig
from protocol.errors import ConfigError
from sim.replay import Links, Replay, ReplayConfig

P, H = 4, 8
SHARES = [0.4, 0.3, 0.2, 0.1]
LINKS = Links(contrib_s=0.05, fanout_s=0.03, floor_s=0.03)
T0 = 1_000.0


def write_run(folder: Path, m: int = 4, seconds: float = 60.0, seed: int = 0, kill: tuple | None = None,
              slow: float = 1.0, quorum: int = 1, accepts: bool = True, slow_link_s: float | None = None
              ) -> Path:  # fmt: skip
    """A run folder of ``m`` nodes whose rounds were decided by the replay's rules: each learner steps about
    every 0.25 s (the last one ``slow`` times slower); ``kill``: (node, at_s, back_s), a kill -9 and restart;
    ``accepts``: the synchronisers recorded when they took each contribution in (tapes before they did not);
    ``slow_link_s``: the last learner's contributions take this long to arrive."""
    rng = random.Random(seed)
    pcfg = ProtocolConfig(sync_every=H, fragments=P, quorum=quorum)
    names = [f"peer{i}" for i in range(m)]
    tapes, steps_of = [], {}
    for i, name in enumerate(names):
        t, k, steps, life_steps = T0 + 0.05 * i, 0, [], []
        base = 0.25 * (slow if i == m - 1 else 1.0)
        kills, outs = (), ()
        while t < T0 + seconds:
            if kill and kill[0] == i and T0 + kill[1] <= t < T0 + kill[2]:
                t = T0 + kill[2]
                k = max(0, k - 3)  # the restart resumes from its checkpoint, a few steps back
                continue
            d = base * rng.uniform(0.9, 1.1)
            k += 1
            steps.append((k, t, t + d))
            t += d
        if kill and kill[0] == i:
            kills, outs = (T0 + kill[1],), ((T0 + kill[1], T0 + kill[2]),)
        from sim.replay import LearnerTape

        tapes.append(LearnerTape(name, tuple(steps), outs, kills))
        steps_of[name] = steps
        del life_steps
    slowest = {} if slow_link_s is None else {names[-1]: slow_link_s}
    links = Links(
        LINKS.contrib_s, LINKS.fanout_s, LINKS.floor_s, by_learner={k: (v,) for k, v in slowest.items()}
    )
    cfg = ReplayConfig(pcfg, tuple(SHARES), T0 + 0.05 * (m - 1), T0 + seconds, links, 8.0, 1.0, (None,) * P)
    res = Replay(cfg, tapes).run()
    settings = {k: getattr(pcfg, k) for k in TAPE_SETTINGS}
    settings.update(fragments=P, system="decoupled", ttl_s=8.0, heartbeat_s=2.0)
    for i, name in enumerate(names):
        d = folder / f"node-{i}"
        d.mkdir(parents=True)
        recs = [{"kind": "join", "t": T0 + 0.05 * i, "learner": name, "how": "fresh", "settings": settings}]
        if kill and kill[0] == i:
            recs.append({"kind": "join", "t": T0 + kill[2], "learner": name, "how": "restart",
                         "settings": settings})  # fmt: skip
        recs += [{"kind": "step", "learner": name, "step": s, "t0": a, "t1": b} for s, a, b in steps_of[name]]
        for r in res.records[name]:
            recs.append({**r, **({"bytes": 1000 * (r["fragment"] + 1)} if r["kind"] == "contribute" else {})})
            if (
                accepts and r["kind"] == "contribute"
            ):  # on its synchroniser's tape, in truth: any tape will do
                recs.append({"kind": "accept", "t": r["t"] + slowest.get(name, LINKS.contrib_s),
                             "fragment": r["fragment"],
                             "learner": name, "cid": r["cid"], "base": 0})  # fmt: skip
        for r in res.merges:
            signer = r["learners"][0]
            t = r["t"] if signer == name else r["t"] + LINKS.fanout_s
            recs.append({**r, "t": t, "signer": signer})
        recs.sort(key=lambda r: r.get("t", r.get("t1", 0.0)))
        recs.append({"kind": "run", "t0": T0, "t1": T0 + seconds, "learners": [name], "shares": SHARES,
                     "overlap": pcfg.overlap, "system": "decoupled"})  # fmt: skip
        (d / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if kill:
        doc = {"t0": cfg.t0, "t1": cfg.t1, "peer_ids": {str(i): n for i, n in enumerate(names)},
               "outages": [{"node": kill[0], "kind": "kill", "t0": T0 + kill[1], "t1": None}], "plan": []}  # fmt: skip
        (folder / WINDOW_FILE).write_text(json.dumps(doc))
    return folder


def test_a_run_decided_by_these_rules_replays_to_its_own_figures(tmp_path):
    run = read_run(write_run(tmp_path))
    assert run.protocol.sync_every == H and run.protocol.quorum == 1 and not run.notes
    links = measured_links(run)  # each contribution's own delay, from its accept
    assert links.contrib_s == pytest.approx(LINKS.contrib_s) and links.merge_s == pytest.approx(0.0, abs=1e-9)
    assert len(links.delays) > 100 and links.fanout_s == pytest.approx(LINKS.fanout_s)
    real, own = real_figures(run), replay(run)
    assert real["rounds_merged"] > 4 * P  # it merged
    for key in ("goodput", "rounds_merged", "rounds_per_fragment", "learners_per_merge", "contributions",
                "payload_mb"):  # fmt: skip
        assert own[key] == pytest.approx(real[key], rel=1e-6), key


def test_a_learner_on_a_slow_link_replays_with_its_own_delays(tmp_path):
    """One learner's contributions take 0.4 s, more than its grace window allows: it misses rounds. Replayed
    with each contribution's measured delay the run gives its own figures; with one delay for all it would
    not."""
    run = read_run(write_run(tmp_path, slow_link_s=0.4))
    links = measured_links(run)
    assert all(d == pytest.approx(0.4) for d in links.by_learner["peer3"])
    assert all(d == pytest.approx(0.05) for d in links.by_learner["peer0"])
    real, own = real_figures(run), replay(run)
    fast = replay(run, {"learners": 1})  # an added learner steps as peer0 does, on peer0's kind of link
    for key in ("goodput", "rounds_merged", "learners_per_merge", "contributions"):
        assert own[key] == pytest.approx(real[key], rel=1e-6), key
    assert real["learners_per_merge"] < 3.9  # the slow link shows
    assert fast["learners_per_merge"] > own["learners_per_merge"]


def test_a_killed_learner_replays_to_its_own_figures_and_its_unsent_steps_are_lost(tmp_path):
    run = read_run(write_run(tmp_path, kill=(2, 20.0, 40.0), accepts=False))  # a tape of before 'accept'
    assert not measured_links(run).delays
    assert [o.kind for o in run.outages] == ["kill"] and "chaos.json" in run.notes[0]
    tapes = {t.name: t for t in learner_tapes(run)}
    assert tapes["peer2"].kills == (T0 + 20.0,)
    real, own = real_figures(run), replay(run)
    assert real["goodput"] < 0.95  # twenty seconds of one learner of four are down
    for key in ("goodput", "rounds_merged", "learners_per_merge", "contributions"):
        assert own[key] == pytest.approx(real[key], rel=1e-6), key
    # a quorum of every learner does not wait out the outage: the dead one's record expired (ttl_s)
    everyone = replay(run, {"quorum": 4})
    assert everyone["rounds_merged"] >= 0.9 * own["rounds_merged"]
    assert everyone["learners_per_merge"] > own["learners_per_merge"] - 0.2


def test_a_node_killed_for_good_is_read_as_killed_and_without_the_harness_as_cut_short(tmp_path):
    folder = write_run(tmp_path / "run", kill=(2, 20.0, 40.0))
    f = folder / "node-2" / "events.jsonl"
    recs = [json.loads(x) for x in f.read_text().splitlines()]
    # the node never came back: its tape ends at the kill, with no second life and no 'run' record
    kept = [r for r in recs if r.get("t", r.get("t1", 0.0)) <= T0 + 20.0 and r["kind"] != "run"]
    f.write_text("".join(json.dumps(r) + "\n" for r in kept))
    run = read_run(folder)  # chaos.json says it was killed: accepted
    assert real_figures(run)["goodput"] < 0.87  # one learner of four down from 20 s of 60 to the end
    assert replay(run)["rounds_merged"] > 0
    (folder / WINDOW_FILE).unlink()
    with pytest.raises(TapeError, match=r"node-2/events.jsonl: truncated \(no 'run' record"):
        read_run(folder)


def test_what_ifs_move_the_figures_the_way_their_rule_says(tmp_path):
    run = read_run(write_run(tmp_path, slow=1.6))
    own = replay(run)
    everyone = replay(run, {"quorum": 4})
    assert everyone["learners_per_merge"] >= own["learners_per_merge"]
    longer = replay(run, {"sync_every": 2 * H})
    assert longer["rounds_merged"] == pytest.approx(own["rounds_merged"] / 2, rel=0.2)
    assert longer["contributions"] < 0.6 * own["contributions"]
    more = replay(run, {"learners": 2})
    assert more["learners_per_merge"] > own["learners_per_merge"] + 1
    fp32 = replay(run, {"codec": "fp32"})
    assert fp32["payload_mb"] == pytest.approx(
        own["payload_mb"] * 32 / 4.5, rel=0.1
    )  # int4: 4.5 bits a value
    no_grace = replay(run, {"grace": False})
    assert no_grace["decisions"]["merged_grace_over"] > own["decisions"]["merged_grace_over"]
    assert no_grace["learners_per_merge"] < own["learners_per_merge"]


def test_the_command_prints_the_real_run_beside_its_replays(tmp_path, capsys):
    folder = write_run(tmp_path)
    assert main(["replay", str(folder), "--json", "--what-if", "quorum=2,sync_every=16 grace=off"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["real"]["goodput"] == pytest.approx(doc["replay"]["goodput"])
    assert [r["what"] for r in doc["what_if"]] == ["quorum=2", "sync_every=16 grace=off"]
    assert main(["replay", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "rounds merged" in out and "merged with every live learner in" in out
    png = tmp_path / "timeline.png"
    assert main(["replay", str(folder), "--what-if", "grace=off", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["replay", str(folder), "--plot", str(tmp_path / "timeline.jpg")]) == 2
    assert "give a .png file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("quorum=2,speed=3", "'speed' is unknown"),
        ("quorum=two", "quorum='two' is invalid"),
        ("codec=int3", "codec='int3' is invalid"),
        ("grace=maybe", "grace='maybe' is invalid"),
        ("learners=-1", "learners='-1' is invalid"),
        ("quorum", "'quorum' is invalid: write KEY=VALUE"),
        (" , ", "is empty"),
    ],
)
def test_a_bad_what_if_is_refused_by_name(text, named):
    with pytest.raises(ConfigError, match=named):
        parse_what_if(text)


def test_a_what_if_the_protocol_refuses_is_refused_naming_it(tmp_path):
    run = read_run(write_run(tmp_path))
    with pytest.raises(ConfigError, match="K=9 exceeds the 4 learners"):
        replay(run, {"quorum": 9})
    with pytest.raises(ConfigError, match="overlap=2 is invalid"):
        replay(run, {"sync_every": 2})


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def test_a_folder_it_cannot_be_true_to_is_refused_naming_the_file(tmp_path, capsys):
    with pytest.raises(TapeError, match="no such folder"):
        read_run(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TapeError, match="no node-N folders"):
        read_run(tmp_path / "empty")
    both = tmp_path / "both"
    write_run(both / "decoupled")
    write_run(both / "sync-diloco", seed=1)
    with pytest.raises(TapeError, match=r"several runs \(decoupled, sync-diloco\)"):
        read_run(both)

    missing = write_run(tmp_path / "missing")
    (missing / "node-2" / "events.jsonl").unlink()
    with pytest.raises(TapeError, match=r"node-2/events.jsonl: missing"):
        read_run(missing)

    torn = write_run(tmp_path / "torn")
    f = torn / "node-1" / "events.jsonl"
    text = f.read_text()
    f.write_text(text[: len(text) - 25])  # cut inside its last line
    with pytest.raises(TapeError, match=r"node-1/events.jsonl: truncated \(line \d+, its last"):
        read_run(torn)

    unstopped = write_run(tmp_path / "unstopped")
    f = unstopped / "node-3" / "events.jsonl"
    f.write_text("".join(_lines(f)[:-1]))  # no 'run' record: it never stopped cleanly
    with pytest.raises(TapeError, match=r"node-3/events.jsonl: truncated \(no 'run' record"):
        read_run(unstopped)

    mixed = write_run(tmp_path / "mixed")
    other = write_run(tmp_path / "other", seed=5)
    for name in ("events.jsonl",):
        (mixed / "node-1" / name).write_text(
            (other / "node-1" / name).read_text().replace("replay:", "other:")
        )
    with pytest.raises(TapeError, match="node-1 and node-0 share no merged round: nodes of different runs"):
        read_run(mixed)

    baseline = write_run(tmp_path / "baseline")
    for d in baseline.iterdir():
        f = d / "events.jsonl"
        f.write_text(
            f.read_text().replace('"system": "decoupled", "ttl_s"', '"system": "sync-diloco", "ttl_s"')
        )
    with pytest.raises(TapeError, match="ran system=sync-diloco"):
        read_run(baseline)

    # the command says so and exits 2, changing nothing
    before = (torn / "node-1" / "events.jsonl").read_bytes()
    assert main(["replay", str(torn)]) == 2
    assert "truncated" in capsys.readouterr().err
    assert (torn / "node-1" / "events.jsonl").read_bytes() == before


def test_a_learner_that_stepped_for_the_last_time_adopts_records_as_they_reach_its_node():
    """A paused learner's node reads the swarm's records as they come (the real node's tape shows adoptions
    after its last step), so the steps it made since its last contribution are overwritten there, not at a
    next step that never comes; a node killed after its last step reads nothing more."""
    from sim.replay import LearnerTape

    pcfg = ProtocolConfig(sync_every=H, fragments=P, quorum=1)

    def steps(until: float) -> tuple:
        return tuple((k, T0 + 0.25 * (k - 1), T0 + 0.25 * k) for k in range(1, int(until / 0.25) + 1))

    def run(tail: LearnerTape) -> list[dict]:
        tapes = [tail, LearnerTape("busy", steps(20.0))]
        cfg = ReplayConfig(pcfg, tuple(SHARES), T0, T0 + 20.0, LINKS, 8.0, 1.0, (None,) * P)
        return Replay(cfg, tapes).run().records["idle"]

    last_end = T0 + 10.0
    idle = run(LearnerTape("idle", steps(10.0)))
    late = [r for r in idle if r["kind"] == "adopt" and r["t"] > last_end]
    assert late and all(r["step"] == 40 for r in late)  # adopted when the records came, on its last step
    assert {r["t"] for r in late} != {last_end}
    killed = run(LearnerTape("idle", steps(10.0), ((last_end + 1.0, float("inf")),), (last_end + 1.0,)))
    after = [r for r in killed if r["kind"] == "adopt" and r["t"] > last_end]
    assert after and all(r["t"] < last_end + 1.0 for r in after)  # until its node went out
