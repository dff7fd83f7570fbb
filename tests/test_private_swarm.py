"""A private swarm: three admitted nodes and an outsider with its own key, all real processes.

The outsider can neither push a contribution, nor obtain model state, nor write a membership record the
members accept, nor take a member's DHT slot — each refusal counted — and the members' model is unchanged
by all of it. A leaked secret without a certificate is not enough either. A revoked member drops out of
everyone's view."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
from hivemind.utils import get_dht_time

from dht.admission import Admission, AdmissionError, Certificate, admit, init_swarm, revoke
from dht.identity import Identity
from dht.launch import SwarmUnreachable, start_dht
from dht.records import Member
from dht.swarm import Membership
from node.swarm.sealed import SealedTransport
from node.swarm.transport import Transport
from tests.swarm_util import Swarm, wait_until
from tests.test_wire_refusals import _contribution, _spec

pytestmark = pytest.mark.timeout(400)
SWARM = "priv-test"


def test_admission_certificates_and_sealing(tmp_path):
    doc = init_swarm(tmp_path / "auth", SWARM)
    me, other = Identity.generate(), Identity.generate()
    cert = admit(tmp_path / "auth", me.peer_id, days=1)
    secret = bytes.fromhex((tmp_path / "auth" / "secret.key").read_text())
    adm = Admission(SWARM, doc["authority"], secret, cert, str(tmp_path / "auth" / "revoked.txt"))
    now = time.time()
    assert adm.check(me.peer_id, cert.to_json(), now) == cert
    with pytest.raises(AdmissionError, match="names"):
        adm.check(other.peer_id, cert.to_json(), now)  # someone else's certificate
    with pytest.raises(AdmissionError, match="valid from"):
        adm.check(me.peer_id, cert.to_json(), now + 2 * 86400)  # expired
    forged = Certificate(SWARM, other.peer_id, "any", now, now + 99, doc["authority"], "00" * 64)
    with pytest.raises(AdmissionError, match="not signed"):
        adm.check(other.peer_id, forged.to_json(), now)
    with pytest.raises(AdmissionError, match="no admission"):
        adm.check(other.peer_id, "", now)
    for bad in (10**400, float("inf"), float("nan")):  # 10**400: float() overflows (found by the fuzzer)
        doc_bad = {**json.loads(cert.to_json()), "expires_at": bad}
        with pytest.raises(AdmissionError, match="malformed admission certificate"):
            adm.check(me.peer_id, json.dumps(doc_bad), now)
    revoke(tmp_path / "auth", me.peer_id)
    with pytest.raises(AdmissionError, match="revoked"):
        adm.check(me.peer_id, cert.to_json(), now)
    sealed = adm.seal(b"payload", "ctx")
    assert adm.open(sealed, "ctx") == b"payload" and b"payload" not in sealed
    with pytest.raises(AdmissionError):
        adm.open(sealed, "other ctx")  # bound to what it is for
    with pytest.raises(AdmissionError):
        Admission(SWARM, doc["authority"], b"x" * 32, cert).open(sealed, "ctx")  # another key


def _cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "node", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.slow
def test_outsider_is_refused_everywhere_and_changes_nothing(tmp_path):
    auth = tmp_path / "auth"
    authority = _cli("swarm", "init", "--dir", str(auth), "--name", SWARM).split("authority ")[1].split()[0]
    extra = {}
    for i in range(3):
        pid = _cli("keygen", "--out", str(tmp_path / f"n{i}.key"))
        _cli("swarm", "admit", pid, "--dir", str(auth), "--out", str(tmp_path / f"n{i}.cert"))
        extra[i] = ["--identity", str(tmp_path / f"n{i}.key"), "--certificate", str(tmp_path / f"n{i}.cert")]
    swarm = Swarm(tmp_path / "swarm")
    swarm.flags += ["--swarm", SWARM, "--authority", authority, "--swarm-secret", str(auth / "secret.key"),
                    "--revoked", str(auth / "revoked.txt")]  # fmt: skip
    dhts = []
    try:
        swarm.start_many(3, extra=extra)
        ids = {i: c.peer_id for i, c in swarm.children.items()}
        wait_until(lambda: set(ids.values()) <= swarm.merged_contributors(0), 120, "every member merged")
        before = swarm.settle()
        h0 = before[0]["model_hash"]

        outsider = Identity.generate()
        secret = bytes.fromhex((auth / "secret.key").read_text())
        fake_auth = tmp_path / "fake"
        init_swarm(fake_auth, SWARM)  # its own authority: a certificate the members' authority did not sign
        own_cert = admit(fake_auth, outsider.peer_id)
        leaked = Admission(SWARM, own_cert.authority, secret, own_cert)  # the secret leaked, no admission
        dhts.append(start_dht(outsider.save(tmp_path / "out.key"), ["/ip4/127.0.0.1/tcp/0"],
                              swarm.children[0].maddrs, timeout_s=30))  # fmt: skip
        now = get_dht_time()
        mine = Member(outsider.peer_id, (), "x", now, now + 60)
        # 1. a plain (unsealed) membership record, and 2. a sealed one with the leaked secret and its own
        # certificate: stored or not, no member lets the outsider into its view
        for adm in (None, leaked):
            m = Member(**{**vars(mine), "cert": own_cert.to_json() if adm else ""})
            try:
                Membership(dhts[0], SWARM, outsider, admission=adm).publish(m)
            except SwarmUnreachable:
                pass  # the members' DHT validators refused to store it
        # 3. squatting: a value under a member's slot, signed by the outsider, is refused by every member DHT
        victim = ids[1]
        from dht.records import bucket_of, members_key, sign_member

        raw = leaked.seal(sign_member(SWARM, outsider, mine), f"dht|{SWARM}|{victim}")
        slot = members_key(SWARM, bucket_of(victim))
        assert not dhts[0].store(slot, raw, get_dht_time() + 60, subkey=victim)

        spec = _spec()
        r0 = before[0]["fragments"][0]["round"]

        async def attack():
            p2p = await dhts[0].replicate_p2p()
            plain, sealed = Transport(p2p, timeout_s=20), SealedTransport(Transport(p2p, timeout_s=20), leaked,
                                                                          outsider.peer_id)  # fmt: skip
            contrib = _contribution(outsider.peer_id, spec, base=r0)
            out = []
            try:
                for tr in (plain, sealed):
                    out.append(await tr.call(ids[0], "contribute", contrib))
                    out.append(await tr.call(ids[1], "snapshot", b'{"fragments": [0]}'))
                    out.append(await tr.call(ids[2], "records", b'{"fragment": 0, "from": 1}'))
            finally:
                await p2p.shutdown()
            return out

        replies = asyncio.run(attack())
        # refused at admission, before the body is read (and so before it could be opened): unknown_peer
        assert [r.code for r in replies] == ["unknown_peer"] * 6
        assert all(not r.ok and not r.body for r in replies)
        time.sleep(3)  # a few heartbeats: the outsider's records had their chance to be read
        after = swarm.status()
        for st in after.values():
            assert outsider.peer_id not in {p["peer_id"] for p in st["peers"]}
            assert victim in {p["peer_id"] for p in st["peers"]}  # the squatted slot still holds node 1
            assert st["model_hash"] == h0
        refused = {k: sum(after[i]["refused"].get(k, 0) - before[i]["refused"].get(k, 0) for i in after)
                   for k in ("not_admitted", "unknown_peer")}  # fmt: skip
        assert refused["unknown_peer"] >= 6

        # revocation: node 2 listed in the file every member reads drops out of the others' views
        revoke(auth, ids[2])
        wait_until(
            lambda: all(ids[2] not in {p["peer_id"] for p in swarm.status()[i]["peers"]} for i in (0, 1)),
            30, "the revoked member to leave the others' views",
        )  # fmt: skip
    finally:
        swarm.stop()
        for d in dhts:
            d.shutdown()
