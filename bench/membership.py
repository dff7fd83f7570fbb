"""Membership at size: what a node's heartbeat costs when the swarm's DHT holds N member records,
with the records spread over ``dht.records.BUCKETS`` keys (the product), against the same records under one
key (the layout before 574bd83), side by side on the same two DHT processes.

The records are stored from one DHT node; a second, the reader, then publishes its own record and reads the
view three times. Printed per layout: the seconds to store the N records (100 at a time), to publish one
record, and to read the view (the first read, then the mean of two more), with the one-key figures over the
buckets' as ratios. The one-key reader checks every signature on every read, as the node did before its
checks were remembered; the one-key DHT side is not checked by ``OwnerValidator`` (it judges only the bucket
keys), so that baseline is faster than the old code was, not slower.

    .venv/bin/python bench/membership.py                 # 2,000 records
    .venv/bin/python bench/membership.py --members 500 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dht.records as records  # noqa: E402
from dht.identity import Identity  # noqa: E402
from dht.launch import start_dht  # noqa: E402
from dht.records import Member, bucket_of, live_view, members_key, sign_member  # noqa: E402
from dht.swarm import Membership, get_dht_time  # noqa: E402

SWARM = "bench-membership"
ONE_KEY = f"{SWARM}/members-one-key"


def _store(dht, signed: list[tuple[Member, bytes]], key_of) -> float:
    t0 = time.monotonic()
    for k in range(0, len(signed), 100):
        futures = [
            dht.store(key_of(m.peer_id), raw, m.expires_at, subkey=m.peer_id, return_future=True)
            for m, raw in signed[k : k + 100]
        ]
        stored = sum(bool(f.result(timeout=300)) for f in futures)
        print(f"  stored {k + stored} of {len(signed)} ({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    return time.monotonic() - t0


def _timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def _one_key_view(dht, now: float) -> int:
    """The view as the node read it before: one key, every signature checked on every read."""
    found = dht.get(ONE_KEY, latest=True)
    raws = {k: getattr(v, "value", v) for k, v in found.value.items()} if found is not None else {}
    records._verified.clear()
    return len(live_view(SWARM, raws, now)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=2000, help="member records stored (default 2000)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    if args.members < 1:
        ap.error("--members must be at least 1")
    tmp = Path(tempfile.mkdtemp(prefix="ddiloco-bench-membership-"))
    writer = start_dht(Identity.generate().save(tmp / "w.key"), ["/ip4/127.0.0.1/tcp/0"], swarm=SWARM)
    reader_id = Identity.generate()
    peers = [str(a) for a in writer.get_visible_maddrs()]
    reader = start_dht(reader_id.save(tmp / "r.key"), ["/ip4/127.0.0.1/tcp/0"], peers, swarm=SWARM)
    try:
        now = get_dht_time()
        ids = [Identity.generate() for _ in range(args.members)]
        signed = []
        for ident in ids:
            m = Member(ident.peer_id, (), "ddiloco/0.3", now, now + 3600)
            signed.append((m, sign_member(SWARM, ident, m)))
        out: dict[str, dict[str, float]] = {}
        view = Membership(reader, SWARM, reader_id, timeout_s=120)

        def own() -> Member:
            t = get_dht_time()
            return Member(reader_id.peer_id, (), "ddiloco/0.3", t, t + 600)

        print("buckets:", file=sys.stderr)
        records._verified.clear()
        b = {"store_s": _store(writer, signed, lambda pid: members_key(SWARM, bucket_of(pid)))}
        b["publish_s"] = _timed(lambda: view.publish(own()))
        records._verified.clear()  # the reader's first read checks every signature
        b["first_read_s"] = _timed(view.live)
        b["read_s"] = sum(_timed(view.live) for _ in range(2)) / 2
        out["buckets"] = b

        print("one key:", file=sys.stderr)
        o = {"store_s": _store(writer, signed, lambda pid: ONE_KEY)}
        raw_own = lambda: sign_member(SWARM, reader_id, own())  # noqa: E731
        o["publish_s"] = _timed(
            lambda: reader.store(ONE_KEY, raw_own(), get_dht_time() + 600, subkey=reader_id.peer_id)
        )
        o["first_read_s"] = _timed(lambda: _one_key_view(reader, get_dht_time()))
        o["read_s"] = sum(_timed(lambda: _one_key_view(reader, get_dht_time())) for _ in range(2)) / 2
        out["one_key"] = o
        assert len(view.live()[0]) == args.members + 1, "the bucketed view lost records"
        assert _one_key_view(reader, get_dht_time()) == args.members + 1, "the one-key view lost records"
    finally:
        writer.shutdown()
        reader.shutdown()
    ratios = {k: out["one_key"][k] / max(out["buckets"][k], 1e-9) for k in out["buckets"]}
    if args.json:
        print(json.dumps({"members": args.members, **out, "one_key_over_buckets": ratios}))
        return
    print(f"{args.members} member records, 2 DHT processes on loopback")
    print(f"{'':>14} {'buckets':>10} {'one key':>10} {'one key / buckets':>18}")
    for k in out["buckets"]:
        print(f"{k:>14} {out['buckets'][k]:>10.3f} {out['one_key'][k]:>10.3f} {ratios[k]:>17.1f}x")


if __name__ == "__main__":
    main()
