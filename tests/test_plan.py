"""``ddiloco plan`` (``sim.plan``): its byte model is the node's codec's, its choices follow the link, the step
and the failures, and bad input is refused by name."""

import json
import math

import pytest
import torch

from node.cli.main import main
from node.cli.plan import hf_params
from protocol.codecs import encode_tensors, wire_bytes
from protocol.errors import ConfigError
from sim.plan import Site, baselines, plan, traffic


@pytest.mark.parametrize("codec", ["int4", "int8", "bf16", "fp32"])
def test_a_fragments_bytes_are_what_the_codec_puts_on_the_wire(codec):
    n = 64 * 300
    enc = encode_tensors({"w": torch.randn(n)}, codec, 64)
    t = traffic(Site(params=4 * n, learners=4, codec=codec, record_codec=codec), fragments=4, sync_every=16)
    assert t.contribution_B == wire_bytes(enc) == t.record_B
    # every fragment once in H steps, and a quarter of the rounds' records to the three others
    assert t.sent_per_step_B == pytest.approx(4 / 16 * (t.contribution_B + t.record_B * 3 / 4))


def test_the_link_carries_the_floor_and_a_public_swarms_audits_membership_and_headers_on_top():
    from sim.plan import DHT_STORE_B, HEADER_B, MEMBER_BASE_B, MEMBER_HEAD_B, MESSAGE_B

    site = Site(params=24 * 64 * 300, learners=4, step_s=0.5, heartbeat_s=2.0)
    private = traffic(site, fragments=24, sync_every=24)
    assert private.audit_B == 0
    # each other member gets this node's record every heartbeat: a quarter of one per 0.5 s step
    assert private.membership_B == pytest.approx(
        (MEMBER_BASE_B + 24 * MEMBER_HEAD_B + DHT_STORE_B) * 3 * 0.25
    )
    # a contribution and 3/4 of a record a step, each framed, with the packets' headers on top
    framed = private.sent_per_step_B + 1.75 * MESSAGE_B + private.membership_B
    assert private.link_per_step_B > framed + private.packets_per_step * HEADER_B
    # the full segments alone: at least one per 1,448 bytes, an acknowledgement for some of those received
    assert private.packets_per_step > private.sent_per_step_B / 1448 * 1.5
    public = traffic(Site(**{**site.__dict__, "audit": 1.0}), fragments=24, sync_every=24)
    # one auditor fetches each round's contributions but its own, each from the learner that sent it
    assert public.audit_B == pytest.approx(24 / 24 * public.contribution_B * 3 / 4)
    assert public.link_per_step_B > private.link_per_step_B + public.audit_B
    assert public.sent_per_step_B == private.sent_per_step_B  # the floor is the schedule's alone


def test_a_thinner_link_gets_a_longer_h_and_a_shorter_step_more_fragments():
    wide = plan(Site(params=1e9, learners=4, step_s=2.0, link_bps=10e9))
    thin = plan(Site(params=1e9, learners=4, step_s=2.0, link_bps=0.5e9))
    assert thin.sync_every > wide.sync_every
    assert thin.traffic.link_util <= 0.5 and wide.traffic.link_util <= 0.5
    slow = plan(Site(params=1e9, learners=4, step_s=4.0, link_bps=1e9))
    fast = plan(Site(params=1e9, learners=4, step_s=0.5, link_bps=1e9))
    assert fast.fragments > slow.fragments
    assert fast.traffic.round_s <= fast.overlap * 0.5
    assert any("round time" in b for b in fast.binding)


def test_failures_cost_goodput_and_the_largest_quorum_within_a_point_of_the_best_is_chosen():
    calm = plan(Site(params=1e8, learners=4, step_s=1.0, link_bps=10e9, seed=1))
    stormy = plan(Site(params=1e8, learners=4, step_s=1.0, link_bps=10e9, mtbf_s=600.0, seed=1))
    assert stormy.goodput < calm.goodput - 0.05  # each failure costs a restart of about a minute
    for p in (calm, stormy):
        best = max(p.goodput_by_quorum.values())
        assert p.goodput >= best - 0.01
        assert all(g < best - 0.01 for k, g in p.goodput_by_quorum.items() if k > p.quorum)
    fixed = plan(Site(params=1e8, learners=4, step_s=1.0, link_bps=10e9, mtbf_s=600.0, quorum=2))
    assert fixed.quorum == 2 and list(fixed.goodput_by_quorum) == [2]


def test_the_baselines_need_the_link_data_parallel_training_is_known_for():
    site = Site(params=12e9, learners=4, step_s=5.0, link_bps=2.5e9)
    p = plan(site)
    by = {b.system: b for b in baselines(site, p.sync_every)}
    # a ring all-reduce of 12B bf16 gradients over 4 sites: 2 * 3/4 * 24 GB a step
    assert by["dp-bf16"].sent_per_step_B == pytest.approx(36e9)
    assert by["dp-fp32"].needed_gbps == pytest.approx(2 * by["dp-bf16"].needed_gbps)
    assert by["dp-bf16"].blocked_share > 0.9
    # ours: under a gigabit a second, two orders of magnitude below data-parallel's
    assert p.needed_gbps < 1.0 and by["dp-bf16"].needed_gbps / p.needed_gbps > 50


def test_a_hugging_face_config_is_counted():
    import tempfile
    from pathlib import Path

    tiny_llama = {  # TinyLlama-1.1B: 1,100,048,384 parameters
        "hidden_size": 2048, "num_hidden_layers": 22, "vocab_size": 32000, "intermediate_size": 5632,
        "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False,
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(tiny_llama))
        assert hf_params(str(path)) == pytest.approx(1_100_048_384, rel=1e-3)
        path.write_text("{not json")
        with pytest.raises(ConfigError, match="hf-config"):
            hf_params(str(path))
        path.write_text(json.dumps({"hidden_size": 8}))
        with pytest.raises(ConfigError, match="num_hidden_layers"):
            hf_params(str(path))


def test_the_command_prints_a_plan_and_json(capsys, tmp_path):
    assert main(["plan", "--params", "12e9", "--learners", "4", "--link-gbps", "2.5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {
        "fragments",
        "sync_every",
        "overlap",
        "quorum",
        "grace",
        "traffic",
        "goodput",
        "baselines",
    } <= set(doc)
    assert doc["site"]["mtbf_s"] is None  # no failures: JSON has no inf
    assert 0 < doc["traffic"]["link_util"] <= 0.5
    assert main(["plan", "--params", "1e8", "--learners", "2", "--link-gbps", "10"]) == 0
    out = capsys.readouterr().out
    assert "schedule" in out and "sync-diloco" in out and "what binds" in out
    png = tmp_path / "plan.png"
    assert main(["plan", "--params", "1e8", "--learners", "2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["plan", "--params", "1e8", "--learners", "2", "--plot", str(tmp_path / "plan.svg")]) == 2


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--params", "12e9", "--learners", "0"], "learners"),
        (["--params", "-1", "--learners", "4"], "params"),
        (["--params", "12e9", "--learners", "4", "--link-gbps", "0"], "link_bps"),
        (["--params", "12e9", "--learners", "4", "--link-gbps", "nan"], "link_gbps"),
        (["--params", "12e9", "--learners", "4", "--codec", "int3"], "codec"),
        (["--params", "12e9", "--learners", "4", "--quorum", "5"], "quorum"),
        (["--params", "12e9", "--learners", "4", "--fragments", "64", "--sync-every", "16"], "fragments"),
        (["--hf-config", "/nonexistent/config.json", "--learners", "4"], "hf-config"),
        (["--params", "12e9", "--learners", "4", "--audit", "2"], "audit"),
        (["--params", "12e9", "--learners", "4", "--heartbeat-s", "0"], "heartbeat_s"),
    ],
)
def test_bad_input_is_refused_by_name(argv, named, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and "invalid" in err


def test_inf_failures_are_no_failures():
    p = plan(Site(params=1e8, learners=2, mtbf_s=math.inf))
    assert p.goodput > 0.9
