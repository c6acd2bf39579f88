"""Floor 2 of ``nbremote.rpc``: the only code that moves bytes on a kernel's channels (zmq or a server's websocket).

``base`` is the seam (``Link``, ``Connection``); ``zmqlink`` and ``wslink`` implement it over a kernel's zmq
channels and over a Jupyter server's kernel websocket, ``iothread`` owns their sockets, ``threadsockets``
lets a blocking call receive its own reply, ``shm`` carries big frames between processes of one machine,
``cpuwake`` keeps idle CPUs quick to wake while messages leave, ``switches`` reads the environment's on/off
switches, ``cellclient`` and ``wscells`` are a frontend's own client for running cells. It builds on ``_wire`` only;
:func:`open_link` is the one way the floors above make a link from a peer's connection info.
"""

from __future__ import annotations

from typing import Any

from nbremote.rpc._transport.base import Connection
from nbremote.rpc._transport.wslink import server_link
from nbremote.rpc._transport.zmqlink import KernelLink

__all__ = ["open_link"]


def open_link(name: str, conn: dict[str, Any], *, watched: bool = False) -> Connection:
    """A new, not yet handshaken link to peer ``name``: through its Jupyter server when its connection info
    names one (``url``), else to its kernel's own zmq channels. ``watched``: see ``KernelLink``."""
    if "url" in conn:
        return server_link(name, conn)
    return KernelLink(name, conn, watched=watched)
