"""``ddiloco doctor``'s judgements: each check turns evidence into one ``Check`` line — ok, warn or fail —
with what was seen and what to do. Pure: the evidence (dial results, a status document, event records, disk
numbers) is gathered by ``node.cli.doctor`` and handed in, so each rule is tested without a network.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import asdict, dataclass

LEVELS = ("ok", "warn", "fail")
LAST_CONTRIBUTIONS = 20  # how many of the newest contributions the quorum check reads
CONFIG_CODES = {"wrong_shape", "wrong_fragment"}  # refusals that only other [model]/[protocol] settings earn
MB = 1e6


@dataclass(frozen=True)
class Check:
    name: str
    level: str  # ok | warn | fail
    evidence: str
    fix: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _tried(results: list[tuple[str, str | None]]) -> str:
    return "; ".join(f"{a}: {'ok' if err is None else err}" for a, err in results)


def initial_peers(results: list[tuple[str, str | None]]) -> Check:
    """``results``: each initial peer's multiaddr and the error of dialing it (None when it answered)."""
    if not results:
        return Check("initial peers", "ok", "none given: this node starts a swarm of its own")
    bad = [a for a, err in results if err is not None]
    fix = (
        "check that the bootstrap node is running, that the address, port and /p2p/ peer id are current "
        "(its STATE_DIR/ready.json lists them), and that TCP to that port is allowed"
    )
    if len(bad) == len(results):
        return Check("initial peers", "fail", f"no initial peer answered: {_tried(results)}", fix)
    if bad:
        return Check(
            "initial peers", "warn", f"{len(bad)} of {len(results)} did not answer: {_tried(results)}", fix
        )
    return Check("initial peers", "ok", f"every initial peer answered: {_tried(results)}")


def ports(results: list[tuple[str, str | None]]) -> Check:
    """``results``: each listen address and the error of binding it (None when the port is free)."""
    bad = [err for _, err in results if err is not None]
    if bad:
        return Check(
            "listen port",
            "fail",
            _tried(results),
            "stop what holds the port (another node on this host?) or pick another one; tcp/0 takes any free port",
        )
    return Check("listen port", "ok", _tried(results) or "no fixed TCP port to check")


def reachability(results: list[tuple[str, str | None]], client_mode: bool) -> Check:
    """``results``: each announced address and the error of dialing it from a fresh p2p daemon."""
    if client_mode:
        return Check(
            "announced address", "ok", "client mode: the node announces no address and only dials out"
        )
    if not results:
        return Check(
            "announced address",
            "warn",
            "the node announces no address",
            "set --announce-maddrs or --host-maddrs",
        )
    bad = [a for a, err in results if err is not None]
    if bad:
        level = "fail" if len(bad) == len(results) else "warn"
        return Check(
            "announced address",
            level,
            f"dialed from a fresh p2p daemon: {_tried(results)}",
            "peers dial what the node announces: set --announce-maddrs to an address that reaches its listen "
            "port (behind NAT, the public address with that port forwarded), or fix the firewall",
        )
    return Check("announced address", "ok", f"a fresh p2p daemon dialed it back: {_tried(results)}")


def _private(maddr: str) -> bool:
    parts = maddr.split("/")
    for proto in ("ip4", "ip6"):
        if proto in parts and parts.index(proto) + 1 < len(parts):
            try:
                ip = ipaddress.ip_address(parts[parts.index(proto) + 1])
            except ValueError:
                return False
            return ip.is_private or ip.is_loopback or ip.is_link_local
    return False  # dns names: cannot tell


def mode(status: dict) -> Check:
    if status.get("client_mode"):
        return Check(
            "client mode / NAT",
            "warn",
            "client mode: the node dials out only; it contributes and follows by pulling, and is never elected "
            "synchroniser nor pushed to",
            "if peers can reach this host, run without --client-mode so it takes its share of the rounds",
        )
    addrs = status.get("maddrs") or []
    if addrs and all(_private(a) for a in addrs):
        return Check(
            "client mode / NAT",
            "warn",
            f"every announced address is private or loopback: {addrs}",
            "fine inside one network; for peers elsewhere announce the public address (--announce-maddrs) and "
            "forward its port, or run with --client-mode",
        )
    return Check("client mode / NAT", "ok", f"serving, announced {addrs}")


def download(status: dict, events: list[dict], stall_s: float) -> Check:
    """The state download: donors, bytes and rate, and any donor with no byte for ``stall_s``."""
    tr = status.get("transfers") or {}
    live = [c for c in tr.get("in_flight", []) if c.get("op") == "snapshot"]
    stuck = [c for c in live if c["idle_s"] >= stall_s]
    done = [c for c in tr.get("recent", []) if c.get("op") == "snapshot"]
    dl = [e for e in events if e.get("kind") == "download"]
    rate = lambda c: c["bytes"] / max(c.get("seconds", c.get("age_s", 0.0)), 1e-3) / MB  # noqa: E731
    parts = [
        f"{c['peer']}: {c['bytes']:,} bytes in {c['age_s']:.0f} s, no byte for {c['idle_s']:.0f} s"
        for c in live
    ]
    parts += [f"{c['peer']}: {c['bytes']:,} bytes at {rate(c):.2f} MB/s ({c['outcome']})" for c in done[-5:]]
    if dl:
        e = dl[-1]
        parts.append(
            f"joined by download of fragments {e['fragments']} from {e['donors']} in {e['seconds']:.1f} s"
        )
    evidence = "; ".join(parts)
    if stuck:
        names = ", ".join(c["peer"] for c in stuck)
        return Check(
            "state download",
            "fail",
            f"stuck donor(s) {names}: {evidence}",
            "the donor accepted the request but sends nothing; after the RPC deadline the node tries another "
            "donor. If it stays stuck, check that donor (ddiloco doctor on its host), or stop it",
        )
    failed = [c for c in done if c["outcome"] != "ok"]
    if failed:
        return Check(
            "state download",
            "warn",
            f"{len(failed)} snapshot request(s) failed: {evidence}",
            "the node retries other donors; repeated failures from one donor point at that donor",
        )
    if live:
        return Check("state download", "ok", f"downloading: {evidence}")
    if not evidence:
        joined = status.get("joined_by", "")
        return Check("state download", "ok", f"no state download ({joined or 'not needed'})")
    return Check("state download", "ok", evidence)


def _code_of(why: str) -> str:
    """The refusal code in a drop event's reason ``PEER: CODE message`` (or the reason itself)."""
    head, sep, rest = why.partition(": ")
    if sep and head.startswith("12D3KooW") and rest:
        return rest.split(" ", 1)[0]
    return why.split(":", 1)[0][:60]


def quorum(status: dict, events: list[dict], last: int = LAST_CONTRIBUTIONS) -> Check:
    """The last contributions of this node: merged, refused (with codes) or still pending."""
    me = status.get("peer_id")
    sent = [e for e in events if e.get("kind") == "contribute" and e.get("learner") == me][-last:]
    merged = {c for e in events if e.get("kind") == "merge" for c in e.get("cids", [])}
    drops = {e.get("cid"): e.get("why", "") for e in events if e.get("kind") == "drop"}
    if not sent:
        c = status.get("counters", {})
        if c.get("contributions_sent", 0) or c.get("contributions_dropped", 0):
            return _counted(c)
        return Check(
            "quorum", "ok", "no contribution sent yet (the learner's first rounds have not come due)"
        )
    n_merged = sum(1 for e in sent if e["cid"] in merged)
    codes = Counter(_code_of(drops[e["cid"]]) for e in sent if e["cid"] in drops and e["cid"] not in merged)
    pending = len(sent) - n_merged - sum(codes.values())
    evidence = (
        f"last {len(sent)} contributions: {n_merged} merged, {sum(codes.values())} refused or dropped"
        f"{' (' + ', '.join(f'{k} x{v}' for k, v in codes.most_common()) + ')' if codes else ''}, {pending} pending"
    )
    example = next((drops[e["cid"]] for e in reversed(sent) if e["cid"] in drops), "")
    if example:
        evidence += f"; last: {example[:200]}"
    # Earlier refusals say why: after repeated ones a synchroniser bans the node, and the newest
    # contributions only read "banned".
    mine = {e.get("cid") for e in events if e.get("kind") == "contribute" and e.get("learner") == me}
    seen = Counter(
        _code_of(e.get("why", "")) for e in events if e.get("kind") == "drop" and e.get("cid") in mine
    )
    if seen and set(seen) != set(codes):
        evidence += "; every refusal in the records: " + ", ".join(f"{k} x{v}" for k, v in seen.most_common())
    fix = (
        "wrong_shape / wrong_fragment: every node must use the same [protocol], [task] and [model] settings; "
        "unknown_peer / not_admitted: the synchroniser does not see this node as a member (certificate, swarm "
        "name, expired record); stale_base: the node is behind and catches up; banned: the synchroniser "
        "banned this node after repeated refusals, fix their first cause and the ban ends (ban_s)"
    )
    if n_merged == 0 and codes and pending < len(sent):
        return Check("quorum", "fail", evidence, fix)
    # A peer that finds this node's model of another shape refuses it for good (and soon bans it): its own
    # merges, as the synchroniser of a fragment in its own view, are not the swarm's.
    if codes and set(seen) & CONFIG_CODES:
        return Check("quorum", "fail", evidence, fix)
    if codes:
        return Check("quorum", "warn", evidence, fix)
    return Check("quorum", "ok", evidence)


def _counted(c: dict) -> Check:
    sent, dropped = c.get("contributions_sent", 0), c.get("contributions_dropped", 0)
    evidence = f"from status counters: {sent} sent, {dropped} dropped (no event records to read the codes)"
    if dropped and not sent:
        return Check(
            "quorum", "fail", evidence, "run doctor with --state-dir on the node's host for the codes"
        )
    return Check("quorum", "warn" if dropped > sent else "ok", evidence)


def schedule(status: dict, warn_behind: int = 2, fail_behind: int = 8) -> Check:
    """Where the node stands in the swarm's schedule: rounds behind the newest head, per fragment."""
    frags = status.get("fragments", [])
    behind = {f["fragment"]: (f["round"], f.get("behind", 0)) for f in frags}
    worst = max((b for _, b in behind.values()), default=0)
    lagging = {p: rb for p, rb in behind.items() if rb[1] > 0}
    evidence = (
        "at the newest round of every fragment"
        if not lagging
        else "behind: " + ", ".join(f"fragment {p} round {r} (-{b})" for p, (r, b) in sorted(lagging.items()))
    )
    fix = (
        "the node pulls records or a snapshot from a peer ahead; if the gap stays, look at the state download "
        "and at the peers' heads (ddiloco status), and that the node's records apply (refusals, hash mismatches)"
    )
    if worst >= fail_behind:
        return Check("schedule", "fail", evidence, fix)
    if worst >= warn_behind:
        return Check("schedule", "warn", evidence, fix)
    return Check("schedule", "ok", evidence)


def own_link(status: dict) -> Check:
    """Whether this node's own link carries what it sends: the rate measured from what arrived, and the
    contributions that waited out their sender's budget behind the bodies ahead of them and were dropped
    (``transfers.uplink``: ``node.swarm.uplink``)."""
    up = (status.get("transfers") or {}).get("uplink")
    if not up:
        return Check("own link", "ok", "nothing sent yet")
    evidence = (
        f"{up.get('rate_bps', 0) * 8 / 1e6:.2f} Mbit/s measured out; {up.get('out', 0) / 1024:.0f} KiB in flight "
        f"of a {up.get('window', 0) / 1024:.0f} KiB window, {up.get('waiting', 0)} bodies waiting"
    )
    dropped = (up.get("gave_up") or {}).get("contribution", 0)
    if dropped:
        return Check(
            "own link",
            "warn",
            f"{evidence}; {dropped} contributions found no room on it in time and were dropped",
            "the link carries less than this node sends: merge records go first, so the swarm stays on one "
            "chain, but the dropped contributions' work is lost; fewer bytes a step (a larger --sync-every) "
            "or a faster link",
        )
    return Check("own link", "ok", evidence)


def disk(folder: str, free_bytes: int, checkpoint_bytes: int, keep: int = 3) -> Check:
    """Room for checkpoints: the newest checkpoint's size times the files kept plus one being written."""
    need = (keep + 1) * checkpoint_bytes if checkpoint_bytes else 64 * 1024 * 1024
    evidence = (
        f"{free_bytes / MB:,.0f} MB free in {folder}; newest checkpoint {checkpoint_bytes / MB:,.1f} MB"
        if checkpoint_bytes
        else f"{free_bytes / MB:,.0f} MB free in {folder}; no checkpoint yet"
    )
    fix = "free space or move --state-dir to a larger disk; a checkpoint that cannot be written is lost on a crash"
    if free_bytes < need:
        return Check("checkpoint disk", "fail", f"{evidence}; needs at least {need / MB:,.0f} MB", fix)
    if free_bytes < 4 * need:
        return Check("checkpoint disk", "warn", f"{evidence}; little room beyond {need / MB:,.0f} MB", fix)
    return Check("checkpoint disk", "ok", evidence)


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.level == "fail" for c in checks) else 0


def render(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"[{c.level.upper():>4}] {c.name}: {c.evidence}")
        if c.fix and c.level != "ok":
            lines.append(f"       fix: {c.fix}")
    fails = sum(c.level == "fail" for c in checks)
    warns = sum(c.level == "warn" for c in checks)
    lines.append(f"{len(checks)} checks: {fails} failed, {warns} warnings")
    return "\n".join(lines)
