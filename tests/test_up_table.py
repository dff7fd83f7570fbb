"""The live table of ``ddiloco up``: the global model's newest evaluation, from whichever node made it, with its
age; and the token cache built once before the nodes start."""

from __future__ import annotations

import json
import time
from pathlib import Path

from node.learner.token_cache import CacheSpec, open_cache
from node.local.launcher import Child, global_eval, prepare_data, table
from tests.hf_util import docs


class Running:
    returncode = None

    def poll(self):
        return None


def child(i: int, evals: list[tuple[float, int, float]] | None) -> Child:
    c = Child(i, Path("."), Running(), Path("log"))
    if evals is not None:
        learner = {"steps": 9, "tokens_per_s": 1.0, "loss": 1.0, "eval_loss": evals[-1][2] if evals else None}
        learner["eval_history"] = evals
        c.last = {
            "peer_id": f"peer{i}",
            "learner": learner,
            "rounds_merged": 1,
            "bytes_sent": 0,
            "bytes_received": 0,
            "refused": {},
            "model_hash": "ab" * 8,
        }
    return c


def test_the_newest_evaluation_of_any_node_is_shown_with_its_age():
    now = time.time()
    kids = [
        child(0, [(now - 300, 0, 5.622)]),
        child(1, [(now - 400, 0, 5.6), (now - 12, 80, 2.25)]),
        child(2, []),
    ]
    assert global_eval(kids) == "global model: eval loss 2.2500 (node 1, 12s ago)"
    rows = table(kids).splitlines()
    assert "5.622 300s ago" in rows[1] and "2.250 12s ago" in rows[2] and rows[3].split()[5] == "-"
    assert global_eval([child(0, None), child(1, [])]) == "global model: eval loss -"


def test_up_builds_the_token_cache_before_the_nodes_start(tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs(30_000)))
    flags = ["--threads", "1", "--data", str(data), "--token-cache", str(tmp_path / "tc"), "--fragments", "4"]
    prepare_data(flags, quiet=True)
    assert not open_cache(CacheSpec(str(data)), tmp_path / "tc").built  # the nodes only read it
    prepare_data(["--threads", "1"], quiet=True)  # no --data: nothing to prepare
