"""The node's HTTP endpoint (docs/design.md, section 7), on aiohttp and the node's event loop.

Routes:
  * ``GET /status``: the status document (``node.swarm.status.status_doc``) as JSON, from a copy rebuilt at
    most every ``CACHE_S`` seconds while the node trains (a flood of readers costs the node one build per
    interval, not one each), and at the next request after a rarer change (``FREQUENT``, ``on_event``);
  * ``POST /control``: pause, resume, stop, evaluate (and the ``block`` test hook), only with the node's control token
    (``Authorization: Bearer TOKEN``); without it, 403 before the body is read, and nothing changes;
  * ``GET /metrics``: Prometheus exposition from the node's own registry (``node.swarm.metrics``);
  * ``GET /history``: the curves and recent lists the dashboard draws (``node.swarm.history``);
  * ``GET /``: the dashboard, a page and a script shipped in ``node/swarm/dashboard`` (no build step, no CDN).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from node.swarm.history import History
from node.swarm.metrics import NodeMetrics
from node.swarm.status import MAX_REQUEST, BadRequest, apply_control, parse_control, status_doc
from protocol.errors import DDiLoCoError

logger = logging.getLogger(__name__)
CACHE_S = 0.5  # the status document served is at most this old, unless a rarer event made it stale
# Records of ordinary training, many a second: they leave the cached document in place. Any other record
# (join, reject, ban, failover, fork, resync, drop, relink, checkpoint, ...) marks it stale, so a reader
# sees such a change at once while a flood of readers still costs at most one build per CACHE_S.
FREQUENT = frozenset({"step", "contribute", "accept", "adopt", "merge", "eval", "align", "block"})
SAMPLE_S = 5.0  # how often the goodput curve of /history gets a point
DASHBOARD = Path(__file__).with_name("dashboard")
ASSETS = {"/": ("index.html", "text/html"), "/dashboard.js": ("dashboard.js", "text/javascript")}


def _json(code: int, doc: dict) -> web.Response:
    return web.Response(status=code, text=json.dumps(doc, default=str), content_type="application/json")


class StatusServer:
    def __init__(
        self,
        node: Any,
        token: str,
        build: Callable[[Any], dict] = status_doc,
        clock: Callable[[], float] = time.monotonic,
        history: History | None = None,
    ) -> None:
        self.token = token  # what POST /control must carry (``write_control_token``)
        self.node = node
        self.build, self.clock = build, clock
        self.builds = 0  # documents built (the cache keeps this far below the requests served)
        self._doc: dict | None = None
        self._built_at = 0.0
        self._version = 0  # bumped by a change the cached document must not hide (``on_event``)
        self._doc_version = -1
        self.history = history
        self.metrics = NodeMetrics(getattr(node, "peer_id", ""), self.document)
        self.runner: web.AppRunner | None = None
        self._sampler: asyncio.Task | None = None
        self.url = ""

    # ------------------------------------------------------------------ the cached document
    def document(self) -> dict:
        now, version = self.clock(), self._version
        if self._doc is None or version != self._doc_version or now - self._built_at >= CACHE_S:
            # an event during the build bumps _version again, so the next request rebuilds
            self.builds += 1
            doc = {**self.build(self.node), "status_builds": self.builds}  # which build a reader got
            self._doc, self._doc_version, self._built_at = doc, version, now
        return self._doc

    def stale(self) -> None:
        self._version += 1

    def on_event(self, rec: dict) -> None:
        """The node's event records (``EventLog.subscribe``): metrics, and the cache marked stale."""
        self.metrics.on_event(rec)
        if rec.get("kind") not in FREQUENT:
            self.stale()

    async def _sample_loop(self) -> None:
        while True:
            try:
                doc = self.document()
                self.history.sample(time.time(), doc["goodput"], doc["learner"]["tokens_per_s"])
            except Exception:  # a status bug costs a point of the curve, not the sampler
                logger.exception("sampling the status document for /history failed")
            await asyncio.sleep(SAMPLE_S)

    # ------------------------------------------------------------------ lifecycle
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST, middlewares=[self._errors])
        app.router.add_get("/status", self._status)
        app.router.add_post("/control", self._control)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/history", self._history)
        for route in ASSETS:
            app.router.add_get(route, self._asset)
        return app

    async def start(self, host: str, port: int) -> None:
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        try:
            await site.start()
        except OSError as e:
            await self.runner.cleanup()
            self.runner = None
            raise DDiLoCoError(
                f"cannot serve status on {host}:{port}: {e.strerror} (port in use? use status_port = 0)"
            ) from e
        h, p = self.runner.addresses[0][:2]
        self.url = f"http://{h}:{p}"
        if self.history is not None:
            self._sampler = asyncio.ensure_future(self._sample_loop())  # owned here, cancelled in stop()

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(BaseException):
                await self._sampler
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # ------------------------------------------------------------------ handlers
    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every answer is JSON with an ``error`` the client shows, including aiohttp's own 4xx."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status == 404:
                msg = f"no route {request.method} {request.path}: use GET /status, /metrics, /history, / or POST /control"
            else:
                msg = e.reason
            return _json(e.status, {"error": msg})
        except Exception as e:  # a status bug must not take the node down
            logger.exception("status endpoint failed")
            return _json(500, {"error": f"{type(e).__name__}: {e}"})

    async def _status(self, request: web.Request) -> web.Response:
        return _json(200, self.document())

    def _authorised(self, request: web.Request) -> bool:
        scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
        token = token.strip()
        return (
            scheme.lower() == "bearer"
            and bool(token)
            and hmac.compare_digest(token.encode(), self.token.encode())
        )

    async def _control(self, request: web.Request) -> web.Response:
        if not self._authorised(request):  # refused before the body is read, and nothing changes
            return _json(
                403,
                {
                    "error": "POST /control needs the node's control token: send "
                    "'Authorization: Bearer TOKEN' with STATE_DIR/control.token"
                },
            )
        try:
            async with asyncio.timeout(10):
                body = await request.read()
            action, peers = parse_control(body)
        except (BadRequest, TimeoutError) as e:
            return _json(400, {"error": f"bad request: {e}"})
        code, doc = apply_control(self.node, action, peers)
        self.stale()  # the next /status shows the change
        return _json(code, doc)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _history(self, request: web.Request) -> web.Response:
        if self.history is None:
            return _json(404, {"error": "this node keeps no history"})
        return _json(200, self.history.doc())

    async def _asset(self, request: web.Request) -> web.Response:
        name, ctype = ASSETS[request.path]
        return web.Response(body=(DASHBOARD / name).read_bytes(), content_type=ctype)
