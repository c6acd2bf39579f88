"""Cells (``rpc.run_cell``, ``%%remote``) on a server-hosted kernel: a frontend's websocket of its own.

``_driver.cells`` polls zmq sockets; here a reader thread moves what the websocket brings, per channel, into
inproc PAIR sockets that poll like a kernel's own (``shell``, ``control``, ``iopub``), and sends go out on
the websocket. The server subscribes to IOPub itself, so no sync is needed beyond one ``kernel_info``
round trip that proves the kernel answers. The RPC link (``_transport.wslink``) is separate: calls and cells run
side by side, as they do over zmq.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from jupyter_client.session import Session

from nbremote.errors import WorkerError
from nbremote.rpc._transport.websocket import WebSocket, WebSocketClosed
from nbremote.rpc._wire.wsproto import SUBPROTOCOL, decode, encode_legacy, encode_v1

__all__ = ["CellClient"]


class CellClient:
    """A frontend's conversation with a server-hosted kernel, for cells (``_driver.cells``): its own websocket.

    ``_driver.cells`` polls zmq sockets; here a reader thread moves what the websocket brings, per channel, into
    inproc PAIR sockets that poll like a kernel's own (``shell``, ``control``, ``iopub``), and sends go
    out on the websocket. The server subscribes to IOPub itself, so no sync is needed beyond one
    ``kernel_info`` round trip that proves the kernel answers.
    """

    def __init__(self, worker: str, ws: WebSocket) -> None:
        import zmq

        self.worker = worker
        self.ws = ws
        self.v1 = ws.subprotocol == SUBPROTOCOL
        self.session = Session(key=b"", username="nbremote-cell")
        ctx: Any = zmq.Context.instance()
        base = f"inproc://nbremote-cell-{uuid.uuid4().hex}"
        self._channels: dict[int, str] = {}
        self._feeds: dict[str, Any] = {}
        for channel in ("shell", "control", "iopub"):
            sock = ctx.socket(zmq.PAIR)
            sock.linger = 0
            sock.rcvhwm = 0
            sock.bind(f"{base}-{channel}")
            feed = ctx.socket(zmq.PAIR)
            feed.linger = 0
            feed.sndhwm = 0
            feed.connect(f"{base}-{channel}")
            setattr(self, channel, sock)
            self._channels[id(sock)] = channel
            self._feeds[channel] = feed
        self._reader = threading.Thread(target=self._read, name=f"nbremote-cell-ws-{worker}", daemon=True)
        self._reader.start()

    shell: Any
    control: Any
    iopub: Any

    def _read(self) -> None:
        with contextlib.suppress(OSError, WebSocketClosed):
            while True:
                self._forward(*self.ws.recv())  # in a call of its own: the loop keeps no message (pooled memory)
        for feed in self._feeds.values():
            feed.close(linger=0)

    def _forward(self, opcode: int, data: memoryview) -> None:
        message = decode(opcode, data, self.v1)
        if message is None:
            return
        channel, parts = message
        feed = self._feeds.get(channel)
        if feed is not None and len(parts) >= 4:
            feed.send_multipart(parts, copy=False)

    def send(self, sock: Any, msg_type: str, content: dict[str, Any]) -> str:
        msg = self.session.msg(msg_type, content)
        channel = self._channels[id(sock)]
        if self.v1:
            pack = self.session.pack
            self.ws.send(encode_v1(channel, [pack(msg["header"]), pack(msg["parent_header"]),
                                             pack(msg["metadata"]), pack(msg["content"])]))
        else:
            parts, opcode = encode_legacy(channel, msg)
            self.ws.send(parts, opcode)
        return str(msg["header"]["msg_id"])

    def recv(self, sock: Any) -> dict[str, Any]:
        frames = sock.recv_multipart()
        return {"header": json.loads(frames[0]), "parent_header": json.loads(frames[1]),
                "metadata": json.loads(frames[2]), "content": json.loads(frames[3]), "buffers": frames[4:]}

    def sync(self, lost: Callable[[], str | None], timeout: float = 30.0) -> None:
        msg_id = self.send(self.control, "kernel_info_request", {})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            why = lost()
            if why is not None:
                raise WorkerError(f"cannot run a cell on worker {self.worker!r}: {why}", self.worker)
            if self.control.poll(250) and self.recv(self.control)["parent_header"].get("msg_id") == msg_id:
                return
        raise WorkerError(f"worker {self.worker!r} did not answer through its server within {timeout:.0f} s",
                          self.worker)

    def execute(self, code: str) -> str:
        return self.send(self.shell, "execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True})

    def close(self) -> None:
        self.ws.close()
        self._reader.join(5)
        for sock in (self.shell, self.control, self.iopub):
            sock.close(linger=0)
