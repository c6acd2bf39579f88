"""A direct data channel to a server-hosted kernel: big buffers skip the server when its ports can be reached.

Through a Jupyter server every byte crosses the server twice, and its own CPU (zmq copies, joining the v1
message, tornado's framing and 64 KiB reads) is the floor: ~330 ms for 64 MB here (issue 22), where the
kernel's own zmq socket carries it in ~130. Yet a server's kernel is an ordinary kernel with a shell
socket, which the driver can often reach: a server on the driver's network whose kernels bind beyond
loopback, a gateway's kernels in pods the driver's cluster routes to.

So a ``ServerLink`` asks the kernel, in its ``comm_open`` (over the websocket: authenticated by the
server's token), for its connection info. If the address answers, two DEALERs of ours connect to the
kernel's shell socket -- ``tx`` sends, ``rx`` receives, as a ``KernelLink``'s do -- and ``tx`` introduces
itself with a ``ping`` signed with the kernel's key that carries the link's secret token and ``rx``'s
identity; the kernel's shell path (``_worker.shellpath``) makes ``tx`` a way in for that same caller and
``rx`` the way out for its big replies, and answers ``pong`` on ``rx``. Only then is the channel used:
for batches with ``BULK_MIN`` bytes of buffers or more, both ways; everything else, and everything when
the address does not answer (``PROBE_TIMEOUT``), keeps to the websocket.

Security, as for any zmq link: every message is signed with the kernel's key (HMAC-SHA256); beyond
loopback the channel is used only where the kernel's transport is encrypted (CurveZMQ keys in its
connection info: a server started with ``--KernelManager.transport_encryption=auto``), since the
websocket may well be TLS, and an unencrypted kernel port would put the data in clear text on the wire.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
import uuid
from collections.abc import Sequence
from typing import Any

import zmq

from nbremote.rpc._transport.heartbeat import Heartbeat
from nbremote.rpc._transport.sockets import connect, dealer, recv_frames, send_frames
from nbremote.rpc._wire import envelope
from nbremote.rpc._wire.codec import Codec
from nbremote.rpc._wire.envelope import Buffer, Envelope

__all__ = ["BULK_MIN", "DirectChannel", "buffer_bytes", "open_direct"]

log = logging.getLogger("nbremote")

BULK_MIN = 1 << 20  # bytes of buffers in a batch from which it takes the direct channel (as shared memory does)
PROBE_TIMEOUT = 2.0  # s for the kernel's pong by the direct channel before we settle for the websocket
_WILDCARDS = ("", "0.0.0.0", "*", "::")


def buffer_bytes(items: Sequence[tuple[Envelope, Sequence[Buffer]]]) -> int:
    return sum(memoryview(f).nbytes for _, frames in items for f in frames)


class DirectChannel:
    """Two DEALERs on a server-hosted kernel's shell socket, signed with its key (see the module docstring).

    ``tx`` is used under the owning link's outbox lock only; ``rx`` belongs to the IO thread once adopted.
    """

    def __init__(self, name: str, conn: dict[str, Any]) -> None:
        self.name = name
        self.conn = conn
        key = conn.get("key", b"")
        self.codec = Codec(key.encode() if isinstance(key, str) else key,
                           signature_scheme=str(conn.get("signature_scheme", "hmac-sha256")))
        self.curve = bool(conn.get("curve_publickey") and conn.get("curve_secretkey"))
        self.digests = not envelope.is_loopback(str(conn["ip"])) and not self.curve  # as KernelLink's
        ident = f"nbremote-direct-{uuid.uuid4().hex[:12]}".encode()
        self.rx_identity = ident + b"-rx"
        self.tx, self.rx = dealer(ident), dealer(self.rx_identity)
        for sock in (self.tx, self.rx):
            connect(sock, conn, "shell_port")
        # The kernel's heartbeat, where it offered its port: the way to it is the data's, and its silence
        # is seen in ~2 s where the server's websocket takes up to SILENCE_LIMIT (``_transport.heartbeat``).
        self.heart = Heartbeat(conn) if isinstance(conn.get("hb_port"), int) else None

    def send(self, items: Sequence[tuple[Envelope, Sequence[Buffer]]]) -> None:
        send_frames(self.tx, self.codec.encode_items(items, digests=self.digests, pieces=True))

    def receive(self) -> list[tuple[Envelope, list[Buffer]]]:
        """What the kernel sent us on ``rx`` (only the kernel knows its identity)."""
        _, content, buffers = self.codec.decode(recv_frames(self.rx))
        return self.codec.unpack_items(content, buffers, digests=self.digests)

    def probe(self, token: str, timeout: float) -> bool:
        """Introduce ``tx`` and ``rx`` to the kernel's shell path; True once its pong came back on ``rx``."""
        hello: Envelope = {"k": "ping", "link": token,
                           "bulk": {"rx": self.rx_identity.hex(), "digests": self.digests}}
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            self.send([(hello, ())])
            end = time.monotonic() + min(left, 0.25)
            while (wait := end - time.monotonic()) > 0:
                if self.rx.poll(int(wait * 1000) + 1):
                    try:
                        if any(env["k"] == "pong" for env, _ in self.receive()):
                            return True
                    except Exception:  # a reply we cannot read is no channel
                        log.debug("unreadable pong on %r's direct channel", self.name, exc_info=True)
        return False

    def close(self) -> None:
        for sock in (self.tx, self.rx, *((self.heart.sock,) if self.heart is not None else ())):
            sock.close(linger=0)


def open_direct(name: str, offer: object, server_url: str, token: str, timeout: float = PROBE_TIMEOUT,
                ) -> DirectChannel | None:
    """The direct channel a kernel offered (its connection info, see ``_worker.install``), once proven to
    work; None where it is not offered, would cross a network in clear text, or does not answer."""
    if not isinstance(offer, dict) or not isinstance(offer.get("shell_port"), int):
        return None
    conn = dict(offer)
    server_host = urllib.parse.urlparse(server_url).hostname or "127.0.0.1"
    if conn.get("transport", "tcp") != "tcp" or (conn.get("curve_publickey") and not zmq.has("curve")):
        return None
    if str(conn.get("ip", "")) in _WILDCARDS:  # bound everywhere: reach it where we reach its server
        conn["ip"] = server_host
    elif envelope.is_loopback(str(conn["ip"])) and not envelope.is_loopback(server_host):
        return None  # the loopback of the server's machine: out of our reach (ours may hold another kernel)
    if not envelope.is_loopback(str(conn["ip"])) and not conn.get("curve_publickey"):
        log.info("worker %r: its kernel's ports are not encrypted beyond loopback: big buffers keep to the server",
                 name)
        return None
    channel = DirectChannel(name, conn)
    if channel.probe(token, timeout):
        return channel
    channel.close()
    log.info("worker %r: its kernel's ports at %s do not answer: big buffers go through the server", name, conn["ip"])
    return None
