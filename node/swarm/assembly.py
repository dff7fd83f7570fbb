"""How a node's parts are built and wired: its trust policy (made with the node), and, on its event loop, the
parts made when it runs: the transport, the record push, snapshot vetting, catch-up, the intake and the
sender of contributions, the records held for a retry, and the table of which part answers each op. Each
part is handed the state it shares and the calls of the others it uses (``node.swarm.agent`` builds the
parts made with the node itself)."""

from __future__ import annotations

import time

from node.swarm.catch_up import CatchUp
from node.swarm.dispatch import OPS
from node.swarm.frames import max_frame_bytes
from node.swarm.intake import Intake
from node.swarm.links import LinkRates
from node.swarm.record_push import RecordPush
from node.swarm.sender import Sender
from node.swarm.transport import Reply, Transport
from node.swarm.trust.held import HeldRecords
from node.swarm.trust.policy import TrustChecks, TrustPolicy
from node.swarm.trust.vetting import SnapshotVetting
from protocol.errors import ProtocolError, RejectCode


async def _pong(caller: str, body: bytes) -> Reply:
    """``ping``: whether this node is up and takes contributions, asked by a member that was told it is dead
    (the dispatcher has admitted the caller)."""
    return Reply(True)


def wire_running_parts(node, p2p, addrs: list[str]) -> dict:
    """Build the parts made when ``node`` (a ``node.swarm.agent.Node``) runs (its loop, membership and p2p exist by now), hand the view what
    it needed from them, and return each op's handler."""
    s = node.settings
    budget, most = int(s.peer_inflight_mib * (1 << 20)), max_frame_bytes(node.plan)
    node.transport = Transport(
        p2p,
        most,
        timeout_s=s.rpc_timeout_s,
        admit=node.view.admit,
        peer_budget=budget,
        links=LinkRates(s.link_floor_mbps * 1e6 / 8),
    )
    if node.admission is not None and node.admission.sealed:
        from node.swarm.sealed import SealedTransport

        node.transport = SealedTransport(node.transport, node.admission, node.peer_id)
    node.record_push = RecordPush(
        node.transport,
        s,
        node.peer_id,
        node.suspect,
        node.view.live_members,
        node.view.workers,
        node.view.candidates,
        node.loop.time,
    )
    node.vetting = SnapshotVetting(
        s,
        node.pcfg,
        node.spec,
        node.peer_id,
        node.replicas,
        node.heads,
        node.logs,
        node.work,
        node.transport,
        node.events,
        node.view.live_members,
        node.view.winning_heads,
        node.penalise,
    )
    node.catch_up = CatchUp(
        s,
        node.pcfg,
        node.peer_id,
        node.spec,
        node.replicas,
        node.heads,
        node.logs,
        node.merged_tokens,
        node.syncing,
        node.lagging_since,
        node.counters,
        node.events,
        node.peer_scores,
        node.work,
        node.clocks,
        node.learner,
        node.learner_loop,
        node.transport,
        node.vetting,
        node.auditor,
        members=lambda: node.view.members,
        live_members=node.view.live_members,
        winning_heads=node.view.winning_heads,
        outvoted=node.view.outvoted,
        credible=node.view.credible,
        within_records=node.view.within_records,
        head_key=node.view.head_key,
        workers=node.view.workers,
        logged_learners=node.view.logged_learners,
        credit_snapshot=node.view.credit_snapshot,
        heartbeat=node.view.heartbeat,
        apply=node.apply,
        reset_sync=node.reset_sync,
        spawn=node.spawn,
        clock=node.loop.time,
    )
    node.view.start(node.membership, node.loop.time, addrs, node.catch_up.reconcile)
    node.intake = Intake(
        s,
        node.pcfg,
        node.peer_id,
        node.spec,
        node.replicas,
        node.syncs,
        node.leases,
        node.clocks,
        node.suspect,
        node.trust,
        node.work,
        node.counters,
        node.events,
        node.transport,
        known=node.view.known,
        members=lambda: node.view.members,
        live_members=node.view.live_members,
        candidates=node.view.candidates,
        synchroniser_of=node.view.synchroniser_of,
        lease_seen=lambda: node.view.lease_seen,
        swarm_steps=lambda: node.view.swarm_steps,
        decide=node.decide,
        penalise=node.penalise,
        clock=node.loop.time,
    )
    node.sender = Sender(
        s,
        node.pcfg,
        node.peer_id,
        node.identity,
        node.suspect,
        node.peer_scores,
        node.counters,
        node.events,
        node.auditor,
        node.transport,
        node.receipts,
        candidates=node.view.candidates,
        rounds_behind=node.view.rounds_behind,
        accept=node.intake.accept,
        watch=node.deadlines.watch,
        clock=node.loop.time,
    )
    # each op's handler: the component that answers it (node.swarm.dispatch admits and scores)
    handlers = {
        "contribute": node.intake.accept,
        "record": node.on_record,
        "records": node.on_records,
        "snapshot": node.catch_up.on_snapshot,
        "ping": _pong,
        "evidence": node.auditor.on_evidence,
        "kept": node.auditor.on_kept,
        "proof": node.auditor.on_proof,
        "omission": node.receipts.on_omission,
    }
    if set(handlers) != set(OPS):
        raise RuntimeError(f"ops without a handler, or handlers of no op: {sorted(set(OPS) ^ set(handlers))}")
    return handlers


def held_records(node) -> tuple[HeldRecords, HeldRecords]:
    """The records held out of turn (tried again a ``failover_s`` later for each candidate ranked before
    their signer, judged as the fence stood when they came), and those the fence refused (tried once more a
    heartbeat later)."""
    s, c = node.settings, node.counters

    def turn_refused(e: ProtocolError, caller: str) -> None:
        node.events.emit("reject", t=time.time(), peer=caller, code=e.code.value, why=str(e)[:300])

    def still_unelected(e: ProtocolError, caller: str) -> None:
        if e.code is RejectCode.UNELECTED:
            c["unelected_refused"] += 1

    def count(key: str):
        return lambda: c.__setitem__(key, c[key] + 1)

    common = dict(call_later=node.loop.call_later, stopped=node.stopping)
    turn = HeldRecords(
        "out of turn",
        s.swarm,
        node.spec,
        node.replicas,
        node.signed_files,
        wait_s=node.fence.turn_wait_s,
        retry=lambda sr, caller: node.take_record(sr, caller, waited=True),
        refused=turn_refused,
        on_held=count("out_of_turn_held"),
        on_full=lambda: None,
        **common,
    )
    unelected = HeldRecords(
        "refused by the election fence",
        s.swarm,
        node.spec,
        node.replicas,
        node.signed_files,
        wait_s=lambda sr: s.heartbeat_s,
        retry=lambda sr, caller: node.apply(sr),
        refused=still_unelected,
        on_held=lambda: None,
        on_full=count("unelected_refused"),  # too many held: refused now
        **common,
    )
    return turn, unelected


def trust_policy(node) -> TrustPolicy:
    """The trust policy the node's accepting, merging and applying paths ask (``node.swarm.trust.policy``),
    over the trust parts made with the node; its checks from the swarm's kind (``TrustChecks.of``)."""
    return TrustPolicy(
        TrustChecks.of(node.settings, node.pcfg),
        node.peer_id,
        node.peer_scores,
        node.work,
        node.agreement,
        node.fence,
        node.auditor,
        node.receipts,
        node.suspect,
        node.counters,
        node.events,
        step_rate=lambda q: getattr(node.view.members.get(q), "steps_per_s", 0.0),
        hold_out_of_turn=lambda sr, caller: node.turn_held.hold(sr, caller),
        hold_unelected=lambda sr, caller: node.unelected_held.hold(sr, caller),
        spawn=node.spawn,
    )
