"""The in-process runner against oracles and under injected speeds and failures."""

from __future__ import annotations

import pytest
import torch

from node.common.events import EventLog
from node.learner.learner import InnerConfig, lr_lambda
from node.local.run_config import LearnerPlan, RunConfig
from node.local.runner import VirtualSwarm, run_system
from protocol.config import ProtocolConfig
from protocol.errors import ConfigError
from protocol.goodput import compute_goodput

INNER = InnerConfig(lr=3e-3)


def _run_plans(task, plans: tuple[LearnerPlan, ...], pcfg: ProtocolConfig, steps_each: int):
    """The runner with one learner per plan and a budget of ``steps_each`` steps' tokens per learner; its
    result and events."""
    ev = EventLog()
    n = len(plans)
    run = RunConfig(learners=n, token_budget=n * steps_each * task.tokens_per_batch, plans=plans)
    return run_system(task, run, pcfg, INNER, ev), ev


def handwritten_diloco(task, learners: int, h: int, rounds: int, total_steps: int, lr: float, mu: float):
    """Synchronous DiLoCo written out plainly: H AdamW steps each, mean outer gradient, Nesterov SGD."""
    models = [task.new_model() for _ in range(learners)]
    glob = task.new_model()
    momentum = {k: torch.zeros_like(v) for k, v in glob.named_parameters()}
    # the learner's AdamW kernel (fused): the comparison is of the schedule and the outer step, and the
    # foreach kernel rounds differently (4e-6 apart after a few rounds)
    opts = [
        torch.optim.AdamW(
            m.parameters(), lr=INNER.lr, betas=(0.9, 0.95), weight_decay=INNER.weight_decay, fused=True
        )
        for m in models
    ]
    gens = [torch.Generator().manual_seed(m + 1) for m in range(learners)]
    sched = lr_lambda(total_steps, INNER)
    step = 0
    history = []
    for _ in range(rounds):
        for _ in range(h):
            for m, model in enumerate(models):
                for g in opts[m].param_groups:
                    g["lr"] = INNER.lr * sched(step)
                loss = task.loss(model, task.batch(gens[m]))
                opts[m].zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), INNER.grad_clip)
                opts[m].step()
            step += 1
        with torch.no_grad():
            for name, gp in glob.named_parameters():
                grad = sum(gp - dict(m.named_parameters())[name] for m in models) / learners
                momentum[name] = mu * momentum[name] + grad  # Nesterov, as torch.optim.SGD(nesterov=True)
                gp -= lr * (grad + mu * momentum[name])
        for m in models:
            m.load_state_dict(glob.state_dict())
        history.append({k: v.detach().clone() for k, v in glob.named_parameters()})
    return history


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_sync_schedule_matches_handwritten_diloco_step_for_step(tiny_task, rounds):
    m, h = 2, 4
    per_learner_total = 3 * h  # fixes the lr schedule across the three runs
    pcfg = ProtocolConfig(
        fragments=1,
        sync_every=h,
        overlap=0,
        quorum=m,
        grace=False,
        merge="mean",
        codec="fp32",
        record_codec="fp32",
        clip_factor=0.0,
    )
    tokens = rounds * h * m * tiny_task.tokens_per_batch
    run = RunConfig(system="sync-diloco", learners=m, token_budget=tokens, eval_points=1)
    sw = VirtualSwarm(tiny_task, run, pcfg, INNER)
    for s in sw.slots:  # same schedule length as the oracle regardless of this run's budget
        s.learner.total_steps = per_learner_total
        s.learner._lr = lr_lambda(per_learner_total, INNER)
    sw.run()
    oracle = handwritten_diloco(
        tiny_task, m, h, rounds, per_learner_total, pcfg.outer_lr, pcfg.outer_momentum
    )
    got = sw.global_params()
    assert sw.replicas[0].round == rounds
    for k, v in oracle[-1].items():
        assert (got[k] - v).abs().max().item() <= 1e-6, k


@pytest.mark.slow
def test_decoupled_trains_and_all_fragments_merge(tiny_task):
    pcfg = ProtocolConfig(fragments=4, sync_every=8, overlap=2, quorum=1)
    events = EventLog()
    res = run_system(
        tiny_task,
        RunConfig(learners=3, token_budget=3 * 48 * tiny_task.tokens_per_batch),
        pcfg,
        INNER,
        events,
    )
    assert res.final_loss < res.evals[0][2] - 0.5  # it learned
    merged_fragments = {r["fragment"] for r in events.of("merge")}
    assert merged_fragments == {0, 1, 2, 3}
    assert 0.5 < res.goodput <= 1.0
    assert all(s["c_steps"] > 0 for s in events.of("contribute"))


@pytest.mark.slow
def test_k1_without_grace_merges_alone_and_grace_waits_for_stragglers(tiny_task):
    plans = (LearnerPlan(1.0), LearnerPlan(1.0), LearnerPlan(1 / 1.2, 0.1), LearnerPlan(1 / 1.2, 0.1))
    budget = 4 * 48 * tiny_task.tokens_per_batch
    sizes = {}
    for grace in (False, True):
        ev = EventLog()
        pcfg = ProtocolConfig(fragments=2, sync_every=8, overlap=4, quorum=1, grace=grace)
        run_system(tiny_task, RunConfig(learners=4, token_budget=budget, plans=plans), pcfg, INNER, ev)
        sizes[grace] = sum(len(r["cids"]) for r in ev.of("merge")) / len(ev.of("merge"))
    assert sizes[True] > sizes[False]


@pytest.mark.slow
def test_learner_down_does_not_stop_the_others_and_rejoins(tiny_task):
    plans = (LearnerPlan(), LearnerPlan(), LearnerPlan(down=((5.0, 20.0),)))
    pcfg = ProtocolConfig(fragments=2, sync_every=4, overlap=1, quorum=3)
    res, ev = _run_plans(tiny_task, plans, pcfg, 40)
    # K=3 but only two live learners while L2 is down: quorum follows the live set, merges go on
    during = [r for r in ev.of("merge") if 5.0 < r["t"] < 20.0]
    assert during and all("L2" not in r["learners"] for r in during)
    assert any(r["t"] > 20.0 and "L2" in r["learners"] for r in ev.of("merge"))  # it rejoined and counts
    g = compute_goodput(ev.records)
    assert g.down_s >= 15.0 and res.goodput < 1.0


@pytest.mark.slow
def test_a_learner_that_starts_late_joins_from_the_global_model(tiny_task):
    """``LearnerPlan.start_s``: as the launcher starts nodes one after another, the runner starts a learner
    late; until then the others merge without it, then it downloads the global model and trains."""
    plans = (LearnerPlan(), LearnerPlan(), LearnerPlan(start_s=12.0))
    pcfg = ProtocolConfig(fragments=2, sync_every=4, overlap=1, quorum=3)
    _, ev = _run_plans(tiny_task, plans, pcfg, 40)
    steps = [r for r in ev.of("step") if r["learner"] == "L2"]
    assert steps and min(r["t0"] for r in steps) >= 12.0
    assert min(r["t0"] for r in ev.of("step") if r["learner"] == "L0") == 0.0
    early = [r for r in ev.of("merge") if r["t"] < 12.0]
    assert early and all("L2" not in r["learners"] for r in early)  # K = 3 follows the live set
    assert any("L2" in r["learners"] for r in ev.of("merge"))


@pytest.mark.slow
def test_a_learner_started_before_the_first_merge_is_in_the_first_round_of_sync_diloco(tiny_task):
    """As on the nodes (the launcher starts them seconds apart, before any round merged), a learner that
    starts before the swarm's first merge has nothing to download and is a member from its start: the first
    round of synchronous DiLoCo (K = M) waits for it, and the learners stay in one rhythm. (It was left out
    of round 1 and sent round 2 a contribution from round 0, then waited a round for it.) After its first
    step it takes the swarm's step number, as a node does (``_align_schedule``), so it sends with the others
    the steps it made: 3, started 1.5 steps late."""
    plans = (LearnerPlan(), LearnerPlan(), LearnerPlan(start_s=1.5))
    ev = EventLog()
    pcfg = ProtocolConfig(fragments=2, sync_every=4, overlap=1)
    run_system(
        tiny_task,
        RunConfig(
            system="sync-diloco", learners=3, token_budget=3 * 16 * tiny_task.tokens_per_batch, plans=plans
        ),
        pcfg,
        INNER,
        ev,
    )
    merges = sorted(ev.of("merge"), key=lambda r: r["round"])
    assert merges and all(sorted(r["learners"]) == ["L0", "L1", "L2"] for r in merges), merges
    steps = {r["cid"]: r["step"] for r in ev.of("contribute")}
    first = {c.split(":")[0]: steps[c] for c in merges[0]["cids"]}
    assert first == {"L0": 4, "L1": 4, "L2": 3}, first
    aligned = [r for r in ev.of("align") if r["learner"] == "L2"]
    assert [(r["before"], r["after"]) for r in aligned] == [(1, 2)], aligned


@pytest.mark.parametrize("system", ["dp", "streaming", "sync-diloco"])
@pytest.mark.slow
def test_baselines_run_and_learn(tiny_task, system):
    pcfg = ProtocolConfig(fragments=2, sync_every=4, overlap=1)
    res = run_system(
        tiny_task,
        RunConfig(system=system, learners=2, token_budget=2 * 24 * tiny_task.tokens_per_batch),
        pcfg,
        INNER,
    )
    assert res.final_loss < res.evals[0][2]
    assert res.merges > 0 and 0 < res.goodput <= 1.0


@pytest.mark.parametrize(
    "system,p,h,steps,down",
    [
        ("streaming", 4, 8, 100, (25.0, 50.0)),
        ("sync-diloco", 4, 8, 100, (25.0, 50.0)),
        ("streaming", 8, 24, 120, (30.0, 60.0)),  # deadlocked before rejoiners were waited for per fragment
    ],
)
@pytest.mark.slow
def test_blocking_systems_survive_a_learner_down_and_back(tiny_task, system, p, h, steps, down):
    # A returning learner must come back in phase with the swarm's fragment schedule; otherwise learners
    # that wait for each other's fragments deadlock (found by bench/quality.py's one-down scenario).
    plans = (LearnerPlan(),) * 3 + (LearnerPlan(down=(down,)),)
    ev = EventLog()
    pcfg = ProtocolConfig(fragments=p, sync_every=h, overlap=2)
    res = run_system(
        tiny_task,
        RunConfig(
            system=system, learners=4, token_budget=4 * steps * tiny_task.tokens_per_batch, plans=plans
        ),
        pcfg,
        INNER,
        ev,
    )
    assert res.tokens >= 4 * steps * tiny_task.tokens_per_batch
    assert any(any(c.startswith("L3:") for c in r["cids"]) for r in ev.of("merge") if r["t"] > down[1])
    cids = [r["cid"] for r in ev.of("contribute")]
    assert len(cids) == len(set(cids))  # contribution ids stay unique across the rejoin


def test_a_learner_that_starts_late_contributes_each_fragment_with_the_others(tiny_task):
    """Before a fragment's first record its round takes the stagger's slot from another fragment's clock
    (``protocol.schedule.swarm_clocks``), so a learner that starts while the swarm is starting sends each
    fragment when the others do, not at its own step count (where that round, merged without it, would
    overwrite its steps). Its first step takes nothing (its schedule is put in phase with the others' after
    it, as a node's is): a round of its one step, merged alone, would overwrite the others' work."""
    plans = (LearnerPlan(), LearnerPlan(), LearnerPlan(start_s=3.0))
    pcfg = ProtocolConfig(fragments=8, sync_every=8, overlap=1)
    _, ev = _run_plans(tiny_task, plans, pcfg, 24)
    start = min(r["t0"] for r in ev.of("step") if r["learner"] == "L2")
    firsts = [r for r in ev.of("merge") if r["round"] == 1 and r["t"] > start + 2.0]
    assert len(firsts) >= 3  # fragments whose first round came after L2's second step
    assert all(sorted(r["learners"]) == ["L0", "L1", "L2"] for r in firsts), firsts
    l2 = sorted((r["t"], r["step"]) for r in ev.of("contribute") if r["learner"] == "L2")
    assert l2[0][1] == 2, l2  # nothing from its first step
    end = max(r["t1"] for r in ev.of("step"))  # after it, the budget spent, stragglers merge alone
    alone = [r for r in ev.of("merge") if r["t"] <= end and set(r["learners"]) == {"L2"}]
    assert not alone, alone


@pytest.mark.parametrize("system", ["dp", "decoupled"])
def test_evaluates_at_the_token_counts_given(tiny_task, system):
    """``eval_tokens`` (bench.parity reads the runner at the real nodes' evaluation points): one eval
    at the first step that reaches each count, the budget's last, none elsewhere."""
    per = tiny_task.tokens_per_batch
    budget = 2 * 20 * per
    wanted = (5 * per, 17 * per, 31 * per)
    pcfg = ProtocolConfig(fragments=2, sync_every=4, overlap=1)
    run = RunConfig(system=system, learners=2, token_budget=budget, eval_tokens=wanted + (10**9,))
    res = run_system(tiny_task, run, pcfg, INNER)
    at = [n for n, _, _ in res.evals]
    assert at[0] == 0 and at[-1] == budget and len(at) == len(wanted) + 2, at
    for n, want in zip(at[1:-1], wanted):
        assert want <= n < want + 2 * per, (at, wanted)  # two learners step per round of the clock


def test_eval_tokens_must_be_positive():
    with pytest.raises(ConfigError, match="eval_tokens"):
        RunConfig(eval_tokens=(100, 0))


def test_a_learners_first_steps_take_the_times_its_plan_gives(tiny_task):
    """``LearnerPlan.first_steps_s`` (bench.parity: a node's steps while the other nodes were still starting
    on the same host): the learner's first steps take those times, then its speed and jitter apply."""
    plans = (LearnerPlan(first_steps_s=(4.5, 7.0)), LearnerPlan())
    pcfg = ProtocolConfig(fragments=2, sync_every=4, overlap=1)
    _, ev = _run_plans(tiny_task, plans, pcfg, 12)
    l0 = [r["t1"] - r["t0"] for r in ev.of("step") if r["learner"] == "L0"]
    assert l0[:3] == pytest.approx([4.5, 7.0, 1.0]), l0
    assert all(r["t1"] - r["t0"] == pytest.approx(1.0) for r in ev.of("step") if r["learner"] == "L1")
