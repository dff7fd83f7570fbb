"""What a run across sites needs, before it starts: ``ddiloco plan`` (docs/plan.md).

From a model's size, the number of learners (M, one per site), the inner step's time, the link between sites
(rate and round trip) and how often a site fails, ``plan`` chooses the schedule — fragments P, steps between
two syncs of a fragment H, overlap tau, quorum K, the grace window and the codec — and says what it costs:
the bytes a node sends per inner step, the share of the link they take, how long a round's transfers take,
the goodput the simulator (``sim.decoupled``, the real synchroniser state machines) gives under the failure
rate, and what the two baselines would spend on the same link.

The byte model is the node's own. A contribution of a fragment of n values is ``protocol.codecs.
encoded_nbytes(n, codec, block)`` bytes, the figure a node's learner records as ``bytes`` on its
``contribute`` event; a merge record carries the merged outer gradient in ``record_codec`` and goes from its
synchroniser to the M - 1 others. Per inner step a node sends, on average,

    (N / H) * (c + r * (M - 1) / M)

bytes for a model of N values, with c and r the bytes per value of the two codecs: every fragment once per H
steps, and the records of the 1/M of rounds it synchronises, each to M - 1 peers. That is the schedule's
floor. On the link (``Traffic.link_per_step_B``) come on top: in a public swarm (``audit``, the node's
``--audit``), the contributions an auditor fetches, each from its learner, ``audit * (M - 1) / M`` of the
contributions; a frame of ``MESSAGE_B`` a message; the node's membership record to each other member every
heartbeat; a merge record's signed head; and every packet's headers (``HEADER_B``: full segments, each
message's small packets, the acknowledgements). Catch-up is left out (nothing at a steady state).
``bench/wan.py`` measures both the payload and the link bytes.

The baselines, as their authors run them: data-parallel training all-reduces the gradients every step (a ring:
each worker sends 2 (M - 1) / M of them, in bf16 or fp32, and waits 2 (M - 1) round trips); synchronous
DiLoCo all-reduces its fp32 outer gradients the same way every H steps, and waits for it. What they block is
that time, against the step.

What is chosen, and why:

- codec ``int4`` for contributions and records (what the node sends by default; docs/algorithm.md measures
  its quality against fp32);
- H: the smallest of ``H_CHOICES`` above P whose bytes per step take at most ``target_util`` of the link;
- P: the smallest of ``P_CHOICES`` (at most H) with which one round's transfers — M - 1 contributions into
  the synchroniser, then its record out to M - 1 peers, and the round trips — fit in tau steps; tau is
  ``overlap`` (2 by default) and grows, up to H / P, only when no P fits;
- K: the largest quorum whose simulated goodput is within ``K_SLACK`` (one point) of the best one's: more
  learners in each merge, for as little goodput as waiting for failed or slow sites costs (the simulator's
  learners step with 5% jitter); the grace window is on.

A constraint that binds is named in ``Plan.binding``. Pure arithmetic and the simulator: no torch tensors,
no network.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from protocol.codecs import CODECS, encoded_nbytes
from protocol.errors import ConfigError
from sim.engine import simulate
from sim.model import HOUR_S, SimConfig

# What the link carries beyond the schedule's floor. Bytes, from the node's own counters (``transfers.by_op``)
# and encoders: a message's frame (its header, GO and the reply's header, a contribution's signed envelope);
# a merge record's signed document and tensor headers (``node.swarm.wire.encode_record``: about 650 B, 115 B
# a contributor, 170 B a tensor, and a digest a contributor in a public swarm); a membership record (packed:
# 1.3 KB with 24 fragment heads, docs/swarm.md), stored on each other member every heartbeat, with the DHT's
# framing of the store, its reply and the whole-view read every two minutes (``DHT_STORE_B``).
MESSAGE_B = 250
RECORD_BASE_B, RECORD_LEARNER_B = 1000, 185
MEMBER_BASE_B, MEMBER_HEAD_B = 300, 42
DHT_STORE_B = 1200
# Packets, each with ``HEADER_B`` of Ethernet, IP and TCP (with timestamps) as the interface counts them:
# full segments of ``MSS``; a message's part-filled last segment and ``MESSAGE_PACKETS`` small ones (its
# header, GO, the reply's header, receipts, the stream's close); an acknowledgement for ``ACKS_A_SEGMENT``
# of the data segments received (a node receives about what it sends); and ``STORE_PACKETS`` for each
# membership store (its segments, the reply, acknowledgements, pings). The DHT's and the packets' figures
# were read off packet captures of one node on a 3 Mbit/s link (``tcpdump`` on its interface while
# ``bench/wan.py`` trained, then with its learners paused; docs/plan.md).
HEADER_B, MSS = 66, 1448
MESSAGE_PACKETS = 5
ACKS_A_SEGMENT = 0.65
STORE_PACKETS = 15
H_CHOICES = (16, 24, 32, 48, 64, 100, 128, 200, 256, 500, 1000)
P_CHOICES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
K_SLACK = 0.01  # goodput a larger quorum may cost and still be chosen
SIM_ROUNDS = 30  # outer rounds of every fragment the simulator runs per quorum tried


@dataclass(frozen=True)
class Site:
    """What the run is made of. Rates in bits per second, times in seconds."""

    params: float
    learners: int
    step_s: float = 1.0
    link_bps: float = 2.5e9
    rtt_s: float = 0.05
    mtbf_s: float = math.inf  # mean time between failures of one learner (its whole site)
    codec: str = "int4"
    record_codec: str = "int4"
    block: int = 64
    target_util: float = 0.5
    overlap: int = 2
    sync_every: int | None = None  # H fixed by the user; None: chosen
    fragments: int | None = None  # P fixed by the user; None: chosen
    quorum: int | None = None  # K fixed by the user; None: chosen
    audit: float = 0.0  # share of records an auditor recomputes (the node's --audit): 1 in a public swarm
    heartbeat_s: float = 2.0  # membership refresh (the node's --heartbeat-s)
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> ConfigError:
            return ConfigError(f"{name}={getattr(self, name)!r} is invalid: {want}")

        if not (self.params >= 1 and math.isfinite(self.params)):
            raise bad("params", "give the model's parameter count, e.g. 1.2e10")
        if self.learners < 1:
            raise bad("learners", "M must be >= 1")
        for name in ("step_s", "link_bps"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise bad(name, "must be a finite number > 0")
        if not (self.rtt_s >= 0 and math.isfinite(self.rtt_s)):
            raise bad("rtt_s", "must be a finite time >= 0")
        if not self.mtbf_s > 0:
            raise bad("mtbf_s", "must be > 0 (inf: no failures)")
        for name in ("codec", "record_codec"):
            if getattr(self, name) not in CODECS:
                raise bad(name, f"choose one of {', '.join(sorted(CODECS))}")
        if self.block < 1:
            raise bad("block", "must be >= 1")
        if not 0 < self.target_util <= 1:
            raise bad("target_util", "must be in (0, 1]")
        if self.overlap < 0:
            raise bad("overlap", "tau must be >= 0")
        if self.quorum is not None and not 1 <= self.quorum <= self.learners:
            raise bad("quorum", f"K must be between 1 and the {self.learners} learners")
        if self.sync_every is not None and self.sync_every < 1:
            raise bad("sync_every", "H must be >= 1")
        if self.fragments is not None and self.fragments < 1:
            raise bad("fragments", "P must be >= 1")
        if not 0 <= self.audit <= 1:
            raise bad("audit", "a share of records in [0, 1]")
        if not (self.heartbeat_s > 0 and math.isfinite(self.heartbeat_s)):
            raise bad("heartbeat_s", "must be a finite time > 0")


def bytes_per_value(codec: str, block: int) -> float:
    """Wire bytes per value of ``codec`` over whole blocks (``protocol.codecs.encoded_nbytes``)."""
    return encoded_nbytes(block * 1024, codec, block) / (block * 1024)


@dataclass(frozen=True)
class Traffic:
    """Bytes and times of one schedule on one link."""

    contribution_B: float  # one fragment's contribution
    record_B: float  # one fragment's merge record
    sent_per_step_B: float  # what a node sends per inner step, on average: the schedule's floor
    link_util: float  # that against the link's rate over one step
    round_s: float  # one round's transfers: M - 1 contributions in, the record out to M - 1, round trips
    audit_B: float = 0.0  # per step: the contributions an auditor fetches, sent by their learners
    membership_B: float = 0.0  # per step: this node's membership record to every other member
    link_per_step_B: float = 0.0  # per step, on the link: all of it, framed, with TCP/IP's headers
    packets_per_step: float = 0.0  # per step, out of the interface: segments, acknowledgements, control


def traffic(site: Site, fragments: int, sync_every: int) -> Traffic:
    n = site.params / fragments
    c = n * bytes_per_value(site.codec, site.block)
    r = n * bytes_per_value(site.record_codec, site.block)
    m = site.learners
    rounds = fragments / sync_every  # rounds a step, swarm-wide; a node sends one contribution to each
    per_step = rounds * (c + r * (m - 1) / m)
    rate = site.link_bps / 8
    round_s = (max(1, m - 1) * c + (m - 1) * r) / rate + 2 * site.rtt_s
    # one member audits a share of the records (node.swarm.trust.audit, AUDITORS): it fetches every
    # contribution of the round but its own, each from the learner that sent it
    audit = site.audit * rounds * c * (m - 1) / m
    records = rounds * (m - 1) / m  # record messages a step: the 1/M of rounds it merges, to M - 1 each
    messages = rounds + records + 2 * site.audit * rounds * (m - 1) / m  # contributions, records, fetches
    heads = records * (RECORD_BASE_B + RECORD_LEARNER_B * m * (1 + site.audit))
    stores = (m - 1) * site.step_s / site.heartbeat_s  # membership stores a step
    member = (MEMBER_BASE_B + MEMBER_HEAD_B * fragments + DHT_STORE_B) * stores
    data = per_step + audit + messages * MESSAGE_B + heads + member
    segments = (data - member) / MSS + messages / 2
    packets = segments * (1 + ACKS_A_SEGMENT) + messages * MESSAGE_PACKETS + stores * STORE_PACKETS
    link = data + packets * HEADER_B
    return Traffic(c, r, per_step, per_step / (rate * site.step_s), round_s, audit, member, link, packets)


@dataclass(frozen=True)
class Baseline:
    system: str
    sent_per_step_B: float
    blocked_per_step_s: float  # what a learner waits per inner step, on average
    blocked_share: float  # of its time
    needed_gbps: float  # the link that would carry its bytes in the step itself


def baselines(site: Site, sync_every: int) -> list[Baseline]:
    m, n, rate = site.learners, site.params, site.link_bps / 8
    out = []
    for name, width in (("dp-bf16", 2), ("dp-fp32", 4)):
        sent = 2 * (m - 1) / m * n * width if m > 1 else 0.0
        wait = sent / rate + (2 * (m - 1) * site.rtt_s if m > 1 else 0.0)
        out.append(Baseline(name, sent, wait, wait / (wait + site.step_s), sent * 8 / site.step_s / 1e9))
    # synchronous DiLoCo: every H steps a ring all-reduce of the fp32 outer gradients (bench/wan.py sync-ar)
    model = 4 * n
    sent = 2 * (m - 1) / m * model / sync_every if m > 1 else 0.0  # averaged over steps
    wait = (2 * (m - 1) / m * model / rate + 2 * (m - 1) * site.rtt_s) / sync_every if m > 1 else 0.0
    out.append(Baseline("sync-diloco", sent, wait, wait / (wait + site.step_s), sent * 8 / site.step_s / 1e9))
    return out


@dataclass(frozen=True)
class Plan:
    site: Site
    fragments: int
    sync_every: int
    overlap: int
    quorum: int
    grace: bool
    traffic: Traffic
    goodput: float
    goodput_by_quorum: dict[int, float]
    baselines: list[Baseline]
    binding: list[str] = field(default_factory=list)

    @property
    def needed_gbps(self) -> float:
        """The link that would carry this schedule's bytes in the step itself (utilisation 1)."""
        return self.traffic.sent_per_step_B * 8 / self.site.step_s / 1e9

    def as_dict(self) -> dict:
        d = asdict(self)
        d["site"] = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d["site"].items()}
        d["needed_gbps"] = self.needed_gbps
        d["goodput_by_quorum"] = {str(k): v for k, v in self.goodput_by_quorum.items()}
        return d


def _choose_h(site: Site, fragments: int, binding: list[str]) -> int:
    if site.sync_every is not None:
        return site.sync_every
    tried = [h for h in H_CHOICES if h > fragments]
    for i, h in enumerate(tried):
        if traffic(site, fragments, h).link_util <= site.target_util:
            if i > 0:
                binding.append(
                    f"link: H >= {h} so that a node's bytes per step take at most {site.target_util:.0%} of "
                    f"{site.link_bps / 1e9:g} Gbit/s"
                )
            return h
    h = tried[-1] if tried else H_CHOICES[-1]
    binding.append(
        f"link: even H = {h} takes {traffic(site, fragments, h).link_util:.0%} of the link (target "
        f"{site.target_util:.0%}); a faster link, a longer step or a smaller codec is needed"
    )
    return h


def _choose_p(site: Site, tau: int, binding: list[str]) -> tuple[int, int]:
    """(P, tau): the fewest fragments whose round fits in tau steps."""
    if site.fragments is not None:
        return site.fragments, tau
    budget = max(tau, 1) * site.step_s
    for p in P_CHOICES:
        if traffic(site, p, max(H_CHOICES)).round_s <= budget:
            if p > 1:
                binding.append(
                    f"round time: P >= {p} so that one round's transfers "
                    f"({traffic(site, p, max(H_CHOICES)).round_s:.2f} s) fit in tau = {max(tau, 1)} steps"
                )
            return p, tau
    p = P_CHOICES[-1]
    need = math.ceil(traffic(site, p, max(H_CHOICES)).round_s / site.step_s)
    binding.append(
        f"round time: even P = {p} needs {need} steps for a round's transfers; tau is raised to {need}"
    )
    return p, need


def simulated_goodput(
    site: Site, fragments: int, sync_every: int, overlap: int, quorum: int, t: Traffic
) -> float:
    m = site.learners
    cfg = SimConfig(
        system="decoupled",
        chips=m,
        learners=m,
        host_chips=1,
        mtbi_s=site.mtbf_s,
        step_s=site.step_s,
        duration_s=SIM_ROUNDS * sync_every * site.step_s,
        learner_recovery="restart",
        quorum=quorum,
        fragments=fragments,
        sync_every=sync_every,
        overlap=min(overlap, sync_every - 1),
        contrib_s=max(1, m - 1) * t.contribution_B * 8 / site.link_bps + site.rtt_s,
        sync_s=(m - 1) * t.record_B * 8 / site.link_bps + site.rtt_s,
        jitter=0.05,
        seed=site.seed,
    )
    return simulate(cfg).goodput.goodput


def plan(site: Site) -> Plan:
    binding: list[str] = []
    fragments, tau = _choose_p(site, site.overlap, binding)
    sync_every = _choose_h(site, fragments, binding)
    if fragments > sync_every:
        raise ConfigError(
            f"fragments={fragments} is invalid with sync_every={sync_every}: P must not exceed H (each fragment "
            "syncs once in H steps)"
        )
    tau = min(tau, sync_every - 1)
    t = traffic(site, fragments, sync_every)
    quorums = [site.quorum] if site.quorum is not None else list(range(1, site.learners + 1))
    by_k = {k: simulated_goodput(site, fragments, sync_every, tau, k, t) for k in quorums}
    best = max(by_k.values())
    k = max(q for q, g in by_k.items() if g >= best - K_SLACK)
    if site.quorum is None and k < site.learners:
        why = (
            "the slowest learner's steps (5% jitter)"
            if math.isinf(site.mtbf_s)
            else f"a failed site (one failure every {site.mtbf_s / HOUR_S:g} h per site)"
        )
        binding.append(
            f"quorum: K = {k}; K = {k + 1} loses {best - by_k[k + 1]:.1%} of goodput waiting for {why}"
        )
    return Plan(
        site, fragments, sync_every, tau, k, True, t, by_k[k], by_k, baselines(site, sync_every), binding
    )
