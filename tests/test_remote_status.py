"""``ddiloco status --peer``: a node's status read through libp2p by py-libp2p in a process of its own (no
Go daemon, no HTTP), against real node processes of a public and of a private swarm. In the private swarm
an ``observer`` certificate is enough to read, a caller without one is refused and counted, and an
observer is never a member."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from dht.admission import Admission, admit, init_swarm
from dht.identity import Identity
from dht.records import Member, live_view, sign_member
from node.cli.main import main
from tests.swarm_util import Swarm, wait_until

pytestmark = pytest.mark.timeout(300)
PRIVATE = "remote-status-test"


def _status(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["status", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_client_imports_py_libp2p_and_never_hivemind():
    code = (
        "import sys, node.cli.remote_status as r, libp2p, trio; "
        "r._key_pair(None); assert 'hivemind' not in sys.modules, 'hivemind imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow
def test_status_over_libp2p_public_swarm(tmp_path, capsys):
    swarm = Swarm(tmp_path / "swarm")
    try:
        swarm.start_many(1)
        c = swarm.children[0]
        rc, out, err = _status(capsys, "--peer", c.maddrs[0], "--json")
        assert rc == 0, err
        doc = json.loads(out)
        assert doc["peer_id"] == c.peer_id and doc["swarm"] == "ddiloco-local"
        rc, out, err = _status(capsys, "--peer", c.maddrs[0])
        assert rc == 0 and f"node {c.peer_id}" in out and "fragment  round" in out, err
        # an identity of our own: the node sees that peer id as the caller
        key = tmp_path / "me.key"
        Identity.generate().save(key)
        rc, out, err = _status(capsys, "--peer", c.maddrs[0], "--identity", str(key), "--json")
        assert rc == 0, err
        # a peer id that is not there: the libp2p client says what failed, and no status is printed
        other = c.maddrs[0].rsplit("/", 1)[0] + "/" + Identity.generate().peer_id
        rc, out, err = _status(capsys, "--peer", other, "--timeout-s", "8")
        assert rc == 2 and out == "" and other in err, (out, err)
    finally:
        swarm.stop()


@pytest.mark.slow
def test_status_over_libp2p_private_swarm_needs_a_certificate(tmp_path, capsys):
    auth = tmp_path / "auth"
    doc = init_swarm(auth, PRIVATE)
    node_key, obs_key = tmp_path / "n0.key", tmp_path / "obs.key"
    node_id = Identity.generate()
    node_id.save(node_key)
    obs = Identity.generate()
    obs.save(obs_key)
    (tmp_path / "n0.cert").write_text(admit(auth, node_id.peer_id).to_json())
    obs_cert = admit(auth, obs.peer_id, role="observer")
    (tmp_path / "obs.cert").write_text(obs_cert.to_json())
    flags = ["--swarm", PRIVATE, "--authority", doc["authority"], "--swarm-secret", str(auth / "secret.key")]
    swarm = Swarm(tmp_path / "swarm")
    swarm.flags += flags
    try:
        swarm.start_many(
            1, extra={0: ["--identity", str(node_key), "--certificate", str(tmp_path / "n0.cert")]}
        )
        c = swarm.children[0]
        peer = c.maddrs[0]
        rc, out, err = _status(
            capsys,
            "--peer",
            peer,
            "--identity",
            str(obs_key),
            "--certificate",
            str(tmp_path / "obs.cert"),
            "--json",
        )
        assert rc == 0, err
        assert json.loads(out)["peer_id"] == c.peer_id
        # no certificate, and a certificate that names another peer: refused, and counted by the node
        rc, out, err = _status(capsys, "--peer", peer, "--identity", str(obs_key))
        assert rc == 2 and "not_admitted" in err and "no admission certificate" in err, err
        rc, out, err = _status(capsys, "--peer", peer, "--certificate", str(tmp_path / "obs.cert"))
        assert rc == 2 and "not_admitted" in err and "names" in err, err
        wait_until(lambda: swarm.status()[0]["refused"].get("not_admitted", 0) >= 2, 30, "refusals counted")
        # an observer cannot run a node
        rc = main(["node", "--state-dir", str(tmp_path / "obs-node"), "--identity", str(obs_key),
                   "--certificate", str(tmp_path / "obs.cert"), *flags])  # fmt: skip
        assert rc == 2 and "observer" in capsys.readouterr().err
    finally:
        swarm.stop()


def test_an_observer_is_never_a_member(tmp_path):
    auth = tmp_path / "auth"
    doc = init_swarm(auth, PRIVATE)
    member, obs = Identity.generate(), Identity.generate()
    secret = bytes.fromhex((auth / "secret.key").read_text())
    adm = Admission(PRIVATE, doc["authority"], secret, admit(auth, member.peer_id))
    now = time.time()
    raws = {}
    for ident, role in ((member, "any"), (obs, "observer")):
        cert = admit(auth, ident.peer_id, role=role).to_json()
        raws[ident.peer_id] = sign_member(
            PRIVATE, ident, Member(ident.peer_id, (), "v", now, now + 60, cert=cert)
        )
    members, dropped = live_view(PRIVATE, raws, now, adm)
    assert [m.peer_id for m in members] == [member.peer_id]
    assert "observer" in dropped[obs.peer_id]
