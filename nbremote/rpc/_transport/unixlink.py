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

import collections
import contextlib
import itertools
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from nbremote.rpc._transport.switches import switched_on
from nbremote.rpc._wire.codec import Codec
from nbremote.rpc._wire.envelope import Buffer, Envelope

__all__ = ["HELLO_TIMEOUT", "UnixChannel", "connect_unix", "reader_thread", "unix_wanted"]

HELLO_TIMEOUT = 1.0  # s for the kernel's pong on a new connection before we settle for zmq
_HEAD = struct.Struct("<IQQ")  # frames, bytes after the head (their lengths, then the frames), messages acked
_JOIN_BELOW = 1 << 16  # a message smaller than this is joined and sent with one call
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
MAX_FRAMES = 1 << 20  # more frames than this in one message is not ours: the connection is dropped
MAX_BYTES = 1 << 40
HELLO_BYTES = 1 << 16  # an introduction is a few hundred bytes: a head asking for more is refused unread
# A receiver acknowledges what it read whole in the head of each message it sends back, or, where it sends
# nothing, in a message of its own once this many messages or bytes are unacknowledged: the sender keeps
# each message until then, to send it again by zmq if the connection ends first.
ACK_EVERY = 32
ACK_BYTES = 1 << 20
# A thread that may wait (``wait_for_room``: not a reader) waits while more than HIGH_WATER bytes are queued
# for a connection, until fewer than LOW_WATER are: backpressure instead of memory without bound.
HIGH_WATER = 64 << 20
LOW_WATER = 16 << 20
_NOWAIT = getattr(socket, "MSG_DONTWAIT", 0)


_readers = threading.local()


def reader_thread(reading: bool = True) -> None:
    """The calling thread reads connections (an IO thread; a receiving thread while it receives), or no longer
    does: a reader never waits for room, for the room it would wait for may be made only by what it reads."""
    _readers.reading = reading


def unix_wanted() -> bool:
    """``NBREMOTE_UNIX=0`` keeps every same-host link on the kernel's zmq channels (to compare, or to work around)."""
    return switched_on("NBREMOTE_UNIX") and hasattr(socket, "AF_UNIX")


class UnixChannel:
    """One connected Unix stream socket carrying whole messages (lists of frames), both ways, with flow control.

    **Nothing ever blocks on the peer.** ``send`` writes what the socket takes at once and queues the rest;
    a writer thread of the connection's own (started when the socket is full, gone once the queue is empty)
    writes the queue as the peer reads. So two ends that send to each other at once never wait on each
    other (a write-write deadlock needs both writers blocked), a peer that stops (SIGSTOP, a long GIL hold)
    costs its callers memory, not threads, and no timeout stands in for flow control: a connection is
    given up only when it ends (the peer closed it, its process died) or carries something malformed.
    Threads that are not readers may wait for room (``wait_for_room``) so that memory stays bounded.

    **Reading is incremental**: ``take`` reads what has come and returns a message once it is whole, ``[]``
    before; whoever polls the descriptor (the IO thread, a receiving thread, a blocking call's thread) never
    waits for the rest of a message.

    **Nothing is lost when it ends.** Each message is kept until the peer acknowledges it (``ACK_EVERY``);
    once the connection is given up, ``leftovers`` hands back, once, every message the peer may not have
    read whole, for its owner to send by the kernel's zmq channels in order before anything new. What the
    peer did read gets there twice: the receiving codec refuses the second by its signature (replay check,
    ``codec.ReplayedMessage``), and a reply is matched by its call id anyway.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)  # blocking for the writer thread; everything else passes MSG_DONTWAIT
        self.sock = sock
        self.fd = sock.fileno()
        self.limit = MAX_BYTES  # the most a message may carry (an introduction's reader lowers it)
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self.broken = False  # it failed or was closed: its link went back to zmq
        self.sent = self.got = 0  # messages each way (what the tests count; ``got`` is what we acknowledge)
        self.failure: str | None = None  # why it was given up, where something failed (not a plain close)
        # sending
        self._out: collections.deque[Any] = collections.deque()  # bytes to write, in order (views or bytes)
        self.queued = 0  # bytes in ``_out``
        self._writer = False  # a writer thread owns the socket's writing (until ``_out`` is empty)
        self._finishing = False  # ``finish``: shut the sending half once ``_out`` is written
        self._kept: collections.deque[tuple[int, Sequence[Any]]] = collections.deque()  # (number, message) unacked
        self._kept_taken = False
        # receiving: the message being read (its head, then its body), and what we owe the peer an ack for
        self._head = bytearray(_HEAD.size)
        self._body: memoryview | None = None
        self._filled = 0
        self._acked = 0  # the ``got`` we last told the peer
        self._owed_bytes = 0

    # -- sending -----------------------------------------------------------------------------------------
    def send(self, frames: Sequence[Any]) -> None:
        """Queue one message and write what the socket takes now; never waits for the peer. Raises
        ``ConnectionError`` once the connection is given up (its ``leftovers`` then go another way)."""
        views: list[Any] = [f if type(f) is bytes else memoryview(f).cast("B") for f in frames]
        sizes = [len(v) if type(v) is bytes else v.nbytes for v in views]
        body = 8 * len(views) + sum(sizes)
        with self._lock:
            if self.broken:
                raise ConnectionError(f"the Unix-domain connection was given up ({self.failure or 'closed'})")
            self.sent += 1
            self._kept.append((self.sent, frames))  # (encoded for this send: nobody changes it)
            head = _HEAD.pack(len(views), body, self._acked_now()) + struct.pack(f"<{len(views)}Q", *sizes)
            if body < _JOIN_BELOW:
                data = b"".join([head, *views])
                if not self._out and not self._writer:  # the common case: one write, nothing queued
                    self._send_alone(data)
                    return
                self._out.append(data)
            else:
                self._out.append(head)
                self._out.extend(views)
            self.queued += len(head) + body - 8 * len(views)
            self._write_locked()

    def try_send(self, frames: Sequence[Any]) -> bool:
        """``send`` for a sender with another way (the kernel's zmq socket): False once the connection is given up,
        before or now (``failure`` says why; ``leftovers`` are what it still owes)."""
        try:
            self.send(frames)
            return True
        except OSError:
            return False

    def wait_for_room(self, lost: Callable[[], bool]) -> None:
        """Backpressure, for a thread that is nobody's reader: while more than ``HIGH_WATER`` bytes wait to be
        written, wait until fewer than ``LOW_WATER`` do, or the connection or its link (``lost()``) is gone."""
        if self.queued <= HIGH_WATER or getattr(_readers, "reading", False):
            return
        with self._room:
            while self.queued > LOW_WATER and not self.broken and not lost():
                self._room.wait(0.1)  # (``lost`` is another object's: look at it now and then)

    def _acked_now(self) -> int:
        """Under the lock: what we acknowledge in a head we send now (all we read whole so far)."""
        self._acked, self._owed_bytes = self.got, 0
        return self.got

    def _write_locked(self) -> None:
        """Under the lock: write what the socket takes without waiting; hand the rest to a writer thread."""
        if self._writer:
            return  # it writes in order; we only queue
        try:
            while self._out:
                n = self.sock.sendmsg(self._pieces(), (), _NOWAIT)
                self._written(n)
        except (BlockingIOError, InterruptedError):
            self._writer = True
            threading.Thread(target=self._write, name="nbremote-unix-writer", daemon=True).start()
            return
        except OSError as exc:
            self._give_up(exc)
            return
        self._after_written()

    def _send_alone(self, data: bytes) -> None:
        """Under the lock, with nothing queued: write ``data``; what the socket does not take now is queued."""
        try:
            n = self.sock.send(data, _NOWAIT)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as exc:
            self._give_up(exc)
            return
        if n < len(data):
            self._out.append(memoryview(data)[n:])
            self.queued += len(data) - n
            self._write_locked()

    def _pieces(self) -> list[Any]:
        return list(itertools.islice(self._out, _IOV_MAX))

    def _written(self, n: int) -> None:
        """Under the lock: ``n`` bytes from the front of ``_out`` left."""
        self.queued -= n
        out = self._out
        while out and (n or not len(out[0])):  # (empty frames go with the bytes before them)
            size = len(out[0])  # (views are of bytes: their length is their size)
            if n >= size:
                n -= size
                out.popleft()
            else:
                out[0] = memoryview(out[0])[n:]
                n = 0

    def _after_written(self) -> None:
        """Under the lock, with ``_out`` empty: room for whoever waits, and the sending half shut if asked."""
        self._room.notify_all()
        if self._finishing:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)

    def _write(self) -> None:
        """The writer thread: write ``_out`` as the peer reads (blocking), then leave."""
        while True:
            with self._lock:
                if not self._out or self.broken:
                    self._writer = False
                    if not self.broken:
                        self._after_written()
                    return
                pieces = self._pieces()  # only this thread takes from the front meanwhile; senders append
            try:
                n = self.sock.sendmsg(pieces)
            except InterruptedError:
                continue
            except OSError as exc:
                with self._lock:
                    self._writer = False
                    self._give_up(exc)
                return
            with self._lock:
                self._written(n)
                if self.queued <= LOW_WATER:
                    self._room.notify_all()

    def _ack(self) -> None:
        """Under the lock: a message of its own that acknowledges what we read (we send nothing else now)."""
        if self.broken:
            return
        self._out.append(_HEAD.pack(0, 0, self._acked_now()))
        self.queued += _HEAD.size
        self._write_locked()

    def leftovers(self) -> list[list[Any]] | None:
        """Once the connection is given up: the messages the peer may not have read whole, in order -- to send
        by another way, exactly once (None before it is given up, and after the first call)."""
        with self._lock:
            if not self.broken or self._kept_taken:
                return None
            self._kept_taken = True
            kept, self._kept = self._kept, collections.deque()
            return [list(message) for _, message in list(kept)]  # (one step: the reader may pop acked ones)

    # -- receiving ---------------------------------------------------------------------------------------
    def take(self) -> list[memoryview] | None:
        """The next message's frames (views over one buffer of its own) once it has come whole; ``[]`` while it
        has not (nothing waits for the rest); None once the connection is given up (it ended, or carried
        something malformed: ``failure`` says what; the socket is shut, and its reader ``close``s it)."""
        try:
            frames = self._read()
            while frames == []:  # an ack of the peer's: read on
                frames = self._read()
        except BlockingIOError:
            return []
        except (OSError, ValueError) as exc:
            with self._lock:
                self._give_up(exc)
            return None
        if frames is None:
            with self._lock:
                self._give_up()
        return frames

    def _read(self) -> list[memoryview] | None:
        """Read on from where the last call stopped: a whole message, ``[]`` for an ack, None at the end.
        Raises ``BlockingIOError`` when nothing more has come (what came is kept for the next call)."""
        if self._body is None:
            view = memoryview(self._head)
            while self._filled < _HEAD.size:
                n = self.sock.recv_into(view[self._filled :], _HEAD.size - self._filled, _NOWAIT)
                if n == 0:
                    if self._filled:
                        raise ConnectionError("the connection closed in the middle of a message")
                    return None
                self._filled += n
            count, total, acked = _HEAD.unpack(self._head)
            self._filled = 0
            self._acknowledged(acked)
            if count == 0 and total == 0:
                return []  # an ack of its own
            if count > MAX_FRAMES or total > self.limit or total < 8 * count:
                raise ValueError(f"malformed message head ({count} frames, {total} bytes)")
            self._body = memoryview(bytearray(total))
        body = self._body
        while self._filled < body.nbytes:
            n = self.sock.recv_into(body[self._filled :], body.nbytes - self._filled, _NOWAIT)
            if n == 0:
                raise ConnectionError("the connection closed in the middle of a message")
            self._filled += n
        self._body, self._filled = None, 0
        count = _HEAD.unpack(self._head)[0]
        sizes = struct.unpack_from(f"<{count}Q", body)
        if sum(sizes) != body.nbytes - 8 * count:
            raise ValueError("malformed message: its frame lengths do not add up")
        frames, at = [], 8 * count
        for size in sizes:
            frames.append(body[at : at + size])
            at += size
        self.got += 1  # (only the reader writes it: a sender reads it under the lock, as an ack never too high)
        self._owed_bytes += body.nbytes
        if self.got - self._acked >= ACK_EVERY or self._owed_bytes >= ACK_BYTES:
            with self._lock:
                self._ack()
        return frames

    def _acknowledged(self, acked: int) -> None:
        """The peer read our messages up to number ``acked``: they need not be kept."""
        kept = self._kept  # (senders append under the lock; deque's popleft and append are atomic)
        with contextlib.suppress(IndexError):  # (``leftovers`` took it meanwhile)
            while kept and kept[0][0] <= acked:
                kept.popleft()

    def receive_within(self, timeout: float) -> list[memoryview] | None:
        """The next whole message, waiting at most ``timeout`` for it (an introduction and its answer); None
        if it ends, fails or does not come in time."""
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            if poller.poll(left * 1000 + 1):
                frames = self.take()
                if frames is None or frames:
                    return frames
        return None

    def hello(self, codec: Codec, env: Envelope, timeout: float) -> bool:
        """Send a signed introduction and wait (at most ``timeout``) for the kernel's signed ``pong``."""
        try:
            self.send(codec.encode_items([(env, ())]))
            frames = self.receive_within(timeout)
            if not frames:
                return False
            _, content, buffers = codec.decode(frames)
            return any(e["k"] == "pong" for e, _ in codec.unpack_items(content, buffers, digests=False))
        except Exception:  # no answer, or one we cannot read: no such channel
            return False

    # -- ending ------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Send nothing more: the peer reads what was sent and queued, then sees the connection end (a goodbye
        that follows by another way, the comm's close, is then not served before what this connection still
        carries)."""
        with self._lock:
            self._finishing = True
            if not self._out and not self._writer:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_WR)

    def _give_up(self, exc: BaseException | None = None) -> None:
        """Under the lock: the connection is over (``exc``: why, where something failed)."""
        if exc is not None and self.failure is None:
            self.failure = f"{type(exc).__name__}: {exc}"
        self.broken = True
        self._out.clear()
        self.queued = 0
        self._room.notify_all()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def shut(self) -> None:
        """Give the connection up, from any thread: both ends see it closed, and its reader lets it go
        (``close``) -- the descriptor stays valid until then, so no thread ever polls a reused one."""
        with self._lock:
            self._give_up()

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
    sock.settimeout(timeout)  # (UnixChannel makes it blocking again)
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
