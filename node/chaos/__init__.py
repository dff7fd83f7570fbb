"""Real node processes under a failure plan (``ddiloco chaos``): the run's configuration (``config``), the
failure model and plan (``plan``), the harness that applies it (``harness``), the report scored from the
nodes' event records (``report``), network namespaces with capped links (``netns``), a finished run's
folder read back (``tape``) and replayed in the simulator (``replay``, ``ddiloco replay``).

May import: ``protocol``, ``sim``, ``node.common``, ``node.local``.
"""
