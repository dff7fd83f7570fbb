"""The token cache (``node.learner.token_cache``): the same tokens as reading the corpus in memory, built by
worker processes once under a lock, resumed after an interruption, rebuilt when it no longer matches its
manifest, read by windows in a block-shuffled, disjoint, resumable order."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from node.learner import corpus as corpus_mod
from node.learner import sources, token_cache
from node.learner.corpus import ArrayStream, Corpus, Reader, ShardStream, read_tokens
from node.learner.token_cache import CacheSpec, open_cache
from node.learner.tokenize import Tokenizer, load_tokenizer
from protocol.errors import ConfigError
from tests.hf_util import docs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def many_units(monkeypatch):
    """Units of 4 KiB and no in-process shortcut: every build goes through worker processes."""
    monkeypatch.setattr(sources, "UNIT_BYTES", 4096)
    monkeypatch.setattr(token_cache, "SMALL_BYTES", 0)


def jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def stream_tokens(cache) -> np.ndarray:
    return ShardStream(cache).read(0, cache.tokens)


@pytest.mark.slow
def test_workers_write_the_tokens_the_in_memory_reader_reads(tmp_path, many_units):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = docs(60_000)
    data = tmp_path / "data"
    data.mkdir()
    jsonl(data / "a.jsonl", texts[::2])
    pq.write_table(pa.table({"text": texts[1::2]}), data / "b.parquet", row_group_size=50)
    (data / "c.txt").write_text("\n".join(texts[:40]))  # one document, cut into several units
    cache = open_cache(CacheSpec(str(data)), tmp_path / "cache", workers=2)
    assert cache.built and len(cache.shards) > 10 and cache.dtype == "uint16"
    want = read_tokens(str(data), Tokenizer())
    assert np.array_equal(stream_tokens(cache), want)
    # document boundaries: one per JSONL record and Parquet row, one for the whole text file
    idx = [np.fromfile(cache.folder / s["index"], dtype=np.uint64) for s in cache.manifest["shards"]]
    assert sum(len(i) for i in idx) == len(texts[::2]) + len(texts[1::2]) + 1
    assert [s["path"] for s in cache.manifest["sources"]] == [str(p) for p in sorted(data.iterdir())]
    again = open_cache(CacheSpec(str(data)), tmp_path / "cache")
    assert not again.built and again.shards == cache.shards


@pytest.mark.slow
def test_bpe_through_the_memo_is_the_library_s_tokens(tmp_path, many_units):
    pytest.importorskip("tokenizers")
    from tests.hf_util import make_inputs

    inputs = make_inputs(tmp_path / "in")
    tok = load_tokenizer(inputs["tokenizer"])
    assert tok._memo is not None  # a GPT-2 style byte-level BPE: the memo is used
    odd = [
        "Ünïcödé wörds 123 4567 ...!!",
        "  two  spaces\n\n\tand tabs  ",
        "it's we'll they'd",
        "x</s>y </s>",
    ]
    for text in odd + docs(5_000):
        assert tok.encode_texts([text])[0].tolist() == tok.tok.encode(text, add_special_tokens=False).ids, (
            text
        )
    cache = open_cache(CacheSpec(inputs["data"], inputs["tokenizer"]), tmp_path / "cache", workers=2)
    library = [
        np.append(tok.tok.encode(t, add_special_tokens=False).ids, tok.eos_id)
        for path in sources.shard_paths(inputs["data"])
        for t in sources.documents(path, "text", "text")
    ]
    assert np.array_equal(stream_tokens(cache), np.concatenate(library))


def test_an_interrupted_build_goes_on_from_its_last_whole_shard(tmp_path, many_units, caplog):
    data = jsonl(tmp_path / "c.jsonl", docs(80_000))
    spec = CacheSpec(str(data))
    seen: list[str] = []

    def stop_after_three(frac, detail):
        seen.append(detail)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        open_cache(spec, tmp_path / "cache", workers=2, progress=stop_after_three)
    folder = token_cache.folder_for(spec, [data], tmp_path / "cache")
    assert not (folder / "manifest.json").exists()
    journal = json.loads((folder / "build.json").read_text())
    total = journal["units"]
    assert len(journal["done"]) == 3 < total
    resumed: list[str] = []
    with caplog.at_level(logging.WARNING, logger="node.learner.token_cache"):
        cache = open_cache(spec, tmp_path / "cache", workers=2, progress=lambda f, d: resumed.append(d))
    assert f"resuming a build, 3 of {total} shards already whole" in caplog.text
    assert len(resumed) == total - 3  # only the shards not yet written
    assert np.array_equal(stream_tokens(cache), read_tokens(str(data), Tokenizer()))
    assert not (folder / "build.json").exists()


def test_a_cache_that_no_longer_matches_is_built_again_and_says_why(tmp_path, caplog):
    data = jsonl(tmp_path / "c.jsonl", docs(20_000))
    spec, root = CacheSpec(str(data)), tmp_path / "cache"
    cache = open_cache(spec, root)
    shard = cache.folder / cache.shards[0][0]

    def rebuilt(needle: str) -> None:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="node.learner.token_cache"):
            again = open_cache(spec, root)
        assert again.built and "is built again: " in caplog.text and needle in caplog.text
        assert np.array_equal(stream_tokens(again), read_tokens(str(data), Tokenizer()))

    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 2)
    rebuilt("cut short")
    (cache.folder / cache.shards[0][0]).unlink()
    rebuilt("is missing")
    (cache.folder / "manifest.json").write_text("{not json")
    rebuilt("manifest cannot be read")
    with open(data, "a") as fh:
        fh.write(json.dumps({"text": "one more document"}) + "\n")
    rebuilt("changed (")
    # the same content with a new mtime (a copy, a checkout): checked by hash, kept, not rebuilt
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert not open_cache(spec, root).built
    data.write_text(data.read_text().replace("a", "b"))  # same size, other content
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    rebuilt("content differs")


def test_a_damaged_shard_under_a_reader_is_an_error_naming_it(tmp_path):
    data = jsonl(tmp_path / "c.jsonl", docs(20_000))
    cache = open_cache(CacheSpec(str(data)), tmp_path / "cache")
    stream = ShardStream(cache)
    path = cache.folder / cache.shards[0][0]
    with open(path, "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(ConfigError, match="cut short") as e:
        stream.read(0, cache.tokens)
    assert str(path) in str(e.value)
    stream.close()


def test_one_process_builds_while_another_waits_for_it(tmp_path, caplog):
    data = jsonl(tmp_path / "c.jsonl", docs(20_000))
    spec, root = CacheSpec(str(data)), tmp_path / "cache"
    folder = token_cache.folder_for(spec, [data], root)
    folder.mkdir(parents=True)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"4242")
    got: list = []
    with caplog.at_level(logging.WARNING, logger="node.learner.token_cache"):
        t = threading.Thread(target=lambda: got.append(open_cache(spec, root)), daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while "waiting for pid 4242" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "waiting for pid 4242" in caplog.text and not got
        os.close(fd)  # the holder goes away without a manifest: the waiter builds it itself
        t.join(timeout=30)
    assert got and got[0].built


@pytest.mark.slow
def test_two_commands_started_together_build_the_cache_once(tmp_path):
    data = jsonl(tmp_path / "c.jsonl", docs(400_000))
    env = {**os.environ, "DDILOCO_CACHE": str(tmp_path / "dc")}
    cmd = [sys.executable, "-m", "node", "data", "prepare", "--data", str(data)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        outs.append(out)
    assert sum("built in" in o for o in outs) == 1 and sum("already built" in o for o in outs) == 1
    assert len(list((tmp_path / "dc" / "tokens").iterdir())) == 1


def test_data_prepare_refuses_bad_input_naming_it(tmp_path, capsys):
    from node.cli.main import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    assert main(["data", "prepare", "--data", str(bad), "--token-cache", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: no text field 'text'" in err
    assert main(["data", "prepare", "--data", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["data", "prepare", "--data", str(bad), "--workers", "-1"]) == 2
    assert "workers=-1 is invalid" in capsys.readouterr().err


def test_the_block_order_reads_a_block_at_a_time_every_window_once_disjoint_and_resumable(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(corpus_mod, "BLOCK_TOKENS", 64 * 8)  # blocks of 8 windows of 64 tokens
    tokens = np.arange(64 * 200 + 500) % 256
    c = Corpus(ArrayStream(tokens), 64, "test")
    n = c.n_windows
    lanes = [Reader(c, 4, k, 2, seed=3) for k in range(2)]
    assert lanes[0].n_blocks == -(-n // 8) > 1
    per_epoch = -(-n // 8)  # batches per lane that cover an epoch
    seen = [w for pos in range(per_epoch) for r in lanes for w in r.window_ids(pos) if w < n]
    assert sorted(seen) == list(range(n))  # every window once an epoch, across the lanes
    a = {w for pos in range(per_epoch) for w in lanes[0].window_ids(pos)}
    b = {w for pos in range(per_epoch) for w in lanes[1].window_ids(pos)}
    assert not a & b
    # locality: each run of 8 consecutive slots of the epoch lies in one block
    order = [lanes[pos * 8 % 2]._slot(0, pos) for pos in range(8 * (n // 8))]
    for k in range(0, len(order) - 8, 8):
        blocks = {w // 8 for w in order[k : k + 8]}
        assert len(blocks) <= 2  # a run may straddle the one short block
    # a reader made anew at a position reads what the first one read there
    fresh = Reader(c, 4, 1, 2, seed=3)
    assert fresh.window_ids(5) == lanes[1].window_ids(5)
    # one block: the order is the seeded permutation of every window (what it was before blocks)
    monkeypatch.setattr(corpus_mod, "BLOCK_TOKENS", 1 << 24)
    one = Reader(c, 4, 0, 1, seed=3)
    import torch

    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3 * 1_000_003))
    assert one.window_ids(0) == perm[:4].tolist()


def test_every_node_evaluates_on_the_same_split(tmp_path, many_units):
    data = jsonl(tmp_path / "c.jsonl", docs(40_000))
    built = open_cache(CacheSpec(str(data)), tmp_path / "cache", workers=2)
    read = open_cache(CacheSpec(str(data)), tmp_path / "cache")
    in_memory = Corpus(ArrayStream(read_tokens(str(data), Tokenizer())), 32, "m").eval_batches(4, 3)
    for cache in (built, read):
        got = Corpus(ShardStream(cache), 32, "c").eval_batches(4, 3)
        assert len(got) == len(in_memory) == 3
        for (x, y), (wx, wy) in zip(got, in_memory, strict=True):
            assert x.dtype == wx.dtype and x.equal(wx) and y.equal(wy)
