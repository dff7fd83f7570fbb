"""The node's HTTP endpoint (``node.swarm.server``) on its own: real HTTP on loopback against a server whose
collaborators (the node, the document builder, the clock) are handed in, so the cache is counted exactly.
The same server inside real node processes: tests/test_operating.py and tests/test_hostile_state.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from types import SimpleNamespace

import aiohttp
import pytest

from node.swarm.server import CACHE_S, StatusServer
from protocol.errors import DDiLoCoError

TOKEN = "t" * 64


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _node() -> SimpleNamespace:
    stops: list[str] = []
    return SimpleNamespace(
        peer_id="12D3KooWTest",
        learner_loop=SimpleNamespace(paused=threading.Event()),
        settings=SimpleNamespace(test_hooks=False),
        request_stop=stops.append,
        stops=stops,
    )


def _server(builds: list[int], clock: Clock) -> StatusServer:
    def build(node) -> dict:
        builds.append(1)
        return {"n": len(builds)}

    return StatusServer(_node(), TOKEN, build=build, clock=clock)


async def _with_server(builds, clock, fn):
    srv = _server(builds, clock)
    await srv.start("127.0.0.1", 0)
    try:
        async with asyncio.timeout(30):
            return await fn(srv)
    finally:
        await srv.stop()


def test_a_status_flood_builds_the_document_once_per_interval():
    builds, clock = [], Clock()

    async def flood(srv):
        async with aiohttp.ClientSession() as http:

            async def get():
                async with http.get(srv.url + "/status") as r:
                    assert r.status == 200
                    return await r.json()

            first = await asyncio.gather(*(get() for _ in range(200)))
            clock.now += CACHE_S / 2
            more = await asyncio.gather(*(get() for _ in range(50)))
            clock.now += CACHE_S
            later = await get()
            return first, more, later

    first, more, later = asyncio.run(_with_server(builds, clock, flood))
    assert {d["n"] for d in first + more} == {1}, "250 requests inside one interval: one build"
    assert later == {"n": 2, "status_builds": 2} and len(builds) == 2


def test_training_records_keep_the_cached_document_and_rarer_ones_make_it_stale():
    builds, clock = [], Clock()
    srv = _server(builds, clock)
    assert srv.document() == {"n": 1, "status_builds": 1}
    for kind in ("step", "contribute", "adopt", "merge", "eval"):
        srv.on_event({"kind": kind, "t": 1.0, "cid": "c", "bytes": 10, "learners": [], "cids": []})
        assert srv.document() == {"n": 1, "status_builds": 1}, f"a {kind} record rebuilt the document"
    for n, kind in enumerate(("reject", "ban", "join", "failover"), start=2):
        srv.on_event({"kind": kind, "t": 1.0})
        doc = {"n": n, "status_builds": n}  # each document says which build it is
        assert srv.document() == doc and srv.document() == doc, kind


async def _raw(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")  # the answer comes although the body never does
    writer.close()
    return head


@pytest.mark.slow
def test_control_without_the_token_is_refused_before_the_body_arrives():
    builds, clock = [], Clock()

    async def probe(srv):
        heads = []
        for auth in (
            b"",
            b"Authorization: Bearer wrong\r\n",
            b"Authorization: Basic " + TOKEN.encode() + b"\r\n",
        ):
            heads.append(
                await _raw(
                    srv.url,
                    b"POST /control HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + auth
                    + b"Content-Length: 5000\r\n\r\n",
                )
            )
        return heads, srv.node

    heads, node = asyncio.run(_with_server(builds, clock, probe))
    for head in heads:
        assert head.startswith(b"HTTP/1.1 403"), head
    assert not node.learner_loop.paused.is_set() and node.stops == [] and builds == []


def test_control_with_the_token_acts_and_bad_bodies_are_400():
    builds, clock = [], Clock()

    async def control(srv):
        out = []
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            for body in (
                b"{not json",
                b'{"action": "explode"}',
                b"[1]",
                b'{"action": "block", "peers": ["p"]}',
                b'{"action": "forget"}',
            ):
                async with http.post(srv.url + "/control", data=body) as r:
                    out.append((r.status, (await r.json())["error"]))
            paused_before = srv.node.learner_loop.paused.is_set()
            async with http.post(srv.url + "/control", data=json.dumps({"action": "pause"})) as r:
                out.append((r.status, await r.json()))
            async with http.get(srv.url + "/nowhere") as r:
                out.append((r.status, (await r.json())["error"]))
            srv.node.loop, srv.node.evaluate_now = asyncio.get_running_loop(), asyncio.Event()
            async with http.post(srv.url + "/control", data=json.dumps({"action": "evaluate"})) as r:
                out.append((r.status, await r.json()))
            await asyncio.wait_for(srv.node.evaluate_now.wait(), 10)  # the eval loop's wait is cut short
        return out, paused_before, srv.node.learner_loop.paused.is_set()

    out, before, after = asyncio.run(_with_server(builds, clock, control))
    assert [code for code, _ in out[:3]] == [400, 400, 400]
    assert "expected JSON" in out[0][1] and "unknown action" in out[1][1]
    assert out[3][0] == 403 and "test hook" in out[3][1]
    assert out[4][0] == 403 and "forget is a test hook" in out[4][1]  # and nothing was forgotten
    assert not before and after and out[5] == (200, {"ok": True, "action": "pause"})
    assert out[6][0] == 404 and "GET /status" in out[6][1]
    assert out[7] == (200, {"ok": True, "action": "evaluate"})


def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]

        async def start():
            srv = _server([], Clock())
            await srv.start("127.0.0.1", port)

        with pytest.raises(DDiLoCoError, match=rf"cannot serve status on 127.0.0.1:{port}.*port in use"):
            asyncio.run(start())


def test_status_over_libp2p_is_served_from_the_http_cache():
    """A stranger opening ``/ddiloco/status/1`` streams in a loop was served a fresh document each time (473 a
    second, the learner 43% slower): the p2p side now answers with the HTTP side's cached document."""
    from types import SimpleNamespace

    from node.swarm.status_p2p import answer

    built = []
    node = SimpleNamespace(admission=None, peer_id="me")
    clock = [100.0]
    node.status_server = StatusServer(
        node, "token", build=lambda n: built.append(1) or {"x": len(built)}, clock=lambda: clock[0]
    )
    for _ in range(500):
        reply = answer(node, "stranger", {}, 0.0)
        assert reply["ok"] and reply["status"]["x"] == 1
    assert len(built) == 1
    clock[0] += 1.0  # older than the cache keeps a document: the next request builds one
    assert answer(node, "stranger", {}, 0.0)["status"]["x"] == 2
