"""The ddiloco node: everything with I/O above the pure core (``protocol``) and the DHT layer (``dht``).

Subpackages, each a room of one concern, listed from the bottom layer up; a package imports only those
below it (``tests/test_layering.py`` holds the rule, and ``tests/test_import_cycles.py`` forbids cycles):

  common    event records, thread and process priority, the status endpoint's client
  learner   the model, data and task; the learner (inner optimiser, snapshots); its training loop; the
            multi-process learner units (DDP, FSDP2)
  swarm     one node of a real swarm: the agent and its transport, wire formats, contributions,
            replication, catch-up, views, peer scores, checkpoints, persistence and status endpoint
  local     the in-process runner and its baselines on a virtual clock; the local multi-node launcher
  chaos     real node processes under a failure plan: the harness, plans, reports, network namespaces
  cli       the ``ddiloco`` command line: one module per subcommand, and the configuration machinery

``swarm`` and ``local`` are siblings: neither imports the other.
"""

import dht  # noqa: F401, E402 - first: hivemind's DHT and P2P without the rest of hivemind (``dht/__init__``)
