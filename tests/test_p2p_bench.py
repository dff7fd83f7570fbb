"""bench/p2p_throughput.py moves every byte it claims through each path, and says so in its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_p2p_bench_measures_every_case_in_one_run():
    out = subprocess.run(
        [sys.executable, "bench/p2p_throughput.py", "--mb", "4", "--reps", "1", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]  # what failed, where a suite run shows it (it once failed)
    res = json.loads(out.stdout)
    cases = ["tcp", "p2pd raw", "p2pd raw, 4 streams", "transport, 1 server", "transport, 2 servers"]
    assert list(res["mb_per_s"]) == cases
    assert all(v > 0 for v in res["mb_per_s"].values())
    assert res["x_tcp"]["tcp"] == 1.0
