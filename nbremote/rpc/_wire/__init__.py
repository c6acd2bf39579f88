"""Floor 1 of ``nbremote.rpc``: values and bytes -- no sockets, no threads started, no other rpc package.

``envelope`` (what peers exchange, validated), ``batching`` (batches, the outbox, messages in pieces),
``codec`` (the shell path's signed ``nbremote_request`` frames), ``serialize`` (cloudpickle protocol 5 with
out-of-band buffers and the framework adapters), ``wsproto`` (a Jupyter server's kernel-websocket formats),
``lease`` (how long a caller's state outlives its silence) and ``sessions`` (a jupyter_client Session kept
off the user's random streams). Everything above builds on these; nothing
here imports from above. Import the modules themselves: the package exports nothing of its own.
"""

__all__: list[str] = []
