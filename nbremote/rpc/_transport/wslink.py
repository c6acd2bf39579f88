"""The second transport: a worker kernel reached through a Jupyter server's kernel websocket.

A kernel hosted by a Jupyter Server (JupyterLab's, a JupyterHub user's), a Kernel Gateway or an
Enterprise Gateway is reachable only through ``/api/kernels/<id>/channels``: one websocket that carries
every channel of the kernel. ``ServerLink`` is the second implementation of the transport seam
(``_transport.Connection``, beside ``KernelLink``): same handshake, same envelopes, same methods the agent
and the IO thread use, with the websocket in place of the zmq sockets.

Formats (``_wire.wsproto``): ``v1.kernel.websocket.jupyter.org`` (jupyter_server >= 2) where the server offers
it, binary parts the server passes through; otherwise the *legacy* one (jupyter_server 1.x, e.g.
Enterprise Gateway 3), which the server decodes and re-encodes, so it costs more. The server signs
what we send with the kernel's key and strips signatures from what it forwards, so nothing here signs;
the server's token and TLS guard the websocket.

Paths, as on zmq (see ``_transport``): the handshake bootstraps the kernel, opens a subshell where the
kernel has them, and opens nbremote's comm inside it. The comm offers the **shell path** with a random
token instead of socket identities (we cannot know the identity of the server's socket): our first
``ping`` carrying the token makes the server's shell socket our identity both ways on the kernel, so
requests and replies are ``nbremote_request`` messages on the shell channel -- served on the kernel's
shell-channel thread, and never broadcast on IOPub, where the server would also rate-limit them
(``iopub_msg_rate_limit``). Where the pong does not come, the comm path (replies on IOPub) is used.

Threads: one reader thread per link receives everything (zero-copy: buffers are writable memoryviews
over the received message) and hands envelopes to the agent; any thread sends under the websocket's
lock. Liveness: a closed websocket, an IOPub ``status`` of ``dead``/``restarting`` (the server's
restarter), a ``kernel_info_reply`` from a new kernel session, no reply to one for ``SILENCE_LIMIT``
seconds, or the server saying it no longer has the kernel (``gone``, polled by ``_kernels.hosted``); and
where the kernel's ports are reached (a direct data channel), its heartbeat stopping for
``HEARTBEAT_TIMEOUT`` (``_transport.heartbeat``: ~2 s, where the websocket's silence takes 20). Cells run
on a websocket of their own (``_transport.wscells``).

Big messages: tornado refuses websocket messages above ``websocket_max_message_size`` (10 MiB unless the
server sets it, and a Kernel Gateway cannot), so what we send goes in pieces of at most ``MAX_MESSAGE``
bytes of buffers (``part`` envelopes, reassembled by the kernel's agent into one buffer). Messages from
the server have no such limit. But the server's own CPU is the floor for anything that goes through it
(~330 ms for 64 MB here), so big buffers avoid it where they can, decided by proof, not by address: a
kernel on the driver's machine shares memory with it (the ``shm`` probes of ``KernelLink``: only the
message goes through the websocket), and a kernel whose ports the driver reaches takes them by a direct
data channel (``_transport.direct``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from jupyter_client.session import Session

from nbremote.errors import ServerError, WorkerStartError
from nbremote.rpc._transport import websocket
from nbremote.rpc._transport.base import (
    SESSION_CHECK_INTERVAL,
    SHELL_PATH_CHECK,
    OnLost,
    OnMessage,
    Pump,
    Queued,
    bootstrap_failed,
    shell_path_wanted,
)
from nbremote.rpc._transport.cpuwake import CPU_WAKE
from nbremote.rpc._transport.direct import BULK_MIN, DirectChannel, buffer_bytes, open_direct
from nbremote.rpc._transport.heartbeat import HEARTBEAT_TIMEOUT
from nbremote.rpc._transport.shm import SharedMemory
from nbremote.rpc._transport.websocket import WebSocket, WebSocketClosed
from nbremote.rpc._wire import batching, envelope
from nbremote.rpc._wire.codec import MSG_TYPE, Codec, is_ours
from nbremote.rpc._wire.envelope import Buffer, Envelope
from nbremote.rpc._wire.lease import renew_every
from nbremote.rpc._wire.wsproto import SUBPROTOCOL, decode, encode_legacy, encode_v1

__all__ = ["MAX_MESSAGE", "OPEN_TIMEOUT", "ServerLink", "auth_headers", "open_websocket", "server_link"]

log = logging.getLogger("nbremote")

# Bytes of buffers per websocket message we send: tornado refuses bigger messages than its
# websocket_max_message_size (10 MiB unless the server sets it); bigger ones go in pieces (_wire "part").
MAX_MESSAGE = 8 << 20
SILENCE_LIMIT = 20.0  # s without a kernel_info_reply: the kernel or its server is gone (long, for GIL-holding work)
OPEN_TIMEOUT = 30.0  # s for a server to take a websocket (as for its REST calls)
ASK_AGAIN_S = 1.0  # s between kernel_info_requests while a new kernel has not answered one


def auth_headers(token: str | None) -> dict[str, str]:
    """The header a Jupyter server takes its token in (never in a URL, which servers and proxies log)."""
    return {"Authorization": f"token {token}"} if token else {}


def open_websocket(url: str, token: str | None, kernel_id: str, name: str, timeout: float = OPEN_TIMEOUT,
                   ) -> WebSocket:
    """A new websocket to the channels of kernel ``kernel_id`` on the server at ``url`` (a base URL ending in
    ``/``), in the v1 protocol where the server offers it; failures are ``ServerError``s naming the fix."""
    base = "wss" + url[5:] if url.startswith("https") else "ws" + url[4:]
    ws_url = f"{base}api/kernels/{urllib.parse.quote(kernel_id)}/channels?session_id={uuid.uuid4().hex}"
    try:
        return websocket.connect(ws_url, auth_headers(token), [SUBPROTOCOL], timeout)
    except ImportError as exc:
        raise ServerError(f"worker {name!r}: server-hosted workers need websocket-client "
                          "(pip install 'nbremote[server]')", name, url=url) from exc
    except Exception as exc:
        raise ServerError(f"worker {name!r}: cannot open the kernel websocket of {url} ({exc})", name,
                          url=url) from exc


def server_link(name: str, conn: dict[str, Any]) -> ServerLink:
    """A link of a worker's own to a server-hosted peer, from the connection info the driver shared
    (``{"url", "kernel_id", "token"}``, see ``nbremote.rpc._kernels.hosted``)."""
    url, kernel_id = str(conn["url"]).rstrip("/") + "/", str(conn["kernel_id"])
    return ServerLink(name, open_websocket(url, conn.get("token") or None, kernel_id, name), kernel_id=kernel_id,
                      url=url)


class ServerLink(Queued):
    """Our websocket to one server-hosted kernel and the comm we opened on it (a ``KernelLink`` twin)."""

    def __init__(self, name: str, ws: WebSocket, *, kernel_id: str, max_message: int = MAX_MESSAGE,
                 gone: Callable[[], str | None] | None = None, url: str = "") -> None:
        self.name = name
        self.url = url  # the server's: where a kernel bound to every address is reached (``direct``)
        self.v1 = ws.subprotocol == SUBPROTOCOL  # else the legacy protocol (jupyter_server 1.x)
        self.kernel_id = kernel_id
        self.max_message = max_message
        self.gone = gone  # why the server no longer has the kernel (it is polled elsewhere), or None
        self.ws = ws
        self.conn: dict[str, Any] = {"kernel_id": kernel_id}
        self.session = Session(key=b"", username="nbremote")  # the server signs for us
        self.codec = Codec(b"", session=self.session.session)
        self.fast = False
        self.same_host = False  # set by open(): the kernel sees our shared memory (the message still goes by us)
        self.direct: DirectChannel | None = None  # set by open(): big buffers by the kernel's own port
        # Over the server, digests would add nothing: the server signs what anyone with its token sends.
        self.digests = False
        self.comm_id = uuid.uuid4().hex
        self.subshell_id: str | None = None
        self.info: dict[str, Any] = {}
        self.lost: str | None = None
        self.on_message: OnMessage | None = None
        self.on_lost: OnLost | None = None
        self.wake: Callable[[], None] = self.drain
        self.kernel_session = ""
        self._token = os.urandom(16).hex()
        self._session_next = 0.0
        self._lease_next = 0.0
        self._asked: float | None = None  # when our unanswered kernel_info_request left
        self._why: str | None = None  # set by the reader: why the kernel is gone
        self._handshake: queue.Queue[tuple[str, list[memoryview]]] | None = queue.Queue()
        self._held: list[list[tuple[Envelope, list[Buffer]]]] = []
        self._deliver_lock = threading.Lock()
        self.outbox = batching.Outbox(self._send_batch)
        self._reader = threading.Thread(target=self._read, name=f"nbremote-ws-{name}", daemon=True)
        self._reader.start()

    # -- sending ---------------------------------------------------------------------------------------
    def _send(self, channel: str, msg_type: str, content: dict[str, Any], *, subshell: bool = False,
              buffers: Sequence[Buffer] = ()) -> str:
        msg = self.session.msg(msg_type, content)
        if subshell and self.subshell_id is not None:
            msg["header"]["subshell_id"] = self.subshell_id
        self._send_msg(channel, msg, buffers)
        return str(msg["header"]["msg_id"])

    def _send_msg(self, channel: str, msg: dict[str, Any], buffers: Sequence[Buffer] = ()) -> None:
        if self.v1:
            pack = self.session.pack
            self.ws.send(encode_v1(channel, [pack(msg["header"]), pack(msg["parent_header"]), pack(msg["metadata"]),
                                             pack(msg["content"]), *buffers]))
        else:
            parts, opcode = encode_legacy(channel, msg, buffers)
            self.ws.send(parts, opcode)

    def _send_request(self, content: dict[str, Any], buffers: Sequence[Buffer]) -> None:
        """One ``nbremote_request`` (the shell path) on the shell channel."""
        if self.v1:  # the lean codec's parts; no delimiter, no signature: the server signs
            self.ws.send(encode_v1("shell", self.codec.encode(content, buffers)[2:]))
        else:
            self._send_msg("shell", self.session.msg(MSG_TYPE, content), buffers)

    def _send_fast(self, items: Sequence[tuple[Envelope, Sequence[Buffer]]]) -> None:
        data, buffers = envelope.pack(items)
        self._send_request(dict(data), buffers)  # served on the kernel's shell-channel thread itself

    def _send_batch(self, items: Sequence[tuple[Envelope, Sequence[Buffer]]]) -> None:
        CPU_WAKE.touch()
        if self.direct is not None and buffer_bytes(items) >= BULK_MIN:
            self.direct.send(items)
            return
        data, buffers = envelope.pack(items)
        messages: list[tuple[dict[str, Any], list[Buffer]]] = [(dict(data), buffers)]
        if sum(memoryview(b).nbytes for b in buffers) > self.max_message:  # the server would refuse it
            messages = batching.split_parts(dict(data), buffers, self.max_message, uuid.uuid4().hex)
        try:
            for content, frames in messages:
                if self.fast:
                    self._send_request(content, frames)
                else:
                    self._send("shell", "comm_msg", {"comm_id": self.comm_id, "data": content}, subshell=True,
                               buffers=frames)
        except (OSError, WebSocketClosed) as exc:
            self._why = self._why or f"its server's websocket failed ({exc})"

    def send_own_reply(self, env: Envelope, frames: Sequence[Buffer]) -> Pump | None:
        """No thread sockets through a server: blocking calls take the shared websocket."""
        return None

    def send_close(self) -> None:
        def send() -> None:
            self._send("shell", "comm_close", {"comm_id": self.comm_id, "data": {}}, subshell=True)

        with contextlib.suppress(OSError, WebSocketClosed):
            self.outbox.locked(send)

    def sockets(self) -> tuple[Any, ...]:
        """What the IO thread polls: the direct channel's receiving socket and its kernel's heartbeat, if
        any (the websocket has a reader thread of its own)."""
        if self.direct is None:
            return ()
        return (self.direct.rx,) if self.direct.heart is None else (self.direct.rx, self.direct.heart.sock)

    def readable(self, sock: object, now: float) -> str | None:
        """The direct channel has input (the IO thread): deliver it, or take the heartbeat's echo."""
        if self.direct is not None:
            if self.direct.heart is not None and sock is self.direct.heart.sock:
                self.direct.heart.answered(now)
                return None
            try:
                self._deliver(self.direct.receive())
            except Exception:
                log.exception("dropping a malformed message from worker %r's direct channel", self.name)
        return None

    def close(self) -> None:
        def close_all() -> None:
            self.ws.close()
            if self.direct is not None:
                self.direct.close()

        self.outbox.close(then=close_all)

    # -- receiving (the reader thread) -------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                self._received(*self.ws.recv())  # no local here keeps the message (and its pooled memory)
        except (OSError, WebSocketClosed) as exc:
            if not self.ws.closed:
                self._why = self._why or f"its server closed the websocket ({exc})"
        finally:
            if self._handshake is not None:
                self._handshake.put(("", []))  # wake a waiting handshake: it will see _why

    def _received(self, opcode: int, data: memoryview) -> None:
        try:
            message = decode(opcode, data, self.v1)
            if message is not None:
                self._dispatch(*message)
        except Exception:
            log.exception("dropping a malformed message from worker %r", self.name)

    def _dispatch(self, channel: str, parts: list[memoryview]) -> None:
        if self._handshake is not None:
            self._handshake.put((channel, parts))
            return
        if len(parts) < 4:
            return
        if channel == "shell" and is_ours(bytes(parts[0])):
            content = json.loads(bytes(parts[3]))
            self._deliver(envelope.unpack(content, list(parts[4:])))
        elif channel == "iopub":
            header = json.loads(bytes(parts[0]))
            msg_type = header.get("msg_type")
            if msg_type == "status":
                state = json.loads(bytes(parts[3])).get("execution_state")
                if state in ("dead", "restarting", "autorestarting"):
                    self._why = f"its server reports the kernel {state} (what it held is gone)"
                return
            if msg_type not in ("comm_msg", "comm_close"):
                return
            content = json.loads(bytes(parts[3]))
            if content.get("comm_id") != self.comm_id:
                return
            if msg_type == "comm_close":
                self._why = "the worker closed nbremote's comm"
                return
            self._deliver(envelope.unpack(content.get("data"), list(parts[4:])))
        elif channel == "control":
            header = json.loads(bytes(parts[0]))
            if header.get("msg_type") == "kernel_info_reply":
                self._asked = None
                session = str(header.get("session", ""))
                if self.kernel_session and session and session != self.kernel_session:
                    self._why = ("its kernel was restarted behind nbremote's back (a new process answers): "
                                 "the RRefs and modules it held are gone")

    def _deliver(self, items: list[tuple[Envelope, list[Buffer]]]) -> None:
        with self._deliver_lock:
            if self.on_message is None:
                self._held.append(items)
                return
            held, self._held = self._held, []
        for each in held:
            self.on_message(self, each)
        if items:
            self.on_message(self, items)

    # -- handshake -------------------------------------------------------------------------------------
    def _wait(self, deadline: float, what: str, match: Callable[[str, list[memoryview]], bool],
              again: Callable[[], None] | None = None) -> list[memoryview]:  # again(): ask anew every ASK_AGAIN_S
        assert self._handshake is not None  # only during open()
        asked = time.monotonic()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerStartError(f"worker {self.name!r} did not answer {what} in time", self.name)
            if self._why is not None:
                raise WorkerStartError(f"worker {self.name!r} was lost during {what}: {self._why}", self.name)
            try:
                channel, parts = self._handshake.get(timeout=min(left, 0.2))
            except queue.Empty:
                if again is not None and time.monotonic() - asked >= ASK_AGAIN_S:
                    again()
                    asked = time.monotonic()
                continue
            if len(parts) < 4:
                continue
            if channel == "iopub":
                self._handshake_iopub(parts)
            if match(channel, parts):
                return parts

    def _handshake_iopub(self, parts: list[memoryview]) -> None:
        header = json.loads(bytes(parts[0]))
        if header.get("msg_type") not in ("comm_msg", "comm_close"):
            return
        content = json.loads(bytes(parts[3]))
        if content.get("comm_id") != self.comm_id:
            return
        if header["msg_type"] == "comm_close":
            raise WorkerStartError(
                f"worker {self.name!r} refused nbremote's comm (no '{envelope.COMM_TARGET}' target): nbremote is not "
                "installed in that kernel or was not bootstrapped", self.name)
        for env, _ in envelope.unpack(content.get("data"), list(parts[4:])):
            if env["k"] == "ack":
                info = dict(env.get("info", {}))
                if info.get("refused"):
                    raise WorkerStartError(f"worker {self.name!r} refused nbremote's comm: {info['refused']}",
                                           self.name)
                self.info = info

    @staticmethod
    def _reply_to(msg_id: str | set[str]) -> Callable[[str, list[memoryview]], bool]:
        ids = {msg_id} if isinstance(msg_id, str) else msg_id  # a set: any of the requests sent (it may grow)
        def match(channel: str, parts: list[memoryview]) -> bool:
            return channel != "iopub" and json.loads(bytes(parts[1])).get("msg_id") in ids
        return match

    def open(self, caller: str, *, bootstrap: str | None, timeout: float, shm: SharedMemory | None = None,
             ) -> dict[str, Any]:
        """Handshake, as ``KernelLink.open``: kernel_info, bootstrap, subshell, comm_open, shell path; then
        shared memory where the kernel proves it shares ours, else a direct data channel where offered."""
        deadline = time.monotonic() + timeout
        try:
            # asked again until answered (jupyter_client does too): a server may drop it before its channels are up
            asked = {self._send("control", "kernel_info_request", {})}
            reply = self._wait(deadline, "kernel_info_request", self._reply_to(asked),
                               lambda: asked.add(self._send("control", "kernel_info_request", {})))
            self.kernel_session = str(json.loads(bytes(reply[0])).get("session", ""))
            features = list(json.loads(bytes(reply[3])).get("supported_features", []))
            if bootstrap is not None:
                mid = self._send("shell", "execute_request", {
                    "code": bootstrap, "silent": True, "store_history": False, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": False})
                content = json.loads(bytes(self._wait(deadline, "the bootstrap", self._reply_to(mid))[3]))
                if content.get("status") != "ok":
                    raise bootstrap_failed(self.name, content)
            if "kernel subshells" in features:
                mid = self._send("control", "create_subshell_request", {})
                reply = self._wait(deadline, "create_subshell_request", self._reply_to(mid))
                self.subshell_id = json.loads(bytes(reply[3])).get("subshell_id")
            else:
                log.warning("worker %r has no kernel subshells (ipykernel < 7): its RPCs wait behind running "
                            "cells", self.name)
            data: dict[str, Any] = {"caller": caller, "digests": False}
            if shm is not None and shm.probe is not None:
                data["shm"] = shm.probe
            if shell_path_wanted():
                data["shell"] = {"token": self._token}
                data["direct"] = True
            self._send("shell", "comm_open", {"comm_id": self.comm_id, "target_name": envelope.COMM_TARGET,
                                              "data": data}, subshell=True)
            self._wait(deadline, "comm_open", lambda channel, parts: bool(self.info))
            if self.info.get("shell"):
                self.fast = self._check_shell_path(min(SHELL_PATH_CHECK, max(0.1, deadline - time.monotonic())))
            self.same_host = shm is not None and bool(self.info.get("shm_seen")) and shm.sees(self.info.get("shm"))
            if self.fast and not self.same_host and self.info.get("direct"):
                self.direct = open_direct(self.name, self.info["direct"], self.url, self._token)
        finally:
            handshake, self._handshake = self._handshake, None
        while handshake is not None and not handshake.empty():  # what came after the handshake's last wait
            channel, parts = handshake.get_nowait()
            if parts:
                self._dispatch(channel, parts)
        return self.info

    def _check_shell_path(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._send_fast([({"k": "ping", "link": self._token}, ())])
            end = min(deadline, time.monotonic() + 0.2)
            with contextlib.suppress(WorkerStartError):
                parts = self._wait(end, "the shell path's ping", lambda channel, parts: (
                    channel == "shell" and is_ours(bytes(parts[0]))))
                content = json.loads(bytes(parts[3]))
                if any(env["k"] == "pong" for env, _ in envelope.unpack(content, list(parts[4:]))):
                    return True
        log.warning("worker %r did not answer on the shell path through its server; using the comm path", self.name)
        return False

    # -- liveness (the IO thread) --------------------------------------------------------------------------
    def heartbeat(self, now: float) -> str | None:
        if self._why is not None:
            return self._why
        gone = self.gone() if self.gone is not None else None
        if gone is not None:
            return gone
        if self._held and self.on_message is not None:
            self._deliver([])
        heart = self.direct.heart if self.direct is not None else None
        if heart is not None and (why := heart.check(now, HEARTBEAT_TIMEOUT)) is not None:
            return why
        if self._asked is not None and now - self._asked > SILENCE_LIMIT:
            return f"it did not answer through its server for {SILENCE_LIMIT:.0f} s (the kernel or server is gone)"
        if now >= self._session_next:
            self._session_next = now + SESSION_CHECK_INTERVAL
            if self._asked is None:
                self._asked = now
            with contextlib.suppress(OSError, WebSocketClosed):
                self._send("control", "kernel_info_request", {})
        if now >= self._lease_next:
            self._lease_next = now + renew_every(self.info.get("lease"))
            self.post({"k": "lease"})
        return None
