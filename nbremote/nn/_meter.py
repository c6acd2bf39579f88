"""How often a ``RemoteModule`` handle forwarded, and how long its last forward took (``forward_stats``)."""

from __future__ import annotations

import threading
from typing import NamedTuple

__all__ = ["ForwardMeter", "ForwardStats"]


class ForwardStats(NamedTuple):
    """This handle's forwards: how many were made, and how long the last one took (seconds)."""

    calls: int
    last_latency: float | None


class ForwardMeter:
    """Counts a handle's forwards and times them (thread-safe: async forwards finish on other threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.last_latency: float | None = None

    def started(self) -> None:
        with self._lock:
            self.calls += 1

    def finished(self, seconds: float) -> None:
        with self._lock:
            self.last_latency = seconds

    def __reduce__(self) -> tuple[type[ForwardMeter], tuple[()]]:
        """A handle's ``__dict__`` may be sent by RPC (torch's tests do): a copy starts counting afresh."""
        return (ForwardMeter, ())

    def snapshot(self) -> ForwardStats:
        with self._lock:
            return ForwardStats(self.calls, self.last_latency)
