"""``ddiloco data prepare``: tokenise a corpus into its token cache ahead of time (``node.learner.token_cache``)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    d = sub.add_parser(
        "data",
        help="prepare a corpus: tokenise --data once into the token cache that nodes read",
        description="'prepare' tokenises the shards of --data with --tokenizer into a cache of flat token "
        "files (uint16, or uint32 above 65,536 tokens) in worker processes, and prints where it is. A node "
        "given the same --data, --tokenizer and fields reads that cache instead of tokenising; one that "
        "finds none builds it. An interrupted build goes on from its last whole shard. See docs/data.md.",
    )
    ds = d.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    p = ds.add_parser("prepare", help="build (or check) the token cache of a corpus")
    p.add_argument("--data", required=True, help="a text, JSONL or Parquet file, a folder of them, or a glob")
    p.add_argument("--tokenizer", default="", help="a local tokenizer.json (default: bytes, 256 tokens)")
    p.add_argument("--text-field", default="text", help="JSONL shards: the field holding the text")
    p.add_argument("--text-column", default="text", help="Parquet shards: the column holding the text")
    p.add_argument(
        "--token-cache", default="", help="the cache's parent folder (default: $DDILOCO_CACHE/tokens)"
    )
    p.add_argument("--workers", type=int, default=0, help="tokenising processes (default: one per core)")


def run(args: argparse.Namespace) -> int:
    import os
    import time
    from pathlib import Path

    from node.common.progress import Bar
    from node.learner.sources import shard_paths
    from node.learner.token_cache import CacheSpec, open_cache
    from protocol.errors import ConfigError

    if args.workers < 0:
        raise ConfigError(f"workers={args.workers} is invalid: must be >= 1 (0: one per core)")
    spec = CacheSpec(args.data, args.tokenizer or None, args.text_field, args.text_column)
    source_bytes = sum(p.stat().st_size for p in shard_paths(args.data))
    t0 = time.monotonic()
    bar = Bar("tokenise")
    try:
        cache = open_cache(
            spec, Path(args.token_cache) if args.token_cache else None, args.workers or None, bar
        )
    finally:
        bar.close()
    dt = time.monotonic() - t0
    disk = sum(os.path.getsize(cache.folder / n) for n in os.listdir(cache.folder))
    print(f"token cache  {cache.folder}")
    print(
        f"tokens       {cache.tokens:,} ({cache.dtype}) in {len(cache.shards)} shards, {disk / 1e6:.1f} MB on disk"
    )
    print(f"sources      {len(cache.manifest['sources'])} files, {source_bytes / 1e6:.1f} MB")
    if cache.built:
        rate = source_bytes / 1e6 / max(dt, 1e-9)
        print(f"built in     {dt:.1f} s ({rate:.1f} MB/s of source)")
    else:
        print(f"already built ({dt:.1f} s to check it)")
    return 0
