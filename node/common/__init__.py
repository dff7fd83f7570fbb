"""What every part of the node shares: event records (``events``), thread and process priority
(``priority``) and the client of a node's status endpoint (``status_client``).

May import: ``protocol`` only.
"""
