"""Corpora bigger than memory: the token cache against today's reader, the cache's format against
the alternatives, and nodes reading a large cache against nodes on a 2 MB corpus.

Steps (each printed as it finishes; ``--json`` prints everything at the end as one object):

  make      a generated JSONL corpus of ``--mb`` MB (an invented language of 50,000 Zipf-distributed words,
            2,000-character documents) and an 8,000-token byte-level BPE trained on it, in ``--work``;
  reader    the single-thread rate of the reader the cache replaces (each document through ``tokenizers``'
            ``encode``, joined into int64), on the corpus's first ``--sample-mb`` MB;
  memo      the tokenizer's pre-token memo against the library's ``encode``, one thread, 4,000 documents;
  prepare   ``ddiloco data prepare`` on the whole corpus, interrupted (SIGINT) once ``--stop-at`` of its
            shards are written, then run again to the end: its rate over both runs' wall time, against the
            reader's, and how many shards the second run found whole;
  formats   random windows of 129 tokens by pread of the cache's uint16 files, by a numpy memory map of them,
            and from a memory-mapped Arrow IPC file (as ``datasets`` keeps): windows a second, and RSS growth
            after reading every window of the first 512 MB once;
  cold      batches of 16 windows read with the page cache dropped (root only), in block order and in one
            random order over the whole corpus (a corpus larger than RAM is always read cold);
  node85    one node at GPT-2 small's shape (--dim 768 --layers 12 --heads 12 --seq-len 128 --batch-size 2,
            the tokenizer's 8,000-token vocabulary: 97M parameters) on the cache, then on the 2 MB corpus;
  nodes     ``ddiloco up --nodes 3`` for ``--seconds`` on the cache, then on a 2 MB corpus of the same
            language: each node's peak RSS and seconds from process start to first step.

    .venv/bin/python bench/corpus.py --mb 2000                  # the issue's 2 GB corpus (about 12 minutes)
    .venv/bin/python bench/corpus.py --mb 200 --steps reader,prepare,formats
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.corpus_reads import cold_reads, formats  # noqa: E402
from bench.scale import _status  # noqa: E402


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_corpus(work: Path, mb: int) -> tuple[Path, Path]:
    corpus, tok_path = work / f"corpus-{mb}mb.jsonl", work / "tokenizer.json"
    words = None
    if not corpus.exists():
        rng = np.random.default_rng(0)
        letters = np.array(list("etaoinshrdlucmfwypvbgkqjxz"))
        lp = 1 / np.arange(1, 27) ** 0.9
        lens = rng.integers(2, 11, size=50_000)
        chars = rng.choice(letters, size=int(lens.sum()), p=lp / lp.sum())
        ends = np.cumsum(lens)
        words = np.array(["".join(chars[e - n : e]) for e, n in zip(ends, lens, strict=True)])
        p = 1 / np.arange(1, len(words) + 1) ** 1.05
        p /= p.sum()
        tmp = corpus.with_suffix(".tmp")
        size, target, t0 = 0, mb * 1_000_000, time.monotonic()
        with open(tmp, "w") as fh:
            while size < target:
                text = " ".join(words[rng.choice(len(words), size=400_000, p=p)])
                lines = "".join(
                    json.dumps({"text": text[k : k + 2000]}) + "\n" for k in range(0, len(text), 2000)
                )
                fh.write(lines)
                size += len(lines)
                if size // 100_000_000 != (size - len(lines)) // 100_000_000:
                    say(
                        f"make      {size / 1e6:7.0f} of {target / 1e6:.0f} MB  {time.monotonic() - t0:5.0f}s"
                    )
        os.replace(tmp, corpus)
    if not tok_path.exists():
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        with open(corpus) as fh:
            sample = [json.loads(next(fh))["text"] for _ in range(5000)]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=8000,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(sample, trainer)
        tok.save(str(tok_path))
    return corpus, tok_path


def reader_rate(corpus: Path, tok_path: Path, sample_mb: float) -> dict:
    """Today's reader, one document at a time through the library, on the first ``sample_mb`` MB."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id("<|endoftext|>")
    t0, size, parts = time.perf_counter(), 0, []
    with open(corpus, encoding="utf-8") as fh:
        for line in fh:
            size += len(line.encode())
            ids = np.asarray(
                tok.encode(json.loads(line)["text"], add_special_tokens=False).ids, dtype=np.int64
            )
            parts.append(np.append(ids, eos))
            if size >= sample_mb * 1e6:
                break
    tokens = np.concatenate(parts)
    dt = time.perf_counter() - t0
    return {"sample_mb": size / 1e6, "seconds": dt, "mb_per_s": size / 1e6 / dt, "tokens": len(tokens)}


def memo_rate(corpus: Path, tok_path: Path, n_docs: int = 4000) -> dict:
    """The pre-token memo (``FileTokenizer.encode_texts``) against the library's ``encode`` a document at a
    time, one thread, on the corpus's first ``n_docs`` documents; the ids must be the same."""
    from node.learner.tokenize import FileTokenizer

    tok = FileTokenizer(str(tok_path))
    with open(corpus) as fh:
        texts = [json.loads(next(fh))["text"] for _ in range(n_docs)]
    t0 = time.perf_counter()
    lib = [tok.tok.encode(t, add_special_tokens=False).ids for t in texts]
    t_lib = time.perf_counter() - t0
    t0 = time.perf_counter()
    memo = tok.encode_texts(texts)
    t_memo = time.perf_counter() - t0
    same = all(m.tolist() == x for m, x in zip(memo, lib, strict=True))
    return {"library_s": t_lib, "memo_s": t_memo, "x_library": t_lib / t_memo, "same_ids": same}


def prepare(corpus: Path, tok_path: Path, cache: Path, stop_at: float) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "node",
        "data",
        "prepare",
        "--data",
        str(corpus),
        "--tokenizer",
        str(tok_path),
    ]
    cmd += ["--token-cache", str(cache)]
    walls, outs = [], []
    t0 = time.monotonic()
    # SIGINT as a terminal's Ctrl+C sends it; restored to its default, since a shell starts a background job
    # with SIGINT ignored and the child would inherit that and never see the interruption
    first = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    journal = None
    while first.poll() is None:
        time.sleep(0.5)
        journal = journal or next(iter(cache.glob("*/build.json")), None)
        try:
            doc = json.loads(journal.read_text()) if journal else None
        except (OSError, ValueError):
            doc = None
        if doc and len(doc["done"]) >= stop_at * doc["units"]:
            first.send_signal(signal.SIGINT)
            break
    out1, err1 = first.communicate(timeout=120)
    walls.append(time.monotonic() - t0)
    interrupted_at = len(json.loads(journal.read_text())["done"]) if journal and journal.exists() else None
    say(
        f"prepare   interrupted after {walls[0]:.1f} s with {interrupted_at} shards whole (exit {first.returncode})"
    )
    t1 = time.monotonic()
    second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=7200)
    walls.append(time.monotonic() - t1)
    outs.append(second.stdout)
    if second.returncode != 0:
        raise RuntimeError(f"data prepare failed: {second.stderr[-2000:]}")
    resumed = next((ln for ln in second.stderr.splitlines() if "resuming a build" in ln), "")
    folder = next(p for p in cache.iterdir() if p.is_dir())
    manifest = json.loads((folder / "manifest.json").read_text())
    disk = sum(p.stat().st_size for p in folder.iterdir())
    mb = corpus.stat().st_size / 1e6
    return {
        "source_mb": mb,
        "walls_s": [round(w, 1) for w in walls],
        "mb_per_s": mb / sum(walls),
        "interrupted_exit": first.returncode,
        "resumed": resumed.split("token cache ")[-1] if resumed else "",
        "tokens": manifest["tokens"],
        "shards": len(manifest["shards"]),
        "disk_mb": disk / 1e6,
        "folder": str(folder),
    }


def _node_status(state: Path) -> dict | None:
    """The status document of the node in state folder ``state``, or None while it is not up."""
    ready = state / "ready.json"
    try:
        return _status(json.loads(ready.read_text())["status_url"]) if ready.exists() else None
    except (OSError, ValueError, KeyError):
        return None


def _events(state: Path) -> tuple[list[dict], float]:
    """A node's event records and the seconds from its process start to its first step."""
    events = [json.loads(x) for x in (state / "events.jsonl").read_text().splitlines() if x]
    join = next(e for e in events if e["kind"] == "join")
    step = next(e for e in events if e["kind"] == "step")
    return events, step["t1"] - (join["t"] - join["startup"]["state"])


def nodes(flags: str, seconds: float, label: str) -> list[dict]:
    """``ddiloco up --nodes 3`` with ``flags``; per node the peak RSS seen and seconds to the first step."""
    run = Path(tempfile.mkdtemp(prefix="ddiloco-corpus-up-"))
    cmd = [
        sys.executable,
        "-m",
        "node",
        "up",
        "--nodes",
        "3",
        "--duration",
        str(seconds),
        "--json",
        "--quiet",
    ]
    cmd += ["--run-dir", str(run), "--node-flags", flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak: dict[int, int] = {}
    while proc.poll() is None:
        for i in range(3):
            doc = _node_status(run / f"node-{i}")
            if doc:
                peak[i] = max(peak.get(i, 0), doc["memory"]["rss"] or 0)
        time.sleep(1.0)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: ddiloco up exited {proc.returncode}: {err[-2000:]}")
    rows = []
    for i in range(3):
        first_step_s = _events(run / f"node-{i}")[1]
        rows.append(
            {"corpus": label, "node": i, "rss_mb": peak.get(i, 0) / 1e6, "first_step_s": first_step_s}
        )
    shutil.rmtree(run, ignore_errors=True)
    return rows


SHAPE_85M = ["--dim", "768", "--layers", "12", "--heads", "12", "--seq-len", "128", "--batch-size", "2"]


def one_node(flags: list[str], seconds: float, label: str) -> dict:
    """One node at GPT-2 small's shape (``SHAPE_85M``, ``--threads 2``) with ``flags``, ``seconds`` after its
    first step: the largest RSS seen at 2 s polls, seconds to the first step, the median step."""
    state = Path(tempfile.mkdtemp(prefix="ddiloco-corpus-node-"))
    cmd = [
        sys.executable,
        "-m",
        "node",
        "node",
        "--state-dir",
        str(state),
        "--threads",
        "2",
        *SHAPE_85M,
        *flags,
    ]
    log = open(state / "node.log", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0, peak, first, last = time.time(), 0, None, None
    try:
        while time.time() - t0 < seconds + 300 and proc.poll() is None:
            time.sleep(2.0)
            doc = _node_status(state)
            if doc:
                peak, last = max(peak, doc["memory"]["rss"] or 0), doc
                first = first or (time.time() if doc["learner"]["steps"] > 0 else None)
                if first and time.time() - first >= seconds:
                    break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()
    if last is None:
        raise RuntimeError(f"{label}: the node never answered; see {state / 'node.log'}")
    events, first_step_s = _events(state)
    shutil.rmtree(state, ignore_errors=True)
    steps = [e for e in events if e["kind"] == "step"]
    w = last["memory"]["weights_bytes"]
    return {
        "corpus": label,
        "params": w // 4,
        "rss_mb": peak / 1e6,
        "rss_x_weights": peak / w,
        "first_step_s": first_step_s,
        "step_s": statistics.median(e["t1"] - e["t0"] for e in steps[1:]),
        "steps": len(steps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=2000, help="corpus size in MB (default 2000)")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "ddiloco-corpus-bench"))
    p.add_argument("--sample-mb", type=float, default=50.0, help="what the single-thread reader reads")
    p.add_argument(
        "--stop-at", type=float, default=0.4, help="share of shards after which prepare is stopped"
    )
    p.add_argument("--seconds", type=float, default=40.0, help="training seconds of each 'up' run")
    p.add_argument("--steps", default="reader,memo,prepare,formats,cold,nodes")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    steps = set(a.steps.split(","))
    corpus, tok = make_corpus(work, a.mb)
    out: dict = {"corpus_mb": corpus.stat().st_size / 1e6, "cpus": os.cpu_count()}
    say(f"corpus    {corpus} ({out['corpus_mb']:.0f} MB), tokenizer {tok}")
    if "reader" in steps:
        r = out["reader"] = reader_rate(corpus, tok, a.sample_mb)
        say(
            f"reader    {r['mb_per_s']:.2f} MB/s, one thread, one document at a time ({r['sample_mb']:.0f} MB)"
        )
    if "memo" in steps:
        r = out["memo"] = memo_rate(corpus, tok)
        say(f"memo      {r['x_library']:.2f}x the library's encode, one thread; same ids: {r['same_ids']}")
    cache_root = work / f"cache-{a.mb}"
    if "prepare" in steps:
        r = out["prepare"] = prepare(corpus, tok, cache_root, a.stop_at)
        ratio = r["mb_per_s"] / out["reader"]["mb_per_s"] if "reader" in out else float("nan")
        r["x_reader"] = ratio
        say(
            f"prepare   {r['mb_per_s']:.2f} MB/s over both runs ({ratio:.2f}x the reader), {r['tokens']:,} tokens "
            f"in {r['shards']} shards, {r['disk_mb']:.0f} MB on disk; second run: {r['resumed'] or 'no resume'}"
        )
    folder = next((p for p in cache_root.iterdir() if p.is_dir()), None) if cache_root.exists() else None
    if "formats" in steps and folder is not None:
        out["formats"] = formats(folder)
        for r in out["formats"]:
            say(
                f"format    {r['format']:<34} {r['windows_per_s']:9.0f} windows/s, RSS +{r['rss_growth_mb']:.0f} MB "
                f"after those and a {r['sweep_mb']:.0f} MB sweep"
            )
    if "cold" in steps and folder is not None:
        if os.geteuid() != 0:
            say("cold      skipped: dropping the page cache needs root")
        else:
            out["cold"] = cold_reads(folder)
            for r in out["cold"]:
                say(
                    f"cold      {r['order']:<34} {r['batches_per_s']:8.1f} batches/s of 16 x 129 tokens, cold cache"
                )
    small = work / "small.jsonl"  # the 2 MB corpus the node steps compare with: the big one's first lines
    if steps & {"nodes", "node85"}:
        with open(corpus) as src, open(small, "w") as dst:
            while dst.tell() < 2_000_000:
                dst.write(src.readline())
    if "nodes" in steps:
        base = f"--tokenizer {tok} --token-cache {cache_root} --fragments 8 --sync-every 8"
        rows = nodes(f"--data {corpus} {base}", a.seconds, f"{a.mb} MB") + nodes(
            f"--data {small} {base}", a.seconds, "2 MB"
        )
        out["nodes"] = rows
        for r in rows:
            say(
                f"node      {r['corpus']:>8} node {r['node']}: RSS {r['rss_mb']:.0f} MB, first step {r['first_step_s']:.1f} s"
            )
    if "node85" in steps:
        flags = ["--tokenizer", str(tok), "--token-cache", str(cache_root), "--checkpoint-every-s", "600"]
        rows = [
            one_node(["--data", str(corpus), *flags], a.seconds, f"{a.mb} MB"),
            one_node(["--data", str(small), *flags], a.seconds, "2 MB"),
        ]
        out["node85"] = rows
        for r in rows:
            say(
                f"node85    {r['corpus']:>8}: {r['params']:,} params, RSS {r['rss_mb']:.0f} MB "
                f"({r['rss_x_weights']:.2f}x), first step {r['first_step_s']:.1f} s, step {r['step_s']:.3f} s "
                f"(median of {r['steps']})"
            )
    if a.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
