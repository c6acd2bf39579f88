"""A kernel reached through its own zmq channels: ``KernelLink``, the transport most workers use.

A link is made and handshaken synchronously by the thread that needs it (``KernelLink.open``):
sync IOPub (the SUB "slow joiner"), optionally run the bootstrap code that installs nbremote's comm
target, create a kernel subshell and open our comm *inside* it (the ``comm_open`` carries the
subshell id, so the comm's messages are served by the subshell thread, not behind running cells).

Two paths carry envelopes (see ``nbremote.rpc._wire``), both signed Jupyter messages on the kernel's
channels:

* the **shell path** (``nbremote.rpc._worker.shellpath`` in the kernel): ``nbremote_request`` messages
  built by the lean ``codec``, sent on our shell DEALER and answered by the kernel's shell ROUTER to a
  second DEALER of ours, ``rx``, whose identity the ``comm_open`` announced. The kernel serves them on
  its shell-channel thread. Used once a ``ping`` sent this way came back as a ``pong`` on ``rx``. On one
  machine the same messages go by a Unix-domain connection of the link's own instead, once the kernel
  offered one and answered on it (``unixlink``): zmq's I/O threads are most of a message's floor.
* the **comm path**: ``comm_msg``s on the shell channel, replies on IOPub under our comm's topic; for
  kernels without the shell path (ipykernel < 7, ``NBREMOTE_SHELL_PATH=0``).

Sockets: ``shell`` is used for sending only, by whichever thread drains the outbox, under its lock (a
blocking call sends from its own thread: no hop, and receives its reply on a socket of its own, see
``threadsockets``); ``rx``, ``iopub``, the heartbeat and ``control`` belong to the process's single IO thread
(``iothread``) once the handshake is over (zmq sockets are not thread-safe), which hands whatever they
receive to ``readable``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from jupyter_client.session import Session

from nbremote.errors import WorkerStartError
from nbremote.rpc._transport.base import (
    SESSION_CHECK_INTERVAL,
    SHELL_PATH_CHECK,
    OnLost,
    OnMessage,
    Pump,
    bootstrap_failed,
    shell_path_wanted,
)
from nbremote.rpc._transport.cpuwake import CPU_WAKE
from nbremote.rpc._transport.heartbeat import HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_POLLED, Heartbeat
from nbremote.rpc._transport.shm import SharedMemory
from nbremote.rpc._transport.sockets import connect, recv_frames, send_frames
from nbremote.rpc._transport.sockets import ctx as _ctx
from nbremote.rpc._transport.threadsockets import ThreadSockets
from nbremote.rpc._transport.unixlink import UnixChannel, connect_unix
from nbremote.rpc._transport.unixway import UnixWay
from nbremote.rpc._wire import batching, envelope
from nbremote.rpc._wire.codec import Codec, ReplayedMessage
from nbremote.rpc._wire.envelope import Buffer, Envelope
from nbremote.rpc._wire.lease import renew_every
from nbremote.rpc._wire.sessions import own_rng

__all__ = ["KernelLink"]

log = logging.getLogger("nbremote")

HANDSHAKE_USERNAME = "nbremote-handshake"  # see _open


class KernelLink(UnixWay):
    """Our sockets to one kernel and the comm we opened on it."""

    def __init__(self, name: str, conn: dict[str, Any], *, alive: Callable[[], bool] | None = None,
                 watched: bool = False) -> None:
        self.name = name
        self.conn = dict(conn)
        key = conn.get("key", b"")
        self.session = own_rng(Session(key=key.encode() if isinstance(key, str) else key,  # (issue 40: see sessions)
                                       signature_scheme=conn.get("signature_scheme", "hmac-sha256"),
                                       username="nbremote"))
        self.codec = Codec(self.session.key, signature_scheme=self.session.signature_scheme,
                           session=self.session.session)
        self.fast = False  # envelopes go by the shell path (see the module docstring)
        self.same_host = False  # set by open(): the kernel sees our shared memory and we see its
        self.comm_id = uuid.uuid4().hex
        self.subshell_id: str | None = None
        self.alive = alive
        # Whether a process that polls the kernel's own (the driver) tells us when it dies: our heartbeat then
        # only catches a hung machine, with the polled limit (a peer on a busy host is not lost after 1.5 s).
        self.watched = watched
        # Buffers are digested inside the signed content beyond loopback (Jupyter leaves them unsigned),
        # unless CurveZMQ carries the link: its per-frame authenticator already refuses altered bytes, and a
        # digest of every buffer on both ends cost a 64 MB echo more than the network did (issue 22).
        self.curve = bool(conn.get("curve_publickey") and conn.get("curve_secretkey"))
        # A Unix-domain socket (ipc) stays on this machine, as loopback does.
        local = conn.get("transport") == "ipc" or envelope.is_loopback(str(conn.get("ip", "127.0.0.1")))
        self.digests = not local and not self.curve
        self.info: dict[str, Any] = {}
        self.lost: str | None = None
        self.on_message: OnMessage | None = None
        self.on_lost: OnLost | None = None
        self.wake: Callable[[], None] = self.drain  # until the IO thread adopts the link: send at once
        self.kernel_session = ""  # the kernel process's session id (its kernel_info replies carry it)
        self._session_next = 0.0
        self._lease_next = 0.0
        self.caller = ""  # our name, which the kernel's control thread renews our lease by (``heartbeat``)
        # A blocking caller drains the outbox itself (no hop to the IO thread); envelopes queued by
        # rpc_async pile up meanwhile and leave together from the IO thread.
        self.outbox = batching.Outbox(self._send_batch)
        c = _ctx()
        self.shell = c.socket(zmq.DEALER)
        self.control = c.socket(zmq.DEALER)
        self.iopub = c.socket(zmq.SUB)
        self.heart = Heartbeat(self.conn)
        self.rx = c.socket(zmq.DEALER)  # receives the kernel's shell-path messages; never sends
        self.threads = ThreadSockets(self)  # blocking callers' own sockets (see _transport.threadsockets)
        self.unix: UnixChannel | None = None  # the shell path's way on this machine, once open (``unixlink``)
        for sock in (self.shell, self.control, self.iopub, self.rx):
            sock.linger = 0
        # Never block the sender: a worker that stops reading must not stall the IO thread (or a
        # caller) at zmq's default high-water mark; its calls time out instead.
        self.shell.sndhwm = 0
        # IOPub is PUB/SUB: a publisher drops messages for a subscriber whose queue is full (1000 by
        # default). libzmq's own thread fills our queue however busy Python is, so with no limit here a
        # burst of replies waits for us instead of being lost.
        self.iopub.rcvhwm = 0
        self.rx.rcvhwm = 0
        ident = self.identity = f"nbremote-{self.comm_id[:12]}".encode()  # our sending identity
        self.shell.identity = ident
        self.control.identity = ident
        self.rx.identity = ident + b"-rx"
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        for sock, port in ((self.shell, "shell_port"), (self.control, "control_port"),
                           (self.iopub, "iopub_port"), (self.rx, "shell_port")):
            connect(sock, self.conn, port)

    # -- handshake (caller thread, before the IO thread owns the sockets) ----------------------------
    def _send(self, sock: zmq.Socket[Any], msg_type: str, content: dict[str, Any], *,
              subshell: bool = False, buffers: Sequence[Buffer] | None = None, username: str | None = None) -> str:
        msg = self.session.msg(msg_type, content)
        if subshell and self.subshell_id is not None:
            msg["header"]["subshell_id"] = self.subshell_id
        if username is not None:
            msg["header"]["username"] = username
        self.session.send(sock, msg, buffers=list(buffers) if buffers else None)  # type: ignore[arg-type]
        return str(msg["header"]["msg_id"])

    def _recv(self, sock: zmq.Socket[Any]) -> dict[str, Any]:
        frames = sock.recv_multipart(copy=False)
        _, msg_list = self.session.feed_identities(frames, copy=False)
        return self.session.deserialize(msg_list, content=True, copy=False)

    def _wait_reply(self, sock: zmq.Socket[Any], msg_id: str, deadline: float, what: str,
                    iopub_seen: list[bool]) -> dict[str, Any]:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.iopub, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerStartError(
                    f"worker {self.name!r} did not answer {what} in time (is its kernel running and is the "
                    "connection information current? a kernel ignores messages signed with another key)", self.name)
            self._check_alive(what)
            for s, _ in poller.poll(int(min(left, 0.1) * 1000)):
                msg = self._recv(s)
                if s is self.iopub:
                    iopub_seen[0] = True
                    self._handshake_iopub(msg)
                elif msg["parent_header"].get("msg_id") == msg_id:
                    return msg

    def _check_alive(self, what: str) -> None:
        if self.alive is not None and not self.alive():
            raise WorkerStartError(f"worker {self.name!r} died during {what}", self.name)

    def _handshake_iopub(self, msg: dict[str, Any]) -> None:
        content = msg["content"]
        if msg["header"]["msg_type"] == "comm_msg" and content.get("comm_id") == self.comm_id:
            for env, _ in envelope.unpack(content.get("data"), msg.get("buffers", [])):
                if env["k"] == "ack":
                    info = dict(env.get("info", {}))
                    if info.get("refused"):
                        raise WorkerStartError(f"worker {self.name!r} refused nbremote's comm: {info['refused']}",
                                               self.name)
                    self.info = info
        elif msg["header"]["msg_type"] == "comm_close" and content.get("comm_id") == self.comm_id:
            raise WorkerStartError(
                f"worker {self.name!r} refused nbremote's comm (no '{envelope.COMM_TARGET}' target): "
                "nbremote is not installed in that kernel or was not bootstrapped", self.name)

    def open(self, caller: str, *, bootstrap: str | None, timeout: float, shm: SharedMemory | None = None,
             ) -> dict[str, Any]:
        """Handshake: sync IOPub, bootstrap, subshell, comm_open; returns the worker's ``ack`` info."""
        try:
            return self._open(caller, bootstrap=bootstrap, timeout=timeout, shm=shm)
        except ValueError as exc:  # jupyter_client's Session: "Invalid Signature" (its only ValueError here)
            if "signature" not in str(exc).lower():
                raise
            raise WorkerStartError(
                f"cannot open worker {self.name!r}: its kernel's messages fail the HMAC check, so the key in the "
                "connection file is not that kernel's (a stale or foreign connection file?); use the kernel's "
                "current connection file", self.name) from exc

    def _open(self, caller: str, *, bootstrap: str | None, timeout: float, shm: SharedMemory | None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        seen = [False]
        # kernel_info on the control channel: answered even while the main shell runs a cell. Repeat it
        # until IOPub delivers something, which proves our SUB socket's subscription is live. Not under the
        # username a kernel running nbremote keeps quiet for (its liveness checks, see _worker): the busy/idle
        # it publishes is what we wait for. ipykernel's iopub_welcome does not always come: its XPUB reports
        # a subscription only when no other subscriber already has that topic (another link opening now).
        features: list[str] = []
        while True:
            mid = self._send(self.control, "kernel_info_request", {}, username=HANDSHAKE_USERNAME)
            reply = self._wait_reply(self.control, mid, deadline, "kernel_info_request", seen)
            features = list(reply["content"].get("supported_features", []))
            self.kernel_session = str(reply["header"].get("session", ""))
            end = time.monotonic() + 0.25
            while not seen[0] and time.monotonic() < end:
                if self.iopub.poll(50):
                    self._handshake_iopub(self._recv(self.iopub))
                    seen[0] = True
            if seen[0]:
                break
        if bootstrap is not None:
            mid = self._send(self.shell, "execute_request", {
                "code": bootstrap, "silent": True, "store_history": False,
                "user_expressions": {}, "allow_stdin": False, "stop_on_error": False})
            reply = self._wait_reply(self.shell, mid, deadline, "the bootstrap", seen)
            content = reply["content"]
            if content.get("status") != "ok":
                raise bootstrap_failed(self.name, content)
        if "kernel subshells" in features:
            mid = self._send(self.control, "create_subshell_request", {})
            reply = self._wait_reply(self.control, mid, deadline, "create_subshell_request", seen)
            self.subshell_id = reply["content"].get("subshell_id")
        else:
            log.warning("worker %r has no kernel subshells (ipykernel < 7): its RPCs wait behind running "
                        "cells", self.name)
        self.iopub.setsockopt(zmq.SUBSCRIBE, f"comm-{self.comm_id}".encode())
        self.caller = caller
        data: dict[str, Any] = {"caller": caller, "digests": self.digests}
        if shm is not None and shm.probe is not None:
            data["shm"] = shm.probe
        if shell_path_wanted():
            data["shell"] = {"tx": self.identity.hex(), "rx": bytes(self.rx.identity).hex()}
        self._send(self.shell, "comm_open", {"comm_id": self.comm_id, "target_name": envelope.COMM_TARGET,
                                             "data": data}, subshell=True)
        while not self.info:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerStartError(f"worker {self.name!r} did not acknowledge nbremote's comm", self.name)
            self._check_alive("comm_open")
            if self.iopub.poll(int(min(left, 0.1) * 1000)):
                self._handshake_iopub(self._recv(self.iopub))
        self.iopub.setsockopt(zmq.UNSUBSCRIBE, b"")
        self.same_host = shm is not None and bool(self.info.get("shm_seen")) and shm.sees(self.info.get("shm"))
        if self.info.get("shell"):
            self.fast = self._check_shell_path(min(SHELL_PATH_CHECK, max(0.1, deadline - time.monotonic())))
        if self.fast and self.same_host and self.info.get("unix"):
            self.unix = connect_unix(self.info["unix"], self.codec, self.identity, "main")
            if self.unix is None:
                log.info("worker %r: its Unix-domain socket did not answer; keeping to its shell socket", self.name)
        return self.info

    @property
    def unix_path(self) -> str | None:
        """Where this link's threads may open Unix-domain connections of their own (see ``threadsockets``)."""
        unix = self.unix
        return str(self.info["unix"]) if unix is not None and not unix.broken else None

    def _check_shell_path(self, timeout: float) -> bool:
        """Ping the kernel by the shell path until its pong arrives on ``rx`` (False: use the comm path)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._send_fast([({"k": "ping"}, ())])
            end = min(deadline, time.monotonic() + 0.1)
            while (left := end - time.monotonic()) > 0:
                if self.rx.poll(int(left * 1000) + 1):
                    items = self.receive_fast()
                    if any(env["k"] == "pong" for env, _ in items):
                        return True
        log.warning("worker %r did not answer on the shell path; using the comm path", self.name)
        return False

    # -- after the handshake ---------------------------------------------------------------------------
    def sockets(self) -> tuple[zmq.Socket[Any], ...]:
        """What the IO thread polls for this link (the shell socket only sends)."""
        unix = self.unix
        if unix is None or unix.broken:
            return (self.iopub, self.heart.sock, self.rx, self.control)
        return (self.iopub, self.heart.sock, self.rx, self.control, unix.fd)  # type: ignore[return-value]

    def send_own_reply(self, env: Envelope, frames: Sequence[Buffer]) -> Pump | None:
        """Send a blocking call on this thread's own socket: returns the pump that receives its reply,
        or None when this thread has none (then ``send`` it)."""
        if not self.fast or self.lost is not None:
            return None
        if self.outbox:  # what was queued before (reference counts) goes first, as it would have
            self.drain()
        return self.threads.send(env, frames)

    def _send_batch(self, items: Sequence[tuple[Envelope, Sequence[Buffer]]]) -> None:
        CPU_WAKE.touch()
        if self.fast:
            self._send_fast(items)
            return
        data, buffers = envelope.pack(items, mac=self.codec.frame_mac(self.digests))
        self._send(self.shell, "comm_msg", {"comm_id": self.comm_id, "data": data}, subshell=True,
                   buffers=buffers)

    def _send_fast(self, items: Sequence[tuple[Envelope, Sequence[Buffer]]]) -> None:
        unix = self.unix
        if unix is None or not self._by_unix(unix, self.codec.encode_items(items, digests=self.digests)):
            send_frames(self.shell, self.codec.encode_items(items, digests=self.digests, pieces=True))

    def receive_fast(self) -> list[tuple[Envelope, list[Buffer]]]:
        """What the kernel sent us by the shell path (always ours: only the kernel knows ``rx``)."""
        _, content, buffers = self.codec.decode(recv_frames(self.rx))
        return self.codec.unpack_items(content, buffers, digests=self.digests)

    def receive(self) -> list[tuple[Envelope, list[Buffer]]] | None:
        msg = self._recv(self.iopub)
        content = msg["content"]
        if content.get("comm_id") != self.comm_id:
            return None
        if msg["header"]["msg_type"] == "comm_close":
            raise ConnectionError("the worker closed nbremote's comm")
        if msg["header"]["msg_type"] != "comm_msg":
            return None
        return envelope.unpack(content.get("data"), msg.get("buffers", []), mac=self.codec.frame_mac(self.digests))

    def close(self) -> None:
        def close_sockets() -> None:  # under the outbox lock: never under a sender's feet
            for sock in (self.shell, self.control, self.iopub, self.heart.sock, self.rx):
                sock.close(linger=0)
            if self.unix is not None:
                self.unix.close()

        self.outbox.close(then=close_sockets)
        self.threads.close()

    def send_close(self) -> None:
        """Tell the worker we are done with this comm (best effort)."""
        def send() -> None:
            if self.unix is not None:  # what it still carries is served before the goodbye (see unixlink)
                self.unix.finish()
            self.threads.finish()
            self._send(self.shell, "comm_close", {"comm_id": self.comm_id, "data": {}}, subshell=True)

        with contextlib.suppress(zmq.ZMQError):
            self.outbox.locked(send)

    def heartbeat(self, now: float) -> str | None:
        """Ping / check the heartbeat (and now and then the kernel's identity); return why it is gone, or None."""
        if self.alive is not None and not self.alive():
            return "its kernel process exited"
        by_control = bool(self.info.get("lease_control"))
        if (self.kernel_session or by_control) and now >= self._session_next:
            self._session_next = now + min(SESSION_CHECK_INTERVAL, renew_every(self.info.get("lease")))
            # answered in _control_answered; by the kernel's control thread, which renews our lease there: a
            # lease must not wait behind data (a burst on our Unix-domain connection, its receiving threads busy)
            self._send(self.control, "kernel_info_request", {"nbremote_lease": self.caller} if by_control else {})
        if not by_control and now >= self._lease_next:  # the kernel frees what we hold if it stops hearing from us
            self._lease_next = now + renew_every(self.info.get("lease"))
            self.post({"k": "lease"})  # the IO thread drains it right after this
        return self.heart.check(now, HEARTBEAT_TIMEOUT if self.alive is None and not self.watched
                                else HEARTBEAT_TIMEOUT_POLLED)

    def readable(self, sock: zmq.Socket[Any], now: float) -> str | None:
        """One of ``sockets()`` has input (the IO thread): take it; why the kernel is gone, or None."""
        if sock is self.heart.sock:
            self.heart.answered(now)
            return None
        if sock is self.control:
            try:
                return self._control_answered()
            except Exception:
                log.debug("unreadable control reply from %r", self.name, exc_info=True)
                return None
        try:
            if type(sock) is int:
                unix = self.unix
                items = self._receive_unix(unix) if unix is not None and sock == unix.fd else None
            else:
                items = self.receive_fast() if sock is self.rx else self.receive()
        except ConnectionError as exc:
            return str(exc)
        except ReplayedMessage:  # read already, by a Unix-domain connection that ended before it said so
            log.debug("dropped a message from worker %r that came twice", self.name)
        except Exception:
            log.exception("dropping a malformed message from worker %r", self.name)
            return None
        if items and self.on_message is not None:
            self.on_message(self, items)
        return None

    def _control_answered(self) -> str | None:
        """A reply on the control channel (a session check): why the kernel is no longer ours, or None."""
        reply = self._recv(self.control)
        session = str(reply["header"].get("session", ""))
        if self.kernel_session and session and session != self.kernel_session:
            return ("its kernel was restarted behind nbremote's back (a new process answers on its ports): "
                    "the RRefs and modules it held are gone")
        return None
