"""Real node processes under a failure plan (``ddiloco chaos``): the run's configuration (``config``), the
failure model and plan (``plan``), the harness that applies it (``harness``), the report scored from the
nodes' event records (``report``), and network namespaces with capped links (``netns``).

May import: ``protocol``, ``node.common``, ``node.local``.
"""
