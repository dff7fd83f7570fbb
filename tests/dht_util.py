"""Helpers for tests that run real hivemind DHT processes on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from dht.identity import Identity
from dht.launch import start_dht

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@contextlib.contextmanager
def dht_chain(tmp: Path, n: int = 3) -> Iterator[list[tuple[Identity, object]]]:
    """``n`` DHT nodes; every one after the first bootstraps from the first. Yields [(identity, dht), ...]
    and shuts them all down on exit."""
    nodes: list[tuple[Identity, object]] = []
    try:
        for i in range(n):
            ident = Identity.generate()
            path = str(ident.save(tmp / f"n{i}.key"))
            peers = [str(a) for a in nodes[0][1].get_visible_maddrs()] if nodes else []
            nodes.append((ident, start_dht(path, LOOPBACK, peers, timeout_s=30)))
        yield nodes
    finally:
        for _, dht in nodes:
            dht.shutdown()
