"""Reused message memory: big messages are received (and masked to send) into buffers that come back once
nothing views them.

Fresh memory is slow to fill: every page faults on first touch. Putting a 64 MB message together from its
8 MiB pieces (``batching.Parts``) into a new ``bytearray`` took 88-104 ms here, 6.7 ms into memory used
before; the driver's websocket (``_transport.websocket``) paid ~50 ms per 64 MB for a fresh buffer per
message (issue 22), and it masked each message it sent into a fresh buffer too. So they take their memory
from :data:`POOL`.

The hard part is knowing when a buffer is free again: the buffers of a received message *are* the
tensors and arrays rebuilt over them (zero-copy), which the user may keep for as long as they like. So
:meth:`BufferPool.take` hands out a memoryview of a fresh numpy view (the *lease*) of the pooled memory:
every slice of that memoryview, and every array or tensor rebuilt over one, keeps the lease alive, and a
``weakref.finalize`` on the lease puts the memory back when the last of them is gone -- never before, so
nothing still in use is ever overwritten (as the shared-memory pool returns segments, ``_transport.shm``).

Bounded: free memory held is at most ``cap`` bytes (the oldest goes first), and memory unused for
``idle`` seconds is let go (:meth:`BufferPool.trim`, on the agent's tick): nothing is kept forever.
Messages under ``MIN_POOLED`` bytes take a plain ``bytearray``: small ones fault little.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque

import numpy as np

__all__ = ["MIN_POOLED", "POOL", "BufferPool"]

MIN_POOLED = 1 << 20  # below this a fresh bytearray costs less than the bookkeeping
POOL_CAP = 256 << 20  # free memory held at most (a 64 MB echo needs ~80 MB per process)
IDLE_SECONDS = 30.0  # free memory unused this long is let go
_GRAIN = 1 << 20  # capacities round up to this, so that sizes that differ a little share buffers


class BufferPool:
    """Writable memory for received messages, reused once nothing views it; thread-safe."""

    def __init__(self, cap: int = POOL_CAP, idle: float = IDLE_SECONDS) -> None:
        self.cap = cap
        self.idle = idle
        self._free: list[tuple[float, np.ndarray]] = []  # (when it came back, memory), oldest first
        self._bytes = 0  # what ``_free`` holds
        self._back: deque[np.ndarray] = deque()  # from finalizers (no lock there: see ``_collect``)
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._collect(time.monotonic())
            return self._bytes

    def take(self, size: int) -> memoryview:
        """``size`` bytes of writable memory (contents undefined), back in the pool once nothing views it."""
        if size < MIN_POOLED:
            return memoryview(bytearray(size))
        with self._lock:
            self._collect(time.monotonic())
            memory = self._pick(size)
        if memory is None:
            memory = np.empty(-(-size // _GRAIN) * _GRAIN, dtype=np.uint8)
        lease = memory[:size]  # a new array object: whatever views the memory keeps this one alive
        done = weakref.finalize(lease, self._back.append, memory)
        done.atexit = False
        return lease.data

    def _pick(self, size: int) -> np.ndarray | None:
        """The smallest free memory that fits ``size`` without wasting over a quarter (the caller locks)."""
        fits = [i for i, (_, memory) in enumerate(self._free) if size <= memory.size <= size + size // 4 + _GRAIN]
        if not fits:
            return None
        _, memory = self._free.pop(min(fits, key=lambda i: self._free[i][1].size))
        self._bytes -= memory.size
        return memory

    def _collect(self, now: float) -> None:
        """Take back what finalizers returned, within ``cap`` and ``idle`` (the caller holds ``_lock``).

        A finalizer may run in any thread, even one holding ``_lock`` (a collection mid-``take``), so
        it only appends to ``_back``; this moves those into ``_free``."""
        while self._back:
            memory = self._back.popleft()
            self._free.append((now, memory))
            self._bytes += memory.size
        while self._free and (self._bytes > self.cap or now - self._free[0][0] > self.idle):
            _, memory = self._free.pop(0)
            self._bytes -= memory.size

    def trim(self) -> None:
        """Let go of memory unused for ``idle`` seconds (called on a timer: nothing is kept forever)."""
        with self._lock:
            self._collect(time.monotonic())


POOL = BufferPool()  # one per process: the reassembly of pieces and the driver's websocket share it
