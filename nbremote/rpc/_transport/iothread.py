"""The process's one IO thread: it owns the sockets of every handshaken link.

zmq sockets are not thread-safe, so once a link's handshake is over its receiving sockets belong to this
thread, which polls them all (with a wake-up pipe) and hands what arrives to the link (``readable``), and
the link hands envelopes to the agent. It also sends what ``rpc_async`` queued (coalescing what is queued
for one link into one message), pings heartbeats, asks each link whether its kernel lives
(``heartbeat``), and ticks the agent's timers every 50 ms. It receives zero-copy (buffers are
memoryviews over the zmq frames). A blocking call does without it: it sends from its own thread and
receives its reply on a socket of its own (``threadsockets``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from nbremote.rpc._transport.base import Connection, OnLost, OnMessage
from nbremote.rpc._transport.unixlink import reader_thread
from nbremote.rpc._wire.envelope import Buffer, Envelope

__all__ = ["IOThread"]

log = logging.getLogger("nbremote")


class IOThread:
    """Owns every handshaken link's sockets; all sends and receives of the process happen here."""

    def __init__(self, name: str, tick: Callable[[float], None]) -> None:
        self._tick = tick
        self._queue: deque[tuple[str, Any]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._links: dict[zmq.Socket[Any], Connection] = {}  # the sockets links have, polled here
        self._all: set[Connection] = set()
        self._stopping = False
        self._poller: zmq.Poller | None = None
        self._thread = threading.Thread(target=self._run, name=f"nbremote-io-{name}", daemon=True)

    def start(self) -> None:
        """Start the thread (once its owner is ready to be ticked)."""
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
        """``link.send``: queue an envelope for ``link`` and see that it leaves (see Queued.send)."""
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
        reader_thread()  # it reads every link's Unix-domain connection: it never waits for room on one
        poller = self._poller = zmq.Poller()
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
                for sock in arg.sockets():  # none for a link that receives by itself (a ServerLink)
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
        for sock in [sock for sock, owner in self._links.items() if owner is link]:  # all it had registered
            del self._links[sock]
            poller.unregister(sock)
        link.close()

    def _readable(self, sock: zmq.Socket[Any]) -> None:
        link = self._links.get(sock)
        if link is None:
            return
        why = link.readable(sock, time.monotonic())
        if why is not None:
            self._lose(link, why)
        elif type(sock) is int and sock not in link.sockets() and self._poller is not None:
            # a descriptor the link gave up (a Unix-domain connection that closed): poll it no more; the link
            # closes it when it closes, so the number is not reused under the poller meanwhile
            self._links.pop(sock, None)
            self._poller.unregister(sock)

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
