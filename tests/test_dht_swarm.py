"""Membership over real hivemind DHT processes on loopback (docs/design.md, section 4): three nodes,
signed records, expiry, forged records, and start_dht's errors."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from dht.identity import Identity
from dht.launch import DHTStartError, SwarmUnreachable, start_dht
from dht.records import Member, RecordError, bucket_of, members_key, sign_member
from dht.swarm import Membership, get_dht_time
from protocol.errors import ConfigError
from tests.dht_util import LOOPBACK, dht_chain


def _ident(tmp, name: str) -> tuple[Identity, str]:
    ident = Identity.generate()
    return ident, str(ident.save(tmp / f"{name}.key"))


def _member(ident: Identity, ttl: float = 30.0, **kw) -> Member:
    now = get_dht_time()
    return Member(
        peer_id=ident.peer_id,
        addrs=("/ip4/127.0.0.1/tcp/1",),
        version="0.1.0",
        issued_at=now,
        expires_at=now + ttl,
        **kw,
    )


def _eventually(check, timeout_s: float = 15.0, every_s: float = 0.2):
    """Poll ``check`` until it returns something truthy; return it, or fail with its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            assert got, f"condition not met within {timeout_s} s (last: {got!r})"
            return got
        time.sleep(every_s)


def _our_sock_dirs() -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"ddiloco-dht-{os.getpid()}-*"))


@pytest.fixture(scope="module")
def swarm3(tmp_path_factory):
    """Three DHT nodes; the second and third bootstrap from the first. Yields [(identity, dht), ...]."""
    with dht_chain(tmp_path_factory.mktemp("swarm3")) as nodes:
        yield nodes


@pytest.fixture
def swarm_id() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"  # a fresh DHT key per test: tests share the nodes, not the records


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_dht_peer_id_is_the_identity(swarm3):
    for ident, dht in swarm3:
        assert dht.peer_id.to_base58() == ident.peer_id
        assert all(str(a).endswith(f"/p2p/{ident.peer_id}") for a in dht.get_visible_maddrs())


@pytest.mark.timeout(60)
def test_every_node_sees_all_three(swarm3, swarm_id):
    views = [Membership(dht, swarm_id, ident, timeout_s=10) for ident, dht in swarm3]
    for view, (ident, _) in zip(views, swarm3):
        view.publish(_member(ident, tokens_per_s=100.0, heads={"0": [3, "ab"]}))
    want = sorted(ident.peer_id for ident, _ in swarm3)
    for view in views:
        members, dropped = _eventually(lambda v=view: (lambda r: r if len(r[0]) == 3 else None)(v.live()))
        assert [m.peer_id for m in members] == want and dropped == {}
        assert all(m.heads == {"0": [3, "ab"]} and m.tokens_per_s == 100.0 for m in members)


class _Forget:  # runs in the DHT process (DHT.run_coroutine pickles it): drop one record from its own copy
    def __init__(self, key: str, subkey: str) -> None:
        self.key, self.subkey = key, subkey

    async def __call__(self, _dht, node) -> bool:
        from hivemind.dht.routing import DHTID

        gone = False
        for storage in (node.protocol.storage, node.protocol.cache):
            entry = storage.data.get(DHTID.generate(source=self.key))
            if entry is not None and self.subkey in entry.value:
                del entry.value[self.subkey]
                gone = True
        return gone


@pytest.mark.timeout(60)
def test_a_node_reads_its_own_copy_and_a_member_missing_from_it_from_the_others(swarm3, swarm_id):
    """Three nodes know each other: each holds every record, so a read after the first is of its own
    storage. A record that never reached one node (gone from its copy) is still in its view: the lost
    member makes it read the whole DHT."""
    (a, dht_a), (b, dht_b), (c, dht_c) = swarm3
    for ident, dht in swarm3:
        Membership(dht, swarm_id, ident).publish(_member(ident))
    reader = Membership(dht_c, swarm_id, c)
    want = sorted(ident.peer_id for ident, _ in swarm3)
    _eventually(lambda: [m.peer_id for m in reader.live()[0]] == want)
    assert reader.last_read == "full"  # the first read of a view
    assert [m.peer_id for m in reader.live()[0]] == want and reader.last_read == "own copy"
    key = members_key(swarm_id, bucket_of(a.peer_id))
    assert dht_c.run_coroutine(_Forget(key, a.peer_id))
    assert [m.peer_id for m in reader.live()[0]] == want and reader.last_read == "full"
    # a member that left every copy leaves the view, after the whole DHT was read for it
    for dht in (dht_a, dht_b, dht_c):
        dht.run_coroutine(_Forget(key, a.peer_id))
    assert [m.peer_id for m in reader.live()[0]] == sorted([b.peer_id, c.peer_id])
    assert reader.last_read == "full"


@pytest.mark.timeout(60)
def test_short_expiry_leaves_the_live_view(swarm3, swarm_id):
    (a, dht_a), (b, dht_b), (_, dht_c) = swarm3
    short = _member(a, ttl=2.0)
    Membership(dht_a, swarm_id, a).publish(short)
    Membership(dht_b, swarm_id, b).publish(_member(b, ttl=30.0))
    reader = Membership(dht_c, swarm_id, a)
    assert [m.peer_id for m in reader.live()[0]] == sorted([a.peer_id, b.peer_id])
    members, dropped = reader.live(now=short.expires_at + 0.1)  # judged at a later time: dropped with reason
    assert [m.peer_id for m in members] == [b.peer_id] and "expired" in dropped[a.peer_id]
    members = _eventually(lambda: (lambda ms: ms if len(ms) == 1 else None)(reader.live()[0]))
    assert members[0].peer_id == b.peer_id  # after real expiry the DHT itself no longer returns it


@pytest.mark.timeout(60)
def test_forged_and_malformed_records_are_dropped(swarm3, swarm_id, tmp_path):
    (a, dht_a), (b, dht_b), _ = swarm3
    victim, other = Identity.generate(), Identity.generate()
    Membership(dht_a, swarm_id, a).publish(_member(a))
    exp = get_dht_time() + 30

    def key(pid: str) -> str:  # the bucket a reader looks for this peer's record in
        return members_key(swarm_id, bucket_of(pid))

    # B signs its own record but stores it in the victim's slot
    dht_b.store(key(victim.peer_id), sign_member(swarm_id, b, _member(b)), exp, subkey=victim.peer_id)
    # a record with a field altered after signing
    doc = json.loads(sign_member(swarm_id, other, _member(other)))
    doc["m"]["tokens_per_s"] = 1e9
    dht_b.store(key(other.peer_id), json.dumps(doc).encode(), exp, subkey=other.peer_id)
    # a record signed for another swarm, garbage bytes, and a value that is not bytes at all
    third, fourth, fifth = Identity.generate(), Identity.generate(), Identity.generate()
    dht_b.store(
        key(third.peer_id), sign_member("other-swarm", third, _member(third)), exp, subkey=third.peer_id
    )
    dht_b.store(key(fourth.peer_id), b"\x00not json", exp, subkey=fourth.peer_id)
    dht_b.store(key(fifth.peer_id), "a string", exp, subkey=fifth.peer_id)

    members, dropped = Membership(dht_a, swarm_id, a).live()
    assert [m.peer_id for m in members] == [a.peer_id]
    assert dropped[victim.peer_id] == f"stored under {victim.peer_id} but signed by {b.peer_id}"
    assert "signature does not match" in dropped[other.peer_id]
    assert "signature does not match" in dropped[third.peer_id]
    assert "malformed" in dropped[fourth.peer_id]
    assert "not a record" in dropped[fifth.peer_id]


@pytest.mark.timeout(60)
def test_publish_refuses_foreign_and_expired_records(swarm3, swarm_id):
    (a, dht_a), (b, _), _ = swarm3
    view = Membership(dht_a, swarm_id, a)
    with pytest.raises(RecordError, match="the key is"):
        view.publish(_member(b))
    with pytest.raises(RecordError, match="already expired"):
        view.publish(_member(a, ttl=-1.0))


@pytest.mark.timeout(60)
def test_start_dht_errors_say_what_was_tried(tmp_path):
    ident, path = _ident(tmp_path, "me")
    dirs_before = set(_our_sock_dirs())
    peer = Identity.generate().peer_id
    unreachable = f"/ip4/127.0.0.1/tcp/1/p2p/{peer}"
    with pytest.raises(SwarmUnreachable, match="none of the initial peers") as e:
        start_dht(path, LOOPBACK, [unreachable], timeout_s=20)
    assert unreachable in str(e.value)
    with pytest.raises(
        ConfigError, match=r"host_maddrs\[0\]='/ip4/127.0.0.1/tcpx/0' is not a valid multiaddr"
    ):
        start_dht(path, ["/ip4/127.0.0.1/tcpx/0"], [])
    with pytest.raises(ConfigError, match=r"initial_peers\[0\].*lacks the peer's /p2p/"):
        start_dht(path, LOOPBACK, ["/ip4/127.0.0.1/tcp/4001"])
    with pytest.raises(ConfigError, match="cannot be read"):
        start_dht(tmp_path / "missing.key", LOOPBACK, [])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DHTStartError, match=f"cannot listen on /ip4/127.0.0.1/tcp/{port}"):
            start_dht(path, [f"/ip4/127.0.0.1/tcp/{port}"], [])
    assert set(_our_sock_dirs()) == dirs_before, "a failed start left its socket directory behind"


@pytest.mark.timeout(60)
def test_port_taken_by_another_node_is_refused(swarm3):
    # p2pd listens with SO_REUSEPORT: without the check, a second daemon would silently share the port
    (_, dht_a), _, _ = swarm3
    port = str(dht_a.get_visible_maddrs()[0]).split("/tcp/")[1].split("/")[0]
    with tempfile.TemporaryDirectory() as tmp:
        ident = Identity.generate()
        with pytest.raises(DHTStartError, match="in use"):
            start_dht(ident.save(os.path.join(tmp, "k")), [f"/ip4/127.0.0.1/tcp/{port}"], [])


@pytest.mark.timeout(60)
def test_reading_through_a_stopped_dht_is_a_clear_error(tmp_path, swarm_id):
    ident, path = _ident(tmp_path, "solo")
    dht = start_dht(path, LOOPBACK, [])
    try:
        view = Membership(dht, swarm_id, ident)
        view.publish(_member(ident))
        assert [m.peer_id for m in view.live()[0]] == [ident.peer_id]  # a lone node stores locally
        sock_dir = dht.sock_dir
    finally:
        dht.shutdown()
    assert not os.path.exists(sock_dir)
    with pytest.raises(SwarmUnreachable, match="local DHT process is not running"):
        view.live()


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_a_node_killed_with_sigkill_leaves_no_dht_or_daemon_behind(tmp_path):
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time

    from dht.launch import _children
    from node.local.launcher import private_tmp

    key = Identity.generate().save(tmp_path / "id.key")
    code = (
        "import sys, time\nfrom dht.launch import start_dht\n"
        f"d = start_dht({str(key)!r}, ['/ip4/127.0.0.1/tcp/0'])\nprint('up', flush=True)\ntime.sleep(120)\n"
    )
    # as the launcher starts a node: a TMPDIR of its own, where a kill -9 leaves the daemon's sockets
    tmp = private_tmp(9)
    env = dict(os.environ, TMPDIR=tmp)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "up"
        assert any(n.startswith("ddiloco-dht-") for n in os.listdir(tmp)), os.listdir(tmp)
        dht_procs = _children(proc.pid)
        daemons = [c for d in dht_procs for c in _children(d)]
        assert dht_procs and daemons  # the DHT process, and p2pd under it
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        left = dht_procs + daemons
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = [p for p in left if os.path.exists(f"/proc/{p}") and not _zombie(p)]
        assert not left, f"still running after the node was killed: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


@pytest.mark.slow
def test_a_node_imports_hiveminds_dht_without_the_rest_and_the_rest_still_comes_on_first_use():
    """``dht/__init__``: no averager (nor scipy) in a node process; the rest of hivemind on first use."""
    code = (
        "import sys, node.swarm.agent; "
        "assert 'hivemind.averaging' not in sys.modules and 'scipy' not in sys.modules, 'averager imported'; "
        "import hivemind; from hivemind import DecentralizedAverager; from hivemind.dht import DHT; "
        "assert hivemind.DHT is DHT and 'hivemind.averaging' in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
