"""The delay line that adds round trips between network namespaces (``node.chaos.delay``): on a socket pair
standing in for its TUN device, and between two namespaces of a lab (root)."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time

import pytest

from node.chaos.delay import DelayLine, main
from tests.netns_util import open_lab


def _pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setblocking(False)
    return a, b


def test_each_packet_comes_back_whole_in_order_after_the_delay():
    a, b = _pair()
    line = DelayLine(a.fileno(), 0.05)
    runner = threading.Thread(target=line.run, kwargs={"until": time.monotonic() + 5})
    runner.start()
    try:
        sent = [os.urandom(n) for n in (1, 1400, 9000, 60, 1500)]
        t0 = time.monotonic()
        for pkt in sent:
            b.send(pkt)
        b.settimeout(5)
        got = [b.recv(1 << 16) for _ in sent]
        took = time.monotonic() - t0
    finally:
        line.stop()
        runner.join(5)
        a.close()
        b.close()
    assert got == sent
    assert 0.045 < took < 1.0, took
    assert line.passed == len(sent) and line.dropped == 0 and line.held_bytes == 0


def test_past_its_limit_the_line_drops_and_keeps_what_it_held():
    a, b = _pair()
    line = DelayLine(a.fileno(), 0.2, limit=3000)
    for _ in range(4):
        b.send(b"x" * 1000)
    line.run(until=time.monotonic() + 0.05)  # reads all four, holds three, releases none yet
    assert (len(line.held), line.held_bytes, line.dropped, line.passed) == (3, 3000, 1, 0)
    line.run(until=time.monotonic() + 0.4)
    b.settimeout(1)
    assert [b.recv(4096) for _ in range(3)] == [b"x" * 1000] * 3
    assert line.passed == 3 and line.held_bytes == 0
    a.close()
    b.close()


def test_a_bad_flag_is_refused_with_its_reason(capsys):
    for argv in (
        ["--one-way-ms", "-1"],
        ["--one-way-ms", "5", "--limit", "10"],
        ["--one-way-ms", "5", "--dev", "x" * 16],
    ):
        with pytest.raises(SystemExit):
            main(argv)
    assert "--dev" in capsys.readouterr().err
    with pytest.raises(ValueError, match="delay"):
        DelayLine(0, 11.0)


@pytest.mark.slow
def test_between_two_namespaces_every_round_trip_takes_the_rtt_and_bytes_arrive_whole():
    """A lab of two capped nodes with an 80 ms round trip: a TCP connect (one round trip) from node 0 to node 1
    takes 80 ms or more; 300 KB cross it whole."""
    lab = open_lab(2, "20mbit", "dl", rtt_ms=80)
    blob = os.urandom(300_000)
    digest, ready = {}, threading.Event()

    def serve():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((lab.addr(1), 5001))
            s.listen()
            s.settimeout(20)
            ready.set()
            conn, _ = s.accept()
            with conn:
                conn.settimeout(20)
                data = bytearray()
                while len(data) < len(blob) and (d := conn.recv(1 << 16)):
                    data += d
                digest["got"] = hashlib.sha256(data).digest()
                conn.sendall(b"k")

    def dial():
        with socket.socket() as c:
            c.settimeout(20)
            t0 = time.monotonic()
            c.connect((lab.addr(1), 5001))
            rtt = time.monotonic() - t0
            c.sendall(blob)
            assert c.recv(1) == b"k"
            return rtt

    try:
        server = threading.Thread(target=lambda: lab.inside(1, serve))
        server.start()
        assert ready.wait(10)
        rtt = lab.inside(0, dial)
        server.join(30)
    finally:
        lab.close()
    assert 0.079 < rtt < 0.5, rtt
    assert digest["got"] == hashlib.sha256(blob).digest()
