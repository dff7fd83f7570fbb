"""The node's status document and control requests (docs/design.md, section 7), served by
``node.swarm.server``; the client is ``node.common.status_client``.

``GET /status`` returns the node's view of the swarm as JSON: peers, who synchronises what, rounds, loss,
tokens/s, bytes sent and received, refusals by code, goodput. ``POST /control`` with ``{"action": ...}`` and the node's control token
(``Authorization: Bearer TOKEN``, the token in ``STATE_DIR/control.token``, readable by the node's user
only) pauses or resumes the learner or stops the node (``ddiloco up`` uses it to end a run cleanly); with
``test_hooks`` on, ``{"action": "block", "peers": [...]}`` makes the node treat those peers as unreachable,
which is how the test suite partitions a swarm on one host, and ``{"action": "forget"}`` drops its open
rounds' contributions (keeping the receipts it gave for them). Reading needs no second p2p daemon: plain HTTP
on the node's status port (bind it to loopback, the default, or put it behind your own access control).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from node.common.events import EventLog, record_time
from node.common.status_client import ACTIONS, StatusError  # noqa: F401 - re-exported for the server's callers
from node.swarm.memory import breakdown as memory_breakdown
from protocol.errors import DDiLoCoError
from protocol.goodput import compute_goodput
from protocol.synchroniser import Phase, effective_quorum, has_quorum

logger = logging.getLogger(__name__)
MAX_REQUEST = 64 * 1024  # the largest request body the endpoint reads
PEERS_LISTED = 64  # members a status document lists ("peer_count" counts them all)


class BadRequest(DDiLoCoError, ValueError):
    """An HTTP request to the status endpoint is malformed; answered with 400 and this message."""


def parse_control(body: bytes) -> tuple[str, list[str]]:
    """The action of a POST /control body and, for ``block``, the peers; BadRequest says what is wrong."""
    usage = 'expected JSON {"action": "pause" | "resume" | "stop" | "evaluate" | "block"}'
    try:
        req = json.loads(body or b"{}")
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"{usage}: {type(e).__name__}: {str(e)[:200]}") from e
    if not isinstance(req, dict) or "action" not in req:
        raise BadRequest(usage)
    action = req["action"]
    if not isinstance(action, str) or action not in ACTIONS:
        raise BadRequest(f"unknown action {repr(action)[:80]}: pause, resume, stop, evaluate or block")
    peers = req.get("peers", []) if action == "block" else []
    if not isinstance(peers, list) or not all(isinstance(x, str) for x in peers):
        raise BadRequest("peers must be a list of peer ids")
    return action, peers


def held_goodput(
    events: EventLog, started_at: float, now: float, learner: str, shares: list[float], overlap: int = 0
) -> tuple[float | None, float]:
    """Goodput of the records held in memory, and since when: the node's start, or, once older records were
    let go (``EventLog(keep=...)``), the oldest record held. None when the records cannot give one."""
    records = events.snapshot()
    since = record_time(records[0]) if events.trimmed and records else started_at
    records.append(
        {"kind": "run", "t0": since, "t1": now, "learners": [learner], "shares": shares, "overlap": overlap}
    )
    try:
        return compute_goodput(records).goodput, since
    except (ValueError, KeyError):
        return None, since


def status_doc(node: Any) -> dict:  # node: the running node.swarm.agent.Node (which imports this module)
    ll = node.learner_loop
    members = node.view.live_members()
    frags = []
    synchronises: dict[str, list[int]] = {}
    for p, rep in enumerate(node.replicas):
        cands = node.view.candidates(p)
        if cands:
            synchronises.setdefault(cands[0], []).append(p)
        frags.append(
            {
                "fragment": p,
                "round": rep.round,
                "hash": rep.hash[:16],
                "synchroniser": cands[0] if cands else None,
                "electable": len(cands),  # members this node would elect in turn (``elect``)
                "collecting": node.syncs[p].phase.value if p in node.leases else None,
                # learners its open round waits for, counted from those whose work was merged lately where
                # members are not trusted (``protocol.synchroniser.quorum_basis``)
                "quorum": effective_quorum(node.pcfg, node.syncs[p]),
                "behind": node.view.rounds_behind(p),  # rounds the newest credible head is ahead of ours
            }
        )
    now = time.time()
    mono = time.monotonic()

    def reachable(pid: str) -> bool:
        return pid not in node.view.blocked and node.suspect.get(pid, 0.0) <= mono

    first = sorted(members, key=lambda pid: (pid != node.peer_id, pid not in synchronises, pid))
    listed = [(pid, members[pid]) for pid in sorted(first[:PEERS_LISTED])]
    goodput, since = held_goodput(
        node.events, node.started_at, now, node.peer_id, node.shares, node.pcfg.overlap
    )
    t = node.transport
    return {
        "peer_id": node.peer_id,
        "swarm": node.settings.swarm,
        "client_mode": node.settings.client_mode,
        "merge_rule": node.pcfg.robust,  # centered-clip where learners are not trusted (protocol.robust)
        "elect": "workers" if node.settings.elect_workers else "anyone",  # who may synchronise (``elect``)
        "uptime_s": now - node.started_at,
        "joined_by": node.joined_by,
        "maddrs": node.view.addrs,
        "model_hash": node.global_hash(),
        "rounds_merged": node.rounds_merged(),
        "tokens_merged": node.tokens_merged(),
        "learner": {
            "steps": node.learner.steps,
            "tokens": ll.tokens,
            "tokens_per_s": ll.tokens_per_s(),
            "loss": ll.loss_ema,
            "eval_loss": ll.eval_loss,
            "eval_history": ll.eval_history[-20:],
            "paused": ll.paused.is_set(),
            "idle": ll.idle.is_set(),
            "tokens_per_step": node.learner.tokens_per_step,
            "unit": node.unit.status() if node.unit is not None else None,
        },
        "fragments": frags,
        # CPU seconds of this process (every thread, not its DHT process or p2pd) and of its learner thread:
        # the rest is the node's own work beside the learner (agent, merges, checkpoints, status)
        "cpu": {
            "process_s": round(sum(os.times()[:2]), 2),
            "learner_s": None if (c := ll.cpu_s()) is None else round(c, 2),
        },
        # Merges this node will make without anything new arriving (rounds holding their quorum, in their
        # grace window or being merged) and contributions it has yet to send: a quiet swarm has none.
        "in_flight": sum(
            1 for st in node.syncs if st.phase.value != "collecting" or has_quorum(node.pcfg, st)
        )
        + (node.outbox.qsize() if hasattr(node, "outbox") else 0),
        "peer_count": len(members),
        "reachable_count": sum(1 for pid in members if reachable(pid)),
        # at most PEERS_LISTED: this node, the fragments' synchronisers, then the others by peer id (a view of
        # 2,000 members made every document a list of 2,000)
        "peers": [
            {
                "peer_id": pid,
                "client_mode": m.client_mode,
                "tokens_per_s": m.tokens_per_s,
                "step": m.step,
                "rounds": sum(int(h[0]) for h in m.heads.values()),
                "expires_in_s": m.expires_at - now,
                # roles and reachability: the fragments it synchronises now; False while a call to it
                # failed within ttl_s (it is skipped as synchroniser) or the block test hook cuts it off
                "synchronises": synchronises.get(pid, []),
                "reachable": reachable(pid),
            }
            for pid, m in listed
        ],
        # what the node holds by part, against resident memory and the fp32 weights (node.swarm.memory)
        "memory": memory_breakdown(node),
        "bytes_sent": t.bytes_out if t else 0,
        "bytes_received": t.bytes_in if t else 0,
        "refused": dict(t.refused) if t else {},
        "transfers": t.transfers(now) if t else {"in_flight": [], "recent": [], "link_bps": {}},
        "guard": node.peer_scores.status(),
        "distrusted": node.agreement.status()["distrusted"],  # left out of this node's merges
        "counters": dict(node.counters),
        "goodput": goodput,
        "goodput_since": since,  # the node's start, or its oldest record still in memory
        "blocked": sorted(node.view.blocked),
    }


def _forget(node: Any) -> None:
    """Test hook: every open round not merging starts over here without its contributions, as an undo that
    carries none would (``Receipts.renounce`` then hands on the rounds whose receipts it can no longer keep)."""
    lost = {}
    for p, st in enumerate(node.syncs):
        cids = {c.cid for c in (*st.pending.values(), *st.queued.values())}
        if cids and st.phase is not Phase.MERGING:
            node.reset_sync(p, merged=cids)
            lost[p] = len(cids)
    node.events.emit("forget", t=time.time(), fragments=lost)


def apply_control(node: Any, action: str, peers: list[str]) -> tuple[int, dict]:
    """Carry out an authorised, parsed ``POST /control``: the HTTP code and the JSON answer."""
    ll = node.learner_loop
    if action == "pause":
        ll.paused.set()
    elif action == "resume":
        ll.paused.clear()
    elif action == "stop":
        node.request_stop("stop requested over the status endpoint")
    elif action == "evaluate":  # the global model as it is now; the eval event follows
        node.loop.call_soon_threadsafe(node.evaluate_now.set)
    elif action in ("block", "forget") and not node.settings.test_hooks:
        return 403, {"error": f"{action} is a test hook; start the node with --test-hooks"}
    elif action == "forget":  # the open rounds' contributions lost here, the receipts given for them kept
        node.loop.call_soon_threadsafe(_forget, node)
    elif action == "block":
        node.view.blocked = set(peers)
        node.events.emit("partition", t=time.time(), blocked=sorted(peers))
    return 200, {"ok": True, "action": action}
