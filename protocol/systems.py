"""The systems one core makes (docs/design.md, section 1): the paper's decoupled DiLoCo and its two baselines.

A system is a protocol configuration plus a blocking mode: the baselines are the same round machinery with
every learner in every round, the plain mean and fp32, learners waiting for the merged fragment.
"""

from __future__ import annotations

from dataclasses import replace

from protocol.config import ProtocolConfig

SYSTEMS = ("decoupled", "streaming", "sync-diloco", "dp")


def system_protocol(
    system: str, pcfg: ProtocolConfig, learners: int, trusted: bool = True
) -> tuple[ProtocolConfig, bool]:
    """The protocol settings and blocking mode that make ``system`` out of the one core. ``trusted``: every
    learner is vouched for (a private swarm, the in-process runner); ``robust`` ``auto`` merges robustly
    where they are not (a public swarm)."""
    if pcfg.robust == "auto":
        pcfg = replace(pcfg, robust="off" if trusted else "centered-clip")
    # The baselines as their authors run them: every learner in every round, each adopting what it waited
    # for, the plain mean of fp32 outer gradients, no clipping (torchft's DiLoCo; the decoupled defaults
    # int4 and clipping moved Theta by about 23% of an update away from it on identical inputs).
    as_published = dict(
        quorum=learners,
        grace=False,
        merge="mean",
        carry=False,
        codec="fp32",
        record_codec="fp32",
        clip_factor=0.0,
        robust="off",
    )
    if system == "streaming":
        return replace(pcfg, **as_published), True
    if system == "sync-diloco":
        return replace(pcfg, fragments=1, overlap=0, **as_published), True
    return pcfg, False
