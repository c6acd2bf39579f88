"""A frontend's own client of a worker kernel, for what is not an RPC: running cells and interrupting them.

``rpc.run_cell`` (``%%remote``) runs code in a worker's own namespace, on the kernel's main shell, as an
``execute_request`` sent by a client of ours: fresh shell, control and IOPub sockets built from the
connection info the driver holds for that worker, separate from the RPC link (which lives in a kernel
subshell, so RPCs keep being served while a cell runs). ``interrupt_request`` interrupts a kernel by
message, for kernels the driver cannot signal. A server-hosted worker has the same client over a
websocket of its own (``wscells``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import zmq
from jupyter_client.session import Session

from nbremote.errors import WorkerError
from nbremote.rpc._transport.sockets import connect
from nbremote.rpc._wire.sessions import own_rng

__all__ = ["SYNC_TIMEOUT", "Client", "interrupt_request"]

SYNC_TIMEOUT = 30.0  # s to reach a worker's kernel before the cell is sent


class Client:
    """Our own shell, control and IOPub sockets to one kernel; used by one thread at a time."""

    def __init__(self, worker: str, conn: dict[str, Any]) -> None:
        self.worker = worker
        key = conn.get("key", b"")
        self.session = own_rng(Session(key=key.encode() if isinstance(key, str) else key,  # (issue 40: see sessions)
                                       signature_scheme=conn.get("signature_scheme", "hmac-sha256"),
                                       username="nbremote-cell"))
        ctx: zmq.Context[Any] = zmq.Context.instance()
        self.shell = ctx.socket(zmq.DEALER)
        self.control = ctx.socket(zmq.DEALER)
        self.iopub = ctx.socket(zmq.SUB)
        for sock in (self.shell, self.control, self.iopub):
            sock.linger = 0
        self.iopub.rcvhwm = 0  # a chatty cell must not lose output while we are slow to read
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        for sock, port in ((self.shell, "shell_port"), (self.control, "control_port"), (self.iopub, "iopub_port")):
            connect(sock, conn, port)

    def send(self, sock: zmq.Socket[Any], msg_type: str, content: dict[str, Any]) -> str:
        msg = self.session.msg(msg_type, content)
        self.session.send(sock, msg)
        return str(msg["header"]["msg_id"])

    def recv(self, sock: zmq.Socket[Any]) -> dict[str, Any]:
        _, frames = self.session.feed_identities(sock.recv_multipart())
        return self.session.deserialize(frames)

    def sync(self, lost: Callable[[], str | None]) -> None:
        """Return once our IOPub subscription is live (the kernel answered on IOPub)."""
        deadline = time.monotonic() + SYNC_TIMEOUT
        while time.monotonic() < deadline:
            why = lost()
            if why is not None:
                raise WorkerError(f"cannot run a cell on worker {self.worker!r}: {why}", self.worker)
            self.send(self.control, "kernel_info_request", {})
            if self.iopub.poll(250):
                with contextlib.suppress(zmq.Again):
                    while True:
                        self.iopub.recv_multipart(zmq.NOBLOCK)  # status messages of our requests
                return
        raise WorkerError(f"worker {self.worker!r} did not answer on its IOPub channel within {SYNC_TIMEOUT:.0f} s; "
                          "is its kernel alive? (rpc.worker_status() shows its state)", self.worker)

    def execute(self, code: str) -> str:
        return self.send(self.shell, "execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True})

    def close(self) -> None:
        for sock in (self.shell, self.control, self.iopub):
            sock.close(linger=0)


def interrupt_request(worker: str, conn: dict[str, Any], timeout: float = 5.0) -> None:
    """Interrupt a kernel by message (``interrupt_request`` on its control channel), for attached kernels."""
    client = Client(worker, conn)
    try:
        msg_id = client.send(client.control, "interrupt_request", {})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if client.control.poll(100) and client.recv(client.control)["parent_header"].get("msg_id") == msg_id:
                return
        raise WorkerError(f"worker {worker!r} did not answer the interrupt_request within {timeout:.0f} s", worker)
    finally:
        client.close()
