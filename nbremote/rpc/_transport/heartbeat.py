"""A kernel's heartbeat channel, pinged and timed: how a link learns that the kernel is gone.

ipykernel answers its heartbeat socket from a thread of libzmq's (an echo device, no Python), so the
answer comes even while the kernel runs GIL-holding code; silence means the process died, the machine
hung, or the way to it is cut. ``KernelLink`` pings every kernel it reaches; ``ServerLink`` pings a
server-hosted kernel whose ports it reaches (its direct data channel's kernel), which its server's
websocket would report only after ``SILENCE_LIMIT`` seconds, or never where the cut is between driver
and server. Used from the IO thread only.
"""

from __future__ import annotations

from typing import Any

import zmq

from nbremote.rpc._transport.sockets import connect, ctx

__all__ = ["HEARTBEAT_INTERVAL", "HEARTBEAT_TIMEOUT", "HEARTBEAT_TIMEOUT_POLLED", "Heartbeat"]

HEARTBEAT_INTERVAL = 0.5  # s between pings
HEARTBEAT_TIMEOUT = 1.5  # s without an answer: the kernel is gone (pending calls fail within ~2 s)
# For kernels whose process we can poll, death is seen at once; the heartbeat then only catches a
# hung machine, and a generous limit keeps a briefly overloaded host from losing a healthy worker.
HEARTBEAT_TIMEOUT_POLLED = 10.0


class Heartbeat:
    """A REQ socket on a kernel's ``hb_port`` (CurveZMQ where its connection info has keys)."""

    def __init__(self, conn: dict[str, Any]) -> None:
        self.sock: zmq.Socket[Any] = ctx().socket(zmq.REQ)
        self.sock.linger = 0
        connect(self.sock, conn, "hb_port")
        self._sent: float | None = None  # when the unanswered ping left
        self._next = 0.0  # when to send the next one

    def check(self, now: float, limit: float) -> str | None:
        """Ping when due; why the kernel is gone if the last ping is unanswered after ``limit`` s, else None."""
        if self._sent is not None:
            if now - self._sent > limit:
                if self.sock.poll(0):  # it answered while the IO thread was busy (a big message): no silence
                    self.answered(now)
                    return None
                return (f"its heartbeat stopped answering for {limit:.1f} s (the kernel died, was restarted, is "
                        "paused or is unreachable; what it held is gone)")
        elif now >= self._next:
            self.sock.send(b"ping", zmq.NOBLOCK)
            self._sent = now
        return None

    def answered(self, now: float) -> None:
        """The socket is readable (the IO thread): take the echo."""
        self.sock.recv()
        self._sent = None
        self._next = now + HEARTBEAT_INTERVAL
