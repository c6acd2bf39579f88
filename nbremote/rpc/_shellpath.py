"""The fast path inside a worker kernel: ``nbremote_request`` messages served where they arrive.

ipykernel 7 receives every shell message on its *shell-channel thread*, which hands it over an inproc
socket to the main shell or a subshell thread; that thread decodes it again, publishes busy/idle,
fires hooks, runs the handler, and flushes stdout and stderr (each a round trip to the IOPub thread).
For a comm message that machinery is most of an RPC's time (TRANSPORT-NOTES: "Where a small call's time
goes"). Here the shell stream's receive callback is wrapped: a message of nbremote's own type is
checked (signature, replay) and handed to the agent right there -- bookkeeping at once, calls to the
executor -- and every other message goes on to ipykernel untouched. Replies go back on the same shell
socket (to the caller's receiving identity), never through IOPub: no busy/idle, no hooks, no flushes.

It stays a Jupyter conversation on the kernel's own channel, signed with the kernel's key; ipyparallel's
engines add their own shell message types the same way. Everything that depends on ipykernel's
internals is in this module, behind :func:`install`'s checks (ipykernel >= 7 with a shell-channel
thread and a shell stream); anywhere else nbremote keeps to the comm path (``_worker``), as it does when
a caller does not ask for this one (``NBREMOTE_SHELL_PATH=0``).

Threads: the shell stream's socket is used by the shell-channel thread's IO loop. Handing every reply to
that loop (``add_callback``) would cost a thread hop and a loop iteration per reply, so the socket is
shared instead, the way zmq allows it (one user at a time, a full memory barrier between users): a lock
is taken around the stream's own uses of it (its event handler and its re-arming) and around ours, and
an executor thread sends its reply itself. Replies that finish together still leave as one message
(``batching.Outbox``), and while calls wait for a thread a finished call's reply waits for theirs, at most
``DEFER_S`` (the loop sends what is left then): a burst's replies leave in a few dozen messages, not one
each, and the kernel and the caller pay per message. A lone call's reply never waits. The stream's
socket is edge-triggered (ZMQ_FD): a send elsewhere can consume the edge of a request that arrived
meanwhile, so after each send we check for pending input and schedule the stream's handler if there is
some -- what pyzmq does after its own sends, and what ipykernel's "wedge" comment warns about. Where the
stream lacks the internals this needs, replies go through ``ZMQStream.send_multipart`` on the loop
thread, as ipykernel's own do.

Receiving: the loop does not receive either (``start_receiving``). Waking the loop, tornado's dispatch
and ZMQStream's bookkeeping, then a hand-off to an executor thread that waits for the GIL while the loop
finishes its iteration, were the largest share of a small call's time in the kernel. Executor threads
receive instead, waiting on the socket's FD (and a wake-up pipe) and taking each message under the lock.
A thread that receives a call runs it itself, so the call starts with no hand-off at all, while another
thread receives: on Linux ``SPARE_RECEIVERS`` threads wait side by side with ``EPOLLEXCLUSIVE``, so that
an event wakes just one of them and nobody is woken to take over when a call starts; elsewhere (or with
``NBREMOTE_SHELL_RECEIVER=relay``) one thread receives. A call that finds every receiving thread busy
with a call of its own goes to the executor, and the thread that received it receives on: receiving
never starts a thread per call (it once started one whenever all were busy -- dozens per burst, every
one a GIL contender -- and with a single receiver that was a relay, a thread hand-off per call). Either
way a call that blocks never blocks receiving. One thread at a time takes a message and serves it
(``_order``), so envelopes reach the agent, and every other message ipykernel's own routing on the loop
thread (``add_callback``), in the order they came; the stream keeps sending ipykernel's replies,
scheduled as pyzmq schedules them. Whoever reads the socket's ``EVENTS`` consumes the FD's edge, so our
sends, the stream's handlers and a receiving thread that goes to run a call wake a receiving thread when
input is left. Should a receiving thread fail, the loop receives again, as it does everywhere with
``NBREMOTE_SHELL_RECEIVER=0``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from nbremote.errors import ProtocolError
from nbremote.rpc._transport.sockets import recv_frames, send_frames
from nbremote.rpc._wire import batching, envelope
from nbremote.rpc._wire.codec import Codec, is_ours, split_idents
from nbremote.rpc._wire.envelope import Buffer, Envelope

__all__ = ["ShellLink", "ShellPath", "install"]

MIN_IPYKERNEL = (7, 0)
_POLLIN = int(zmq.POLLIN)  # an int: pyzmq's enums cost a conversion per use
# Whether input waits, asked with zmq_poll(timeout 0): libzmq reads the socket's EVENTS for it, as
# ``socket.get(zmq.EVENTS)`` does -- which also consumes the FD's edge -- but without that call's two
# Python frames of enum lookup per read (three reads a call here).
_poll = zmq.zmq_poll
_NOBLOCK = int(zmq.NOBLOCK)
DEFER_S = 0.0005  # the longest a reply waits for those of the calls queued behind it (see ShellLink.send)
DEFER_ITEMS = 64  # replies that wait together at most
RECEIVE_POLL_MS = 100  # a receiving thread looks at the socket at least this often (a safety net)
_CLOSED: Any = object()  # what _take says once the socket is closed
SPARE_RECEIVERS = 2  # receiving threads kept waiting where waits are exclusive (see start_receiving)


def _log(text: str) -> None:
    print(f"nbremote: {text}", file=sys.__stderr__, flush=True)  # the worker's log file


class ShellLink:
    """A ``_transport.Link`` back to one caller through the kernel's shell socket."""

    def __init__(self, path: ShellPath, name: str, rx: bytes, digests: bool, same_host: bool, *,
                 alias: bool = False) -> None:
        self.path = path
        self.name = name
        self.rx = rx
        self.digests = digests
        self.same_host = same_host
        # A caller's own link (the way to call it back, once it sent a real request this way) or an
        # alias: one of its threads' own sockets, which only gets the replies to that thread's calls.
        self.alias = alias
        self.confirmed = alias
        self.aliases: list[ShellLink] = []
        self.outbox = batching.Outbox(self._send_batch)
        self._scheduled = False

    @property
    def closed(self) -> bool:
        return self.outbox.closed

    def post(self, env: Envelope, frames: Sequence[Buffer] = ()) -> None:
        self.send(env, frames)

    def send_own_reply(self, env: Envelope, frames: Sequence[Buffer]) -> None:
        """None: a way back to a caller has no sockets of a calling thread's own (see ``Link``)."""
        del env, frames

    def send(self, env: Envelope, frames: Sequence[Buffer] = (), *, now: bool = False) -> None:
        del now  # at once, from this thread where the socket is shared, else by the loop -- or a little later
        self.outbox.post(env, frames)
        if not (self.path.shared or threading.get_ident() == self.path.loop_thread):
            self._flush_soon(0.0)
        elif env["k"] == "ok" and self.path.agent.server.busy() and len(self.outbox) < DEFER_ITEMS:
            # More calls wait for a thread: their replies follow within moments, and leave with this one
            # (one message instead of many: the kernel and the caller pay per message). The loop sends
            # whatever is left after DEFER_S, so a long call queued behind cannot hold this reply back.
            self._flush_soon(DEFER_S)
        else:
            self.outbox.drain()

    def _flush_soon(self, delay: float) -> None:
        if self._scheduled:
            return
        self._scheduled = True
        loop = self.path.loop
        if delay:
            loop.add_callback(lambda: loop.call_later(delay, self._flush))
        else:
            loop.add_callback(self._flush)

    def _flush(self) -> None:
        self._scheduled = False  # before draining: a post from now on schedules another flush
        self.outbox.drain()

    def _send_batch(self, items: Sequence[batching.Item]) -> None:
        self.path.send([self.rx, *self.path.codec.encode_items(items, digests=self.digests)])

    def close(self) -> None:
        self.outbox.close()


class ShellPath:
    """The wrapped shell stream of one kernel, and the callers that talk to it this way."""

    def __init__(self, kernel: Any, agent: Any) -> None:
        self.kernel = kernel
        self.agent = agent
        self.stream = kernel.shell_stream
        self.loop = kernel.shell_channel_thread.io_loop
        self.loop_thread: int | None = kernel.shell_channel_thread.ident
        key = kernel.session.key
        self.codec = Codec(key if isinstance(key, bytes) else str(key).encode(),
                           signature_scheme=kernel.session.signature_scheme)
        self._forward = kernel.shell_channel_thread_main  # ipykernel's own routing, for every other message
        self._links: dict[bytes, ShellLink] = {}  # by the caller's sending identity
        self._tokens: dict[str, ShellLink] = {}  # links waiting for their caller's first ping (see register)
        self._lock = threading.RLock()  # one user of the shell socket at a time (see the module docstring)
        self._order = threading.Lock()  # one receiving thread at a time takes a message and serves it
        self._handle_events: Callable[[Any, int], Any] | None = None
        self.shared = False  # replies are sent by the thread that made them (set up by share_socket)
        self.receiving = False  # an executor thread receives, not the loop (see start_receiving)
        self._wake_r, self._wake_w = os.pipe()  # wakes a receiving thread (see _wake)
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._fd = -1  # the socket's FD, for the receiving threads' waits
        self.exclusive = False  # receiving threads wait side by side, each event waking one (start_receiving)
        self._spare = 1  # receiving threads kept waiting
        self._free = 0  # threads receiving (not running a call); counted under the lock
        self._receivers = 0  # threads receiving or running a call they received (at most _spare)
        self._failed = False  # a receiving thread failed: receiving goes back to the loop

    def share_socket(self) -> None:
        """On the loop thread: put the stream's uses of its socket under our lock (see the docstring)."""
        stream = self.stream
        handle, update = getattr(stream, "_handle_events", None), getattr(stream, "_update_handler", None)
        if handle is None or update is None or stream.socket is None:
            return  # another pyzmq: leave the stream alone, reply through it

        def locked(use: Callable[..., Any]) -> Callable[..., Any]:
            """One of the stream's uses of the socket, under our lock; it reads EVENTS, so pass the edge on."""

            def run(*args: Any, **kwargs: Any) -> Any:
                with self._lock:
                    try:
                        return use(*args, **kwargs)
                    finally:
                        if self.receiving:
                            self._pass_edge()

            return run

        handle_events = locked(handle)
        stream._handle_events, stream._update_handler = handle_events, locked(update)
        # The stream receives with ``recv_multipart(NOBLOCK, copy=False)``, whose per-frame Python work
        # (an option read and a keyword call per frame) costs more than the frames' own receive.
        socket, plain = stream.socket, stream.socket.recv_multipart

        def recv_multipart(flags: int = 0, copy: bool = True, track: bool = False) -> list[Any]:
            return plain(flags, copy, track) if copy or track else recv_frames(socket, flags)

        socket.recv_multipart = recv_multipart
        close = socket.close

        def locked_close(*args: Any, **kwargs: Any) -> Any:  # the kernel closes it while we may be using it
            with self._lock:
                return close(*args, **kwargs)

        socket.close = locked_close
        self.loop.remove_handler(stream.socket)  # the loop calls the handler it was given, not the attribute
        self.loop.add_handler(stream.socket, handle_events, self.loop.READ)
        self._handle_events = handle_events
        self.shared = True

    def send(self, frames: list[Any]) -> None:
        """Send one message on the shell socket (from any thread once shared, else on the loop thread)."""
        if not self.shared:
            self.stream.send_multipart(frames, copy=False)
            return
        with self._lock:
            socket = self.stream.socket
            if socket is None:  # the kernel is closing its channels
                return
            send_frames(socket, frames)
            pending = _poll([(socket, _POLLIN)], 0)
        if not pending:
            return
        if self.receiving:  # our send took the edge of a request: whoever receives must look again
            self._wake()
        elif self._handle_events is not None:
            handle = self._handle_events
            self.loop.add_callback(lambda: handle(socket, 0))

    def register(self, name: str, tx: bytes | None, rx: bytes | None, digests: bool, same_host: bool,
                 token: str | None = None) -> ShellLink:
        """A caller's link. A caller that knows the identities of its sockets on our shell socket (a zmq
        client) names them; one behind a proxy (a Jupyter Server's websocket) names a ``token`` instead,
        and the first ping carrying it makes its sender this link's identity both ways (see ``_join``)."""
        link = ShellLink(self, name, rx or b"", digests, same_host)
        if tx is not None and rx is not None:
            self._links[tx] = link
        elif token:
            self._tokens[token] = link
        else:
            raise ValueError("a shell link needs its caller's identities or a token")
        return link

    def unregister(self, link: ShellLink) -> None:
        gone = {link, *link.aliases}
        for tx, known in list(self._links.items()):
            if known in gone:
                del self._links[tx]
        for token, known in list(self._tokens.items()):
            if known in gone:
                del self._tokens[token]
        for each in gone:
            each.close()

    def _join(self, ident: bytes, items: list[tuple[Envelope, list[Any]]]) -> ShellLink | None:
        """A new sending identity introduces itself with a ping naming a link: the token of a link that
        waits for its caller (which from now on sends and receives as ``ident``), or the sending identity
        of a caller's link (``ident`` is then one of its threads' own sockets, see _threadsockets)."""
        for env, frames in items:
            if env["k"] == "ping" and not frames and isinstance(env.get("link"), str):
                waiting = self._tokens.pop(env["link"], None)
                if waiting is not None:
                    waiting.rx = ident
                    self._links[ident] = waiting
                    return waiting
                try:
                    main = self._links.get(bytes.fromhex(env["link"]))
                except ValueError:
                    return None
                if main is None or main.alias:
                    return None
                alias = ShellLink(self, main.name, ident, main.digests, main.same_host, alias=True)
                main.aliases.append(alias)
                self._links[ident] = alias
                return alias
        return None

    def _ours(self, frames: list[Any]) -> int | None:
        """Where the delimiter of an ``nbremote_request`` is; None for any other message."""
        try:
            _, i = split_idents(frames)
        except ProtocolError:
            return None
        return i if len(frames) > i + 2 and is_ours(frames[i + 2].bytes, exact=True) else None

    def on_recv(self, frames: list[Any]) -> Any:
        """The shell stream's receive callback (on the shell-channel thread)."""
        at = self._ours(frames)
        if at is None:
            return self._forward(frames)
        self._handle(frames, at)
        return None

    def _handle(self, frames: list[Any], at: int) -> None:
        """Check one ``nbremote_request`` and hand what it carries to the agent."""
        ident = frames[0].bytes if at else None
        link = self._links.get(ident) if ident is not None else None
        try:
            _, content, buffers = self.codec.decode(frames, at=at)
            # from an unknown identity only a frameless ping is ever used (see _join)
            digests = link is not None and link.digests
            items = envelope.unpack(content, [f.buffer for f in buffers], require_digests=digests)
        except Exception as exc:  # a bad message must never take the kernel down, nor run
            _log(f"dropped a malformed message from {'an unknown caller' if link is None else repr(link.name)}: {exc}")
            return
        if link is None:
            link = self._join(ident, items) if ident is not None else None
            if link is None:
                _log("dropped an nbremote_request from a caller that did not open nbremote's comm first")
                return
            items = [(env, f) for env, f in items if env["k"] == "ping"]
        for env, _ in items:
            if env["k"] == "ping":
                link.send({"k": "pong"})
                items = [(env, f) for env, f in items if env["k"] != "ping"]
                break
        if items:
            if not link.confirmed:
                link.confirmed = True
                self.agent.attach_caller(link)  # calls back to this caller can take this way too
            self.agent.receive(link.name, items, link)


    # -- the receiving threads -----------------------------------------------------------------------------
    def start_receiving(self) -> None:
        """On the loop thread: executor threads receive from now on (see the module docstring)."""
        socket = self.stream.socket
        if not self.shared or self.receiving or socket is None:
            return
        self._fd = socket.FD
        self.exclusive = _exclusive_wait_works(self._wake_r)
        self._spare = SPARE_RECEIVERS if self.exclusive else 1
        self.stream.stop_on_recv()  # the stream only sends now; its sends are scheduled, not polled for
        self.loop.remove_handler(socket)
        self.receiving = True
        self._free = self._receivers = 1
        if not self.agent.server.relay(self._receive):
            self.receiving = False
            self._resume_loop()

    def _receive(self) -> None:
        """One receiving thread: receive until a call arrives, run it here while others receive, then receive
        again while fewer than ``_spare`` threads do, else go back to the executor."""
        wait, close = self._waiter()
        try:
            while True:
                run = self._receive_until_call(wait)
                if run is None:
                    return
                run()  # outside the receiving try: whatever the call raises is the pool's to swallow
                if not self._rejoin():
                    return
        finally:
            close()

    def _waiter(self) -> tuple[Callable[[], list[tuple[int, int]]], Callable[[], None]]:
        """This thread's wait for the socket's FD or the wake-up pipe: ``(wait, close)``; ``wait`` returns the
        ready ``(fd, events)``. Exclusive waits (``EPOLLEXCLUSIVE``) wake one waiting thread per event, however
        many wait."""
        if self.exclusive:
            epoll = select.epoll()
            for fd in (self._fd, self._wake_r):
                epoll.register(fd, select.EPOLLIN | select.EPOLLEXCLUSIVE)
            return functools.partial(epoll.poll, RECEIVE_POLL_MS / 1000), epoll.close
        poller = select.poll()
        for fd in (self._fd, self._wake_r):
            poller.register(fd, select.POLLIN)
        return functools.partial(poller.poll, RECEIVE_POLL_MS), lambda: None

    def _receive_until_call(self, wait: Callable[[], list[tuple[int, int]]]) -> Callable[[], None] | None:
        """Receive; return the first call that arrives once receiving goes on without this thread.

        One thread at a time receives a message and serves what it carries (``_order``): cells reach ipykernel
        and envelopes the agent in the order they came, however many threads receive.
        """
        try:
            while True:
                with self._order:
                    frames = self._take()
                    if frames is _CLOSED:  # the kernel closed its shell socket, or receiving stopped
                        self._leave()
                        return None
                    idle = frames is None
                    run = None if idle else self._serve(frames)
                    frames = None
                    if run is not None and self._hand_on():
                        return run
                if run is not None and not self.agent.server.queue(run):
                    # The executor is shut down: nobody to hand over to, so run it and go on receiving here (a
                    # late cancellation of that call, landing after it ended, must not stop the receiving).
                    with contextlib.suppress(BaseException):
                        run()
                elif idle:
                    for fd, _ in wait():
                        if fd == self._wake_r:  # woken: then look at the socket (next round)
                            with contextlib.suppress(BlockingIOError):
                                os.read(self._wake_r, 4096)
        except BaseException as exc:  # a bug, or the kernel going down: the loop receives again
            _log(f"the shell path's receiving thread stopped ({type(exc).__name__}: {exc}); the shell-channel "
                 "thread receives again")
            with self._lock:
                self.receiving = False  # the others stop too; the last to leave hands back to the loop
                self._failed = True
            self._leave()
            return None

    def _take(self) -> Any:
        """The next message on the shell socket if one is waiting, else None; ``_CLOSED`` once the socket is
        closed or receiving stopped.

        The socket's FD is edge-triggered: it fires when the socket's state may have changed, and reading
        ``EVENTS`` anywhere (here, in the stream, in ``send``) consumes the edge -- those places wake a
        receiving thread (``_pass_edge``, ``_wake``) when input is left, and so does a receiving thread that
        goes to run a call (``_hand_on``).
        """
        with self._lock:
            socket = self.stream.socket
            if socket is None or socket.closed or not self.receiving:
                return _CLOSED
            try:
                if _poll([(socket, _POLLIN)], 0):
                    return recv_frames(socket, _NOBLOCK)
            except zmq.Again:
                pass
            except zmq.ZMQError:
                return _CLOSED
        return None

    def _serve(self, frames: list[Any]) -> Callable[[], None] | None:
        """Route one message: another's to ipykernel on the loop thread, ours to the agent; the first call it
        carries is returned for this thread to run -- unless every receiving thread is busy with a call and
        no other may start (then all go to the executor, in order; see ``_hand_on``)."""
        at = self._ours(frames)
        if at is None:
            self.loop.add_callback(self._forward, frames)
            return None
        try:
            # Read without the lock: meanwhile other threads can only raise _free or lower _receivers (but for a
            # closing one), so a thread told to claim a call can almost always run it (else it queues it).
            if self._all_busy():
                self._handle(frames, at)
                return None
            return self.agent.server.take_one(functools.partial(self._handle, frames, at))
        except Exception as exc:  # a bug: one message is lost, never the receiving
            _log(f"could not serve a message: {type(exc).__name__}: {exc}")
            return None

    def _hand_on(self) -> bool:
        """This receiving thread has a call to run. True: it runs it itself, and another one receives meanwhile
        (one already waiting, woken if input is left, or one started now while fewer than ``_spare`` receive).
        False: every receiving thread is busy with a call, so this one queues the call on the executor and
        receives on -- receiving never starts a thread per call, however long a burst (it once did: a
        worker grew by dozens of threads a burst, each a GIL contender) -- or the executor is shut down."""
        with self._lock:
            if self._all_busy():
                return False
            if self._free > 1:
                self._free -= 1
                self._pass_edge()
                return True
            self._receivers += 1  # counted before it starts, so that no other thread starts one too
        if self.agent.server.relay(self._receive):  # it receives in this thread's stead (``_free`` stays)
            return True
        with self._lock:
            self._receivers -= 1
        return False

    def _all_busy(self) -> bool:
        """No other receiving thread waits, and no other may start: a call received now goes to the executor."""
        return self._free <= 1 and self._receivers >= self._spare

    def _rejoin(self) -> bool:
        """After its call: whether this thread receives again (fewer than ``_spare`` do, and receiving goes on)."""
        with self._lock:
            if not self.receiving or self._free >= self._spare:
                self._receivers -= 1
                return False
            self._free += 1
            return True

    def _leave(self) -> None:
        """A receiving thread stops receiving; after a failure the last one hands receiving back to the loop
        (its forwarded messages are queued on the loop before that, so none overtakes them)."""
        with self._lock:
            self._free -= 1
            self._receivers -= 1
            resume = self._failed and self._free <= 0
        if resume:
            with contextlib.suppress(Exception):
                self.loop.add_callback(self._resume_loop)

    def _pass_edge(self) -> None:
        """Under the lock, after someone read the socket's ``EVENTS``: wake a receiving thread if input waits."""
        socket = self.stream.socket
        try:  # not contextlib.suppress: this runs before every call a receiving thread takes on
            if socket is not None and not socket.closed and _poll([(socket, _POLLIN)], 0):
                self._wake()
        except zmq.ZMQError:
            pass

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
            os.write(self._wake_w, b"!")

    def _resume_loop(self) -> None:
        """On the loop thread: the stream receives again, as before start_receiving."""
        self.receiving = False
        socket = self.stream.socket
        if socket is None or socket.closed or self._handle_events is None:
            return
        self.stream.on_recv(self.on_recv, copy=False)
        with contextlib.suppress(Exception):  # already registered
            self.loop.add_handler(socket, self._handle_events, self.loop.READ)
        self._handle_events(socket, 0)


def _exclusive_wait_works(fd: int) -> bool:
    """Whether threads can wait for one FD so that an event wakes only one of them (Linux >= 4.5:
    ``EPOLLEXCLUSIVE``), and ``NBREMOTE_SHELL_RECEIVER`` does not ask for the relay instead."""
    flag = getattr(select, "EPOLLEXCLUSIVE", None)
    if flag is None or os.environ.get("NBREMOTE_SHELL_RECEIVER") == "relay":
        return False
    try:
        with select.epoll() as probe:
            probe.register(fd, select.EPOLLIN | flag)
    except OSError:
        return False
    return True


def _version(module: Any) -> tuple[int, ...]:
    parts = []
    for piece in str(getattr(module, "__version__", "0")).split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _receiver_wanted() -> bool:
    return os.environ.get("NBREMOTE_SHELL_RECEIVER", "1") != "0"


def install(kernel: Any, agent: Any) -> ShellPath | None:
    """Wrap the kernel's shell stream (once); None where this ipykernel cannot take it."""
    existing = getattr(kernel, "_nbremote_shell_path", None)
    if existing is not None:
        existing.agent = agent
        return existing  # type: ignore[no-any-return,unused-ignore]
    import ipykernel

    thread = getattr(kernel, "shell_channel_thread", None)
    if (_version(ipykernel) < MIN_IPYKERNEL or thread is None or getattr(kernel, "shell_stream", None) is None
            or not hasattr(kernel, "shell_channel_thread_main") or thread.ident is None):
        return None
    path = ShellPath(kernel, agent)
    ready = threading.Event()

    def swap() -> None:  # the stream is the loop's: change its callback there
        path.stream.on_recv(path.on_recv, copy=False)
        path.share_socket()
        if _receiver_wanted():
            path.start_receiving()
        ready.set()

    path.loop.add_callback(swap)
    if not ready.wait(10):
        _log("the shell-channel thread did not take nbremote's handler; staying on the comm path")
        return None
    kernel._nbremote_shell_path = path
    return path
