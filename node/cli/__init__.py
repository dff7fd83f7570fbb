"""The ``ddiloco`` command line (``main``), one module per subcommand, each with ``add_parser(sub)`` and
``run(args)``: ``train_local``, ``node_cmd``, ``up``, ``swarm``, ``status`` (with ``watch`` and, over
libp2p in a child process, ``remote_status``), ``doctor``, ``keygen``, ``sim``, ``chaos``; rich progress bars
(``progress``);
the configuration machinery that turns dataclass sections into flags and TOML tables (``config``); and the
fork server, a process that forks ready-imported ``ddiloco node`` processes for a launcher
(``forkserver``; its launcher's side is ``node.local.forks``).

May import: anything in the project.
"""
