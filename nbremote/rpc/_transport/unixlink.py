"""A same-host link's own socket: the kernel's signed messages over a Unix-domain stream socket.

zmq hands every message to an I/O thread of its own on both sides, so a round trip between two processes
wakes six threads where a plain socket read by the waiting thread wakes two; after a moment's idle (a
training step's messages always are) that is ~72 us more per one-way message (``benchmarks/bench_wire.py``:
zmq ipc 176 us a round trip, a Unix socket 32). A training step is a chain of such messages, each waiting
for the one before, so that floor is most of what still separates it from torch's (issue 20).

So a worker whose caller proved it shares this machine (``shm``: the two see each other's ``/dev/shm``)
offers a Unix-domain socket in its ``comm_open`` ack: ``/dev/shm/nbr-<pid>-<random>-sock``, mode 0600 (a
connection needs write permission on it: only its user), named like the process's shared-memory segments
so that the same exit paths unlink it (at exit, SIGTERM, SIGHUP) and the driver's sweep removes it after a
SIGKILL (``shm.sweep_dead``). The caller connects and introduces the connection with a ``ping`` signed with the
kernel's key that names the link it belongs to (its shell identity) and whether it is the link's own
(``main``) or one of its threads' (``thread``, see ``threadsockets``); the kernel answers ``pong`` on it.
From then on everything that link sent and received on the shell path goes this way, both ways: the same
signed Jupyter frames (``codec``: HMAC and replay checks, shared memory for big buffers, all as before),
each message ``<frames, bytes>`` then the frames' lengths then the frames. Whoever waits reads: a blocking
call's thread its own connection, the IO thread (which polls the descriptor beside its zmq sockets) the
link's, the worker's receiving threads theirs (``_worker.receivers``). A connection that breaks or
closes is given up and its link goes back to the kernel's zmq channels, which are still open: whether the
kernel lives is judged there, as it always was. ``NBREMOTE_UNIX=0`` keeps every link on zmq.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from nbremote.rpc._transport.shm import SHM_DIR, reap_on_exit
from nbremote.rpc._transport.switches import switched_on
from nbremote.rpc._wire.codec import Codec
from nbremote.rpc._wire.envelope import Buffer, Envelope

__all__ = ["HELLO_TIMEOUT", "UnixChannel", "UnixListener", "connect_unix", "unix_wanted"]

HELLO_TIMEOUT = 1.0  # s for the kernel's pong on a new connection before we settle for zmq
# s a send may wait for room, or a read for the rest of a message whose start came: a peer that stops
# midway (paused, wedged) breaks the connection, and its link goes back to zmq, instead of stalling the
# thread (the IO thread, a receiving thread) for good
IO_TIMEOUT = 5.0
_HEAD = struct.Struct("<IQ")  # frames, bytes after the head (their lengths, then the frames)
_JOIN_BELOW = 1 << 16  # a message smaller than this is joined and sent with one call
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
MAX_FRAMES = 1 << 20  # more frames than this in one message is not ours: the connection is dropped
MAX_BYTES = 1 << 40
HELLO_BYTES = 1 << 16  # an introduction is a few hundred bytes: a head asking for more is refused unread


def unix_wanted() -> bool:
    """``NBREMOTE_UNIX=0`` keeps every same-host link on the kernel's zmq channels (to compare, or to work around)."""
    return switched_on("NBREMOTE_UNIX") and hasattr(socket, "AF_UNIX")


class UnixChannel:
    """One connected Unix stream socket carrying whole messages (lists of frames), both ways.

    Sending is serialized by a lock of its own; receiving is its reader's (one thread at a time). A message
    is read whole once its first bytes are there (``timeout`` bounds a sender that stalls midway).
    """

    def __init__(self, sock: socket.socket, *, timeout: float = IO_TIMEOUT) -> None:
        sock.settimeout(timeout)
        self.sock = sock
        self.timeout = timeout
        self.fd = sock.fileno()
        self._send_lock = threading.Lock()
        self.broken = False  # it failed or was closed: its link went back to zmq
        self.sent = self.got = 0  # messages each way (what the tests count)
        self.failure: str | None = None  # why ``take`` gave it up, where a read failed (not a plain close)

    def send(self, frames: Sequence[Any]) -> None:
        """Send one message; raises ``OSError`` once the connection is gone (then mark it ``broken``)."""
        views: list[Any] = [f if type(f) is bytes else memoryview(f).cast("B") for f in frames]
        sizes = [len(v) if type(v) is bytes else v.nbytes for v in views]
        head = _HEAD.pack(len(views), 8 * len(views) + sum(sizes)) + struct.pack(f"<{len(views)}Q", *sizes)
        with self._send_lock:
            self.sent += 1
            if sum(sizes) < _JOIN_BELOW:
                self.sock.sendall(b"".join([head, *views]))
                return
            pending: list[Any] = [head, *views]
            while pending:
                sent = self.sock.sendmsg(pending[:_IOV_MAX])
                while pending and (sent or not len(pending[0])):  # (empty frames go with the bytes before them)
                    n = len(pending[0])
                    if sent >= n:
                        sent -= n
                        pending.pop(0)
                    else:
                        pending[0] = memoryview(pending[0])[sent:]
                        sent = 0

    def receive(self, limit: int = MAX_BYTES) -> list[memoryview] | None:
        """The next message's frames (views over one buffer of its own); None once the peer closed.
        Raises ``OSError`` (``TimeoutError`` for a sender that stalls) and ``ValueError`` for a malformed head
        or one over ``limit`` bytes (checked before anything is allocated)."""
        head = bytearray(_HEAD.size)
        if not self._fill(memoryview(head), eof_ok=True):
            return None
        count, total = _HEAD.unpack(head)
        if count > MAX_FRAMES or total > limit or total < 8 * count:
            raise ValueError(f"malformed message head ({count} frames, {total} bytes)")
        body = memoryview(bytearray(total))
        self._fill(body, eof_ok=False)
        sizes = struct.unpack_from(f"<{count}Q", body)
        if sum(sizes) != total - 8 * count:
            raise ValueError("malformed message: its frame lengths do not add up")
        self.got += 1
        frames, at = [], 8 * count
        for size in sizes:
            frames.append(body[at : at + size])
            at += size
        return frames

    def try_send(self, frames: Sequence[Any]) -> bool:
        """``send`` for a sender with another way (the kernel's zmq socket): False once the connection is given up,
        before or now (``failure`` says why); a message it did not take whole, its reader drops."""
        if self.broken:
            return False
        try:
            self.send(frames)
            return True
        except OSError as exc:  # gone, or stalled past its timeout
            self.failure = f"{type(exc).__name__}: {exc}"
            self.shut()
            return False

    def take(self) -> list[memoryview] | None:
        """``receive`` for a reader that gives the connection up once it ends or fails: None then, the connection
        shut (``failure`` says why, where a read failed)."""
        try:
            frames = self.receive()
        except (OSError, ValueError) as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            frames = None
        if frames is None:
            self.shut()
        return frames

    def _fill(self, view: memoryview, *, eof_ok: bool) -> bool:
        got, want = 0, view.nbytes
        while got < want:
            n = self.sock.recv_into(view[got:], want - got)
            if n == 0:
                if got == 0 and eof_ok:
                    return False
                raise ConnectionError("the connection closed in the middle of a message")
            got += n
        return True

    def hello(self, codec: Codec, env: Envelope, timeout: float) -> bool:
        """Send a signed introduction and wait (at most ``timeout``) for the kernel's signed ``pong``."""
        try:
            self.send(codec.encode_items([(env, ())]))
            self.sock.settimeout(timeout)
            frames = self.receive()
            self.sock.settimeout(self.timeout)
            if frames is None:
                return False
            _, content, buffers = codec.decode(frames)
            return any(e["k"] == "pong" for e, _ in codec.unpack_items(content, buffers, digests=False))
        except Exception:  # no answer, or one we cannot read: no such channel
            return False

    def finish(self) -> None:
        """Send nothing more: the peer reads what was sent, then sees the connection end (a goodbye that follows
        by another way, the comm's close, is then not served before what this connection still carries)."""
        with self._send_lock, contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def shut(self) -> None:
        """Give the connection up, from any thread: both ends see it closed, and its reader lets it go
        (``close``) -- the descriptor stays valid until then, so no thread ever polls a reused one."""
        self.broken = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """By its reader, or once nobody polls it any more."""
        self.shut()
        self.sock.close()


def connect_unix(path: object, codec: Codec, link: bytes, role: str, timeout: float = HELLO_TIMEOUT,
                 ) -> UnixChannel | None:
    """A connection to a kernel's socket at ``path`` for the link whose shell identity is ``link``, once the
    kernel answered its introduction; None where there is no such socket or it does not answer."""
    if not isinstance(path, str) or not unix_wanted():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    channel = UnixChannel(sock)
    if channel.hello(codec, {"k": "ping", "link": link.hex(), "unix": role}, timeout):
        return channel
    channel.close()
    return None


def received(codec: Codec, frames: list[Any], digests: bool) -> list[tuple[Envelope, list[Buffer]]]:
    """The envelopes of a message read from a channel (signature and replay checked by ``codec``)."""
    _, content, buffers = codec.decode(frames, at=0)
    return codec.unpack_items(content, buffers, digests=digests)


class UnixListener:
    """A kernel's listening socket (see the module docstring for where, and who removes it); a thread of its
    own accepts connections and hands each to ``accepted(channel)`` (which reads its introduction)."""

    def __init__(self, accepted: Any) -> None:
        self.path = str(SHM_DIR / f"nbr-{os.getpid()}-{os.urandom(4).hex()}-sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # its mode comes from the umask until the chmod; whoever connects in between must still introduce
            # itself with the kernel's key, as every connection must
            self._sock.bind(self.path)
            os.chmod(self.path, 0o600)
        except OSError:
            self._sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        reap_on_exit()  # this process's shared-memory names, the socket's among them, are unlinked as it ends
        self._sock.listen(64)
        self._accepted = accepted
        self._closed = False
        atexit.register(self.close)
        threading.Thread(target=self._accept, name="nbremote-unix-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # out of descriptors, say: try again, never spin
                continue
            threading.Thread(target=self._accepted, args=(UnixChannel(sock),),
                             name="nbremote-unix-hello", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
