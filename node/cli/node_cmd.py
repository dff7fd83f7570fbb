"""``ddiloco node``: one node of a real swarm, or (with ``--nproc N``) the torchrun launch of its learner unit."""

from __future__ import annotations

import argparse
import logging
import sys

from node.cli.config import add_config_args
from node.swarm.settings import NodeConfig
from protocol.errors import ConfigError


def add_parser(sub) -> None:
    nd = sub.add_parser(
        "node",
        help="run one node of a swarm: a learner plus its network agent",
        description="Run one swarm node: it joins the DHT through --initial-peers (or starts a swarm), "
        "trains its learner, sends contributions to the elected synchroniser of each fragment, takes that "
        "role when elected, and keeps a replica of the global model. Status: GET STATUS_URL/status (the URL "
        "is in STATE_DIR/ready.json). SIGTERM or Ctrl+C stops it after a checkpoint and an export. It trains "
        "the byte-level default unless --preset, --model, --tokenizer or --data say otherwise; with --data give "
        "each node its own --data-part K/N (docs/custom-task.md).",
    )
    nd.add_argument("--config", help="TOML file with [node] [protocol] [task] [model] [inner] tables")
    add_config_args(nd, root=NodeConfig)


def _without_flag(argv: list[str], flag: str) -> list[str]:
    """argv less ``flag VALUE`` / ``flag=VALUE`` (torchrun's parser would take --nproc as its own prefix)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def run(args: argparse.Namespace, argv: list[str]) -> int:
    import os

    import torch.multiprocessing as torch_mp

    from node.cli.config import build_config, describe
    from node.common.heap import mmap_threshold, steady_allocator, tune_allocator
    from node.learner.unit import Unit, run_rank
    from node.swarm.agent import Node

    # hivemind (imported above) puts torch's shared memory on the file_system strategy, whose helper
    # process, torch_shm_manager, outlives the node and aborts ("terminate called after throwing an
    # instance of 'std::system_error'") once the node's temporary folder is gone: every node the launcher
    # stopped wrote that to its log. What the node shares it shares by fork (hivemind's future states),
    # which file descriptors serve without a helper. HIVEMIND_MEMORY_SHARING_STRATEGY still chooses.
    torch_mp.set_sharing_strategy(os.environ.get("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor"))
    cfg = build_config(args, args.config, root=NodeConfig)
    n = cfg.node.nproc
    world = os.environ.get("WORLD_SIZE")
    unit_cls = Unit
    task = None
    if cfg.task.data or cfg.task.tokenizer or cfg.model.name != "tiny" or cfg.node.shard:
        from node.learner.task import load_task

        # the user's model, tokenizer and data are checked here: a bad one stops the node before it starts
        task = load_task(None, cfg.task_config())
    auto = cfg.node.malloc_mmap_mib < 0
    numel = _model_numel(cfg, task) if auto else 0
    if threshold := mmap_threshold(cfg.node.malloc_mmap_mib, numel):
        tune_allocator(threshold)  # before the model and replicas are made
    elif auto and numel:
        steady_allocator(4 * numel)
    if cfg.node.shard:
        from node.learner.unit_fsdp import ShardedUnit, check_shardable

        if max(n, int(world or 1)) < 2:
            raise ConfigError(
                "shard=True is invalid for a single-process learner: FSDP2 shards across the processes of a "
                "learner unit; add --nproc N with N >= 2 (or start the node under torchrun)"
            )
        check_shardable(task.new_model())
        unit_cls = ShardedUnit
    if n > 1 and world is None:
        # A multi-process learner unit: torchrun starts n copies of this command, ranks in the environment.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
        cmd += ["-m", "node", *_without_flag(argv, "--nproc")]
        print(f"starting a {n}-process learner unit: {' '.join(cmd)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.execv(sys.executable, cmd)
    if n > 1 and int(world) != n:
        raise ConfigError(f"nproc={n} is invalid: torchrun started {world} processes (WORLD_SIZE)")
    unit = unit_cls.from_env(cfg.node.unit_timeout_s)
    if unit is not None and not unit.lead:
        rc = run_rank(cfg, unit)
        # No interpreter teardown: after destroy_process_group, gloo's threads now and then abort it
        # (SIGABRT, "terminate called without an active exception") once all the rank's work is done.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    print("resolved configuration:\n" + describe(cfg), file=sys.stderr, flush=True)
    node = Node(cfg, unit)
    print(f"node {node.peer_id} starting (state in {cfg.node.state_dir})", file=sys.stderr, flush=True)
    return node.run()


def _model_numel(cfg, task) -> int:
    """The model's parameter count, no weights made: the built-in model's by its shape, a transformers one's
    from a copy on the meta device; 0 if that fails."""
    import torch

    from node.learner.model import TinyGPT

    if task is None or getattr(task, "hf", None) is None:
        return TinyGPT.numel(cfg.model if task is None else task.model_cfg)
    try:
        with torch.device("meta"):
            return sum(p.numel() for p in task.new_model().parameters())
    except Exception:  # noqa: BLE001 - e.g. a checkpoint folder's weights that will not load on meta: no tuning
        return 0
