"""Synchronisers that drop contributions they took, on real nodes: 3 honest nodes and two
running ``bench/hostile_node.py``. ``sync-drop`` answers every contribution ``ok``, with the signed receipt a
public swarm's synchroniser gives, and when elected merges only the first it holds: a faithful merge of a
subset, which no audit refutes, but its record beside its own receipt proves the drop
(``node.swarm.trust.receipts``). ``sync-censor`` does the same and gives no receipt. Every honest node bans the
dropper; the censor's oks without receipts send each contribution to the next candidate. The work left out
goes again (``MergeDeadlines.left_out``) and is merged in a later round, and the model holds."""

import time

import pytest

from tests.swarm_util import TINY, Swarm, assert_eval_held, fork_server, wait_until

pytestmark = pytest.mark.timeout(420)


@pytest.mark.slow
def test_a_synchroniser_that_drops_what_it_took_is_banned_and_one_that_promises_nothing_is_passed_over(
    tmp_path,
):
    from bench.attacks import start_hostile
    from node.local.launcher import wait_ready

    swarm = Swarm(tmp_path, TINY)
    try:
        swarm.start_many(3)
        wait_until(lambda: _evals(swarm), 90, "an evaluation on every honest node")
        since = time.time()
        dropper = start_hostile(
            3, tmp_path, "sync-drop", swarm.flags, swarm.children[0].maddrs, forks=fork_server()
        )
        censor = start_hostile(
            4, tmp_path, "sync-censor", swarm.flags, swarm.children[0].maddrs, forks=fork_server()
        )
        swarm.children[3], swarm.children[4] = dropper, censor
        wait_ready([dropper, censor], 120)
        honest = range(3)

        def bans(i: int, peer: str) -> list[dict]:
            return [e for e in swarm.events(i) if e["kind"] == "ban" and e["peer"] == peer]

        def merged_later(i: int) -> set[str]:
            """Node i's contributions a liar left out (or took without a receipt) that a later record names."""
            out = {
                e["cid"]: e["t"]
                for e in swarm.events(i)
                if e["kind"] in ("left_out", "no_receipt") and e.get("signer", e.get("peer")) in liars
            }
            return {
                c
                for e in swarm.events(i)
                if e["kind"] == "merge"
                for c in e["cids"]
                if c in out and e["t"] >= out[c]
            }

        liars = {dropper.peer_id, censor.peer_id}
        wait_until(
            lambda: all(bans(i, dropper.peer_id) for i in honest),
            150,
            "every honest node's ban of the dropper",
        )
        for i in honest:
            assert bans(i, dropper.peer_id)[0]["last"] == "omitted_contribution", bans(i, dropper.peer_id)
        # each ban's proof came from a member other than the dropper, and the first of them saw the drop
        # itself (its own receipt). That member may be the censor: it contributes, and the dropper's
        # receipts and records convict it there as anywhere (in one CI run no honest node's first ban was its own).
        others = {c.peer_id for c in swarm.children.values()} - {dropper.peer_id}
        assert {bans(i, dropper.peer_id)[0]["evidence"] for i in honest} <= others
        own = [
            i
            for i in (*honest, 4)
            if (b := bans(i, dropper.peer_id)) and b[0]["evidence"] == swarm.children[i].peer_id
        ]
        assert own, [bans(i, dropper.peer_id)[:1] for i in (*honest, 4)]
        wait_until(
            lambda: sum(1 for e in (e for i in honest for e in swarm.events(i)) if e["kind"] == "no_receipt"
                        and e["peer"] == censor.peer_id) >= 2,
            150,
            "oks without a receipt from the censor",
        )  # fmt: skip
        wait_until(lambda: sum(1 for i in honest if merged_later(i)) >= 2, 150, "left-out work merged later")
        for i in honest:  # no honest node banned; the censor proved nothing against itself
            for j in honest:
                assert not bans(i, swarm.children[j].peer_id), f"node {i} banned honest node {j}"
            assert not bans(i, censor.peer_id) or bans(i, censor.peer_id)[0]["last"] != "omitted_contribution"
        swarm.kill9(3)
        swarm.kill9(4)
        del swarm.children[3], swarm.children[4]
        final = swarm.settle()
        assert len({s["model_hash"] for s in final.values()}) == 1
        assert_eval_held(swarm, since, honest)
    finally:
        swarm.stop()


def _evals(swarm: Swarm) -> bool:
    return all(any(e["kind"] == "eval" for e in swarm.events(i)) for i in range(3))
