"""A damaged or foreign newest checkpoint is skipped with a logged reason naming the file and the cause, and
the previous valid checkpoint loads with exactly what was saved (docs/design.md, section 6)."""

from __future__ import annotations

import json
import logging
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from node.swarm.checkpoint import CheckpointError, load_checkpoint, load_latest, save_checkpoint

SWARM = "s1"


def tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "global/0/w": torch.randn(16, 8, generator=g),
        "opt/exp_avg": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "opt/step": torch.tensor([step], dtype=torch.int64),
    }


def meta(step: int) -> dict:
    return {"rounds": [step, step + 1], "merged_tokens": [step * 1000]}


@pytest.fixture
def folder(tmp_path):
    save_checkpoint(tmp_path, 1, tensors(1), meta(1), swarm=SWARM)
    save_checkpoint(tmp_path, 2, tensors(2), meta(2), swarm=SWARM)
    return tmp_path


def newest(folder):
    return folder / "ckpt-0000000002.safetensors"


def header_len(raw: bytes) -> int:
    return 8 + struct.unpack("<Q", raw[:8])[0]


def assert_previous_is_used(folder, caplog, cause: str) -> None:
    """load_latest skips the newest with a warning that names it and ``cause``, and returns step 1 intact."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="node.swarm.checkpoint"):
        ck = load_latest(folder, SWARM)
    assert ck is not None and ck.step == 1 and ck.meta == meta(1)
    want = tensors(1)
    assert set(ck.tensors) == set(want)
    for k, t in want.items():
        assert ck.tensors[k].dtype == t.dtype and torch.equal(ck.tensors[k], t), k
    reasons = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(reasons) == 1, reasons
    assert newest(folder).name in reasons[0] and cause in reasons[0], reasons[0]


def test_intact_newest_loads_exactly(folder):
    ck = load_latest(folder, SWARM)
    assert ck.step == 2 and ck.meta == meta(2)
    assert all(torch.equal(ck.tensors[k], t) for k, t in tensors(2).items())


def test_truncated_newest_at_every_kind_of_point_falls_back(folder, caplog):
    good = newest(folder).read_bytes()
    h = header_len(good)
    for cut in (0, 1, 7, 8, 9, h // 2, h - 1, h, h + 1, (h + len(good)) // 2, len(good) - 1):
        newest(folder).write_bytes(good[:cut])
        assert_previous_is_used(folder, caplog, "unreadable or truncated")


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_bit_flip_in_tensor_data_falls_back(folder, caplog, where):
    good = newest(folder).read_bytes()
    h = header_len(good)
    i = {"first": h, "middle": (h + len(good)) // 2, "last": len(good) - 1}[where]
    bad = bytearray(good)
    bad[i] ^= 0x04
    newest(folder).write_bytes(bytes(bad))
    assert_previous_is_used(folder, caplog, "tensor data does not match its recorded SHA-256")


def test_bit_flip_in_a_json_number_falls_back(folder, caplog):
    # "step": 2 -> "step": 3 is still valid JSON of the right shape: only the document's own SHA-256 sees it
    good = newest(folder).read_bytes()
    i = good.index(b'\\"step\\": 2') + len(b'\\"step\\": ')
    bad = bytearray(good)
    bad[i] ^= 0x01
    assert bytes(bad[i : i + 1]) == b"3"
    newest(folder).write_bytes(bytes(bad))
    assert_previous_is_used(folder, caplog, "metadata does not match its recorded SHA-256")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_single_bit_flip_in_the_header_falls_back(folder, caplog, data):
    good = newest(folder).read_bytes()
    i = data.draw(st.integers(0, header_len(good) - 1), label="byte")
    bit = data.draw(st.integers(0, 7), label="bit")
    bad = bytearray(good)
    bad[i] ^= 1 << bit
    newest(folder).write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match=newest(folder).name):
        load_checkpoint(newest(folder), SWARM)
    assert_previous_is_used(folder, caplog, "")
    newest(folder).write_bytes(good)


def test_valid_checkpoint_of_another_swarm_as_newest_falls_back(folder, caplog):
    save_checkpoint(folder, 2, tensors(2), meta(2), swarm="someone-else")
    assert_previous_is_used(folder, caplog, "belongs to swarm 'someone-else', not 's1'")


def test_checkpoint_of_the_previous_format_is_refused_by_name(folder, caplog):
    doc = {"format": "ddiloco-checkpoint/1", "swarm": SWARM, "step": 2, "tensors_sha256": "", "meta": {}}
    save_file(tensors(2), str(newest(folder)), metadata={"ddiloco": json.dumps(doc)})
    assert_previous_is_used(folder, caplog, "format 'ddiloco-checkpoint/1', expected 'ddiloco-checkpoint/2'")


@pytest.mark.parametrize(
    "doc, cause",
    [
        ("[1, 2]", "not an object"),
        ("[" * 5000 + "]" * 5000, "no ddiloco metadata"),
        ('{"format": "ddiloco-checkpoint/2"}', "metadata does not match its recorded SHA-256"),
    ],
)
def test_malformed_document_is_refused_not_crashed_on(folder, caplog, doc, cause):
    save_file(tensors(2), str(newest(folder)), metadata={"ddiloco": doc})
    assert_previous_is_used(folder, caplog, cause)


def test_no_valid_checkpoint_at_all_gives_none_with_a_reason_per_file(folder, caplog):
    for p in folder.glob("ckpt-*.safetensors"):
        p.write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="node.swarm.checkpoint"):
        assert load_latest(folder, SWARM) is None
    assert len([r for r in caplog.records if "skipping checkpoint" in r.getMessage()]) == 2
