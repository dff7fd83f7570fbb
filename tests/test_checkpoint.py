"""Checkpoints on disk: atomic, verified, newest valid wins; exports load into a plain model."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from node.learner.model import ModelConfig, TinyGPT
from node.swarm.checkpoint import (
    CheckpointError,
    export_model,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)


def tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "global/0/w": torch.randn(64, 8, generator=g),
        "opt/step": torch.tensor([seed], dtype=torch.int64),
    }


def test_round_trip_and_keep(tmp_path):
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, tensors(step), {"rounds": [step]}, swarm="s1", keep=2)
    files = list_checkpoints(tmp_path)
    assert [f.name for f in files] == ["ckpt-0000000040.safetensors", "ckpt-0000000030.safetensors"]
    ck = load_latest(tmp_path, "s1")
    assert ck.step == 40 and ck.meta == {"rounds": [40]}
    torch.testing.assert_close(ck.tensors["global/0/w"], tensors(40)["global/0/w"])
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "garbage"])
def test_damaged_newest_falls_back_to_previous(tmp_path, damage):
    save_checkpoint(tmp_path, 1, tensors(1), {}, swarm="s1")
    newest = save_checkpoint(tmp_path, 2, tensors(2), {}, swarm="s1")
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "bitflip":
        data[-7] ^= 0x10  # inside the tensor payload, past the header
    else:
        data = bytearray(b"not a checkpoint at all")
    newest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=str(newest.name)):
        load_checkpoint(newest, "s1")
    ck = load_latest(tmp_path, "s1")
    assert ck is not None and ck.step == 1


def test_checkpoint_from_another_swarm_is_refused(tmp_path):
    p = save_checkpoint(tmp_path, 5, tensors(5), {}, swarm="other")
    with pytest.raises(CheckpointError, match="belongs to swarm 'other'"):
        load_checkpoint(p, "mine")
    assert load_latest(tmp_path, "mine") is None


def test_export_loads_into_a_plain_model(tmp_path):
    model = TinyGPT(ModelConfig(dim=32, layers=1, heads=2, seq_len=16))
    p = export_model(tmp_path / "model.safetensors", dict(model.named_parameters()))
    fresh = TinyGPT(ModelConfig(dim=32, layers=1, heads=2, seq_len=16))
    fresh.load_state_dict(load_file(str(p)))
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), n


def test_export_writes_from_the_tensors_a_file_safetensors_reads_with_its_metadata(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    params = {"b.half": torch.ones(5, dtype=torch.bfloat16), "a.cols": w[:, 1:3], "c.empty": torch.zeros(0)}
    p = export_model(tmp_path / "m.safetensors", params, {"model_hash": "abc"})
    got = load_file(str(p))
    assert set(got) == set(params) and all(torch.equal(got[k], params[k]) for k in params)
    with safe_open(str(p), "pt") as f:
        assert f.metadata() == {"model_hash": "abc"}
    assert [x.name for x in tmp_path.iterdir()] == ["m.safetensors"]  # no temporary file left
