"""What every part of the node shares: event records (``events``), thread and process priority
(``priority``), the client of a node's status endpoint (``status_client``), the frames of status over
libp2p (``status_wire``) and the pure rules of ``ddiloco doctor`` (``diagnosis``), the progress display of long work (``progress``) and
where ddiloco keeps its caches (``cache``).

May import: ``protocol`` only.
"""
