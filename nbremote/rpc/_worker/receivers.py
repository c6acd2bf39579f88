"""The shell path's receiving threads: executor threads that take nbremote's messages off the shell socket.

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

Callers on this machine may also send by Unix-domain connections of their own (``_transport.unixlink``):
those are the receiving threads' too. Every receiving thread waits for their descriptors beside the
socket's (exclusively where waits are: one thread wakes per message); they also sit in one level-triggered
epoll, ``_hub``, that says which have input: a thread that takes a message looks at the socket first, then
at the hub, and reads one whole message from a connection that has input. A connection that closes or
fails is let go here; its link sends by the shell socket again. Should receiving go back to the loop,
every connection is closed, so that its caller does the same.
"""


from __future__ import annotations

import contextlib
import functools
import os
import select
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from nbremote.rpc._transport.sockets import recv_frames
from nbremote.rpc._transport.unixlink import UnixChannel, reader_thread

__all__ = ["RECEIVE_POLL_MS", "SPARE_RECEIVERS", "Receivers"]

_POLLIN = int(zmq.POLLIN)  # an int: pyzmq's enums cost a conversion per use
_poll = zmq.zmq_poll  # whether input waits, at timeout 0 (see shellpath: it reads EVENTS, as get(EVENTS) does)
_NOBLOCK = int(zmq.NOBLOCK)
RECEIVE_POLL_MS = 100  # a receiving thread looks at the socket at least this often (a safety net)
_CLOSED: Any = object()  # what _take says once the socket is closed
SPARE_RECEIVERS = 2  # receiving threads kept waiting where waits are exclusive (see start_receiving)


def _log(text: str) -> None:
    print(f"nbremote: {text}", file=sys.__stderr__, flush=True)  # the worker's log file


class Path(Protocol):
    """What the receiving threads use of the shell path whose socket they receive from (``shellpath.ShellPath``)."""

    lock: threading.RLock  # one user of the shell socket at a time
    stream: Any  # the kernel's shell ZMQStream (its socket, stop/on_recv)
    loop: Any  # the shell-channel thread's IO loop
    agent: Any  # the agent (its server claims and queues calls)
    shared: bool  # the socket is shared under ``lock`` (see ShellPath.share_socket)
    handle_events: Callable[[Any, int], Any] | None  # the stream's handler, under the lock

    def ours(self, frames: list[Any]) -> int | None:
        """Where the delimiter of an ``nbremote_request`` is; None for any other message."""

    def handle(self, frames: list[Any], at: int, via: Any = None) -> None:
        """Check one ``nbremote_request`` and hand what it carries to the agent (``via``: the link whose
        Unix-domain connection it came by)."""

    def forward(self, frames: list[Any]) -> Any:
        """ipykernel's own routing of a message that is not ours (on the loop thread)."""

    def on_recv(self, frames: list[Any]) -> Any:
        """The stream's receive callback, for when the loop receives again."""


class Receivers:
    """The receiving threads of one kernel's shell path, and how many of them do what (see the docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = path.lock  # the path's: one user of the shell socket at a time
        self.stream = path.stream
        self.loop = path.loop
        self._order = threading.Lock()  # one receiving thread at a time takes a message and serves it
        self.receiving = False  # an executor thread receives, not the loop (see start_receiving)
        self._wake_r, self._wake_w = os.pipe()  # wakes a receiving thread (see wake)
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._fd = -1  # the socket's FD, for the receiving threads' waits
        self.exclusive = False  # receiving threads wait side by side, each event waking one (start_receiving)
        self._spare = 1  # receiving threads kept waiting
        self._free = 0  # threads receiving (not running a call); counted under the lock
        self._receivers = 0  # threads receiving or running a call they received (at most _spare)
        self._failed = False  # a receiving thread failed: receiving goes back to the loop
        # Same-host callers' Unix-domain connections, by descriptor, with the link each is for (see the docstring)
        self._hub = select.epoll() if hasattr(select, "epoll") else None
        self._channels: dict[int, tuple[UnixChannel, Any]] = {}

    def can_read_channels(self) -> bool:
        """Whether Unix-domain connections can be read here (receiving threads, and ``epoll``)."""
        return self._hub is not None and self.receiving

    def add_channel(self, channel: UnixChannel, link: Any) -> None:
        """From now on the receiving threads read ``channel``, whose messages are ``link``'s."""
        hub = self._hub
        if hub is None or not self.receiving:
            channel.close()
            return
        self._channels[channel.fd] = (channel, link)
        hub.register(channel.fd, select.EPOLLIN)
        self.wake()

    def reads(self, channel: UnixChannel) -> bool:
        """Whether the receiving threads still read ``channel`` (it has not ended)."""
        entry = self._channels.get(channel.fd)
        return entry is not None and entry[0] is channel

    def _drop_channel(self, fd: int) -> None:
        """Under ``_order``: let a connection go (closed by its peer, failed, or shut by its link)."""
        entry = self._channels.pop(fd, None)
        with contextlib.suppress(OSError, ValueError):
            if self._hub is not None:
                self._hub.unregister(fd)
        if entry is not None:
            entry[0].close()

    def start_receiving(self) -> None:
        """On the loop thread: executor threads receive from now on (see the module docstring)."""
        socket = self.stream.socket
        if not self.path.shared or self.receiving or socket is None:
            return
        self._fd = socket.FD
        self.exclusive = _exclusive_wait_works(self._wake_r)
        self._spare = SPARE_RECEIVERS if self.exclusive else 1
        self.stream.stop_on_recv()  # the stream only sends now; its sends are scheduled, not polled for
        self.loop.remove_handler(socket)
        self.receiving = True
        self._free = self._receivers = 1
        if not self.path.agent.server.relay(self._receive):
            self.receiving = False
            self._resume_loop()

    def _receive(self) -> None:
        """One receiving thread: receive until a call arrives, run it here while others receive, then receive
        again while fewer than ``_spare`` threads do, else go back to the executor."""
        try:
            wait, close = self._waiter()
        except BaseException as exc:  # (a bug: it once failed every receiving thread, and nothing received)
            _log(f"a receiving thread could not wait ({type(exc).__name__}: {exc}); the shell-channel thread receives")
            with self._lock:
                self.receiving = False
                self._failed = True
            self._leave()
            return
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
        """This thread's wait for the socket's FD, the wake-up pipe and the Unix-domain connections: ``(wait,
        close)``; ``wait`` returns the ready ``(fd, events)``. Exclusive waits (``EPOLLEXCLUSIVE``) wake one waiting
        thread per event, however many wait. Connections come and go: each wait first registers the new ones
        (``add_channel`` wakes the threads for that); a closed one leaves the wait by itself."""
        flags = select.POLLIN
        if self.exclusive:
            waiter: Any = select.epoll()
            flags = select.EPOLLIN | select.EPOLLEXCLUSIVE
            timeout: float = RECEIVE_POLL_MS / 1000
        else:
            waiter = select.poll()
            timeout = RECEIVE_POLL_MS
        for fd in (self._fd, self._wake_r):
            waiter.register(fd, flags)
        known: dict[int, UnixChannel] = {}

        def wait() -> list[tuple[int, int]]:
            if len(known) != len(self._channels) or self._channels.keys() != known.keys():
                for fd, (channel, _) in list(self._channels.items()):
                    if known.get(fd) is not channel:
                        with contextlib.suppress(OSError, ValueError, KeyError):
                            waiter.unregister(fd)  # (a closed connection's left by itself; its number may be reused)
                        with contextlib.suppress(OSError, ValueError):
                            waiter.register(fd, flags)
                            known[fd] = channel
                for fd in [fd for fd in known if fd not in self._channels]:
                    del known[fd]
                    with contextlib.suppress(OSError, ValueError, KeyError):
                        waiter.unregister(fd)
            return waiter.poll(timeout)

        return wait, (waiter.close if self.exclusive else lambda: None)

    def _receive_until_call(self, wait: Callable[[], list[tuple[int, int]]]) -> Callable[[], None] | None:
        """Receive; return the first call that arrives once receiving goes on without this thread.

        One thread at a time receives a message and serves what it carries (``_order``): cells reach ipykernel
        and envelopes the agent in the order they came, however many threads receive.
        """
        reader_thread()  # while it receives, what it serves never waits for room on a connection (unixlink)
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
                if run is not None and not self.path.agent.server.queue(run):
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
        finally:
            reader_thread(False)  # it runs a call now, or goes back to the executor: as any executor thread

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
        return self._take_channel() if self._channels else None

    def _take_channel(self) -> Any:
        """Under ``_order``: ``(link, frames)`` of one whole message from a Unix-domain connection with input,
        else None (a connection found closed or failing is let go)."""
        assert self._hub is not None
        for fd, _ in self._hub.poll(0, 1):
            entry = self._channels.get(fd)
            if entry is None:
                self._drop_channel(fd)
                return None
            channel, link = entry
            frames = channel.take()
            if frames is None:
                self._drop_channel(fd)
                link.fall_back(channel)  # what it still owes the caller goes by the shell socket
                return None
            return (link, frames) if frames else None
        return None

    def _serve(self, frames: list[Any]) -> Callable[[], None] | None:
        """Route one message: another's to ipykernel on the loop thread, ours to the agent; the first call it
        carries is returned for this thread to run -- unless every receiving thread is busy with a call and
        no other may start (then all go to the executor, in order; see ``_hand_on``)."""
        via = None
        if type(frames) is tuple:  # from a Unix-domain connection: nothing but ours comes that way
            via, frames = frames
            at = 0
        else:
            at = self.path.ours(frames)
        if at is None:
            self.loop.add_callback(self.path.forward, frames)
            return None
        try:
            # Read without the lock: meanwhile other threads can only raise _free or lower _receivers (but for a
            # closing one), so a thread told to claim a call can almost always run it (else it queues it).
            if self._all_busy():
                self.path.handle(frames, at, via)
                return None
            return self.path.agent.server.take_one(functools.partial(self.path.handle, frames, at, via))
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
                self.pass_edge()
                return True
            self._receivers += 1  # counted before it starts, so that no other thread starts one too
        if self.path.agent.server.relay(self._receive):  # it receives in this thread's stead (``_free`` stays)
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

    def pass_edge(self) -> None:
        """Under the lock, after someone read the socket's ``EVENTS``: wake a receiving thread if input waits."""
        socket = self.stream.socket
        try:  # not contextlib.suppress: this runs before every call a receiving thread takes on
            if socket is not None and not socket.closed and _poll([(socket, _POLLIN)], 0):
                self.wake()
                return
        except zmq.ZMQError:
            pass
        if self._channels and self._hub is not None and self._hub.poll(0, 1):
            self.wake()  # a connection has input too: a waiting thread may not have been woken for it

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
            os.write(self._wake_w, b"!")

    def _resume_loop(self) -> None:
        """On the loop thread: the stream receives again, as before start_receiving."""
        self.receiving = False
        for channel, _ in list(self._channels.values()):
            channel.shut()  # nobody reads them now: their callers go back to the shell socket
        socket = self.stream.socket
        if socket is None or socket.closed or self.path.handle_events is None:
            return
        self.stream.on_recv(self.path.on_recv, copy=False)
        with contextlib.suppress(Exception):  # already registered
            self.loop.add_handler(socket, self.path.handle_events, self.loop.READ)
        self.path.handle_events(socket, 0)


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
