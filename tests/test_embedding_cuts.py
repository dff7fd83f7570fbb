"""A large token embedding cut by rows into fragments of its own (``protocol.fragments``): the plan, the
learner's views of the rows, and joining them back into the model's parameters."""

import pytest
import torch

from node.learner.learner import InnerConfig, Learner
from node.learner.task import TaskConfig, load_task
from protocol.config import ProtocolConfig
from protocol.errors import ConfigError
from protocol.fragments import FragmentPlan, plan_fragments, row_slice

# GPT-2 small's shape: a 50257 x 768 embedding, a third of the model, and 148 other tensors
GPT2 = {"wte": 50257 * 768, **{f"h{i}": 7_087_872 // 12 for i in range(12 * 12)}, "ln": 768, "wpe": 98304}


def _rows_covered(plan: FragmentPlan, name: str) -> list[tuple[int, int]]:
    return sorted(
        row_slice(n)[1:] for f in plan.fragments for n in f.names if row_slice(n) and n.startswith(name)
    )


def test_a_gpt2_sized_embedding_is_cut_by_rows_into_fragments_near_the_mean():
    plan = plan_fragments(GPT2, 24, 24, embedding="wte", embedding_rows=50257)
    cuts = [f for f in plan.fragments if f.is_embedding]
    assert len(plan.fragments) == 24 and len(cuts) == 7  # 38.6M of 124M over a mean of 5.2M
    assert [f.index for f in cuts] == list(range(7))
    rows = _rows_covered(plan, "wte")
    assert rows[0][0] == 0 and rows[-1][1] == 50257 and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    assert sum(f.numel for f in plan.fragments) == sum(GPT2.values())
    mean = sum(GPT2.values()) / 24
    assert max(f.numel for f in plan.fragments) < 1.25 * mean  # was 7.4x the mean as one fragment
    assert "wte" not in [n for f in plan.fragments for n in f.names]  # the whole tensor is in no fragment
    assert plan.sliced


def test_an_embedding_below_two_mean_shares_stays_whole_and_cuts_can_be_set():
    small = {"emb": 1000, "a": 500, "b": 400, "c": 300, "d": 300, "e": 200, "f": 100, "g": 90}
    plan = plan_fragments(small, 4, 8, embedding="emb", embedding_rows=10)
    assert plan.fragments[0].names == ("emb",) and not plan.sliced
    plan = plan_fragments(small, 4, 8, embedding="emb", embedding_rows=10, embedding_cuts=3)
    assert [f.names for f in plan.fragments[:3]] == [("emb[0:3]",), ("emb[3:6]",), ("emb[6:10]",)]
    assert [f.numel for f in plan.fragments[:3]] == [300, 300, 400]
    with pytest.raises(ConfigError, match="embedding_cuts=4 is invalid"):
        plan_fragments(small, 4, 8, embedding="emb", embedding_rows=10, embedding_cuts=4)
    with pytest.raises(ConfigError, match="embedding_cuts=-1"):
        ProtocolConfig(embedding_cuts=-1)


def test_a_row_view_writes_its_parameter_and_whole_joins_rows_in_order():
    w = torch.arange(12.0).reshape(6, 2)
    params = {"e": w, "x": torch.zeros(3)}
    view = FragmentPlan.tensor(params, "e[2:4]")
    view.add_(100)
    assert w[2:4].min() >= 100 and w[:2].max() < 100 and w[4:].max() < 100
    joined = FragmentPlan.whole({"e[3:6]": w[3:6].clone(), "e[0:3]": w[:3].clone(), "x": params["x"]})
    assert torch.equal(joined["e"], w) and joined["x"] is params["x"]
    with pytest.raises(KeyError, match="rows of e missing"):
        FragmentPlan.whole({"e[0:3]": w[:3], "e[4:6]": w[4:]})


def test_a_learner_measures_and_adopts_row_fragments_in_its_embedding():
    task = load_task(None, TaskConfig())
    lrn = Learner("m", task, ProtocolConfig(embedding_cuts=3), InnerConfig(), 10, seed=0)
    emb = lrn.params[task.embedding]
    cut = [f for f in lrn.plan.fragments if f.is_embedding]
    assert len(cut) == 3 and all(row_slice(f.names[0])[0] == task.embedding for f in cut)
    before = emb.detach().clone()
    lrn.train_step()
    # fragment 1's outer gradient is base - theta over its rows only
    name = cut[1].names[0]
    _, a, b = row_slice(name)
    delta = lrn.outer_gradient(1)[name]
    assert delta.shape == (b - a, emb.shape[1])
    assert torch.allclose(delta, before[a:b] - emb.detach()[a:b])
    # adopting a new global fragment 1 writes those rows and no others
    trained = emb.detach().clone()
    theta = {name: torch.full((b - a, emb.shape[1]), 0.5)}
    assert lrn.adopt(1, 1, theta, merged=[])
    assert torch.equal(emb.detach()[a:b], theta[name])
    assert torch.equal(emb.detach()[:a], trained[:a]) and torch.equal(emb.detach()[b:], trained[b:])
    assert lrn.base[1][name] is not None and lrn.base[1][name].shape == (b - a, emb.shape[1])
    # the global model, joined from every fragment's base, is a model's parameters again
    whole = lrn.plan.whole({n: t for base in lrn.base for n, t in base.items()})
    assert set(whole) == set(lrn.params) and torch.equal(whole[task.embedding][a:b], theta[name])


@pytest.mark.parametrize("name", ["gpt2", "tiny"])  # a tied head (transformers' GPT-2) and the built-in model
@pytest.mark.slow
def test_an_evaluation_reads_a_cut_embedding_from_its_cuts_without_joining_them(name, monkeypatch):
    from node.learner.evaluation import ParamsModel
    from node.learner.model import ModelConfig

    task = load_task(None, TaskConfig(model=ModelConfig(name=name, dim=32, layers=1, heads=2, seq_len=16)))
    model = task.new_model()
    params = {n: p.detach() for n, p in model.named_parameters()}
    emb = params[task.embedding]
    cut = {n: t for n, t in params.items() if n != task.embedding}
    edges = [0, emb.shape[0] // 3, emb.shape[0] // 2, emb.shape[0]]
    cut.update({f"{task.embedding}[{a}:{b}]": emb[a:b] for a, b in zip(edges, edges[1:])})
    ev = ParamsModel(task, model)
    want = ev.evaluate(params)

    def joined(*_):
        raise AssertionError("the cuts were joined into a whole tensor")

    monkeypatch.setattr("node.learner.evaluation.join_rows", joined)
    assert ev.evaluate(cut) == pytest.approx(want, rel=1e-6)
    assert ev.tensors() == [] and not any("forward" in vars(m) for m in ev.model.modules())
    assert ev.evaluate(params) == want  # nothing of the cut evaluation stays behind
