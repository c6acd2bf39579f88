"""The only code that touches jupyter_client / zmq: one ``KernelLink`` per kernel, one ``IOThread``.

A link is made and handshaken synchronously by the thread that needs it (``KernelLink.open``):
sync IOPub (the SUB "slow joiner"), optionally run the bootstrap code that installs nbremote's comm
target, create a kernel subshell and open our comm *inside* it (the ``comm_open`` carries the
subshell id, so the comm's messages are served by the subshell thread, not behind running cells).

Two paths carry envelopes (see ``_wire``), both signed Jupyter messages on the kernel's channels:

* the **shell path** (``_shellpath`` in the kernel): ``nbremote_request`` messages built by the lean
  ``_codec``, sent on our shell DEALER and answered by the kernel's shell ROUTER to a second DEALER of
  ours, ``rx``, whose identity the ``comm_open`` announced. The kernel serves them on its shell-channel
  thread. Used once a ``ping`` sent this way came back as a ``pong`` on ``rx``.
* the **comm path**: ``comm_msg``s on the shell channel, replies on IOPub under our comm's topic; for
  kernels without the shell path (ipykernel < 7, ``NBREMOTE_SHELL_PATH=0``).

Sockets: ``shell`` is used for sending only, by whichever thread drains the outbox, under its lock (a
blocking call sends from its own thread: no hop); ``rx``, ``iopub`` and ``hb`` belong to the process's
single IO thread once the handshake is over (zmq sockets are not thread-safe). The IO thread receives
zero-copy (``recv_multipart(copy=False)``: buffers are memoryviews over the zmq frames), sends what
``rpc_async`` queued (coalescing what is queued for one link into one message), pings heartbeats,
calls the owner's liveness check, and ticks the agent's timers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq
from jupyter_client.session import Session

from nbremote.errors import WorkerStartError
from nbremote.rpc._shm import SharedMemory
from nbremote.rpc._sockets import connect, recv_frames, send_frames
from nbremote.rpc._sockets import ctx as _ctx
from nbremote.rpc._threadsockets import ThreadSockets
from nbremote.rpc._wire import batching, envelope
from nbremote.rpc._wire.codec import Codec
from nbremote.rpc._wire.envelope import Buffer, Envelope
from nbremote.rpc._wire.lease import renew_every

log = logging.getLogger("nbremote")

OnMessage = Callable[["Connection", list[tuple[Envelope, list[Buffer]]]], None]
OnLost = Callable[["Connection", str], None]

HEARTBEAT_INTERVAL = 0.5  # s between pings
HEARTBEAT_TIMEOUT = 1.5  # s without an answer: the kernel is gone (pending calls fail within ~2 s)
# For kernels whose process we can poll, death is seen at once; the heartbeat then only catches a
# hung machine, and a generous limit keeps a briefly overloaded host from losing a healthy worker.
HEARTBEAT_TIMEOUT_POLLED = 10.0
HANDSHAKE_USERNAME = "nbremote-handshake"  # see _open
SHELL_PATH_CHECK = 2.0  # s to wait for the shell path's pong before settling for the comm path
# s between checks that the kernel is still the process we bootstrapped: a kernel restarted by someone
# else (same ports, new process) answers the heartbeat but knows nothing of nbremote (see heartbeat())
SESSION_CHECK_INTERVAL = 1.0


def shell_path_wanted() -> bool:
    """``NBREMOTE_SHELL_PATH=0`` keeps every link on the comm path (to compare, or to work around)."""
    return os.environ.get("NBREMOTE_SHELL_PATH", "1").strip().lower() not in ("0", "false", "no", "off")


class Link(Protocol):
    """One way to reach a peer: a link we opened to its kernel, or a comm it opened on ours."""

    name: str
    same_host: bool  # the peer shares our /dev/shm: big frames may go by shared memory (see _shm)

    @property
    def closed(self) -> bool: ...

    def post(self, env: Envelope, frames: Sequence[Buffer] = ()) -> None:
        """Queue an envelope to go out with (or before) the next send; frames must not change afterwards."""

    def send(self, env: Envelope, frames: Sequence[Buffer] = (), *, now: bool = False) -> None:
        """Queue an envelope and see that it leaves (from this thread at once when ``now``)."""


class Connection(Protocol):
    """The transport seam: what the agent, the driver and the IO thread use of a link to one kernel.

    Two transports implement it: ``KernelLink`` (the kernel's zmq channels, here) and ``_wslink.ServerLink``
    (a Jupyter server's kernel websocket). The IO thread polls a ``KernelLink``'s sockets itself; a
    ``ServerLink`` has a reader thread of its own and is only drained and ticked (``heartbeat``) here.
    """

    name: str
    info: dict[str, Any]
    lost: str | None
    same_host: bool
    fast: bool
    on_message: OnMessage | None
    on_lost: OnLost | None
    wake: Callable[[], None]
    outbox: batching.Outbox  # what is queued to go out (the IO thread drains a non-empty one on its tick)

    @property
    def closed(self) -> bool: ...

    def open(self, caller: str, *, bootstrap: str | None, timeout: float, shm: SharedMemory | None = None,
             ) -> dict[str, Any]: ...

    def post(self, env: Envelope, frames: Sequence[Buffer] = ()) -> None: ...

    def send(self, env: Envelope, frames: Sequence[Buffer] = (), *, now: bool = False) -> None: ...

    def drain(self) -> None: ...

    def send_close(self) -> None: ...

    def close(self) -> None: ...

    def heartbeat(self, now: float) -> str | None: ...


class Queued:
    """The sending half both transports share: envelopes queue in an ``outbox`` and leave in batches,
    from the caller's thread (``now``) or from the IO thread once ``wake``d; nothing leaves a lost link."""

    outbox: batching.Outbox
    lost: str | None
    wake: Callable[[], None]

    @property
    def closed(self) -> bool:
        return self.outbox.closed

    def post(self, env: Envelope, frames: Sequence[Buffer] = ()) -> None:
        """Queue an envelope; frames must not change afterwards. Call ``drain`` (or wake the IO thread)."""
        self.outbox.post(env, frames)

    def drain(self) -> None:
        """Send everything queued (thread-safe: the channel is used under the outbox's lock only)."""
        if self.lost is None:
            self.outbox.drain()

    def send(self, env: Envelope, frames: Sequence[Buffer] = (), *, now: bool = False) -> None:
        """Queue an envelope (thread-safe; frames must not change afterwards) and see that it leaves.

        ``now``: send from this thread at once (a blocking call saves the hop to the IO thread);
        otherwise the IO thread sends it, together with whatever else is queued by then.
        """
        self.post(env, frames)
        if now:
            self.drain()
        else:
            self.wake()


class KernelLink(Queued):
    """Our sockets to one kernel and the comm we opened on it."""

    def __init__(self, name: str, conn: dict[str, Any], *, alive: Callable[[], bool] | None = None) -> None:
        self.name = name
        self.conn = dict(conn)
        key = conn.get("key", b"")
        self.session = Session(
            key=key.encode() if isinstance(key, str) else key,
            signature_scheme=conn.get("signature_scheme", "hmac-sha256"),
            username="nbremote",
        )
        self.codec = Codec(self.session.key, signature_scheme=self.session.signature_scheme,
                           session=self.session.session)
        self.fast = False  # envelopes go by the shell path (see the module docstring)
        self.same_host = False  # set by open(): the kernel sees our shared memory and we see its
        self.comm_id = uuid.uuid4().hex
        self.subshell_id: str | None = None
        self.alive = alive
        self.digests = not envelope.is_loopback(str(conn.get("ip", "127.0.0.1")))
        self.info: dict[str, Any] = {}
        self.lost: str | None = None
        self.on_message: OnMessage | None = None
        self.on_lost: OnLost | None = None
        self.wake: Callable[[], None] = self.drain  # until the IO thread adopts the link: send at once
        self._hb_sent: float | None = None
        self._hb_next = 0.0
        self.kernel_session = ""  # the kernel process's session id (its kernel_info replies carry it)
        self._session_next = 0.0
        self._lease_next = 0.0
        # A blocking caller drains the outbox itself (no hop to the IO thread); envelopes queued by
        # rpc_async pile up meanwhile and leave together from the IO thread.
        self.outbox = batching.Outbox(self._send_batch)
        c = _ctx()
        self.shell = c.socket(zmq.DEALER)
        self.control = c.socket(zmq.DEALER)
        self.iopub = c.socket(zmq.SUB)
        self.hb = c.socket(zmq.REQ)
        self.rx = c.socket(zmq.DEALER)  # receives the kernel's shell-path messages; never sends
        self.threads = ThreadSockets(self)  # blocking callers' own sockets (see _threadsockets)
        for sock in (self.shell, self.control, self.iopub, self.hb, self.rx):
            sock.linger = 0
        # Never block the sender: a worker that stops reading must not stall the IO thread (or a
        # caller) at zmq's default high-water mark; its calls time out instead.
        self.shell.sndhwm = 0
        # IOPub is PUB/SUB: a publisher drops messages for a subscriber whose queue is full (1000 by
        # default). libzmq's own thread fills our queue however busy Python is, so with no limit here a
        # burst of replies waits for us instead of being lost.
        self.iopub.rcvhwm = 0
        self.rx.rcvhwm = 0
        ident = f"nbremote-{self.comm_id[:12]}".encode()
        self.shell.identity = ident
        self.control.identity = ident
        self.rx.identity = ident + b"-rx"
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        for sock, port in ((self.shell, "shell_port"), (self.control, "control_port"),
                           (self.iopub, "iopub_port"), (self.hb, "hb_port"), (self.rx, "shell_port")):
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
                raise WorkerStartError(
                    f"bootstrapping worker {self.name!r} failed: {content.get('ename')}: {content.get('evalue')}"
                    " (is nbremote installed in that kernel's environment? `pip install nbremote` there)",
                    self.name)
        if "kernel subshells" in features:
            mid = self._send(self.control, "create_subshell_request", {})
            reply = self._wait_reply(self.control, mid, deadline, "create_subshell_request", seen)
            self.subshell_id = reply["content"].get("subshell_id")
        else:
            log.warning("worker %r has no kernel subshells (ipykernel < 7): its RPCs wait behind running "
                        "cells", self.name)
        self.iopub.setsockopt(zmq.SUBSCRIBE, f"comm-{self.comm_id}".encode())
        data: dict[str, Any] = {"caller": caller, "digests": self.digests}
        if shm is not None and shm.probe is not None:
            data["shm"] = shm.probe
        if shell_path_wanted():
            data["shell"] = {"tx": bytes(self.shell.identity).hex(), "rx": bytes(self.rx.identity).hex()}
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
        return self.info

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
        return (self.iopub, self.hb, self.rx, self.control)

    def send_own_reply(self, env: Envelope, frames: Sequence[Buffer]) -> Callable[[float], None] | None:
        """Send a blocking call on this thread's own socket: returns the pump that receives its reply,
        or None when this thread has none (then ``send`` it)."""
        if not self.fast or self.lost is not None:
            return None
        if self.outbox:  # what was queued before (reference counts) goes first, as it would have
            self.drain()
        return self.threads.send(env, frames)

    def _send_batch(self, items: Sequence[tuple[Envelope, Sequence[Buffer]]]) -> None:
        if self.fast:
            self._send_fast(items)
            return
        data, buffers = envelope.pack(items, digests=self.digests)
        self._send(self.shell, "comm_msg", {"comm_id": self.comm_id, "data": data}, subshell=True,
                   buffers=buffers)

    def _send_fast(self, items: Sequence[tuple[Envelope, Sequence[Buffer]]]) -> None:
        send_frames(self.shell, self.codec.encode_items(items, digests=self.digests))

    def receive_fast(self) -> list[tuple[Envelope, list[Buffer]]]:
        """What the kernel sent us by the shell path (always ours: only the kernel knows ``rx``)."""
        _, content, buffers = self.codec.decode(recv_frames(self.rx))
        return envelope.unpack(content, [f.buffer for f in buffers], require_digests=self.digests)

    def receive(self) -> list[tuple[Envelope, list[Buffer]]] | None:
        msg = self._recv(self.iopub)
        content = msg["content"]
        if content.get("comm_id") != self.comm_id:
            return None
        if msg["header"]["msg_type"] == "comm_close":
            raise ConnectionError("the worker closed nbremote's comm")
        if msg["header"]["msg_type"] != "comm_msg":
            return None
        return envelope.unpack(content.get("data"), msg.get("buffers", []), require_digests=self.digests)

    def close(self) -> None:
        def close_sockets() -> None:  # under the outbox lock: never under a sender's feet
            for sock in (self.shell, self.control, self.iopub, self.hb, self.rx):
                sock.close(linger=0)

        self.outbox.close(then=close_sockets)
        self.threads.close()

    def send_close(self) -> None:
        """Tell the worker we are done with this comm (best effort)."""
        def send() -> None:
            self._send(self.shell, "comm_close", {"comm_id": self.comm_id, "data": {}}, subshell=True)

        with contextlib.suppress(zmq.ZMQError):
            self.outbox.locked(send)

    def heartbeat(self, now: float) -> str | None:
        """Ping / check the heartbeat (and now and then the kernel's identity); return why it is gone, or None."""
        if self.alive is not None and not self.alive():
            return "its kernel process exited"
        if self.kernel_session and now >= self._session_next:
            self._session_next = now + SESSION_CHECK_INTERVAL
            self._send(self.control, "kernel_info_request", {})  # answered in control_answered
        if now >= self._lease_next:  # the kernel frees what we hold there if it stops hearing from us
            self._lease_next = now + renew_every(self.info.get("lease"))
            self.post({"k": "lease"})  # the IO thread drains it right after this
        if self._hb_sent is not None:
            limit = HEARTBEAT_TIMEOUT if self.alive is None else HEARTBEAT_TIMEOUT_POLLED
            if now - self._hb_sent > limit:
                return (f"its heartbeat stopped answering for {limit:.1f} s (the kernel died, was restarted, is "
                        "paused or is unreachable; what it held is gone)")
        elif now >= self._hb_next:
            self.hb.send(b"ping", zmq.NOBLOCK)
            self._hb_sent = now
        return None

    def heartbeat_answered(self, now: float) -> None:
        self.hb.recv()
        self._hb_sent = None
        self._hb_next = now + HEARTBEAT_INTERVAL

    def control_answered(self) -> str | None:
        """A reply on the control channel (a session check): why the kernel is no longer ours, or None."""
        reply = self._recv(self.control)
        session = str(reply["header"].get("session", ""))
        if self.kernel_session and session and session != self.kernel_session:
            return ("its kernel was restarted behind nbremote's back (a new process answers on its ports): "
                    "the RRefs and modules it held are gone")
        return None


class IOThread:
    """Owns every handshaken link's sockets; all sends and receives of the process happen here."""

    def __init__(self, name: str, tick: Callable[[float], None]) -> None:
        self._tick = tick
        self._queue: deque[tuple[str, Any]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._links: dict[zmq.Socket[Any], KernelLink] = {}  # the sockets of zmq links, polled here
        self._all: set[Connection] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"nbremote-io-{name}", daemon=True)
        self._thread.start()

    def _post(self, op: str, arg: Any) -> None:
        self._queue.append((op, arg))
        with contextlib.suppress(OSError):  # pipe closed: the thread is gone
            os.write(self._wake_w, b"x")

    def adopt(self, link: Connection, on_message: OnMessage, on_lost: OnLost) -> None:
        link.on_message, link.on_lost = on_message, on_lost
        link.wake = lambda: self._post("drain", link)
        self._post("adopt", link)

    def send(self, link: Connection, env: Envelope, frames: Sequence[Buffer] = (), *, now: bool = False) -> None:
        """``link.send``: queue an envelope for ``link`` and see that it leaves (see KernelLink.send)."""
        link.send(env, frames, now=now)

    def drop(self, link: Connection, *, close_comm: bool = True) -> None:
        self._post("drop", (link, close_comm))

    def lose(self, link: Connection, why: str) -> None:
        """Treat ``link``'s kernel as gone (someone else saw it die): its pending calls fail now."""
        self._post("lose", (link, why))

    def stop(self) -> None:
        self._stopping = True
        self._post("stop", None)
        if threading.current_thread() is not self._thread:
            self._thread.join(5)

    # -- the loop ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        next_tick = 0.0
        while True:
            try:
                events = poller.poll(50)
                for sock, _ in events:
                    if sock == self._wake_r:
                        self._drain_wake()
                    else:
                        self._readable(sock)
                if self._queue and not self._commands(poller):
                    break
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + 0.05
                    self._liveness(now)
                    self._tick(now)
            except Exception:  # the IO thread must survive anything one message does
                log.exception("nbremote IO thread error")
        for link in list(self._all):
            link.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _commands(self, poller: zmq.Poller) -> bool:
        drains: set[Connection] = set()
        while self._queue:
            op, arg = self._queue.popleft()
            if op == "drain":
                drains.add(arg)
            elif op == "adopt":
                self._all.add(arg)
                for sock in arg.sockets() if isinstance(arg, KernelLink) else ():  # a ServerLink reads itself
                    self._links[sock] = arg
                    poller.register(sock, zmq.POLLIN)
            elif op == "drop":
                link, close_comm = arg
                if link in self._all:
                    link.drain()
                    if close_comm and link.lost is None:
                        link.send_close()
                self._forget(link, poller)
            elif op == "lose":
                link, why = arg
                if link in self._all and link.lost is None:
                    self._lose(link, why)
            elif op == "stop":
                for link in self._all:
                    link.drain()
                return False
        for link in drains:
            if link in self._all:
                link.drain()
        return True

    def _forget(self, link: Connection, poller: zmq.Poller) -> None:
        if link not in self._all:
            return
        self._all.discard(link)
        for sock in link.sockets() if isinstance(link, KernelLink) else ():
            self._links.pop(sock, None)
            poller.unregister(sock)
        link.close()

    def _readable(self, sock: zmq.Socket[Any]) -> None:
        link = self._links.get(sock)
        if link is None:
            return
        if sock is link.hb:
            link.heartbeat_answered(time.monotonic())
            return
        if sock is link.control:
            try:
                why = link.control_answered()
            except Exception:
                log.debug("unreadable control reply from %r", link.name, exc_info=True)
                return
            if why is not None:
                self._lose(link, why)
            return
        try:
            items = link.receive_fast() if sock is link.rx else link.receive()
        except ConnectionError as exc:
            self._lose(link, str(exc))
            return
        except Exception:
            log.exception("dropping a malformed message from worker %r", link.name)
            return
        if items and link.on_message is not None:
            link.on_message(link, items)

    def _liveness(self, now: float) -> None:
        for link in list(self._all):
            why = link.heartbeat(now)
            if why is not None:
                self._lose(link, why)
            elif link.outbox:  # envelopes queued without a wake-up (see Agent.fork_rref)
                link.drain()

    def _lose(self, link: Connection, why: str) -> None:
        link.lost = why
        self._post("drop", (link, False))
        if link.on_lost is not None:
            link.on_lost(link, why)
