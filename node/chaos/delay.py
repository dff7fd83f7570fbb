"""A TCP relay that holds every byte for a fixed time each way: round trips between network namespaces,
where ``netem`` is not available (``NetLab(rtt_ms=...)``).

Run in the lab's hub namespace, it listens on one address per node and forwards each connection to that
node's own address. The node announces the relay's address (``--announce-maddrs``), so every connection
to it from a peer goes through one relay, which holds each direction's bytes ``one_way_ms``: a round trip
between two nodes takes ``2 x one_way_ms`` more. The token buckets on the nodes' links still cap both legs.

Each direction keeps at most ``window`` bytes held (then it stops reading, and TCP's flow control reaches the
sender): a path with that much in flight, as a window-limited TCP connection over a long link has.

``python -m node.chaos.delay --one-way-ms 25 LISTEN_HOST:PORT=TARGET_HOST:PORT ...``; it runs until it
is sent SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections import deque

WINDOW = 4 << 20  # bytes held a direction at most


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, window: int
) -> None:
    """Forward ``reader`` to ``writer``, each piece ``delay_s`` after it was read."""
    loop = asyncio.get_running_loop()
    held: deque[tuple[float, bytes]] = deque()
    nbytes = [0]
    more, room, done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    room.set()

    async def read() -> None:
        try:
            while chunk := await reader.read(64 << 10):
                await room.wait()
                held.append((loop.time() + delay_s, chunk))
                nbytes[0] += len(chunk)
                if nbytes[0] >= window:
                    room.clear()
                more.set()
        except (ConnectionError, OSError):
            pass
        finally:
            done.set()
            more.set()

    async def write() -> None:
        while True:
            if not held:
                if done.is_set():
                    break
                more.clear()
                await more.wait()
                continue
            due, chunk = held[0]
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            held.popleft()
            nbytes[0] -= len(chunk)
            if nbytes[0] < window:
                room.set()
            writer.write(chunk)
            await writer.drain()

    reading = asyncio.ensure_future(read())
    try:
        await write()
    except (ConnectionError, OSError):
        pass
    finally:
        reading.cancel()
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()
        with contextlib.suppress(BaseException):
            await reading


async def _connection(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    target: tuple[str, int],
    delay_s: float,
    window: int,
) -> None:
    try:
        r2, w2 = await asyncio.wait_for(asyncio.open_connection(*target), timeout=10)
    except (OSError, TimeoutError):
        writer.close()
        return
    try:
        await asyncio.gather(_pump(reader, w2, delay_s, window), _pump(r2, writer, delay_s, window))
    finally:
        for w in (writer, w2):
            w.close()


def _endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def _route(text: str) -> tuple[tuple[str, int], tuple[str, int]]:
    listen, sep, target = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not LISTEN_HOST:PORT=TARGET_HOST:PORT")
    return _endpoint(listen), _endpoint(target)


async def serve(routes, one_way_ms: float, window: int = WINDOW, ready=None) -> None:
    """Relay every route until cancelled, or SIGTERM/SIGINT; ``ready()`` is called once every route listens."""
    delay_s = one_way_ms / 1000.0
    servers = []
    for listen, target in routes:

        def handle(r, w, target=target):
            return _connection(r, w, target, delay_s, window)

        servers.append(await asyncio.start_server(handle, *listen))
    if ready is not None:
        ready()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for s in servers:
            s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m node.chaos.delay", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--one-way-ms", type=float, required=True, help="milliseconds each byte is held, each way"
    )
    ap.add_argument("--window", type=int, default=WINDOW, help="bytes held a direction at most")
    ap.add_argument("routes", nargs="+", type=_route, help="LISTEN_HOST:PORT=TARGET_HOST:PORT")
    args = ap.parse_args(argv)
    if not 0 <= args.one_way_ms <= 10_000:
        ap.error(f"--one-way-ms {args.one_way_ms:g}: 0 to 10000")
    if args.window < 1 << 16:
        ap.error(f"--window {args.window}: at least 65536 bytes")
    asyncio.run(serve(args.routes, args.one_way_ms, args.window, lambda: print("relaying", flush=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
