"""How a node catches up a fragment it is behind on: records while they bridge the gap cheaply, else one
snapshot (``node.swarm.catch_up.records_bridge``)."""

import time
from dataclasses import replace
from types import SimpleNamespace

from node.swarm.catch_up import SNAPSHOT_BYTES_PER_PARAM, CatchUp, record_bytes_per_param, records_bridge
from node.swarm.limits import Backoff
from protocol.config import ProtocolConfig


def fake_catch_up(**given) -> CatchUp:
    """A ``CatchUp`` over fakes of its collaborators: ``given`` replaces any of them (by its argument's name)."""
    settings = SimpleNamespace(
        heartbeat_s=0.5, rpc_timeout_s=5.0, elect_workers=False, snapshot_burst=0, snapshots_per_min=0
    )

    async def nothing():
        return None

    args = dict(
        settings=settings,
        pcfg=ProtocolConfig(),
        peer_id="me",
        spec={0: {}},
        replicas=[object()],
        heads=[(0, "", 0, 0.0)],
        logs=[{}],
        merged_tokens=[0],
        syncing=set(),
        lagging_since={},
        counters={},
        events=SimpleNamespace(emit=lambda *a, **k: None),
        peer_scores=None,
        work=None,
        clocks=None,
        learner=None,
        learner_loop=SimpleNamespace(deliver=lambda *a: None, is_alive=lambda: False),
        transport=None,
        vetting=SimpleNamespace(refused_heads=lambda p: set()),
        auditor=None,
        members=dict,
        live_members=dict,
        winning_heads=lambda p, members, refused=(): (None, []),
        outvoted=lambda p, members: (None, []),
        credible=lambda p, pid, round_, members: True,
        within_records=lambda p, round_: True,
        head_key=lambda h: h,
        workers=lambda p, holders: holders,
        logged_learners=set,
        credit_snapshot=lambda st: None,
        heartbeat=nothing,
        apply=lambda sr: None,
        reset_sync=lambda p, merged=frozenset(): None,
        spawn=lambda coro: coro.close(),
        clock=time.monotonic,
    )
    unknown = set(given) - set(args)
    assert not unknown, unknown
    args.update(given)
    return CatchUp(**args)


def test_records_while_they_weigh_less_than_a_snapshot():
    cfg = replace(ProtocolConfig(), history=16)  # int4 records, blocks of 64: 0.5625 bytes a parameter
    per = record_bytes_per_param(cfg.record_codec, cfg.codec_block)
    assert per == 0.5 + 4 / 64
    bridged = [g for g in range(0, 40) if records_bridge(g, cfg)]
    assert bridged == list(range(1, 15))  # 14 records (7.9 bytes a parameter) < a snapshot (8) < 15
    assert 14 * per < SNAPSHOT_BYTES_PER_PARAM <= 15 * per


def test_a_gap_past_the_peers_record_log_goes_to_a_snapshot():
    cfg = replace(ProtocolConfig(), history=4)
    assert records_bridge(4, cfg) and not records_bridge(5, cfg)


def test_fp32_records_bridge_one_round_only_and_no_gap_needs_nothing():
    cfg = replace(ProtocolConfig(), record_codec="fp32")
    assert [g for g in range(-2, 10) if records_bridge(g, cfg)] == [1]


def test_the_default_log_bridges_its_four_rounds():
    # four int4 records a fragment: 2.25 bytes a parameter kept, a quarter of what a snapshot weighs
    cfg = ProtocolConfig()
    assert [g for g in range(0, 40) if records_bridge(g, cfg)] == [1, 2, 3, 4]


def test_a_lagging_fragment_is_pulled_from_any_holder_not_backing_off():
    """The pulls spread over the peers holding the winning head, and skip one backing off: always the first
    holder by peer id spent that donor's snapshot allowance, and a node fell behind for good."""
    picked = []
    node = fake_catch_up(
        lagging_since={0: time.monotonic() - 60},
        winning_heads=lambda p, ms, refused: ([9, "h", 1, 1.0], ["a", "b", "c"]),
    )
    backoff = node.backoff = Backoff(base_s=60, cap_s=60)
    backoff.failed("a", time.monotonic())
    backoff.failed("b", time.monotonic())
    node.catch_up = lambda p, pid, head, yielding: picked.append(pid) or _noop()
    for _ in range(20):
        node.reconcile()
    assert set(picked) == {"c"}  # a and b back off
    backoff.succeeded("a")
    backoff.succeeded("b")
    picked.clear()
    for _ in range(60):
        node.reconcile()
    assert set(picked) == {"a", "b", "c"}


async def _noop() -> None:
    return None


def test_a_restarted_node_keeps_asking_a_donor_that_refuses_it_until_a_heartbeat_lets_it_in():
    """A donor that has not read the restarted node's fresh record refuses it until its next view re-read,
    a heartbeat later. Two quick tries both met that refusal and the node trained on its stale checkpoint
    (CI: the first ``catch_up`` event moved no fragment, ``behind`` 4)."""
    import asyncio

    async def main():
        loop = asyncio.get_running_loop()
        t_start = loop.time()
        replicas = [SimpleNamespace(round=3, theta=f"theta{p}") for p in range(4)]
        delivered, events, tries = [], [], []

        async def catch_up(p, pid, head):
            tries.append(p)
            if loop.time() - t_start < 0.5:  # the donor's view does not hold us yet
                return
            replicas[p].round = head[0]

        async def nothing():
            return None

        node = fake_catch_up(
            replicas=replicas,
            clock=loop.time,
            spawn=lambda coro: asyncio.ensure_future(coro),
            live_members=lambda: {"a": 1},
            winning_heads=lambda p, ms: ([7, "h", 1, 1.0], ["a"]) if replicas[p].round < 7 else (None, []),
            learner_loop=SimpleNamespace(deliver=lambda p, r, theta, now: delivered.append((p, r))),
            events=SimpleNamespace(emit=lambda kind, **kw: events.append((kind, kw))),
        )
        node.await_members = node.publish_while_joining = nothing
        node.catch_up = catch_up
        await node.catch_up_restored()
        return delivered, events, tries

    delivered, events, tries = asyncio.run(main())
    assert sorted(delivered) == [(p, 7) for p in range(4)]
    assert len(tries) > 8  # the first tries were refused, and it went on past two of them
    ((kind, kw),) = events
    assert kind == "catch_up" and kw["fragments"] == [0, 1, 2, 3] and kw["behind"] == 4


def test_catch_ups_of_many_fragments_fetch_at_most_snapshots_in_flight_at_once_and_all_arrive():
    """A node behind on eight fragments catches each up in a task of its own: their snapshots are fetched
    ``SNAPSHOTS_IN_FLIGHT`` at a time (all at once, on a thin link each ran past its deadline), and every
    one is fetched."""
    import asyncio

    from node.swarm.catch_up import SNAPSHOTS_IN_FLIGHT

    frags = 8
    cu = fake_catch_up(
        spec={p: {} for p in range(frags)},
        replicas=[object()] * frags,
        heads=[(0, "", 0, 0.0)] * frags,
        logs=[{}] * frags,
        merged_tokens=[0] * frags,
    )
    live, most, fetched = [0], [0], []

    async def fetch_snapshot(pid, fragments, replace_ours=False, head=None):
        live[0] += 1
        most[0] = max(most[0], live[0])
        await asyncio.sleep(0.02)
        live[0] -= 1
        fetched.extend(fragments)

    cu.fetch_snapshot = fetch_snapshot

    async def go():
        head = [3, "theirs", 4, 4.0]
        await asyncio.gather(*(cu.catch_up(p, "donor", head, yielding=True) for p in range(frags)))

    asyncio.run(go())
    assert sorted(fetched) == list(range(frags))
    assert most[0] == SNAPSHOTS_IN_FLIGHT < frags
