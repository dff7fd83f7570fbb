"""How fast bytes cross the p2p daemon on this machine: the ceiling under a joiner's state download.

Two hivemind P2P daemons (``p2pd``, the one the nodes use) on loopback, in one process. Measured the same
way, one after the other, in the same run:

- ``tcp``: a plain asyncio TCP connection on loopback (the machine's own ceiling, no daemon);
- ``p2pd raw``: one libp2p stream through both daemons (Noise, yamux), the reader draining it; then four
  such streams at once;
- ``transport``: the node's own request/response (``node.swarm.transport``: framed, chunked, one stream per
  request), one server, and two servers at once (a joiner downloading from two donors).

Each moves ``--mb`` megabytes per repetition and prints the median MB/s of ``--reps`` repetitions, and each
daemon's ratio against the plain TCP figure.

    .venv/bin/python bench/p2p_throughput.py                 # 256 MB, 3 repetitions
    .venv/bin/python bench/p2p_throughput.py --mb 686 --reps 1 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RAW = "ddiloco/bench/raw/1"
CHUNK = 1 << 20


async def _send(writer: asyncio.StreamWriter, nbytes: int) -> None:
    """Write ``nbytes`` zero bytes in chunks, then close: the serving side of every case."""
    block = memoryview(bytes(CHUNK))
    left = nbytes
    while left > 0:
        writer.write(block[: min(CHUNK, left)])
        left -= min(CHUNK, left)
        await writer.drain()
    writer.close()


async def _tcp(nbytes: int) -> float:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _send(writer, nbytes)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    t = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = 0
    while chunk := await reader.read(CHUNK):
        got += len(chunk)
    dt = time.perf_counter() - t
    writer.close()
    server.close()
    await server.wait_closed()
    assert got == nbytes, (got, nbytes)
    return nbytes / dt / 1e6


async def _pair(n_servers: int):
    from hivemind.p2p import P2P

    servers = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(n_servers)]
    peers = []
    for s in servers:
        peers += [str(m) for m in await s.get_visible_maddrs()]
    client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers)
    return servers, client


async def _raw(nbytes: int, streams: int = 1) -> float:
    (server,), client = await _pair(1)
    share = nbytes // streams

    async def serve(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _send(writer, share)

    async def one() -> int:
        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, RAW)
        got = 0
        while chunk := await reader.read(CHUNK):
            got += len(chunk)
        writer.close()
        return got

    try:
        await server.add_binary_stream_handler(RAW, serve)
        t = time.perf_counter()
        got = sum(await asyncio.gather(*(one() for _ in range(streams))))
        dt = time.perf_counter() - t
        assert got == share * streams, (got, nbytes)
        return got / dt / 1e6
    finally:
        await client.shutdown()
        await server.shutdown()


async def _transport(nbytes: int, n_servers: int) -> float:
    from node.swarm.transport import Reply, Transport

    servers, client = await _pair(n_servers)
    share = nbytes // n_servers
    body = bytes(share)

    async def handler(caller: str, payload: bytes) -> Reply:
        return Reply(True, body=body)

    try:
        for s in servers:
            tr = Transport(s, max_bytes=share + (1 << 20), timeout_s=600)
            tr.register("blob", handler)
            await tr.start()
        tc = Transport(client, max_bytes=share + (1 << 20), timeout_s=600)
        t = time.perf_counter()
        replies = await asyncio.gather(*(tc.call(s.peer_id.to_base58(), "blob") for s in servers))
        dt = time.perf_counter() - t
        got = sum(len(r.body) for r in replies)
        assert all(r.ok for r in replies) and got == share * n_servers, (
            got,
            [(r.code, r.message) for r in replies],
        )
        return got / dt / 1e6
    finally:
        await client.shutdown()
        for s in servers:
            await s.shutdown()


async def _run(mb: float, reps: int) -> dict:
    nbytes = int(mb * 1e6)
    cases = {
        "tcp": lambda: _tcp(nbytes),
        "p2pd raw": lambda: _raw(nbytes),
        "p2pd raw, 4 streams": lambda: _raw(nbytes, 4),
        "transport, 1 server": lambda: _transport(nbytes, 1),
        "transport, 2 servers": lambda: _transport(nbytes, 2),
    }
    out = {name: [] for name in cases}
    for r in range(reps):
        for name, fn in cases.items():  # interleaved: a slow moment of the machine hits every case alike
            out[name].append(await fn())
            print(f"p2p: rep {r + 1}/{reps} {name}: {out[name][-1]:.0f} MB/s", file=sys.stderr, flush=True)
    med = {name: statistics.median(v) for name, v in out.items()}
    return {"mb": mb, "reps": reps, "mb_per_s": med, "x_tcp": {k: v / med["tcp"] for k, v in med.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=256.0, help="megabytes per repetition and case")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (median reported)")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    a = ap.parse_args(argv)
    res = asyncio.run(_run(a.mb, a.reps))
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"{'case':24s} {'MB/s':>8s} {'x tcp':>7s}   ({a.mb:g} MB each, median of {a.reps})")
    for name, v in res["mb_per_s"].items():
        print(f"{name:24s} {v:8.0f} {res['x_tcp'][name]:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
