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

Receiving is not the loop's either: executor threads take messages off the shared socket (``receivers``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from nbremote.errors import ProtocolError
from nbremote.rpc._transport.base import CallerLink
from nbremote.rpc._transport.cpuwake import CPU_WAKE
from nbremote.rpc._transport.direct import BULK_MIN
from nbremote.rpc._transport.sockets import recv_frames, send_frames
from nbremote.rpc._transport.unixlink import UnixChannel
from nbremote.rpc._wire import batching
from nbremote.rpc._wire.codec import Codec, ReplayedMessage, is_ours, split_idents
from nbremote.rpc._wire.envelope import Buffer, Envelope
from nbremote.rpc._worker.localsock import LocalSockets
from nbremote.rpc._worker.receivers import Receivers

__all__ = ["ShellLink", "ShellPath", "install"]

MIN_IPYKERNEL = (7, 0)
_POLLIN = int(zmq.POLLIN)  # an int: pyzmq's enums cost a conversion per use
# Whether input waits, asked with zmq_poll(timeout 0): libzmq reads the socket's EVENTS for it, as
# ``socket.get(zmq.EVENTS)`` does -- which also consumes the FD's edge -- but without that call's two
# Python frames of enum lookup per read (three reads a call here).
_poll = zmq.zmq_poll
DEFER_S = 0.0005  # the longest a reply waits for those of the calls queued behind it (see ShellLink.send)
DEFER_ITEMS = 64  # replies that wait together at most


def _log(text: str) -> None:
    print(f"nbremote: {text}", file=sys.__stderr__, flush=True)  # the worker's log file


class ShellLink(CallerLink):
    """A ``_transport.base.Link`` back to one caller through the kernel's shell socket."""

    def __init__(self, path: ShellPath, name: str, rx: bytes, digests: bool, same_host: bool, *,
                 alias: bool = False, pieces: bool = False) -> None:
        self.path = path
        self.name = name
        self.rx = rx
        self.digests = digests
        self.same_host = same_host
        # Whether big frames go in pieces (``codec.in_pieces``): to a zmq client, which puts them together;
        # not through a server, whose websocket carries one message whole (and would gain nothing).
        self.pieces = pieces
        # A caller's own link (the way to call it back, once it sent a real request this way) or an
        # alias: one of its threads' own sockets, which only gets the replies to that thread's calls.
        self.alias = alias
        self.confirmed = alias
        self.aliases: list[ShellLink] = []
        # A server-hosted kernel's caller with a direct data channel (``_transport.direct``): the alias whose
        # ``rx`` takes our big batches to it, instead of the server's socket.
        self.bulk: ShellLink | None = None
        # A same-host caller's own Unix-domain connection for this link (``_transport.unixlink``): what we send
        # it goes there while it holds; an alias that came that way has no ``rx`` and, once its connection is
        # gone, sends by its ``main`` link.
        self.unix: UnixChannel | None = None
        self.main: ShellLink | None = None
        self.outbox = batching.Outbox(self._send_batch)
        self._scheduled = False

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
        CPU_WAKE.touch()
        unix = self.unix
        if unix is not None and self._by_unix(unix, self.path.codec.encode_items(items, digests=self.digests)):
            return
        if self.main is not None and not self.rx:
            self.main._send_batch(items)
            return
        bulk = self.bulk
        if bulk is not None and sum(memoryview(f).nbytes for _, frames in items for f in frames) >= BULK_MIN:
            bulk._send_batch(items)
            return
        self.path.send([self.rx, *self.path.codec.encode_items(items, digests=self.digests, pieces=self.pieces)])

    def fall_back(self, channel: UnixChannel) -> None:
        """``channel``, this link's Unix-domain connection, was let go (``receivers``): what it owes the caller goes
        by the shell socket, between sends."""
        self.outbox.locked(lambda: self._resend(channel))

    def _resend(self, channel: UnixChannel) -> None:
        """Once ``channel`` is given up: what the caller may not have read whole of it goes another way, in order,
        once (``UnixChannel.leftovers``)."""
        leftovers = channel.leftovers()
        if leftovers is None:
            return
        if leftovers or channel.failure is not None:  # (not a plain goodbye)
            _log(f"{self.name!r}'s Unix-domain connection ended ({channel.failure or 'closed'}); its replies go by "
                 f"the shell socket, {len(leftovers)} message(s) sent again")
        for message in leftovers:
            self._send_encoded(message)

    def _by_unix(self, unix: UnixChannel, message: list[Any]) -> bool:
        """Send ``message`` by ``unix``; False where it no longer takes messages. Once it is given up, what it owes
        goes by the shell socket first (``_resend``; what it took as it ended among it)."""
        took = unix.try_send(message)
        if unix.broken:
            self._resend(unix)
        return took

    def _send_encoded(self, message: list[Any]) -> None:
        main = self.main
        if main is not None and not self.rx:  # a thread's alias with no socket of its own: by its link's way
            if main.unix is None or not main._by_unix(main.unix, message):
                main._send_encoded(message)
            return
        self.path.send([self.rx, *message])

    def close(self) -> None:
        self.outbox.close()
        if self.unix is not None:
            self.unix.shut()  # its reader, a receiving thread, sees it closed and lets it go


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
        self.forward = kernel.shell_channel_thread_main  # ipykernel's own routing, for every other message
        self._links: dict[bytes, ShellLink] = {}  # by the caller's sending identity
        self._tokens: dict[str, ShellLink] = {}  # links waiting for their caller's first ping (see register)
        self._joined: dict[str, ShellLink] = {}  # the same once joined: a direct data channel may name them
        self.lock = threading.RLock()  # one user of the shell socket at a time (see the module docstring)
        self.handle_events: Callable[[Any, int], Any] | None = None
        self.shared = False  # replies are sent by the thread that made them (set up by share_socket)
        self.receivers = Receivers(self)  # executor threads that receive, once started (see ``receivers``)
        self.local = LocalSockets(self)  # same-host callers' Unix-domain connections (``localsock``)

    def share_socket(self) -> None:
        """On the loop thread: put the stream's uses of its socket under our lock (see the docstring)."""
        stream = self.stream
        handle, update = getattr(stream, "_handle_events", None), getattr(stream, "_update_handler", None)
        if handle is None or update is None or stream.socket is None:
            return  # another pyzmq: leave the stream alone, reply through it

        receivers = self.receivers

        def locked(use: Callable[..., Any]) -> Callable[..., Any]:
            """One of the stream's uses of the socket, under our lock; it reads EVENTS, so pass the edge on."""

            def run(*args: Any, **kwargs: Any) -> Any:
                with self.lock:
                    try:
                        return use(*args, **kwargs)
                    finally:
                        if receivers.receiving:
                            receivers.pass_edge()

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
            with self.lock:
                return close(*args, **kwargs)

        socket.close = locked_close
        self.loop.remove_handler(stream.socket)  # the loop calls the handler it was given, not the attribute
        self.loop.add_handler(stream.socket, handle_events, self.loop.READ)
        self.handle_events = handle_events
        self.shared = True

    def send(self, frames: list[Any]) -> None:
        """Send one message on the shell socket (from any thread once shared, else on the loop thread)."""
        if not self.shared:
            self.stream.send_multipart(frames, copy=False)
            return
        with self.lock:
            socket = self.stream.socket
            if socket is None:  # the kernel is closing its channels
                return
            send_frames(socket, frames)
            pending = _poll([(socket, _POLLIN)], 0)
        if not pending:
            return
        receivers = self.receivers
        if receivers.receiving:  # our send took the edge of a request: whoever receives must look again
            receivers.wake()
        elif self.handle_events is not None:
            handle = self.handle_events
            self.loop.add_callback(lambda: handle(socket, 0))

    def caller_link(self, tx: bytes) -> ShellLink | None:
        """The link (not an alias) of the caller whose sending identity is ``tx``."""
        link = self._links.get(tx)
        return None if link is None or link.alias else link

    def alias(self, main: ShellLink, rx: bytes = b"") -> ShellLink:
        """A new way back to ``main``'s caller for one of its threads: its own socket's identity ``rx`` on the shell
        socket (``_join``), or none (it gets a Unix-domain connection, ``localsock``)."""
        alias = ShellLink(self, main.name, rx, main.digests, main.same_host, alias=True, pieces=main.pieces)
        alias.main = main
        main.aliases.append(alias)
        return alias

    def register(self, name: str, tx: bytes | None, rx: bytes | None, digests: bool, same_host: bool,
                 token: str | None = None) -> ShellLink:
        """A caller's link. A caller that knows the identities of its sockets on our shell socket (a zmq
        client) names them; one behind a proxy (a Jupyter Server's websocket) names a ``token`` instead,
        and the first ping carrying it makes its sender this link's identity both ways (see ``_join``)."""
        link = ShellLink(self, name, rx or b"", digests, same_host, pieces=tx is not None)
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
        for tokens in (self._tokens, self._joined):
            for token, known in list(tokens.items()):
                if known in gone:
                    del tokens[token]
        for each in gone:
            each.close()

    def _join(self, ident: bytes, items: list[tuple[Envelope, list[Any]]]) -> ShellLink | None:
        """A new sending identity introduces itself with a ping naming a link: the token of a link that
        waits for its caller (which from now on sends and receives as ``ident``), the token of a joined
        link with ``bulk`` (``ident`` is then its caller's direct data channel, ``_transport.direct``), or
        the sending identity of a caller's link (``ident`` is then one of its threads' own sockets:
        ``_transport.threadsockets``)."""
        for env, frames in items:
            if env["k"] == "ping" and not frames and isinstance(env.get("link"), str):
                waiting = self._tokens.pop(env["link"], None)
                if waiting is not None:
                    waiting.rx = ident
                    self._links[ident] = waiting
                    self._joined[env["link"]] = waiting
                    return waiting
                bulk, joined = env.get("bulk"), self._joined.get(env["link"])
                if isinstance(bulk, dict) and joined is not None:
                    return self._join_bulk(ident, joined, bulk)
                try:
                    main = self.caller_link(bytes.fromhex(env["link"]))
                except ValueError:
                    return None
                if main is None:
                    return None
                alias = self._links[ident] = self.alias(main, ident)
                return alias
        return None

    def _join_bulk(self, ident: bytes, main: ShellLink, bulk: dict[str, Any]) -> ShellLink | None:
        """``main``'s caller opens a direct data channel: ``ident`` sends, ``bulk["rx"]`` receives."""
        try:
            rx = bytes.fromhex(str(bulk.get("rx")))
        except ValueError:
            return None
        channel = ShellLink(self, main.name, rx, bool(bulk.get("digests")), main.same_host, alias=True, pieces=True)
        if main.bulk is not None:
            self.unregister(main.bulk)
            main.aliases.remove(main.bulk)
        main.aliases.append(channel)
        main.bulk = channel
        self._links[ident] = channel
        return channel

    def ours(self, frames: list[Any]) -> int | None:
        """Where the delimiter of an ``nbremote_request`` is; None for any other message."""
        try:
            _, i = split_idents(frames)
        except ProtocolError:
            return None
        return i if len(frames) > i + 2 and is_ours(frames[i + 2].bytes, exact=True) else None

    def on_recv(self, frames: list[Any]) -> Any:
        """The shell stream's receive callback (on the shell-channel thread)."""
        at = self.ours(frames)
        if at is None:
            return self.forward(frames)
        self.handle(frames, at)
        return None

    def handle(self, frames: list[Any], at: int, via: ShellLink | None = None) -> None:
        """Check one ``nbremote_request`` and hand what it carries to the agent; ``via``: the link whose Unix-domain
        connection it came by (else the sender's identity names it)."""
        ident = frames[0].bytes if at else None
        link = via if via is not None else self._links.get(ident) if ident is not None else None
        try:
            _, content, buffers = self.codec.decode(frames, at=at)
            # from an unknown identity only a frameless ping is ever used (see _join)
            items = self.codec.unpack_items(content, buffers, digests=link is not None and link.digests)
        except ReplayedMessage:  # read already, by a Unix-domain connection that ended before it said so
            return
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
        # A ROUTER drops, without a word, what it cannot queue for a peer: 1,000 messages by default, which a
        # burst of calls to a caller fills whenever libzmq's IO thread is slow to write them out (a worker's
        # 2,000 rpc_async to the driver lost hundreds). Unbounded, as the callers' own sockets are: a caller
        # that stops reading is found by its lease and heartbeat, not by losing its messages.
        path.stream.socket.sndhwm = 0
        path.stream.on_recv(path.on_recv, copy=False)
        path.share_socket()
        if _receiver_wanted():
            path.receivers.start_receiving()
        ready.set()

    path.loop.add_callback(swap)
    if not ready.wait(10):
        _log("the shell-channel thread did not take nbremote's handler; staying on the comm path")
        return None
    kernel._nbremote_shell_path = path
    return path
