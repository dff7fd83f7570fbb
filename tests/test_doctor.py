"""``ddiloco doctor`` against failures caused for real: a dead bootstrap (a port nobody listens on, and a
live node's address with a peer id that is not there), a taken port, an announced address nothing listens
on, a node whose contributions are refused (another model shape), and a state download from a donor that
accepts the request and never answers (an attacker process with its own DHT and p2p daemon)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket

import pytest

from dht.identity import Identity
from dht.swarm import Membership
from node.cli.main import main
from node.common import diagnosis as dx
from tests.swarm_util import Swarm, wait_until
from tests.test_hostile_state import SWARM, Attacker

pytestmark = pytest.mark.timeout(400)


def _doctor(capsys, *args: str) -> tuple[int, dict]:
    rc = main(["doctor", *args, "--json", "--dial-timeout-s", "8"])
    out = capsys.readouterr().out
    return rc, {c["name"]: c for c in json.loads(out)["checks"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_preflight_dead_bootstrap_and_taken_port(tmp_path, capsys):
    dead = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{Identity.generate().peer_id}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, checks = _doctor(
            capsys,
            "--initial-peers",
            dead,
            "--host-maddrs",
            f"/ip4/127.0.0.1/tcp/{port}",
            "--state-dir",
            str(tmp_path),
        )
    assert rc == 1
    assert checks["initial peers"]["level"] == "fail"
    assert (
        dead in checks["initial peers"]["evidence"]
        and "connection refused" in checks["initial peers"]["evidence"]
    )
    assert checks["listen port"]["level"] == "fail" and "in use" in checks["listen port"]["evidence"]
    assert checks["checkpoint disk"]["level"] in ("ok", "warn") and checks["torch"]["level"] in ("ok", "warn")
    # the same flags with a free port and no initial peers: nothing fails
    rc, checks = _doctor(capsys, "--host-maddrs", f"/ip4/127.0.0.1/tcp/{_free_port()}")
    assert rc == 0 and checks["listen port"]["level"] == "ok"


@pytest.mark.slow
def test_doctor_on_running_nodes(tmp_path, capsys):
    swarm = Swarm(tmp_path / "swarm")
    bad = None
    try:
        swarm.start_many(1)
        n0 = swarm.children[0]
        # a healthy node: nothing fails; its initial peer answers, and the wrong peer id at its address fails
        wrong = n0.maddrs[0].rsplit("/", 1)[0] + "/" + Identity.generate().peer_id
        rc, checks = _doctor(
            capsys, "--state-dir", str(n0.state_dir), "--initial-peers", f"{n0.maddrs[0]},{wrong}"
        )
        assert checks["announced address"]["level"] == "ok", checks["announced address"]
        assert checks["initial peers"]["level"] == "warn" and wrong in checks["initial peers"]["evidence"]
        assert checks["node"]["level"] == "ok" and rc == 0, checks
        # node 1 announces an address nothing listens on; node 2 trains another model shape
        nowhere = f"/ip4/127.0.0.1/tcp/{_free_port()}"
        swarm.start(1, ["--announce-maddrs", nowhere])
        swarm.start(2, ["--dim", "48"])
        from node.local.launcher import wait_ready

        wait_ready([swarm.children[1], swarm.children[2]], 120)
        rc, checks = _doctor(capsys, "--state-dir", str(swarm.children[1].state_dir))
        assert rc == 1 and checks["announced address"]["level"] == "fail", checks
        assert nowhere in checks["announced address"]["evidence"]

        def refused():
            rc, checks = _doctor(capsys, "--state-dir", str(swarm.children[2].state_dir))
            q = checks["quorum"]
            return (rc, q) if q["level"] == "fail" else None

        rc, q = wait_until(refused, 120, "node 2's contributions refused", interval_s=2)
        # node 2 may merge its own contributions where it is a fragment's synchroniser in its own view
        assert rc == 1 and "wrong_shape" in q["evidence"], q
        swarm.kill9(2)
        swarm.kill9(1)

        # a stalled state download: a donor with node 0's heads that accepts the snapshot op and never answers
        # every fragment merged before the learner pauses: node 0 can re-sync a fragment to another node's
        # fork, younger than its own (a suite run: fragment 3 back to round 0 from node 1's, at round 28),
        # and merges it again only from contributions it still makes (paused first, that run waited 60 s)
        wait_until(lambda: all(f["round"] >= 1 for f in swarm.status()[0]["fragments"]), 60, "rounds merged")
        swarm.control(0, "pause")
        # at rest: a round merged after the attacker copies node 0's published heads leaves the attacker's
        # behind, and node 3 then downloads from node 0 alone (a full run here did, at this commit and before)
        swarm.settle()
        bad = Attacker(tmp_path, n0.maddrs)
        heads = {m.peer_id: m.heads for m in Membership(bad.dht, SWARM, bad.ident).live()[0]}[n0.peer_id]
        never = asyncio.Event()

        async def snapshot(caller: str, raw: bytes):
            await never.wait()

        bad.tr.timeout_s = 300  # its server keeps the stream open
        bad.serve("snapshot", snapshot)
        bad.run(bad.tr.start())
        bad.publish(heads)
        swarm.start(3, ["--rpc-timeout-s", "60"])
        d3 = swarm.children[3].state_dir

        def stuck():
            if not (d3 / "starting.json").exists():
                return None
            rc, checks = _doctor(capsys, "--state-dir", str(d3), "--stall-s", "3")
            return (rc, checks["state download"]) if checks["state download"]["level"] == "fail" else None

        rc, dl = wait_until(stuck, 90, "the stuck donor diagnosed", interval_s=1)
        assert rc == 1 and bad.ident.peer_id in dl["evidence"] and "stuck" in dl["evidence"], dl
        assert bad.calls.get("snapshot", 0) >= 1
        # asked to stop while its download hangs, it stops: it does not sit out the download's 60 s deadline
        swarm.children[3].proc.send_signal(signal.SIGTERM)  # no status URL yet: as systemd or Ctrl-C stop it
        swarm.children[3].proc.wait(timeout=30)
        assert json.loads((d3 / "final.json").read_text())["stop_reason"], "no stop reason written"
        assert not (d3 / "ready.json").exists()  # it never joined
    finally:
        swarm.stop()
        if bad is not None:
            bad.close()


def test_rules_on_evidence_built_by_hand():
    me = "12D3KooWme"
    events = [{"kind": "contribute", "learner": me, "cid": f"c{i}", "fragment": 0} for i in range(4)]
    events += [
        {"kind": "merge", "cids": ["c0", "c1"]},
        {"kind": "drop", "cid": "c2", "why": "12D3KooWx: stale_base old"},
    ]
    q = dx.quorum({"peer_id": me}, events)
    assert (
        q.level == "warn"
        and "2 merged" in q.evidence
        and "stale_base x1" in q.evidence
        and "1 pending" in q.evidence
    )
    # a node of another model shape that merges its own contributions where it is the synchroniser
    events += [{"kind": "contribute", "learner": me, "cid": f"s{i}", "fragment": 1} for i in range(3)]
    events += [
        {"kind": "merge", "cids": ["s0", "s1"]},
        {"kind": "drop", "cid": "s2", "why": "12D3KooWx: wrong_shape a"},
    ]
    q = dx.quorum({"peer_id": me}, events)
    assert q.level == "fail" and "wrong_shape" in q.evidence and "4 merged" in q.evidence, q
    st = {"fragments": [{"fragment": 0, "round": 3, "behind": 0}, {"fragment": 1, "round": 1, "behind": 9}]}
    assert dx.schedule(st).level == "fail" and "fragment 1 round 1 (-9)" in dx.schedule(st).evidence
    assert dx.disk("/x", 10, 100).level == "fail" and dx.disk("/x", 10**12, 100).level == "ok"
    up = {"out": 65536, "window": 65536, "rate_bps": 125000.0, "waiting": 3, "waited_s": {}, "gave_up": {}}
    assert dx.own_link({"transfers": {"uplink": up}}).level == "ok"
    up["gave_up"] = {"contribution": 7, "audit": 2}
    link = dx.own_link({"transfers": {"uplink": up}})
    assert link.level == "warn" and "7 contributions" in link.evidence and "1.00 Mbit/s" in link.evidence
    assert dx.mode({"maddrs": ["/ip4/10.0.0.2/tcp/1"]}).level == "warn"
    assert dx.mode({"maddrs": ["/ip4/1.2.3.4/tcp/1"]}).level == "ok"
    assert dx.mode({"client_mode": True}).level == "warn"
    assert dx.exit_code([dx.Check("a", "warn", "")]) == 0 and dx.exit_code([dx.Check("a", "fail", "")]) == 1
