"""One node of a real swarm (docs/design.md, section 4). ``agent.Node`` owns the shared state and builds the
rest (those made when it runs: ``assembly``):

  settings       the node's configuration sections (``NodeSettings``, ``NodeConfig``)
  transport      request/reply ops over hivemind's P2P, with deadlines and refusal codes
  wire, sealed   signed wire formats of contributions, records and snapshots; sealed (private) swarms
  sender         a learner's contribution routed to its synchroniser, failing over; the ids this node sent
  intake         a synchroniser's checks of a contribution before the pure core takes it
  replication    merge records: merging, applying, pushing, serving
  catch_up       joining by download, catching up from records or a snapshot, yielding to the majority
  view           the live membership view, heads it believes and elections
  trust          what the node believes of its peers and does about a lie: scores, work credits, receipts,
                 audits and their archive, evidence, snapshot vetting, lateness (``trust/__init__``)
  signed_files   signed bytes (records, audited messages) kept in files of the state folder
  record_push    whom a new merge record is pushed to, and the pushes
  limits         per-peer backoff and token buckets (catch-up retries, snapshot requests)
  checkpoint, persistence   safetensors checkpoints and exports, written off the event loop
  status         the status document; ``server`` serves it over HTTP (aiohttp) with ``/control`` (token),
                 ``/metrics`` (``metrics``), ``/history`` (``history``) and the dashboard (``dashboard/``);
                 ``status_p2p`` serves it over libp2p (client: ``node.cli.remote_status``)
  probe          dials and binds for ``ddiloco doctor``

May import: ``protocol``, ``dht``, ``node.common``, ``node.learner``.
"""
