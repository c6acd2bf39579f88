"""A websocket for big binary messages: websocket-client's handshake, framing of nbremote's own.

websocket-client opens the connection (HTTP upgrade, TLS, proxies, subprotocol negotiation); frames
are then read and written here, on its socket, because its own framing copies a big payload several
times: it receives into ``bytes`` (read-only, so arrays rebuilt over it are read-only too) and masks
with Python big-int arithmetic. Here a message is received with ``recv_into`` straight into one
buffer -- the buffers of a Jupyter message are then writable memoryviews over it, no copy -- and
sent masked in one numpy pass that also gathers its parts (a client must mask what it sends, RFC 6455
5.3: the one copy a websocket cannot avoid). A big binary message is received into memory reused from
``bufpool.POOL`` (a fresh buffer faults on every page: ~50 ms per 64 MB here, issue 22); it goes back
there once nothing views it (the arrays rebuilt over it are gone). A big message is masked into pooled
memory too, back in the pool once it is sent. Control frames are handled as they
come: a ping is answered, a close ends the connection.

Every message received is acknowledged at once (``TCP_QUICKACK``, Linux): jupyter_server does not turn
Nagle's algorithm off on its websockets, so a small message it sends right after another (a reply after
a worker's shared-memory bookkeeping, or after a call's printed output) waited for our delayed ACK --
40 ms each time, measured on every call whose arguments went by shared memory (issue 22).

One thread receives (``recv``); any thread may send (``send``, under a lock).
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import struct
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from nbremote.rpc._wire.bufpool import POOL
from nbremote.rpc._wire.wsproto import OP_BINARY, OP_CLOSE, OP_CONT, OP_PING, OP_PONG

__all__ = ["WebSocket", "WebSocketClosed", "connect", "mask_into"]

_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux only; it lasts until the kernel decides again


class WebSocketClosed(ConnectionError):
    """The peer closed the websocket (``code`` and ``reason`` from its close frame, if any)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


def mask_into(out: memoryview, offset: int, data: Any, key: bytes) -> None:
    """XOR ``data`` with the 4-byte ``key`` into ``out[offset:]``; the key's phase follows ``offset``."""
    src = np.frombuffer(data, dtype=np.uint8)
    n = src.size
    if n == 0:
        return
    phase = offset % 4
    rotated = key[phase:] + key[:phase]
    dst = np.frombuffer(out, dtype=np.uint8, count=n, offset=offset)
    words = n // 8
    if words:
        k64 = np.frombuffer(rotated * 2, dtype=np.uint64)
        np.bitwise_xor(src[: words * 8].view(np.uint64), k64, out=dst[: words * 8].view(np.uint64))
    tail = n - words * 8
    if tail:
        np.bitwise_xor(src[words * 8 :], np.frombuffer((rotated * 2)[:tail], dtype=np.uint8), out=dst[words * 8 :])


def frame_header(opcode: int, length: int) -> bytes:
    """A masked, final frame's header, without the mask key."""
    first = 0x80 | opcode
    if length < 126:
        return struct.pack("!BB", first, 0x80 | length)
    if length < 1 << 16:
        return struct.pack("!BBH", first, 0x80 | 126, length)
    return struct.pack("!BBQ", first, 0x80 | 127, length)


class WebSocket:
    """One client websocket; ``subprotocol`` is what the server selected."""

    def __init__(self, sock: socket.socket, subprotocol: str | None, keepalive: Any) -> None:
        self.sock = sock
        self.subprotocol = subprotocol
        self._keepalive = keepalive  # websocket-client's object: closing it closes the socket
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, parts: Sequence[Any], opcode: int = OP_BINARY) -> None:
        """Send one message made of ``parts`` (bytes-like), gathered and masked in one pass."""
        sizes = [memoryview(p).nbytes for p in parts]
        length = sum(sizes)
        key = os.urandom(4)
        head = frame_header(opcode, length) + key
        view = POOL.take(len(head) + length)  # reused memory: back when this returns (8 MiB pieces, one after another)
        view[: len(head)] = head
        body = view[len(head) :]
        offset = 0
        for part, size in zip(parts, sizes, strict=True):
            mask_into(body, offset, memoryview(part).cast("B") if size else b"", key)
            offset += size
        with self._send_lock:
            if self.closed:
                raise WebSocketClosed("the websocket is closed")
            self._sendall(view)

    def _sendall(self, data: Any) -> None:
        """``sendall``, without SIGPIPE where the socket allows (a process whose SIGPIPE is at its default
        would die writing to a connection the server closed)."""
        if _NOSIGNAL and not isinstance(self.sock, ssl.SSLSocket):
            self.sock.sendall(data, _NOSIGNAL)
        else:
            self.sock.sendall(data)

    def _read_exact(self, n: int, pooled: bool = False) -> memoryview:
        view = POOL.take(n) if pooled else memoryview(bytearray(n))
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise WebSocketClosed("the server closed the connection")
            got += k
        return view

    def recv(self) -> tuple[int, memoryview]:
        """The next data message: ``(opcode, payload)``. Answers pings; raises WebSocketClosed at a close."""
        message: memoryview | None = None
        message_op = OP_BINARY
        while True:
            b0, b1 = self._read_exact(2)
            fin, opcode, masked, length = b0 & 0x80, b0 & 0x0F, b1 & 0x80, b1 & 0x7F
            if length == 126:
                length = struct.unpack("!H", self._read_exact(2))[0]
            elif length == 127:
                length = struct.unpack("!Q", self._read_exact(8))[0]
            key = bytes(self._read_exact(4)) if masked else None
            payload = self._read_exact(length, pooled=opcode == OP_BINARY)
            if key is not None:  # servers do not mask; accept it anyway
                mask_into(payload, 0, bytes(payload), key)
            if opcode == OP_PING:
                self.send([payload], OP_PONG)
                continue
            if opcode == OP_PONG:
                continue
            if opcode == OP_CLOSE:
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
                reason = bytes(payload[2:]).decode(errors="replace")
                self.close()
                raise WebSocketClosed(f"the server closed the websocket ({code}{': ' + reason if reason else ''})",
                                      code)
            if opcode == OP_CONT and message is not None:  # a fragmented message (rare): joined by copying
                message = memoryview(bytes(message) + bytes(payload))
            else:
                message, message_op = payload, opcode
            if fin:
                if _QUICKACK is not None:
                    with contextlib.suppress(OSError):
                        self.sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
                return message_op, message

    def close(self) -> None:
        with self._send_lock:
            if self.closed:
                return
            self.closed = True
            try:
                body = struct.pack("!H", 1000)
                key = os.urandom(4)
                out = bytearray(frame_header(OP_CLOSE, len(body)) + key + body)
                mask_into(memoryview(out), len(out) - len(body), body, key)
                self._sendall(out)
            except OSError:
                pass
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._keepalive.shutdown()  # closes the socket; its close() would send a second close frame


def connect(url: str, headers: dict[str, str], subprotocols: Sequence[str], timeout: float) -> WebSocket:
    """Open a websocket (websocket-client does the handshake); raises websocket-client's errors."""
    import websocket  # websocket-client: only server-hosted workers need it

    def open_with(protocols: list[str]) -> Any:
        return websocket.create_connection(url, header=[f"{k}: {v}" for k, v in headers.items()],
                                           subprotocols=protocols or None, timeout=timeout,
                                           skip_utf8_validation=True)

    try:
        ws = open_with(list(subprotocols))
    except websocket.WebSocketBadStatusException:
        raise
    except websocket.WebSocketException:
        if not subprotocols:
            raise
        # websocket-client refuses an upgrade that selects none of the subprotocols offered: a server
        # that knows none of them (jupyter_server 1.x). Ask again for its default protocol.
        ws = open_with([])
    sock = ws.sock
    if sock is None:
        raise WebSocketClosed(f"the websocket to {url} closed during its handshake")
    sock.settimeout(None)  # the reader blocks; senders never wait on the peer for long
    return WebSocket(sock, ws.getsubprotocol(), ws)
