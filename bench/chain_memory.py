"""What checking a snapshot against its donor's records holds in memory (``protocol.chain``), at the size of
the largest tensor of ``--preset gpt2-125m`` (its embedding, 50,257 x 768: 147 MB in fp32): the check
walks one outer step back and one forward over a range of the tensor at a time, so what it holds beyond
its inputs is a few ranges, not copies of the tensor.

    .venv/bin/python bench/chain_memory.py
"""

from __future__ import annotations

import gc
import resource

import torch

from protocol.chain import snapshot_mismatch


def main() -> None:
    n = 50257 * 768
    torch.manual_seed(0)
    theta, mom = {"e": torch.randn(n) * 0.02}, {"e": torch.randn(n) * 1e-3}
    back, fwd = {"e": torch.randn(n) * 1e-3}, {"e": torch.randn(n) * 1e-3}
    served_theta, served_mom = {"e": theta["e"].clone()}, {"e": mom["e"].clone()}
    held = sum(d["e"].numel() * 4 for d in (theta, mom, back, fwd, served_theta, served_mom)) / 2**20
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    why = snapshot_mismatch(theta, mom, [(back, 0.7, 0.9)], [(fwd, 0.7, 0.9)], served_theta, served_mom)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"inputs: {held:.0f} MB (six tensors of {n * 4 / 2**20:.0f} MB)")
    print(f"peak RSS above them during the check: {(peak - before) / 1024:.0f} MB")
    print(f"verdict on a snapshot one step off: {why}")


if __name__ == "__main__":
    main()
