"""The node's HTTP status endpoint, DESIGN §7 (the client is ``node.common.status_client``).

``GET /status`` returns the node's view of the swarm as JSON: peers, who synchronises what, rounds, loss,
tokens/s, bytes sent and received, refusals by code, goodput. ``POST /control`` with ``{"action": ...}``
pauses or resumes the learner or stops the node (``ddiloco up`` uses it to end a run cleanly); with
``test_hooks`` on, ``{"action": "block", "peers": [...]}`` makes the node treat those peers as unreachable,
which is how the test suite partitions a swarm on one host. Reading needs no second p2p daemon: plain HTTP
on the node's status port (bind it to loopback, the default, or put it behind your own access control).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from node.common.events import EventLog, record_time
from node.common.status_client import ACTIONS, StatusError  # noqa: F401 - re-exported for the server's callers
from node.swarm.limits import TokenBucket
from protocol.errors import DDiLoCoError
from protocol.goodput import compute_goodput
from protocol.synchroniser import has_quorum

logger = logging.getLogger(__name__)
MAX_REQUEST = 64 * 1024
STATUS_BUILDS_PER_S = 2.0  # GET /status builds at most this many documents a second, sustained...
STATUS_BUILD_BURST = 4  # ...after a burst of this many; other requests get the last document built


class BadRequest(DDiLoCoError, ValueError):
    """An HTTP request to the status endpoint is malformed; answered with 400 and this message."""


def parse_request_head(head: bytes) -> tuple[str, str, int]:
    """Method, path and Content-Length of an HTTP request head (the bytes up to the blank line)."""
    if len(head) > MAX_REQUEST:
        raise BadRequest(f"request header of {len(head)} bytes exceeds {MAX_REQUEST}")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) != 3:
        raise BadRequest(f"request line {lines[0][:80]!r} is not 'METHOD PATH VERSION'")
    method, path, _ = parts
    length = 0
    for line in lines[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == "content-length":
            v = v.strip()
            if not (v.isascii() and v.isdigit() and len(v) <= 9):
                raise BadRequest(f"Content-Length {v[:20]!r} is not a byte count")
            length = int(v)
    if length > MAX_REQUEST:
        raise BadRequest(f"request body of {length} bytes exceeds {MAX_REQUEST}")
    return method, path, length


def parse_control(body: bytes) -> tuple[str, list[str]]:
    """The action of a POST /control body and, for ``block``, the peers; BadRequest says what is wrong."""
    usage = 'expected JSON {"action": "pause" | "resume" | "stop" | "block"}'
    try:
        req = json.loads(body or b"{}")
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"{usage}: {type(e).__name__}: {str(e)[:200]}") from e
    if not isinstance(req, dict) or "action" not in req:
        raise BadRequest(usage)
    action = req["action"]
    if not isinstance(action, str) or action not in ACTIONS:
        raise BadRequest(f"unknown action {repr(action)[:80]}: pause, resume, stop or block")
    peers = req.get("peers", []) if action == "block" else []
    if not isinstance(peers, list) or not all(isinstance(x, str) for x in peers):
        raise BadRequest("peers must be a list of peer ids")
    return action, peers


def held_goodput(
    events: EventLog, started_at: float, now: float, learner: str, shares: list[float]
) -> tuple[float | None, float]:
    """Goodput of the records held in memory, and since when: the node's start, or, once older records were
    let go (``EventLog(keep=...)``), the oldest record held. None when the records cannot give one."""
    records = events.snapshot()
    since = record_time(records[0]) if events.trimmed and records else started_at
    records.append({"kind": "run", "t0": since, "t1": now, "learners": [learner], "shares": shares})
    try:
        return compute_goodput(records).goodput, since
    except (ValueError, KeyError):
        return None, since


def status_doc(node: Any) -> dict:  # node: the running node.swarm.agent.Node (which imports this module)
    ll = node.learner_loop
    members = node.live_members()
    frags = []
    for p, rep in enumerate(node.replicas):
        cands = node.candidates(p)
        frags.append(
            {
                "fragment": p,
                "round": rep.round,
                "hash": rep.hash[:16],
                "synchroniser": cands[0] if cands else None,
                "collecting": node.syncs[p].phase.value if p in node.leases else None,
            }
        )
    now = time.time()
    goodput, since = held_goodput(node.events, node.started_at, now, node.peer_id, node.shares)
    t = node.transport
    return {
        "peer_id": node.peer_id,
        "swarm": node.settings.swarm,
        "client_mode": node.settings.client_mode,
        "uptime_s": now - node.started_at,
        "joined_by": node.joined_by,
        "maddrs": node._addrs,
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
        # Merges this node will make without anything new arriving (rounds holding their quorum, in their
        # grace window or being merged) and contributions it has yet to send: a quiet swarm has none.
        "in_flight": sum(
            1 for st in node.syncs if st.phase.value != "collecting" or has_quorum(node.pcfg, st)
        )
        + (node.outbox.qsize() if hasattr(node, "outbox") else 0),
        "peers": [
            {
                "peer_id": pid,
                "client_mode": m.client_mode,
                "tokens_per_s": m.tokens_per_s,
                "step": m.step,
                "rounds": sum(int(h[0]) for h in m.heads.values()),
                "expires_in_s": m.expires_at - now,
            }
            for pid, m in sorted(members.items())
        ],
        "bytes_sent": t.bytes_out if t else 0,
        "bytes_received": t.bytes_in if t else 0,
        "refused": dict(t.refused) if t else {},
        "guard": node.guard.status(),
        "counters": dict(node.counters),
        "goodput": goodput,
        "goodput_since": since,  # the node's start, or its oldest record still in memory
        "blocked": sorted(node.blocked),
    }


class StatusServer:
    """Serves GET /status from a cached document: building one walks the election, the goodput records and
    every replica's hash on the node's event loop, and a flood of requests slowed the learner by ~40% when
    each built its own (issue 19). A token bucket (``STATUS_BUILD_BURST`` builds, refilled at
    ``STATUS_BUILDS_PER_S``) decides: a reader polling now and then gets a fresh document every time, a
    flood gets one built every 0.5 s on average. A POST /control makes the next GET build afresh, so a
    reader sees what it changed. ``builds`` counts the documents built (``status_builds`` in each)."""

    def __init__(
        self, node: Any, builds_per_s: float = STATUS_BUILDS_PER_S, burst: int = STATUS_BUILD_BURST
    ) -> None:
        self.node = node
        self.server: asyncio.AbstractServer | None = None
        self.url = ""
        self.builds = 0
        self._bucket = TokenBucket(burst=burst, per_s=builds_per_s)
        self._doc: dict | None = None

    def status(self) -> dict:
        """The status document: a fresh one while the build budget lasts, else the last one built."""
        if self._bucket.take("builds", 1, time.monotonic()) == 0.0 or self._doc is None:
            self.builds += 1
            self._doc = {**status_doc(self.node), "status_builds": self.builds}
        return self._doc

    async def start(self, host: str, port: int) -> None:
        try:
            self.server = await asyncio.start_server(self._serve, host, port)
        except OSError as e:
            raise DDiLoCoError(
                f"cannot serve status on {host}:{port}: {e.strerror} (port in use? use status_port = 0)"
            ) from e
        h, p = self.server.sockets[0].getsockname()[:2]
        self.url = f"http://{h}:{p}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                method, path, length = parse_request_head(await reader.readuntil(b"\r\n\r\n"))
                body = await reader.readexactly(length) if length else b""
                if method != "GET":
                    self._doc = None  # whatever a control request changes shows in the next document
                code, doc = self._route(method, path, body)
        except (TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            code, doc = 400, {"error": f"bad request: {type(e).__name__}: {e}"}
        except Exception as e:  # noqa: BLE001 - a status bug must not take the node down
            logger.exception("status endpoint failed")
            code, doc = 500, {"error": f"{type(e).__name__}: {e}"}
        raw = json.dumps(doc, default=str).encode()
        reason = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 500: "Error"}[code]
        writer.write(
            f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n"
            f"Connection: close\r\n\r\n".encode()
            + raw
        )
        try:
            await asyncio.wait_for(writer.drain(), 10)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def _route(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        node = self.node
        if method == "GET" and path.split("?")[0] == "/status":
            return 200, self.status()
        if method == "POST" and path == "/control":
            try:
                action, peers = parse_control(body)
            except BadRequest as e:
                return 400, {"error": str(e)}
            ll = node.learner_loop
            if action == "pause":
                ll.paused.set()
            elif action == "resume":
                ll.paused.clear()
            elif action == "stop":
                node.request_stop("stop requested over the status endpoint")
            elif action == "block":
                if not node.settings.test_hooks:
                    return 403, {"error": "block is a test hook; start the node with --test-hooks"}
                node.blocked = set(peers)
                node.events.emit("partition", t=time.time(), blocked=sorted(peers))
            return 200, {"ok": True, "action": action}
        return 404, {"error": f"no route {method} {path}: use GET /status or POST /control"}
