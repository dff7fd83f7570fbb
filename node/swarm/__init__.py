"""One node of a real swarm (DESIGN §4). ``agent.Node`` composes the rest:

  settings       the node's configuration sections (``NodeSettings``, ``NodeConfig``)
  transport      request/reply ops over hivemind's P2P, with deadlines and refusal codes
  wire, sealed   signed wire formats of contributions, records and snapshots; sealed (private) swarms
  contributions  a learner's contribution routed to the synchroniser, and the synchroniser's checks
  replication    merge records: merging, applying, pushing, serving
  catch_up       joining by download, and catching up from records or a snapshot
  view, guard    the live membership view and elections; scores and bans of misbehaving peers
  checkpoint, persistence   safetensors checkpoints and exports, written off the event loop
  status         the HTTP status endpoint (its client is ``node.common.status_client``)

May import: ``protocol``, ``dht``, ``node.common``, ``node.learner``.
"""
