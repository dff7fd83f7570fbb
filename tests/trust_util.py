"""A ``TrustPolicy`` over a test fake's trust parts (``node.swarm.trust.policy``): the checks from its
settings as a node wires them, the parts it lacks as None (a path that reaches one fails loudly)."""

from __future__ import annotations

from node.swarm.trust.policy import TrustChecks, TrustPolicy


def trust_of(node, **checks) -> TrustPolicy:
    """``node``: a fake with ``settings``, ``peer_id`` and whichever of ``pcfg``, of ``peer_scores``, ``work``,
    ``agreement``, ``fence``, ``auditor``, ``receipts``, ``suspect``, ``counters``, ``events``, ``members``,
    ``turn_held``, ``unelected_held`` and ``spawn`` its test reaches; ``checks``: any of ``TrustChecks``'
    fields, over what the settings give."""
    s, receipts, pcfg = node.settings, getattr(node, "receipts", None), getattr(node, "pcfg", None)
    given = dict(
        audits=getattr(s, "audit_share", 0.0) > 0,
        receipts=bool(receipts is not None and receipts.receipts_on()),
        distrust=bool(getattr(pcfg, "distrust", False)) and getattr(pcfg, "robust", "off") != "off",
        fence=bool(getattr(s, "elect_workers", False)),
    )
    members = getattr(node, "members", {})
    return TrustPolicy(
        TrustChecks(**(given | checks)),
        node.peer_id,
        getattr(node, "peer_scores", None),
        getattr(node, "work", None),
        getattr(node, "agreement", None),
        getattr(node, "fence", None),
        getattr(node, "auditor", None),
        receipts,
        getattr(node, "suspect", {}),
        getattr(node, "counters", {}),
        getattr(node, "events", None),
        step_rate=lambda q: getattr(members.get(q), "steps_per_s", 0.0),
        hold_out_of_turn=lambda sr, caller: node.turn_held.hold(sr, caller),
        hold_unelected=lambda sr, caller: node.unelected_held.hold(sr, caller),
        spawn=lambda coro: node.spawn(coro),
    )
