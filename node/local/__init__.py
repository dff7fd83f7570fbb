"""Everything that runs on one machine without a real swarm: the in-process runner of M learners on a
virtual clock (``runner``, ``run_config``, ``config``) with the data-parallel baseline (``dp``), and the
launcher of a local swarm of real node processes (``launcher``: ``ddiloco up``), which can have them forked
by a fork server instead of started afresh (``forks``).

May import: ``protocol``, ``node.common``, ``node.learner``. Not ``node.swarm``: the launcher talks to its
nodes through their status endpoints, like any operator.
"""
