"""The size ladder: what one node costs at each model size, against the size of its weights.

For each size this starts one real node (``python -m node node``, its own state folder and p2p daemon),
lets it train for ``--seconds`` after its first step, reads its status document every ``--poll-s`` seconds
and its event records at the end, and prints per size: parameters, the fp32 weights, resident memory now
and at its peak with their ratio to the weights, the largest parts of the node's own account
(``node.swarm.memory``), start-up seconds to the first step (and to ``join``), and the median seconds per
step beside a plain torch loop of the same model with the same threads (a child process; ``plain/node`` is
its step time over the node's: 1.0 = the node trains as fast), and the node's seconds to its first step
over the plain loop's from its process's start to the end of its first step (``1st/plain``). Then, once, the codecs' int4 GB/s against a
memcpy of a 16M-value tensor in the same process (``bench/codecs.py``).

    .venv/bin/python bench/scale.py                                  # tiny, small, 85M
    .venv/bin/python bench/scale.py --sizes tiny,gpt2-125m --seconds 90 --json
    .venv/bin/python bench/scale.py --sizes 350m --seconds 120       # 350M: --dim 1024 --layers 24

Sizes: ``tiny`` (the default, 0.9M), ``small`` (10M), ``85m`` (the built-in byte-level model at GPT-2
small's shape: --dim 768 --layers 12 --heads 12 --seq-len 128 --batch-size 2), ``gpt2-125m`` (the preset,
GPT-2's 50257-token vocabulary: 124M, --seq-len 128 --batch-size 2), ``350m`` (--dim 1024 --layers 24
--heads 16, byte-level, --seq-len 128 --batch-size 2).
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
import urllib.request
from pathlib import Path

STARTED = time.time()  # this process's start, near enough: before torch is imported (plain_loop)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = {
    "tiny": [],
    "small": ["--preset", "small"],
    "85m": ["--dim", "768", "--layers", "12", "--heads", "12", "--seq-len", "128", "--batch-size", "2"],
    "gpt2-125m": ["--preset", "gpt2-125m", "--seq-len", "128", "--batch-size", "2"],
    "350m": ["--dim", "1024", "--layers", "24", "--heads", "16", "--seq-len", "128", "--batch-size", "2"],
}


# each size as the plain loop builds it: model settings, batch size
PLAIN = {
    "tiny": ({}, 16),
    "small": ({"dim": 320, "layers": 8, "heads": 8, "seq_len": 256}, 16),
    "85m": ({"dim": 768, "layers": 12, "heads": 12, "seq_len": 128}, 2),
    "gpt2-125m": ({"name": "gpt2", "dim": 768, "layers": 12, "heads": 12, "seq_len": 128}, 2),
    "350m": ({"dim": 1024, "layers": 24, "heads": 16, "seq_len": 128}, 2),
}


def plain_setup(name: str, threads: int):
    """The size's task, a fresh model, AdamW as the learner builds it, and a seeded batch generator, with torch
    on ``threads`` threads (``plain_loop``, ``bench/allocator.py``)."""
    import torch

    from node.learner.model import ModelConfig
    from node.learner.task import TaskConfig, load_task

    torch.set_num_threads(threads)
    model_kw, batch = PLAIN[name]
    task = load_task(None, TaskConfig(batch_size=batch, model=ModelConfig(**model_kw)))
    model = task.new_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return task, model, opt, torch.Generator().manual_seed(0)


def plain_loop(name: str, steps: int, threads: int) -> dict:
    """A plain torch loop of the size's model (this process): the task's batches and loss, AdamW as the
    learner builds it, clipping; the median seconds per step after the first two, and the seconds from this
    process's start (torch's import included, as a node's start-up includes it) to the end of its first
    step."""
    import torch

    task, model, opt, gen = plain_setup(name, threads)
    times = []
    for _ in range(steps + 2):
        t = time.perf_counter()
        loss = task.loss(model, task.batch(gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t)
        if len(times) == 1:
            first = time.time() - STARTED
    return {
        "size": name,
        "plain_step_s": statistics.median(times[2:]),
        "plain_first_s": first,
        "threads": threads,
    }


def run_plain(name: str, steps: int, threads: int) -> dict:
    """``plain_loop`` in a child process of its own (its memory and threads apart from this one's)."""
    out = subprocess.run(
        [sys.executable, __file__, "--plain", name, "--steps", str(steps), "--threads", str(threads)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return json.loads(out.stdout)


def _status(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/status", timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def run_size(name: str, seconds: float, poll_s: float, threads: int, timeout_s: float) -> dict:
    state = Path(tempfile.mkdtemp(prefix=f"ddiloco-scale-{name}-"))
    cmd = [sys.executable, "-m", "node", "node", "--state-dir", str(state), "--threads", str(threads)]
    cmd += ["--checkpoint-every-s", "30", "--eval-every-s", "60", *SIZES[name]]
    log = open(state / "node.log", "wb")
    # a TMPDIR inside the state folder, removed with it: the DHT's sockets of the node killed -9 below
    (state / "tmp").mkdir()
    env = dict(os.environ, TMPDIR=str(state / "tmp"))
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    t0 = time.time()
    last, first_step_at = None, None
    try:
        deadline = t0 + timeout_s
        while time.time() < deadline and proc.poll() is None:
            ready = state / "ready.json"
            if ready.exists():
                try:
                    doc = _status(json.loads(ready.read_text())["status_url"])
                except (OSError, ValueError, KeyError):
                    doc = None
                if doc is not None:
                    last = doc
                    if first_step_at is None and doc["learner"]["steps"] > 0:
                        first_step_at = time.time()
                    if first_step_at is not None and time.time() - first_step_at >= seconds:
                        break
            time.sleep(poll_s)
        if proc.poll() is not None:
            raise RuntimeError(f"{name}: the node exited with {proc.returncode}; see {state / 'node.log'}")
        if last is None or first_step_at is None:
            raise RuntimeError(f"{name}: no step within {timeout_s:.0f} s; see {state / 'node.log'}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()
    events = [json.loads(x) for x in (state / "events.jsonl").read_text().splitlines() if x.strip()]
    shutil.rmtree(state, ignore_errors=True)
    join = next(e for e in events if e["kind"] == "join")
    steps = [e for e in events if e["kind"] == "step"]
    mem = last["memory"]
    w = mem["weights_bytes"]
    parts = sorted(mem["host"].items(), key=lambda kv: -kv[1])
    return {
        "size": name,
        "params": w // 4,
        "weights_mb": w / 1e6,
        "rss_x": mem["rss_x_weights"],
        "peak_x": mem["peak_x_weights"],
        "peak_mb": (mem["peak_rss"] or 0) / 1e6,
        "parts_x": {k: round(v / w, 2) for k, v in parts if v},
        "other_x": round((mem["other"] or 0) / w, 2),
        "join_s": round(join["startup"]["state"], 2),
        "first_step_s": round(steps[0]["t1"] - t0, 2) if steps else None,
        "step_s": round(statistics.median(e["t1"] - e["t0"] for e in steps[1:]), 3)
        if len(steps) > 1
        else None,
        "steps": len(steps),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="tiny,small,85m", help=f"comma-separated, of: {', '.join(SIZES)}")
    ap.add_argument(
        "--seconds", type=float, default=60.0, help="training seconds per size after its first step"
    )
    ap.add_argument("--poll-s", type=float, default=2.0, help="seconds between status reads")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each node")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="bound on one size's whole run")
    ap.add_argument("--no-codecs", action="store_true", help="skip the codec measurement")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--steps", type=int, default=10, help="steps of the plain torch loop per size")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain torch loop per size")
    ap.add_argument("--plain", default="", help=argparse.SUPPRESS)  # the child that runs one plain loop
    a = ap.parse_args(argv)
    if a.plain:
        print(json.dumps(plain_loop(a.plain, a.steps, a.threads)))
        return 0
    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        ap.error(f"unknown size(s) {bad}; choose from {', '.join(SIZES)}")
    rows = []
    for s in sizes:
        print(f"scale: {s} ...", file=sys.stderr, flush=True)
        row = run_size(s, a.seconds, a.poll_s, a.threads, a.timeout_s)
        if not a.no_plain:
            plain = run_plain(s, a.steps, a.threads)
            row["plain_step_s"] = round(plain["plain_step_s"], 3)
            row["plain_ratio"] = round(row["plain_step_s"] / row["step_s"], 3) if row["step_s"] else None
            row["plain_first_s"] = round(plain["plain_first_s"], 2)
            first = row["first_step_s"]
            row["first_ratio"] = round(first / row["plain_first_s"], 2) if first else None
        rows.append(row)
    codecs = None if a.no_codecs else _codecs()
    if a.json:
        print(json.dumps({"sizes": rows, "codecs": codecs}, indent=1))
        return 0
    print(
        "size       params       weights   rss/w  peak/w  peak MB  join s  1st step s  1st/plain  s/step  "
        "plain  plain/node  largest parts"
    )
    for r in rows:
        top = ", ".join(f"{k} {v}x" for k, v in list(r["parts_x"].items())[:6])
        print(
            f"{r['size']:<10} {r['params']:>12,} {r['weights_mb']:>7.1f}MB {r['rss_x']:>6} {r['peak_x']:>7} "
            f"{r['peak_mb']:>8.0f} {r['join_s']:>7} {r['first_step_s']!s:>11} {r.get('first_ratio', '-')!s:>10} "
            f"{r['step_s']!s:>7} "
            f"{r.get('plain_step_s', '-')!s:>6} {r.get('plain_ratio', '-')!s:>11}  {top}, other {r['other_x']}x"
        )
    if codecs:
        print(codecs)
    return 0


def _codecs() -> str:
    """int4 encode and decode of 16M values against a memcpy of the same tensor, one thread."""
    import torch

    from protocol.codecs import get_codec

    torch.set_num_threads(1)
    x = torch.randn(1 << 24)
    dst = torch.empty_like(x)
    c = get_codec("int4")

    def best(fn) -> float:
        fn()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    cp = best(lambda: dst.copy_(x))
    enc = best(lambda: c.encode(x, 64))
    e = c.encode(x, 64)
    dec = best(lambda: c.decode(e))
    gb = x.numel() * 4 / 1e9
    return (
        f"int4, 16M values, one thread: encode {gb / enc:.2f} GB/s ({enc / cp:.1f}x a memcpy), "
        f"decode {gb / dec:.2f} GB/s ({dec / cp:.1f}x), memcpy {gb / cp:.2f} GB/s"
    )


if __name__ == "__main__":
    sys.exit(main())
