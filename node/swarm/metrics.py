"""The node's Prometheus metrics (``GET /metrics``; docs/design.md, section 7), in a registry of its own.

Two sources, so the training path calls nothing here:

  * everything the status document shows (steps, tokens, tokens/s, loss, eval loss, rounds and tokens
    merged, bytes sent and received, goodput, peers, each fragment's round, the node's counters, refusals
    by code) is read from that document when Prometheus scrapes: ``/metrics`` and ``/status`` agree;
  * distributions come from the node's event stream (``EventLog.subscribe``): the latency from this node
    sending a contribution to the merge that holds it, learners per merge, contribution bytes, and
    relinks (which the status document does not count).

Metric names are listed in docs/operating.md; deploy/grafana-dashboard.json queries them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# What a node counts (``Node.counters``; status and /metrics show them)
NODE_COUNTERS = (
    "records_applied",
    "records_made",
    "contributions_sent",
    "contributions_accepted",
    "contributions_dropped",
    "failovers",
    "convictions",  # members banned for a signed lie, seen here or handed over as evidence or proof
    "stalls",  # rounds a synchroniser took from us and did not merge in time
    "slow_rounds",  # synchronisers passed over: they merge our rounds far later than the others (lateness)
    "left_out",  # rounds that took a contribution of ours and merged without it (it went again)
    "forks",
    "resyncs",
    "hash_mismatches",
    "checkpoints",
    "audits",  # records this node recomputed from their contributions (node.swarm.trust.audit)
    "audits_unfetched",  # audits whose signed contributions could not be fetched
    "audits_unproven",  # of those, records whose signer did not serve them either: the signer passed over here
    "out_of_turn_held",  # records pushed out of turn while nobody is credited yet, held (public)
    "unelected_refused",  # records refused: signed by a member no view on this chain elects (public swarm)
    "rounds_undone",  # records undone: a convicted one, with the rounds on top of it
    "distrusted_left_out",  # contributions this synchroniser left out: their learner opposes the rest
    "no_receipt",  # oks to our contributions that came without a valid receipt (node.swarm.trust.receipts)
    "busy_retries",  # contributions sent again because their synchroniser was merging its round (receipts)
    "receipts_held",  # merges not signed here: they would leave out a contribution we gave a receipt for
)

PREFIX = "ddiloco"
PENDING_KEPT = 4096  # contributions awaiting their merge, for the latency histogram
# (metric, help, path in the status document): gauges read at scrape time
GAUGES = [
    ("learner_steps", "optimizer steps this node's learner has taken", ("learner", "steps")),
    ("learner_tokens", "tokens this node's learner has trained on", ("learner", "tokens")),
    ("learner_tokens_per_second", "this learner's recent training rate", ("learner", "tokens_per_s")),
    ("learner_loss", "training loss (moving average)", ("learner", "loss")),
    ("learner_eval_loss", "last evaluation loss of the global model", ("learner", "eval_loss")),
    ("learner_paused", "1 while the learner is paused", ("learner", "paused")),
    ("rounds_merged", "rounds merged, summed over the fragments (this replica)", ("rounds_merged",)),
    ("tokens_merged", "tokens merged into the global model (weighted by fragment size)", ("tokens_merged",)),
    ("goodput", "share of the learner's time that ended in merged work", ("goodput",)),
    ("in_flight", "merges and sends pending without anything new arriving", ("in_flight",)),
    ("uptime_seconds", "seconds since the node started", ("uptime_s",)),
    ("cpu_process_seconds", "CPU seconds of the node process, every thread", ("cpu", "process_s")),
    ("cpu_learner_seconds", "CPU seconds of its learner thread", ("cpu", "learner_s")),
]


def _at(doc: dict, path: tuple[str, ...]):
    for k in path:
        doc = doc[k]
    return doc


class StatusCollector(Collector):
    """Turns the status document into metric families at each scrape."""

    def __init__(self, document: Callable[[], dict]) -> None:
        self.document = document

    def collect(self) -> Iterator[Metric]:
        doc = self.document()
        for name, help_, path in GAUGES:
            v = _at(doc, path)
            if v is not None:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", help_, value=float(v))
        listed = doc["peers"]  # a document lists some members and counts all (older nodes: listed all)
        yield GaugeMetricFamily(
            f"{PREFIX}_peers",
            "live members this node sees, itself included",
            doc.get("peer_count", len(listed)),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_peers_reachable",
            "live members this node can reach now",
            doc.get("reachable_count", sum(1 for p in listed if p["reachable"])),
        )
        yield CounterMetricFamily(f"{PREFIX}_bytes_sent", "bytes sent to peers", value=doc["bytes_sent"])
        yield CounterMetricFamily(
            f"{PREFIX}_bytes_received", "bytes received from peers", value=doc["bytes_received"]
        )
        rounds = GaugeMetricFamily(
            f"{PREFIX}_fragment_round", "round of each fragment's head", labels=["fragment"]
        )
        sync = GaugeMetricFamily(
            f"{PREFIX}_fragment_synchroniser_self",
            "1 where this node synchronises the fragment's open round",
            labels=["fragment"],
        )
        for f in doc["fragments"]:
            rounds.add_metric([str(f["fragment"])], f["round"])
            sync.add_metric([str(f["fragment"])], float(f["synchroniser"] == doc["peer_id"]))
        yield rounds
        yield sync
        for name, value in doc["counters"].items():
            yield CounterMetricFamily(
                f"{PREFIX}_{name}", f"node counter {name} (see /status counters)", value=value
            )
        refused = CounterMetricFamily(
            f"{PREFIX}_refusals", "requests this node refused, by refusal code", labels=["code"]
        )
        for code, n in sorted(doc["refused"].items()):
            refused.add_metric([code], n)
        yield refused
        mem = doc.get("memory") or {}
        if mem.get("host"):
            parts = GaugeMetricFamily(
                f"{PREFIX}_memory_bytes", "host memory the node holds, by part", labels=["part"]
            )
            for part, n in mem["host"].items():
                parts.add_metric([part], n)
            if mem.get("other") is not None:
                parts.add_metric(["other"], mem["other"])
            yield parts
            for key, help_ in (
                ("weights_bytes", "size of the model's weights in fp32"),
                ("rss", "resident memory of the node's process"),
                ("peak_rss", "peak resident memory of the node's process"),
            ):
                if mem.get(key) is not None:
                    yield GaugeMetricFamily(
                        f"{PREFIX}_memory_{key.removesuffix('_bytes')}_bytes", help_, mem[key]
                    )
        info = GaugeMetricFamily(f"{PREFIX}_node_info", "this node's identity", labels=["peer_id", "swarm"])
        info.add_metric([doc["peer_id"], doc["swarm"]], 1)
        yield info


class NodeMetrics:
    """A node's registry: the status collector plus histograms and counters fed by its events."""

    def __init__(self, peer_id: str, document: Callable[[], dict]) -> None:
        self.peer_id = peer_id
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatusCollector(document))
        r = self.registry
        self.merge_latency = Histogram(
            f"{PREFIX}_merge_latency_seconds",
            "from this node sending a contribution to applying the merge that holds it",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.merge_learners = Histogram(
            f"{PREFIX}_merge_learners",
            "distinct learners whose contributions one merge holds",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.contribution_bytes = Histogram(
            f"{PREFIX}_contribution_bytes",
            "wire size of each contribution this node sends",
            buckets=tuple(2**k for k in range(10, 34, 2)),
            registry=r,
        )
        self.relinks = Counter(
            f"{PREFIX}_relinks", "times the DHT re-linked to members it had lost", registry=r
        )
        self._sent: OrderedDict[str, float] = OrderedDict()  # cid -> when sent, awaiting its merge
        self._lock = threading.Lock()

    def on_event(self, rec: dict) -> None:
        kind = rec.get("kind")
        if kind == "contribute":
            self.contribution_bytes.observe(rec.get("bytes", 0))
            with self._lock:
                self._sent[rec["cid"]] = float(rec["t"])
                while len(self._sent) > PENDING_KEPT:
                    self._sent.popitem(last=False)
        elif kind == "merge":
            self.merge_learners.observe(len(set(rec.get("learners", []))))
            with self._lock:
                sent = [self._sent.pop(c) for c in rec.get("cids", []) if c in self._sent]
            for t in sent:
                self.merge_latency.observe(max(0.0, float(rec["t"]) - t))
        elif kind == "relink":
            self.relinks.inc()
