"""Round trips between network namespaces where ``netem`` is not available: a delay line for IP packets.

With a round trip set (``NetLab(rtt_ms=...)``) the lab's hub namespace routes instead of bridging: every
packet that arrives on a node's hub port is routed into a TUN device (a policy rule per port), and this
process, which holds the device, writes each packet back into it ``one_way_ms`` after reading it; the kernel
then routes it on to its destination's port. A packet crosses the hub once, so every round trip between two
nodes takes ``2 x one_way_ms`` more, whatever carries it: libp2p, the DHT, a gloo process group, a ping.
The token buckets on the nodes' links still cap both legs (upload before the line, download after it).

Packets leave in the order they came, each ``one_way_ms`` after it was read. The line holds at most ``limit``
bytes and drops what comes past that, as a router's full queue does (TCP then backs off); with a
round trip's worth of a thin link in flight it never fills.

``python -m node.chaos.delay --one-way-ms 25 --dev tun0`` (root, inside the hub namespace): it makes the
device, prints one line (``delaying on tun0``) and runs until it is sent SIGTERM or SIGINT; the device goes
with it.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import select
import signal
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA  # _IOW('T', 202, int)
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
LIMIT = 16 << 20  # bytes held at most
READ_SIZE = 1 << 16  # larger than any packet a device with a 64 KB MTU hands over


def open_tun(name: str) -> int:
    """A TUN device ``name`` in this process's network namespace (made if missing), non-blocking; it carries
    bare IP packets (no packet-information header)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class DelayLine:
    """Reads packets from ``fd`` and writes each back to it ``delay_s`` later, in order. ``fd`` is anything
    that hands over one packet a read and takes one a write, non-blocking: a TUN device, or one end of a
    ``SOCK_SEQPACKET`` pair in a test."""

    def __init__(self, fd: int, delay_s: float, limit: int = LIMIT) -> None:
        if not 0 <= delay_s <= 10.0:
            raise ValueError(f"delay {delay_s:g} s is invalid: 0 to 10 s")
        self.fd, self.delay_s, self.limit = fd, delay_s, limit
        self.held: deque[tuple[float, bytes]] = deque()
        self.held_bytes = 0
        self.passed = self.dropped = self.failed = 0
        self.stopping = False

    def _read_all(self) -> None:
        now = time.monotonic()
        while True:
            try:
                pkt = os.read(self.fd, READ_SIZE)
            except BlockingIOError:
                return
            if not pkt:
                self.stopping = True  # the other end is gone (a socket pair in a test)
                return
            if self.held_bytes + len(pkt) > self.limit:
                self.dropped += 1
                continue
            self.held.append((now + self.delay_s, pkt))
            self.held_bytes += len(pkt)

    def _release_due(self) -> None:
        now = time.monotonic()
        while self.held and self.held[0][0] <= now:
            _, pkt = self.held.popleft()
            self.held_bytes -= len(pkt)
            try:
                os.write(self.fd, pkt)
                self.passed += 1
            except BlockingIOError:
                self.dropped += 1  # the stack's backlog is full: dropped, as a congested router would
            except OSError:
                self.failed += 1  # a packet the kernel refuses (malformed): it goes no further

    def run(self, until: float = float("inf")) -> None:
        """Until ``stop()``, or ``until`` (a ``time.monotonic()``), or the fd's other end closes."""
        while not self.stopping and time.monotonic() < until:
            self._release_due()
            wait = self.held[0][0] - time.monotonic() if self.held else 0.2
            ready, _, _ = select.select([self.fd], [], [], min(max(wait, 0.0), 0.2))
            if ready:
                self._read_all()

    def stop(self) -> None:
        self.stopping = True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m node.chaos.delay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--one-way-ms", type=float, required=True, help="milliseconds each packet is held")
    ap.add_argument("--dev", default="tun0", help="the TUN device to make and hold (default tun0)")
    ap.add_argument("--limit", type=int, default=LIMIT, help="bytes held at most; past that, packets drop")
    args = ap.parse_args(argv)
    if not 0 <= args.one_way_ms <= 10_000:
        ap.error(f"--one-way-ms {args.one_way_ms:g}: 0 to 10000")
    if args.limit < 1 << 16:
        ap.error(f"--limit {args.limit}: at least 65536 bytes")
    if not 0 < len(args.dev.encode()) < 16:
        ap.error(f"--dev {args.dev!r}: a device name of 1 to 15 bytes")
    try:
        fd = open_tun(args.dev)
    except OSError as e:
        print(f"cannot open TUN device {args.dev}: {e} (needs root and /dev/net/tun)", flush=True)
        return 1
    line = DelayLine(fd, args.one_way_ms / 1000.0, args.limit)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: line.stop())
    print(f"delaying on {args.dev}", flush=True)
    line.run()
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
