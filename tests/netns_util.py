"""Network namespaces for the tests that need them (root and iproute2): a lab opened, or the test skipped."""

from __future__ import annotations

import os
import shutil

import pytest


def open_lab(nodes: int, rate: str, tag: str, rtt_ms: float = 0.0):
    """A ``node.chaos.netns.NetLab`` of ``nodes`` namespaces with links capped at ``rate``, opened; the test is
    skipped where namespaces cannot be made (not root, no iproute2, or the kernel refuses). ``rtt_ms``: a
    round trip added between every two nodes (a delay line in the hub; it needs ``/dev/net/tun``)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("network namespaces need root and iproute2")
    from node.chaos.netns import NetLab, NetnsError

    lab = NetLab(nodes, rate=rate, tag=f"{tag}{os.getpid() % 100000}", rtt_ms=rtt_ms)
    try:
        lab.open()
    except NetnsError as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    return lab
