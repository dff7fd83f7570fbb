"""One node of a real swarm (docs/design.md, section 4). ``agent.Node`` composes the rest:

  settings       the node's configuration sections (``NodeSettings``, ``NodeConfig``)
  transport      request/reply ops over hivemind's P2P, with deadlines and refusal codes
  wire, sealed   signed wire formats of contributions, records and snapshots; sealed (private) swarms
  contributions  a learner's contribution routed to the synchroniser, and the synchroniser's checks
  replication    merge records: merging, applying, pushing, serving
  catch_up       joining by download, catching up from records or a snapshot, yielding to the majority
  view, guard    the live membership view, heads it believes and elections; scores and bans of peers
  limits         per-peer backoff and token buckets (catch-up retries, snapshot requests)
  checkpoint, persistence   safetensors checkpoints and exports, written off the event loop
  status         the status document; ``server`` serves it over HTTP (aiohttp) with ``/control`` (token),
                 ``/metrics`` (``metrics``), ``/history`` (``history``) and the dashboard (``dashboard/``);
                 ``status_p2p`` serves it over libp2p (client: ``node.cli.remote_status``)
  probe          dials and binds for ``ddiloco doctor``

May import: ``protocol``, ``dht``, ``node.common``, ``node.learner``.
"""
