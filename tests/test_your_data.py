"""Your data: text, JSONL and Parquet shards read into one token stream; learners read disjoint windows,
and a restart from a checkpoint goes on at the recorded position, neither re-reading nor skipping."""

from __future__ import annotations

import json
import os

import pytest
import torch

from node.cli.main import main
from node.learner.corpus import read_tokens
from node.learner.learner import InnerConfig, Learner
from node.learner.task import load_task
from node.learner.tokenize import Tokenizer
from node.swarm.checkpoint import load_checkpoint, save_checkpoint
from protocol.config import ProtocolConfig
from protocol.errors import ConfigError
from tests.conftest import tiny_task_config
from tests.hf_util import docs

PCFG = ProtocolConfig(fragments=2, sync_every=4)
INNER = InnerConfig(lr=3e-3)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "corpus.txt"
    p.write_text("\n".join(docs(60_000)))
    return p


def learner(task, part, seed=1) -> Learner:
    return Learner("L", task, PCFG, INNER, 100, seed=seed, data_part=part)


def ids(lrn: Learner, n: int, start: int = 0) -> list[int]:
    return [i for pos in range(start, start + n) for i in lrn.reader.window_ids(pos)]


@pytest.mark.slow
def test_two_learners_read_disjoint_windows(text_file):
    task = load_task(None, tiny_task_config(data=str(text_file)))
    a, b = learner(task, (0, 2)), learner(task, (1, 2), seed=2)
    for lrn in (a, b):
        for _ in range(3):
            lrn.train_step()
        assert lrn.data_position() == 3  # one batch per step, from the reader
    seen_a, seen_b = ids(a, 3), ids(b, 3)
    assert len(set(seen_a)) == len(seen_a) and len(set(seen_b)) == len(seen_b)
    assert not set(seen_a) & set(seen_b)
    # the batch a learner trains on is the windows the reader names
    x, y = learner(task, (0, 2)).reader.next()
    want = torch.stack([task.corpus.window(i) for i in seen_a[: len(x)]])
    assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])
    # a node's learner unit splits its part again between its ranks: still disjoint from the other part
    lanes = []
    for rank in (0, 1):
        u = learner(task, (1, 2))
        u.use_lane(rank, 2)
        lanes.append(set(ids(u, 3)))
    assert not lanes[0] & lanes[1] and not (lanes[0] | lanes[1]) & set(ids(a, 6))


def test_a_restart_resumes_at_the_recorded_position(text_file, tmp_path):
    task = load_task(None, tiny_task_config(data=str(text_file)))
    first = learner(task, (0, 2))
    for _ in range(3):
        first.train_step()
    tensors, meta = first.state()
    path = save_checkpoint(tmp_path, 3, tensors, {"learner": meta}, swarm="s")
    ck = load_checkpoint(path, "s")
    again = learner(task, (0, 2))
    again.load_state(ck.tensors, ck.meta["learner"])
    assert again.data_position() == 3
    for _ in range(3):
        again.train_step()
    straight = learner(task, (0, 2))
    for _ in range(6):
        straight.train_step()
    # the same six batches in the same order: bitwise the same model as a run that never stopped
    for n, p in straight.params.items():
        assert torch.equal(p, again.params[n]), n
    seen = ids(again, 6)
    assert len(set(seen)) == len(seen) == 6 * task.cfg.batch_size  # no batch twice, none skipped


def test_text_jsonl_parquet_and_globs_give_the_same_tokens(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = docs(20_000)
    (tmp_path / "one.txt").write_text("".join(t + "\n" for t in texts[:1]))
    for k in range(2):
        part = texts[k::2]
        (tmp_path / f"s{k}.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in part))
        pq.write_table(pa.table({"content": part}), tmp_path / f"s{k}.parquet")
    tok = Tokenizer()
    jl = read_tokens(str(tmp_path / "*.jsonl"), tok, text_field="body")
    pqt = read_tokens(str(tmp_path / "*.parquet"), tok, text_column="content")
    assert (jl == pqt).all() and len(jl) == sum(len(t.encode()) + 1 for t in texts)
    one = read_tokens(str(tmp_path / "one.txt"), tok)
    assert bytes(one[:-1].astype("uint8").tolist()).decode() == texts[0] + "\n"


def bad_shard(tmp_path, name: str, content: bytes):
    d = tmp_path / "shards"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"text": "fine text " * 200}) + "\n")
    (d / name).write_bytes(content)
    return d, d / name


@pytest.mark.parametrize(
    "name,content,needle",
    [
        ("b.jsonl", b"", "the shard is empty"),
        ("b.jsonl", b'{"content": "x"}\n', "no text field 'text'"),
        ("b.jsonl", b"not json\n", "not a JSON object"),
        ("b.parquet", b"PAR1 this is not parquet", "not a readable Parquet file"),
        ("b.txt", b"\xff\xfe\x00bad", "not UTF-8 text"),
    ],
)
def test_a_bad_shard_is_refused_naming_the_file(tmp_path, capsys, name, content, needle):
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    folder, shard = bad_shard(tmp_path, name, content)
    with pytest.raises(ConfigError, match=needle) as e:
        load_task(None, tiny_task_config(data=str(folder)))
    assert str(shard) in str(e.value)
    # the CLI says so and starts nothing: no node, no state folder
    state = tmp_path / "state"
    assert main(["node", "--state-dir", str(state), "--data", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddiloco: error: ") and str(shard) in err and needle in err
    assert not state.exists()


def test_an_unreadable_shard_is_named(tmp_path):
    folder, shard = bad_shard(tmp_path, "b.txt", b"some text")
    shard.chmod(0)
    if os.access(shard, os.R_OK):
        pytest.skip("this user reads files of mode 0 (root)")
    with pytest.raises(ConfigError, match="cannot be read") as e:
        load_task(None, tiny_task_config(data=str(folder)))
    assert str(shard) in str(e.value)


def test_a_missing_data_path_and_a_bad_part_are_refused(tmp_path, capsys):
    assert main(["train-local", "--data", str(tmp_path / "nope"), "--tokens", "1"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["train-local", "--data-part", "2/2", "--tokens", "1"]) == 2
    assert "data_part='2/2' is invalid" in capsys.readouterr().err
