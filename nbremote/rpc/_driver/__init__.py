"""Floor 4 of ``nbremote.rpc``, beside ``_worker``: what runs in the driver only, the process that made the world.

``world`` starts, attaches, restarts and removes worker kernels and tells the workers who is in the
world; ``status`` is what status displays show of each worker; ``cells`` runs notebook cells in workers'
own namespaces (``%%remote``) and ``cell_output`` shows what they print in the calling cell. Nothing here
runs in a worker kernel.
"""

__all__: list[str] = []
