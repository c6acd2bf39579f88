"""Sockets of a calling thread's own: a blocking call that receives its reply itself.

By default a reply arrives on the link's ``rx`` socket, which the IO thread owns; the IO thread then
wakes the thread blocked in ``rpc_sync``. Two thread switches and a poller round per call: on a small
call that is a good share of its time. So a thread that makes blocking calls on the shell path gets a
DEALER of its own to the kernel's shell socket (at most ``MAX_PER_LINK`` per link): it sends the call
on it, the kernel answers the identity the call came from, and the same thread receives the reply
(``Future.set_pump``). Its replies never meet another thread; everything else keeps to the shared
sockets (``_transport``). A future completed by another thread (the IO thread failing a call whose
worker was lost or whose time ran out; a backward pass whose last report came to the shared socket)
wakes the waiting thread through a pipe that it polls beside its socket (``Pump.wake``).

A new socket introduces itself with a ``ping`` naming its link (the link's sending identity); the
kernel answers ``pong`` and from then on answers that identity for that caller (``_worker.shellpath``). A
socket that does not get its pong within ``HANDSHAKE`` is closed and the thread keeps to the shared
path. Whoever uses a socket holds its lock; closing takes it too, so a socket is never closed under a
user's feet (a pump holds it for one short poll at a time).

Where the link has a Unix-domain connection of its own (``unixlink``: a kernel on this machine), a
thread's own way is one too, introduced the same way (a ``ping`` naming the link, ``unix: "thread"``);
one that breaks is closed, and its thread keeps to the shared path, whose link gets the kernel's replies.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq
from jupyter_client.session import Session

from nbremote.rpc._transport.cpuwake import CPU_WAKE
from nbremote.rpc._transport.sockets import connect, dealer, recv_frames, send_frames
from nbremote.rpc._transport.unixlink import UnixChannel, connect_unix, received
from nbremote.rpc._wire.codec import Codec
from nbremote.rpc._wire.envelope import Buffer, Envelope

__all__ = ["Owner", "Pump", "ThreadSocket", "ThreadSockets"]

MAX_PER_LINK = 16
HANDSHAKE = 1.0  # s for a new socket's pong

_UNSET: Any = object()
_CLOSED: Any = object()
_POLLIN = int(zmq.POLLIN)


class Owner(Protocol):
    """What the link whose thread sockets these are lends them (``zmqlink.KernelLink``)."""

    conn: dict[str, Any]  # the kernel's connection info: where its shell socket is, its Curve keys
    identity: bytes  # the link's sending identity on the kernel's shell socket, named in a new socket's ping
    session: Session  # the kernel's key and signature scheme: each socket gets a codec of its own
    codec: Codec  # the link's codec, which encodes what the sockets send
    digests: bool  # whether frames carry digests (beyond loopback)

    @property
    def unix_path(self) -> str | None:
        """Where a thread may open a Unix-domain connection of its own, if anywhere (``unixlink``)."""

    @property
    def closed(self) -> bool: ...

    @property
    def on_message(self) -> Callable[[Any, list[tuple[Envelope, list[Buffer]]]], None] | None:
        """Where received envelopes go: ``on_message(link, items)``, as for the link's own sockets."""

    def resend(self, messages: list[list[Any]]) -> None:
        """Send encoded messages by the link's own way (what a thread's connection owed when it ended)."""


class ThreadSocket:
    """One thread's DEALER to a kernel's shell socket (or Unix-domain connection to the kernel), and a pipe
    that wakes the thread waiting on it."""

    def __init__(self, sock: zmq.Socket[Any] | UnixChannel, codec: Codec) -> None:
        self.sock: Any = sock
        self.unix = sock if isinstance(sock, UnixChannel) else None
        self.key: Any = sock.fd if isinstance(sock, UnixChannel) else sock  # what zmq_poll says has input
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # for zmq_poll, which costs half of Socket.poll (and takes a file descriptor beside a socket)
        self.pollable: list[tuple[Any, int]] = [(self.key, _POLLIN), (self._wake_r, _POLLIN)]
        self.codec = codec  # this socket's own: its replay window belongs to what it receives
        self.lock = threading.Lock()
        self._wake_lock = threading.Lock()  # a wake never writes to a closed (or reused) descriptor
        self.closed = False

    def wake(self) -> None:
        """From another thread: what the waiting thread waits for came another way (see ``Pump.wake``)."""
        with self._wake_lock:
            if not self.closed:
                with contextlib.suppress(BlockingIOError):  # full: it is awake already
                    os.write(self._wake_w, b"w")

    def woken(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)

    def close(self) -> None:
        with self.lock, self._wake_lock:
            if self.closed:
                return
            self.closed = True
            if self.unix is not None:
                self.unix.close()
            else:
                self.sock.close(linger=0)
            os.close(self._wake_r)
            os.close(self._wake_w)


class Pump:
    """What a thread runs to receive its own replies while it waits (``Future.set_pump``): ``pump(seconds)``
    takes what arrived on its socket, waiting at most that long; ``wake()``, from any other thread, ends
    such a wait at once (the future was completed another way: a lost worker, a timeout, or a backward
    pass whose last report came to the shared socket)."""

    __slots__ = ("_sockets", "_ts")

    def __init__(self, sockets: ThreadSockets, ts: ThreadSocket) -> None:
        self._sockets, self._ts = sockets, ts

    def __call__(self, seconds: float) -> None:
        ts, link = self._ts, self._sockets._link
        items = None
        with ts.lock:
            if ts.closed:
                items = _CLOSED
            else:
                for what, _ in zmq.zmq_poll(ts.pollable, max(1, int(seconds * 1000))):
                    if what is ts.key or what == ts.key:
                        items = self._sockets._receive(ts)
                    else:
                        ts.woken()
        if ts.unix is not None and ts.unix.broken:
            self._sockets.given_up(ts)  # the kernel's replies to this thread now come by the link's shared way
        if items is _CLOSED:  # the link is gone, and the IO thread fails the call
            time.sleep(seconds)
        elif items and link.on_message is not None:
            link.on_message(link, items)

    def wake(self) -> None:
        self._ts.wake()


class ThreadSockets:
    """The thread sockets of one link."""

    def __init__(self, link: Owner) -> None:
        self._link = link
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[ThreadSocket] = []

    def _mine(self) -> ThreadSocket | None:
        ts = getattr(self._local, "socket", _UNSET)
        if ts is _UNSET:
            ts = self._local.socket = self._open()
        return None if ts is None or ts.closed else ts

    def _open(self) -> ThreadSocket | None:
        link = self._link
        codec = Codec(link.session.key, signature_scheme=link.session.signature_scheme, session=link.codec.session)
        unix_path = link.unix_path  # (introduced already when it connects: the kernel answered it)
        channel = None if unix_path is None else connect_unix(unix_path, codec, link.identity, "thread")
        with self._lock:
            if len(self._all) >= MAX_PER_LINK or link.closed:
                if channel is not None:
                    channel.close()
                return None
            if channel is None:
                sock = dealer(link.identity + b"-t%d" % len(self._all))
                connect(sock, link.conn, "shell_port")
            ts = ThreadSocket(sock if channel is None else channel, codec)
            self._all.append(ts)
        if channel is not None:
            return ts
        hello = link.codec.encode_items([({"k": "ping", "link": link.identity.hex()}, ())],
                                        digests=link.digests)
        deadline = time.monotonic() + HANDSHAKE
        with ts.lock:
            send_frames(sock, hello)
            while (left := deadline - time.monotonic()) > 0:
                if sock.poll(int(left * 1000) + 1) and any(env["k"] == "pong" for env, _ in self._receive(ts)):
                    return ts
        ts.close()
        return None

    def send(self, env: Envelope, frames: Sequence[Buffer]) -> Pump | None:
        """Send a call on this thread's socket; returns its pump, or None (then send it the shared way)."""
        ts = self._mine()
        if ts is None:
            return None
        CPU_WAKE.touch()
        message = self._link.codec.encode_items([(env, frames)], digests=self._link.digests, pieces=ts.unix is None)
        with ts.lock:
            if ts.closed:
                return None
            if ts.unix is None:
                send_frames(ts.sock, message)
                return Pump(self, ts)
            took = ts.unix.try_send(message)  # (taken as it ended: it goes with what the connection owes)
        if ts.unix.broken:
            self.given_up(ts)
        return Pump(self, ts) if took else None  # (not taken: given up before, the call goes the shared way)

    def given_up(self, ts: ThreadSocket) -> None:
        """``ts``'s Unix-domain connection ended: what it owed the kernel goes by the link's own way, and the
        kernel's replies to this thread come that way too."""
        assert ts.unix is not None
        leftovers = ts.unix.leftovers()
        if leftovers:
            self._link.resend(leftovers)
        ts.close()

    def _receive(self, ts: ThreadSocket) -> list[tuple[Envelope, list[Buffer]]]:
        if ts.unix is not None:
            frames = ts.unix.take()  # None: given up (the pump lets it go once it lets go of its lock)
            return received(ts.codec, frames, self._link.digests) if frames else []
        _, content, buffers = ts.codec.decode(recv_frames(ts.sock))
        return ts.codec.unpack_items(content, buffers, digests=self._link.digests)

    def finish(self) -> None:
        """The link says goodbye: its threads' Unix-domain connections send nothing more (``UnixChannel.finish``)."""
        with self._lock:
            for ts in self._all:
                if ts.unix is not None:
                    ts.unix.finish()

    def close(self) -> None:
        with self._lock:
            sockets, self._all = self._all, []
        for ts in sockets:
            ts.close()

