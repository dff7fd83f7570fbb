"""Views on one chain elect alike (``SwarmView.candidates`` in a public swarm): a node's own records credit
it in its own view alone (``node.swarm.view.credits``), so where one member signed every round so far, it
puts itself last rather than first. Else it and the member every other view elects each took a round of
their own, and with sync-diloco's quorum of every learner neither merged again (a suite run)."""

from __future__ import annotations

import time
from collections import OrderedDict
from types import SimpleNamespace

from hivemind.utils import get_dht_time

from dht.records import Member
from node.swarm.trust.work_book import WorkBook
from node.swarm.view import SwarmView

SWARM = "views"


def _member(pid: str) -> Member:
    now = get_dht_time()
    return Member(pid, ("/ip4/127.0.0.1/tcp/1",), "v", now, now + 60, heads={"0": [4, "h4"]})


class _View(SwarmView):
    """What ``candidates`` reads: the live members, this node's replica at ``round_``, a log of records
    of fragment 0 signed by ``signer`` merging every member's work, watched for longer than the window."""

    def __init__(self, me: str, ids: list[str], signer: str, round_: int) -> None:
        self.peer_id, self.ids = me, ids
        self.replicas = [SimpleNamespace(round=round_, hash=f"h{round_}")]
        self.settings = SimpleNamespace(swarm=SWARM, elect_workers=True)
        self.published_self, self.suspect = None, {}
        self.syncs = [SimpleNamespace(due_every=1.0)]
        self.work = WorkBook()
        for q in ids:
            self.work.merged(q, 0, time.monotonic() - 100.0)  # watched for the window
        rec = SimpleNamespace(contributors=[(q, f"{q}:0:1", 1.0, 1, 1) for q in ids])
        self.logs = [OrderedDict((r, SimpleNamespace(signer=signer, record=rec)) for r in range(1, 5))]

    def live_members(self) -> dict[str, Member]:
        return {q: _member(q) for q in self.ids}

    def credible(self, p, pid, round_, members) -> bool:
        return True


def test_views_on_a_chain_one_member_signed_elect_the_same_synchroniser():
    for n in (2, 3):
        ids = [f"peer{i}" for i in range(n)]
        signer = ids[0]
        for r in range(4, 40):  # the open round moves the rendezvous order
            firsts = {me: _View(me, ids, signer, r).candidates(0)[0] for me in ids}
            assert len(set(firsts.values())) == 1, (n, r, firsts)
            assert firsts[signer] != signer  # it is credited by no other view: not first in its own
        # its own view still has it, last: a fail-over past every other member reaches it
        assert _View(signer, ids, signer, 5).candidates(0)[-1] == signer
