"""A node that runs the project's own code with its learner's contributions, or its merges, tampered with: the
hostile member of ``bench/attacks.py`` and ``tests/test_audit.py``. Everything else is honest.

    python bench/hostile_node.py ATTACK [ddiloco node flags...]

Learner attacks: ``flip`` (the negated outer gradient, at honest size), ``flip-x2.5`` (2.5x that: under the
default ``clip_factor`` 3), ``inflate`` (negated, claiming 4x its tokens a step: the ``work_factor`` bound,
16x the weight), ``inflate-1e6`` (negated, claiming a million times its tokens a step: the
unbounded-weight attack, far past the bound), ``random`` (a random direction at 3x honest size).
Synchroniser attacks, when it is elected: ``sync-flip`` (its records merge the negated contributions: a
consistent record, new hash and all, that names the honest messages), ``sync-x1.5`` (the merge scaled by 1.5),
``sync-x1.001`` (scaled by 1.001: a bias of a thousandth), ``sync-share`` (a faithful merge scaled by, and
signed with, a share of 0.02: 98% of each round it merges thrown away),
``sync-drop`` (it answers every contribution ``ok``, with the receipt a public swarm's synchroniser signs, and
merges only the first it holds: a faithful record of a subset, which no audit refutes, and which with the
receipt proves the drop: ``node.swarm.trust.receipts``), ``sync-censor`` (the same, but it gives no receipts: what a
dropper that knows of them does).
"A little is enough" (Baruch, Baruch and Goldberg 2019) as a member can play it: ``alie`` fetches the signed
contributions each record it applies names (the ``kept`` op audits use: public to members) and sends, for that
fragment, their coordinate-wise mean less z of their standard deviations, over the other learners' messages
of the last round and its own honest outer gradient; z from ``DDILOCO_ALIE_Z`` (``bench/attacks.py`` sets the
paper's for the run's counts). Colluders that name a shared file in ``DDILOCO_COLLUDERS`` leave each other's
messages out. ``alie-z1`` is the same at z = 1; ``alie-z0`` at z = 0, the control: all of the attack's work
(fetching and decoding each round's messages), and what it sends the mean of the last round's honest
messages and its own, no bias.
Sybil flood: ``sybil`` (its learner honest; beside its own record it publishes, every heartbeat, the signed
records of ``DDILOCO_SYBILS`` (32) identities of its own with no process behind them, each a copy of its own
record: its address, its heads, its step and rates; so every one is as electable as an honest member).
``sybil-noise`` is its control: the same records signed and stored every heartbeat, under keys of another swarm
name that no member reads (the flood's load on every DHT node and daemon, none of its effect on a view).
Head attack: ``head-zero`` (its membership record claims each fragment a round past its own, with the hash of
an all-zero fragment, and its snapshot op serves that all-zero state; no record leads to it).
Records no one elected (a member that runs a learner but sends none of its work, so no record of another
member credits it): after each record it applies it signs one of its own for the next round of that fragment,
on the right parent with a consistent new hash, naming itself as the only contributor with an outer gradient
of 0.2x the fragment's weights (shrinking them towards zero: inside the record bounds), and pushes it to every
member. ``forge-self`` names no digest of a signed message; ``forge-signed`` names the digest of a
contribution message it signed itself (and serves it, as the ``kept`` op does); ``forge-unserved`` names a
made-up digest that nobody can serve.
A stalled round, from a member whose learner works honestly (so a public swarm credits and elects it):
``sync-stall`` (when elected it answers every contribution ``ok`` and never merges: each round it takes is
dropped and taken again, so it swallows every contribution sent to it); ``sync-late`` (it merges honestly,
but only 0.8 of its senders' stall deadline after its quorum: never found stalled).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch

import node.common.lifetime  # noqa: F401 - first: its launcher read at start (--exit-with-parent)

ATTACKS = {  # (scale of the outer gradient, tokens multiplier, random direction)
    "flip": (-1.0, 1, False),
    "flip-x2.5": (-2.5, 1, False),
    "inflate": (-1.0, 4, False),
    "inflate-1e6": (-1.0, 10**6, False),
    "random": (3.0, 1, True),
}
# (scale of each contribution the record merges, merge only the first)
SYNC_ATTACKS = {
    "sync-flip": (-1.0, False),
    "sync-x1.5": (1.5, False),
    "sync-x1.001": (
        1.001,
        False,
    ),  # a bias a thousandth of the merge: a gap of about 1e-3 (bench/audit_gaps.py)
    "sync-share": (1.0, False),  # a faithful merge, signed with a share of 0.02 (and scaled by it)
    "sync-drop": (1.0, True),
    "sync-censor": (1.0, True),
}


def fp32(v) -> torch.Tensor:
    """A contribution's tensor, decoded from its wire form where it is one."""
    from protocol.codecs import Encoded, get_codec

    return get_codec(v.codec).decode(v) if isinstance(v, Encoded) else v.float()


def tamper_merges(attack: str) -> None:
    from dataclasses import replace as dc_replace

    from protocol.replica import FragmentReplica

    scale, drop = SYNC_ATTACKS[attack]
    honest_make = FragmentReplica.make_record
    if attack == "sync-share":
        import protocol.replica

        protocol.replica.round_share = lambda contributions, cfg, live: 0.02

    def make_record(self, round_, contributions, cfg, *args, **kwargs):
        if kwargs.get("given") is None and attack == "sync-share":
            cfg = dc_replace(cfg, carry=True)  # its own merges scaled by the share it signs
        if kwargs.get("given") is None:  # its own merges, not its audits of others'
            contributions = list(contributions)[:1] if drop else contributions
            contributions = [
                dc_replace(c, delta={k: fp32(v) * scale for k, v in c.delta.items()}, norm=None)
                if scale != 1.0
                else c
                for c in contributions
            ]
        return honest_make(self, round_, contributions, cfg, *args, **kwargs)

    FragmentReplica.make_record = make_record
    if drop:  # the honest node's check before it signs (that it breaks no receipt it gave) taken out
        from node.swarm.trust.receipts import Receipts

        Receipts.holds_receipts = lambda self, rec: False
        if attack == "sync-censor":
            Receipts.give_receipt = lambda self, p, learner, cid: b""


def tamper_heads() -> None:
    from dataclasses import replace as dc_replace

    from node.swarm.catch_up import CatchUp
    from node.swarm.transport import Reply
    from node.swarm.view import SwarmView
    from node.swarm.wire import FragmentState, encode_snapshot, parse_snapshot_request
    from protocol.hashing import tensors_hash

    def zeros(node, p: int) -> dict:
        return {n: torch.zeros(t.shape) for n, t in node.replicas[p].theta.items()}

    honest_member = SwarmView.self_member

    def self_member(self, now):
        m = honest_member(self, now)
        heads = {
            str(p): [h[0] + 1, tensors_hash(zeros(self, p)), h[2], h[3]] for p, h in enumerate(self.heads)
        }
        return dc_replace(m, heads=heads)

    async def snapshot(self, caller: str, raw: bytes) -> Reply:
        states = [
            FragmentState(
                p, h[0] + 1, tensors_hash(zeros(self, p)), h[2], h[3], zeros(self, p), zeros(self, p)
            )
            for p, h in ((p, self.heads[p]) for p in parse_snapshot_request(raw))
        ]
        return Reply(True, body=encode_snapshot(states))

    SwarmView.self_member = self_member
    CatchUp.on_snapshot = snapshot


def tamper_alie(z: float) -> None:
    """``alie``: the last round's honest statistics, fetched after each record, shape what it sends."""
    import asyncio

    from node.swarm.replication import Replication
    from node.swarm.sender import Outbox
    from protocol.codecs import decode_tensors, encode_tensors

    stats: dict[int, list[dict[str, torch.Tensor]]] = {}  # fragment -> the other learners' last deltas
    colluders = os.environ.get("DDILOCO_COLLUDERS")

    def friends(node) -> set[str]:
        if not colluders:
            return {node.peer_id}
        with open(colluders, "a+") as fh:
            fh.seek(0)
            ids = set(fh.read().split())
            if node.peer_id not in ids:
                fh.write(node.peer_id + "\n")
        return ids | {node.peer_id}

    async def learn(node, sr) -> None:
        try:
            msgs = await asyncio.wait_for(node.auditor.fetch_messages(sr), 10.0)
            cs, _ = node.auditor.contributions_of(sr, msgs)
        except Exception:  # noqa: BLE001 - an attacker that cannot see a round waits for the next
            return
        skip = friends(node)
        # decoded off the node's loop, as its own merges are
        deltas = await asyncio.to_thread(
            lambda: [{k: fp32(v) for k, v in c.delta.items()} for c in cs if c.learner not in skip]
        )
        if deltas:
            if sr.record.fragment not in stats:
                print(
                    f"alie: fragment {sr.record.fragment} from {len(deltas)} messages, z {z}", file=sys.stderr
                )
            stats[sr.record.fragment] = deltas

    honest_apply = Replication.apply

    def apply(self, sr, made_here=False):
        honest_apply(self, sr, made_here)
        if sr.record.digests and "" not in sr.record.digests:
            self.spawn(learn(self, sr))

    honest_post = Outbox.post

    def post_contribution(self, header, enc):
        others = stats.get(header.fragment)
        if others:
            own = decode_tensors(enc)
            out = {}
            for k, d in own.items():
                stack = torch.stack([d, *(g[k] for g in others)])
                out[k] = stack.mean(0) - z * stack.std(0, correction=0)
            enc = encode_tensors(out, header.codec, header.block)
        honest_post(self, header, enc)

    Replication.apply = apply
    Outbox.post = post_contribution


def tamper_sybils(n: int, noise: bool = False) -> None:
    from dataclasses import replace as dc_replace

    from dht.identity import Identity
    from dht.records import bucket_of, members_key, sign_member
    from dht.swarm import Membership

    sybils = [Identity.generate() for _ in range(n)]
    honest_publish = Membership.publish

    def publish(self, member) -> None:
        honest_publish(self, member)
        if member.peer_id != self.identity.peer_id:
            return
        for ident in sybils:
            m = dc_replace(member, peer_id=ident.peer_id)
            key = members_key(f"{self.swarm}-noise" if noise else self.swarm, bucket_of(ident.peer_id))
            raw = sign_member(self.swarm, ident, m)
            self.dht.store(key, raw, expiration_time=m.expires_at, subkey=m.peer_id, return_future=True)

    Membership.publish = publish


FORGE_ATTACKS = ("forge-self", "forge-signed", "forge-unserved")


def tamper_forge(attack: str) -> None:
    import asyncio
    import secrets
    import time
    from dataclasses import replace as dc_replace

    from node.swarm.replication import Replication
    from node.swarm.sender import Outbox
    from node.swarm.wire import SignedRecord, encode_record, sign_contribution
    from protocol.audit import frozen_view
    from protocol.codecs import encode_tensors
    from protocol.messages import ContributionHeader, contribution_id, encode_contribution
    from protocol.synchroniser import Contribution

    Outbox.post = lambda self, header, enc: None  # its work credits it nowhere
    forged = {"n": 0}

    def forge(node, p: int):
        rep = node.replicas[p]
        r, h = rep.round + 1, node.pcfg.sync_every
        delta = {k: 0.2 * t for k, t in rep.theta.items()}
        cid = contribution_id(node.peer_id, p, r, time.time())
        enc = encode_tensors(delta, "fp32", node.pcfg.codec_block)
        digest = ""
        if attack == "forge-signed":
            header = ContributionHeader(
                node.peer_id, p, rep.round, h, 64 * h, 0.1, "fp32", node.pcfg.codec_block, cid
            )
            raw = encode_contribution(header, enc)
            digest = node.auditor.archive.put(raw, sign_contribution(node.settings.swarm, node.identity, raw))
        elif attack == "forge-unserved":
            digest = secrets.token_hex(32)
        c = Contribution(node.peer_id, p, rep.round, h, 64 * h, 0.1, delta, cid, None, digest)
        rec = frozen_view(rep, merge=True).make_record(r, [c], node.pcfg)
        if attack == "forge-self":
            rec = dc_replace(rec, digests=())
        return SignedRecord(rec, node.peer_id, encode_record(node.settings.swarm, rec, node.identity))

    async def push(node, p: int) -> None:
        try:
            sr = await asyncio.to_thread(forge, node, p)
        except Exception as e:  # noqa: BLE001 - the replica moved under it: the next record starts another
            print(f"{attack}: fragment {p}: {e}", file=sys.stderr)
            return
        targets = [q for q in node.view.live_members() if q != node.peer_id]
        await asyncio.gather(*(node.record_push.push(q, sr.raw) for q in targets))
        forged["n"] += 1
        if forged["n"] % 20 == 1:
            print(f"{attack}: {forged['n']} records signed and pushed", file=sys.stderr)

    honest_apply = Replication.apply

    def apply(self, sr, made_here=False):
        honest_apply(self, sr, made_here)
        if sr.signer != self.peer_id:
            self.spawn(push(self, sr.record.fragment))

    Replication.apply = apply


def tamper_late() -> None:
    """``sync-late``: when elected it merges honestly, but only 0.8 of its senders' stall deadline after its
    quorum (``node.swarm.deadlines``: ``STALL_PERIODS`` round periods): never found stalled."""
    from node.swarm.deadlines import STALL_PERIODS
    from node.swarm.replication import Replication

    honest_merge = Replication._merge

    def _merge(self, p, a) -> None:
        every = self.syncs[p].due_every or self.settings.failover_s / STALL_PERIODS
        self.loop.call_later(0.8 * STALL_PERIODS * every, honest_merge, self, p, a)

    Replication._merge = _merge


def tamper_stall() -> None:
    from node.swarm.replication import Replication

    def _merge(self, p, a) -> None:  # quorum reached: merge nothing, and take the round again from scratch
        self.reset_sync(p, merged={c.cid for c in a.contributions})

    Replication._merge = _merge


def tamper(attack: str) -> None:
    from node.swarm.sender import Outbox
    from protocol.codecs import decode_tensors, encode_tensors

    scale, inflate, rand = ATTACKS[attack]
    honest_post = Outbox.post

    def post_contribution(self, header, enc):
        delta = decode_tensors(enc)
        out = {}
        for k, d in delta.items():
            if rand:
                r = torch.randn_like(d)
                d = r * (torch.linalg.vector_norm(d) / torch.linalg.vector_norm(r).clamp_min(1e-30))
            out[k] = d * scale
        honest_post(
            self,
            replace(header, c_tokens=header.c_tokens * inflate),
            encode_tensors(out, header.codec, header.block),
        )

    Outbox.post = post_contribution


def main() -> int:
    known = [
        *ATTACKS,
        *SYNC_ATTACKS,
        "head-zero",
        "alie",
        "alie-z1",
        "alie-z0",
        "sybil",
        "sybil-noise",
        "sync-stall",
        "sync-late",
        *FORGE_ATTACKS,
    ]
    if len(sys.argv) < 2 or sys.argv[1] not in known:
        print(f"usage: hostile_node.py {{{'|'.join(known)}}} [node flags...]", file=sys.stderr)
        return 2
    if sys.argv[1] == "head-zero":
        tamper_heads()
    elif sys.argv[1] == "sync-stall":
        tamper_stall()
    elif sys.argv[1] == "sync-late":
        tamper_late()
    elif sys.argv[1] in FORGE_ATTACKS:
        tamper_forge(sys.argv[1])
    elif sys.argv[1].startswith("sybil"):
        tamper_sybils(int(os.environ.get("DDILOCO_SYBILS", "32")), noise=sys.argv[1] == "sybil-noise")
    elif sys.argv[1].startswith("alie"):
        fixed = {"alie-z1": 1.0, "alie-z0": 0.0}
        tamper_alie(fixed.get(sys.argv[1], float(os.environ.get("DDILOCO_ALIE_Z", "0.25"))))
    else:
        (tamper_merges if sys.argv[1] in SYNC_ATTACKS else tamper)(sys.argv[1])
    from node.cli.main import main as ddiloco

    return ddiloco(["node", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
