"""What a node believes of its peers, and what it does about a lie: one room for trust.

  peer_scores    scores and bans of peers, accusations, the replay memory
  work_book      each learner's work: its counters' window, when it last merged, whom the chain credits
  receipts       the signed receipts a synchroniser gives and a sender checks; an omission convicts
  audit          audits of merge records (``Auditor``): recompute, convict, undo, hand the proof on;
                 ``Auditor.ban_and_hand_on`` is the one way a signer is banned for what it signed
  audit_archive  the signed contribution messages kept for audits, served by the ``kept`` op
  audit_wire     the record fields an audit reads (digests, scales, share)
  evidence       the bounds a record is a proven lie against, on every node alike
  fence          whom a record's signer could be (``ElectionFence``): vouching, and the election fence
  held           records held for one more try (``HeldRecords``): out of turn, or refused by the fence
  vetting        whether a donor's head and snapshot are to be believed before catch-up takes them
  lateness       synchronisers that hold their rounds to the deadline, against the others

  policy         the one object the accepting, merging and applying paths ask (``TrustPolicy``), wired
                 from the swarm's kind (``TrustChecks``): a private swarm's checks only what a certified
                 member may still get wrong

The accepting, merging and applying paths (``node.swarm.intake``, ``node.swarm.replication``) reach these
through the policy alone, at named points; read without its calls, those paths are the honest path.
"""
