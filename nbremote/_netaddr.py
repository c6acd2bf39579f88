"""This host's addresses, for the RPC layer and for ``nbremote worker`` alike.

``nbremote worker`` (the command a Slurm job or a remote host runs before its kernel starts) needs both and must
not import the RPC layer, which cost its start 0.3 s; so they live here, below it, once.
"""

from __future__ import annotations

import socket

__all__ = ["is_loopback", "source_address"]


def is_loopback(ip: str) -> bool:
    """``ip`` is this host's loopback (``localhost``, ``127.x.y.z``, ``::1``)."""
    return ip in ("localhost", "::1") or ip.startswith("127.")


def source_address(dest: str) -> str:
    """This host's source address on its route to ``dest``, as ``ip route get`` gives it: ``connect`` on a UDP
    socket picks the route and the address, and sends no packet. Each address ``dest`` resolves to is tried in
    turn; ``socket.gaierror`` if it resolves to none, else the last ``OSError`` if no route leads to any."""
    error: OSError | None = None
    for family, kind, proto, _, where in socket.getaddrinfo(dest, 9, type=socket.SOCK_DGRAM):
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.connect(where)
            except OSError as exc:
                error = exc
                continue
            return str(sock.getsockname()[0])
    raise error or OSError(f"{dest} resolves to no address")
