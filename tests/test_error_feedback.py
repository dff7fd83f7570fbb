"""Error feedback (``ProtocolConfig.feedback``): a learner's contributions of a fragment, decoded, add up to
its outer gradients less what it still owes, and what it owes stays one codec error however many rounds
pass; without feedback the codec's errors add up."""

from __future__ import annotations

import pytest
import torch

from node.learner.learner import InnerConfig, Learner
from protocol.codecs import decode_tensors
from protocol.config import ProtocolConfig


def _learner(tiny_task, codec: str, feedback: str = "auto") -> Learner:
    torch.manual_seed(0)
    pcfg = ProtocolConfig(fragments=2, sync_every=4, overlap=1, codec=codec, feedback=feedback)
    return Learner("a", tiny_task, pcfg, InnerConfig(), 100, seed=3)


def _rounds(lrn: Learner, p: int, rounds: int, snapshot: bool) -> tuple[dict, dict]:
    """Train a step and contribute p, ``rounds`` times, adopting nothing (the base stays): the sum of the
    outer gradients sent, and of the contributions as decoded."""
    sent: dict[str, torch.Tensor] = {}
    got: dict[str, torch.Tensor] = {}
    for _ in range(rounds):
        lrn.train_step()
        delta = lrn.outer_gradient(p)
        if snapshot:
            lrn.snapshot(p, "t")
            [(_, _, wire)] = lrn.ready_contributions()
        else:
            wire = lrn.contribution(p)
        for n, d in decode_tensors(wire).items():
            sent[n] = sent.get(n, 0) + delta[n]
            got[n] = got.get(n, 0) + d
    return sent, got


@pytest.mark.parametrize("snapshot", [False, True], ids=["contribution", "snapshot"])
def test_decoded_contributions_add_up_to_the_outer_gradients_less_the_residual(tiny_task, snapshot):
    lrn = _learner(tiny_task, "int2")
    assert lrn.pcfg.error_feedback
    sent, got = _rounds(lrn, 0, 6, snapshot)
    owed = decode_tensors(lrn.residual[0])  # kept in int8: its own error at most 1/254 of a block's largest
    for n in sent:
        bound = float(owed[n].abs().max()) / 254 * 6 + 1e-6  # six residuals held, each rounded once
        torch.testing.assert_close(got[n] + owed[n], sent[n], atol=bound, rtol=0)
    assert 1 not in lrn.residual  # only the fragment contributed


def test_what_is_owed_stays_one_codec_error_and_without_feedback_the_errors_add_up(tiny_task):
    def drift(feedback: str) -> float:
        lrn = _learner(tiny_task, "int2", feedback)
        sent, got = _rounds(lrn, 0, 8, snapshot=False)
        return sum(float((sent[n] - got[n]).square().sum()) for n in sent) ** 0.5

    with_fb, without = drift("on"), drift("off")
    assert with_fb < 0.5 * without, (with_fb, without)


def test_feedback_follows_the_codec_unless_set_and_a_rejoin_forgets_what_was_owed(tiny_task):
    assert not _learner(tiny_task, "int4").pcfg.error_feedback
    assert _learner(tiny_task, "int4", "on").pcfg.error_feedback
    assert not _learner(tiny_task, "int2", "off").pcfg.error_feedback
    lrn = _learner(tiny_task, "int4")
    _rounds(lrn, 0, 2, snapshot=False)
    assert lrn.residual == {}  # int4 keeps no residual: no memory spent
    lrn = _learner(tiny_task, "int2")
    _rounds(lrn, 1, 2, snapshot=False)
    assert set(lrn.residual) == {1}
    rounds = [c.base_round for c in lrn.book.counters]
    lrn.join(rounds, [dict(b) for b in lrn.base])
    assert lrn.residual == {}
