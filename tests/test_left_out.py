"""A synchroniser that censors (issue 32, item 5): 3 honest nodes and one running ``bench/hostile_node.py
sync-drop``, which answers every contribution ``ok`` and, when elected, merges only the first it holds. Its
records are faithful merges of a subset (no audit refutes them), so before ``node.swarm.watch.left_out`` the
other senders' work in its rounds was lost. Each honest node sees the record of the round that took its
contribution come without it, counts it, and sends it again: it is merged in a later round."""

import pytest

from tests.swarm_util import TINY, Swarm, wait_until

pytestmark = pytest.mark.timeout(400)


def test_a_contribution_a_censoring_synchroniser_left_out_goes_again_and_is_merged(tmp_path):
    from bench.attacks import start_hostile
    from node.local.launcher import wait_ready

    swarm = Swarm(tmp_path, TINY)
    try:
        swarm.start_many(3)
        liar = start_hostile(3, tmp_path, "sync-drop", swarm.flags, swarm.children[0].maddrs)
        swarm.children[3] = liar
        wait_ready([liar], 120)

        def left_out(i: int) -> list[dict]:
            return [e for e in swarm.events(i) if e["kind"] == "left_out" and e["signer"] == liar.peer_id]

        def merged_later(i: int) -> set[str]:
            """The left-out contributions of node i that a later record names."""
            cids = {e["cid"]: e["t"] for e in left_out(i)}
            return {
                c
                for e in swarm.events(i)
                if e["kind"] == "merge"
                for c in e["cids"]
                if c in cids and e["t"] >= cids[c]
            }

        wait_until(
            lambda: sum(1 for i in range(3) if merged_later(i)) >= 2,
            150,
            "honest nodes' left-out contributions merged in a later round",
        )
        st = swarm.status()
        assert sum(st[i]["counters"]["left_out"] for i in range(3)) >= 2, [
            st[i]["counters"] for i in range(3)
        ]
        swarm.one_hash_without(3)
    finally:
        swarm.stop()
