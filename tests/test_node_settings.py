"""Node settings refuse values they cannot run with, naming the setting."""

import pytest

from node.swarm.settings import NodeSettings
from protocol.errors import ConfigError


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"learner_nice": 20}, "learner_nice=20 is invalid"),
        ({"learner_nice": -1}, "learner_nice=-1 is invalid"),
        ({"agent_nice": 20}, "agent_nice=20 is invalid"),
        ({"eval_every_s": 0.0}, "eval_every_s=0.0 is invalid"),
        ({"malloc_mmap_mib": 33.0}, "malloc_mmap_mib=33.0 is invalid"),
        ({"malloc_mmap_mib": -0.5}, "malloc_mmap_mib=-0.5 is invalid"),
        ({"elect": "everyone"}, "elect='everyone' is invalid"),
    ],
)
def test_out_of_range_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        NodeSettings(**kwargs)


def test_the_defaults_are_valid():
    s = NodeSettings()
    assert s.learner_nice == 0 and s.agent_nice == 0 and s.eval_every_s > 0
    assert s.elect_workers  # a public swarm: only workers are elected


def test_elect_auto_elects_anyone_where_an_authority_certifies_synchronisers():
    certified = NodeSettings(authority="x", open_learners=True)
    assert not certified.elect_workers
    assert NodeSettings(authority="x", open_learners=True, elect="workers").elect_workers
    assert not NodeSettings(elect="anyone").elect_workers


def test_the_allocator_threshold_follows_the_model_unless_set():
    from node.common.heap import AUTO_MMAP_PARAMS, mmap_threshold

    assert NodeSettings().malloc_mmap_mib == -1
    assert mmap_threshold(-1, AUTO_MMAP_PARAMS) == 256 << 10  # a model of GPT-2 small's size
    assert mmap_threshold(-1, AUTO_MMAP_PARAMS - 1) == 0  # the default model: the C library's rule
    assert mmap_threshold(2, 10) == 2 << 20 and mmap_threshold(0, AUTO_MMAP_PARAMS) == 0


@pytest.mark.parametrize("kw", [{}, {"dim": 320, "layers": 8, "heads": 8, "seq_len": 256, "vocab": 300}])
def test_the_threshold_reads_the_models_size_without_making_its_weights(kw):
    from types import SimpleNamespace

    from node.cli.node_cmd import _model_numel
    from node.learner.model import ModelConfig, TinyGPT

    cfg = ModelConfig(**kw)
    assert _model_numel(SimpleNamespace(model=cfg), None) == sum(p.numel() for p in TinyGPT(cfg).parameters())
