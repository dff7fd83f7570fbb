"""Open learners, certified synchronisers: the way to run a public swarm.

``ddiloco swarm init --open-learners`` makes a swarm anyone may join as a learner, without a certificate: it
trains and its contributions are merged, but it is never elected, and a merge record it signs is refused.
Only peers the authority admitted synchronise. Nothing is sealed, and the merge is robust."""

from __future__ import annotations

import time

import pytest
import torch

from dht.admission import Admission, AdmissionError, admit, init_swarm
from dht.identity import Identity
from dht.records import Member, eligible, live_view, sign_member
from node.swarm.settings import NodeSettings
from node.swarm.wire import decode_snapshot
from protocol.errors import ConfigError
from protocol.merge import contribution_weight
from tests.swarm_util import Swarm, wait_until
from tests.test_hostile_state import SWARM, Attacker, _forged
from tests.test_private_swarm import _cli
from tests.test_wire_refusals import _spec

pytestmark = pytest.mark.timeout(400)


def _member(ident: Identity, cert: str = "") -> bytes:
    now = time.time()
    return sign_member(
        SWARM, ident, Member(ident.peer_id, (), "x", now, now + 60, heads={"0": [3, "h"]}, cert=cert)
    )


def test_anyone_learns_only_admitted_peers_synchronise_and_nothing_is_sealed(tmp_path):
    doc = init_swarm(tmp_path / "auth", SWARM, open_learners=True)
    assert doc["open_learners"] and not (tmp_path / "auth" / "secret.key").exists()
    sync, learner, other = Identity.generate(), Identity.generate(), Identity.generate()
    cert = admit(tmp_path / "auth", sync.peer_id)
    adm = Admission(SWARM, doc["authority"], None, cert, open_learners=True)
    adm.check_own(sync.peer_id)
    assert not adm.sealed
    assert adm.check(learner.peer_id, "", time.time()).role == "learner"  # no certificate: a learner
    with pytest.raises(AdmissionError, match="names"):  # a certificate still has to be its holder's
        adm.check(other.peer_id, cert.to_json(), time.time())
    raws = {
        sync.peer_id: _member(sync, cert.to_json()),
        learner.peer_id: _member(learner),
        other.peer_id: _member(other, cert.to_json()),  # someone else's certificate: dropped
    }
    members, dropped = live_view(SWARM, raws, time.time(), adm)
    assert {m.peer_id for m in members} == {sync.peer_id, learner.peer_id} and other.peer_id in dropped
    assert eligible(members, 0) == [sync.peer_id]  # the learner is in the view, never elected
    with pytest.raises(ConfigError, match="not sealed"):
        adm.seal(b"x", "ctx")
    # a learner's own admission needs no certificate; a private swarm's still needs both
    Admission(SWARM, doc["authority"], None, None, open_learners=True).check_own(learner.peer_id)
    with pytest.raises(ConfigError, match="secret and this node's certificate"):
        Admission(SWARM, doc["authority"], None, None)
    with pytest.raises(ConfigError, match="not sealed"):
        Admission(SWARM, doc["authority"], b"s" * 32, None, open_learners=True)


def test_settings_of_an_open_learners_swarm():
    s = NodeSettings(authority="12D3KooWx", open_learners=True)
    assert not s.trusted  # robust auto: on
    assert NodeSettings(authority="12D3KooWx", certificate="c", swarm_secret="k").trusted
    assert not NodeSettings().trusted  # a public swarm
    with pytest.raises(ConfigError, match="open_learners"):
        NodeSettings(open_learners=True)  # no authority: nobody could synchronise
    with pytest.raises(ConfigError, match="open_learners"):
        NodeSettings(authority="12D3KooWx", open_learners=True, swarm_secret="k")


@pytest.mark.slow
def test_an_open_learner_trains_but_never_synchronises_and_its_records_are_refused(tmp_path):
    auth = tmp_path / "auth"
    out = _cli("swarm", "init", "--dir", str(auth), "--name", SWARM, "--open-learners")
    authority = out.split("authority ")[1].split()[0]
    assert "learners, anyone:" in out and not (auth / "secret.key").exists()
    extra = {}
    for i in range(2):  # two certified synchronisers; node 2 joins with no certificate
        pid = _cli("keygen", "--out", str(tmp_path / f"n{i}.key"))
        _cli("swarm", "admit", pid, "--dir", str(auth), "--out", str(tmp_path / f"n{i}.cert"))
        extra[i] = ["--identity", str(tmp_path / f"n{i}.key"), "--certificate", str(tmp_path / f"n{i}.cert")]
    swarm = Swarm(tmp_path / "swarm")
    swarm.flags += ["--swarm", SWARM, "--authority", authority, "--open-learners"]
    bad = None
    try:
        swarm.start_many(3, extra=extra)
        ids = {i: c.peer_id for i, c in swarm.children.items()}
        wait_until(lambda: set(ids.values()) <= swarm.merged_contributors(0), 120, "every node's work merged")
        # an attacker joins as an open learner and signs a record that follows the head, with a small
        # gradient and its own contribution: inside every bound, but a learner never synchronises
        bad = Attacker(tmp_path, swarm.children[0].maddrs)
        bad.publish()
        wait_until(
            lambda: bad.call(ids[0], "snapshot", b'{"fragments": [0]}').ok, 30, "the attacker admitted"
        )
        for i in range(3):
            swarm.control(i, "pause")
        before = swarm.settle()
        st = decode_snapshot(bad.call(ids[0], "snapshot", b'{"fragments": [0]}').body, _spec())[0]
        small = {n: torch.randn(t.shape) * 1e-4 for n, t in st.theta.items()}
        own = [(bad.ident.peer_id, "bad:0:1", contribution_weight(2048, 8), 8, 2048)]
        reply = bad.call(ids[0], "record", _forged(bad, st, small, own))
        assert (reply.ok, reply.code) == (False, "forged_record"), reply
        assert "learner only" in reply.message
        after = swarm.settle()
        assert {s["model_hash"] for s in after.values()} == {before[0]["model_hash"]}
        for i, s in after.items():
            assert s["merge_rule"] == "centered-clip"  # its learners are not trusted
            roles = {p["peer_id"]: p["client_mode"] for p in s["peers"]}
            assert roles[ids[2]] and not roles[ids[0]] and not roles[ids[1]], roles
            signers = {e["signer"] for e in swarm.events(i) if e["kind"] == "merge"}
            assert signers and signers <= {ids[0], ids[1]}, signers  # the open learner never merged a round
    finally:
        if bad is not None:
            bad.close()
        swarm.stop()
