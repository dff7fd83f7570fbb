"""How a node catches up a fragment it is behind on: records while they bridge the gap cheaply, else one
snapshot (``node.swarm.catch_up.records_bridge``)."""

from dataclasses import replace

from node.swarm.catch_up import SNAPSHOT_BYTES_PER_PARAM, record_bytes_per_param, records_bridge
from protocol.config import ProtocolConfig


def test_records_while_they_weigh_less_than_a_snapshot():
    cfg = replace(ProtocolConfig(), history=16)  # int4 records, blocks of 64: 0.5625 bytes a parameter
    per = record_bytes_per_param(cfg.record_codec, cfg.codec_block)
    assert per == 0.5 + 4 / 64
    bridged = [g for g in range(0, 40) if records_bridge(g, cfg)]
    assert bridged == list(range(1, 15))  # 14 records (7.9 bytes a parameter) < a snapshot (8) < 15
    assert 14 * per < SNAPSHOT_BYTES_PER_PARAM <= 15 * per


def test_a_gap_past_the_peers_record_log_goes_to_a_snapshot():
    cfg = replace(ProtocolConfig(), history=4)
    assert records_bridge(4, cfg) and not records_bridge(5, cfg)


def test_fp32_records_bridge_one_round_only_and_no_gap_needs_nothing():
    cfg = replace(ProtocolConfig(), record_codec="fp32")
    assert [g for g in range(-2, 10) if records_bridge(g, cfg)] == [1]


def test_the_default_log_bridges_its_four_rounds():
    # four int4 records a fragment: 2.25 bytes a parameter kept, a quarter of what a snapshot weighs
    cfg = ProtocolConfig()
    assert [g for g in range(0, 40) if records_bridge(g, cfg)] == [1, 2, 3, 4]
