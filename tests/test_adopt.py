"""How a learner takes a merged fragment: replacing its copy, or (``rebase``) adding the global change when
the merge holds only other learners' work."""

from __future__ import annotations

import pytest
import torch

from node.learner import InnerConfig, Learner
from protocol.config import ProtocolConfig


def _learner(tiny_task, rebase: bool) -> Learner:
    pcfg = ProtocolConfig(fragments=2, sync_every=4, rebase=rebase)
    lrn = Learner("a", tiny_task, pcfg, InnerConfig(), total_steps=100, seed=0, device=torch.device("cpu"))
    for _ in range(3):
        lrn.train_step()
    return lrn


def _shifted(lrn: Learner, p: int, by: float) -> dict[str, torch.Tensor]:
    return {n: t + by for n, t in lrn.base[p].items()}


@pytest.mark.parametrize("rebase", [False, True])
def test_a_merge_holding_own_work_replaces_the_fragment(tiny_task, rebase):
    lrn = _learner(tiny_task, rebase)
    theta = _shifted(lrn, 0, 0.5)
    assert lrn.adopt(0, 1, theta, own=True)
    for n, t in theta.items():
        assert torch.equal(lrn.params[n].detach(), t)
    c = lrn.book.counters[0]
    assert (c.base_round, c.c_steps) == (1, 0)
    assert all(torch.allclose(lrn.outer_gradient(0)[n], torch.zeros_like(t)) for n, t in theta.items())


def test_rebase_keeps_local_progress_across_a_merge_of_others(tiny_task):
    lrn = _learner(tiny_task, rebase=True)
    before = lrn.outer_gradient(0)  # base - theta: the progress made since the fragment was last received
    local = {n: lrn.params[n].detach().clone() for n in before}
    theta = _shifted(lrn, 0, 0.25)  # the global moved by +0.25 without us
    assert lrn.adopt(0, 1, theta, own=False)
    for n in before:
        assert torch.allclose(lrn.params[n].detach(), local[n] + 0.25, atol=1e-6)
        assert torch.allclose(lrn.outer_gradient(0)[n], before[n], atol=1e-6)  # the same progress, new base
    c = lrn.book.counters[0]
    assert (c.base_round, c.c_steps) == (1, 3)  # still counting the steps whose progress it holds
    assert not lrn.adopt(0, 1, theta, own=False)  # not newer than what it holds: ignored


def test_without_rebase_a_merge_of_others_overwrites_local_progress(tiny_task):
    lrn = _learner(tiny_task, rebase=False)
    theta = _shifted(lrn, 0, 0.25)
    assert lrn.adopt(0, 1, theta, own=False)
    for n, t in theta.items():
        assert torch.equal(lrn.params[n].detach(), t)
    assert lrn.book.counters[0].c_steps == 0
