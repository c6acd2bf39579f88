"""The threads that run what callers send: a few at once, more only when queued work waits.

A ``ThreadPoolExecutor`` starts a thread for every submit that finds none idle, up to its maximum:
a burst of a thousand small calls (one batch of them arrives at once) got 128 threads contending for
the GIL, switching more than working. Here ``CORE`` threads take the queue in order; a new thread is
started only when queued calls wait and no call has finished for ``GROW_AFTER`` -- every thread is
busy with something long (a ``sleep``, a loop) -- up to ``MAX_THREADS``, so long calls do not starve
short ones for long. The owner's timer calls :meth:`Pool.check` (the IO thread's tick); threads above
``CORE`` leave after ``IDLE_EXIT`` seconds without work.

A thread that blocks on a future -- a handler waiting for a nested call (``rpc_sync`` inside a call),
for an RRef's value, or for a distributed backward pass it started -- is not working, and does not
count: the limits bound *running* threads. It tells the pool when it blocks and when it goes on (the
blocking hooks of ``_core.future``), and if calls are queued when it blocks, and fewer than ``CORE``
threads run, another thread starts at once. A fixed cap on all threads deadlocked: when each hop of a
distributed backward pass was a nested call, 60 concurrent passes against one rank had its 128 threads
all waiting on calls whose replies needed one of the 154 calls queued behind them; A->B->A nesting
deeper than the cap stalls the same way (backward hops are notifications now, which hold no thread
while they wait; nested ``rpc_sync`` in user code still does). Threads are bounded by the calls in
flight instead (each blocked one waits on one of them).

A call cancelled by an asynchronous exception (``PyThreadState_SetAsyncExc``, see ``_core.serving``) may
land just after its function returned: the loop swallows it there and takes the next call.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from nbremote.rpc._core.future import on_blocking

__all__ = ["Pool"]

log = logging.getLogger("nbremote")

CORE = 4
MAX_THREADS = 128
GROW_AFTER = 0.02  # s without a finished call, while calls wait, before one more thread is started
IDLE_EXIT = 30.0  # s a thread above CORE waits for work before it leaves
_IDLE: Any = object()  # what a wait for work that timed out yields


class Pool:
    """Runs ``submit``ted callables on its threads, in order of arrival (thread-safe).

    The queue is a ``queue.SimpleQueue``: putting and taking are C calls, and a thread waiting for work
    sleeps in C, so handing a call to a waiting thread costs its wake-up and little else (a
    ``Condition`` costs a lock allocation and several Python-level lock round trips on each side).
    """

    def __init__(self, name: str, core: int = CORE, max_threads: int = MAX_THREADS) -> None:
        self._name = name
        self._core = core
        self._max = max_threads
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._queued: deque[float] = deque()  # when each queued call was submitted, oldest first
        self._lock = threading.Lock()  # the counts below
        self._threads = 0
        self._idle = 0
        self._blocked = 0  # threads blocked on a future (see the module's docstring)
        self._ids = 0
        self._closed = False
        self._progress = time.monotonic()  # when a call last finished (or the queue was last empty)

    @property
    def threads(self) -> int:
        return self._threads

    @property
    def blocked(self) -> int:
        """Threads waiting on a future (a nested call, an RRef's value); a hint, read without the lock."""
        return self._blocked

    @property
    def queued(self) -> int:
        """Calls waiting for a thread (read without the lock: a hint)."""
        return len(self._queued)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"nbremote's pool of {self._name!r} is shut down")
            self._queued.append(time.monotonic())
            self._queue.put((fn, args))
            if len(self._queued) > self._idle and self._threads - self._blocked < self._core:  # more calls than
                self._start()  # waiting threads, and a place for one more running

    def relay(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn`` on another thread now: a waiting one, else a new one, past the core and the maximum if
        need be (the shell path's receiving moves between threads this way, and must never queue behind
        calls). False once shut down."""
        with self._lock:
            if self._closed:
                return False
            if self._idle > len(self._queued):  # a thread waits with nothing queued before this: it takes it
                self._queued.append(time.monotonic())
                self._queue.put((fn, args))
            else:
                self._start((fn, args))
            return True

    def check(self, now: float) -> None:
        """Start one more thread if the oldest queued call has waited too long (from a timer)."""
        with self._lock:
            if (len(self._queued) > self._idle and not self._closed and self._threads - self._blocked < self._max
                    and now - max(self._queued[0], self._progress) > GROW_AFTER):
                self._start()

    def _block(self) -> None:
        """This thread waits on a future: its place goes to queued work at once (see the docstring)."""
        with self._lock:
            self._blocked += 1
            if (len(self._queued) > self._idle and not self._closed
                    and self._threads - self._blocked < self._core):
                self._start()

    def _unblock(self) -> None:
        with self._lock:
            self._blocked -= 1

    def _start(self, first: tuple[Callable[..., Any], tuple[Any, ...]] | None = None) -> None:  # under the lock
        self._threads += 1
        self._ids += 1
        threading.Thread(target=self._run, args=(first,), name=f"nbremote-{self._name}_{self._ids}",
                         daemon=True).start()

    def _next(self) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
        """The next call, or None when this thread is to end (shut down, or idle above the core)."""
        while True:
            with self._lock:
                self._idle += 1
            try:
                work = self._queue.get(timeout=IDLE_EXIT)
            except queue.Empty:
                work = _IDLE
            with self._lock:
                self._idle -= 1
                if work is None or (work is _IDLE and self._threads > self._core):
                    self._threads -= 1
                    return None
                if work is not _IDLE:
                    # Until here this thread counted as waiting and its call as queued: submit compares the
                    # two, so they change together (shutdown may have cleared the queue meanwhile).
                    if self._queued:
                        self._queued.popleft()
                    self._progress = time.monotonic()
                    return work

    def _run(self, first: tuple[Callable[..., Any], tuple[Any, ...]] | None) -> None:
        on_blocking(self._block, self._unblock)
        while True:
            work, first = first, None
            try:
                if work is None:
                    work = self._next()
                if work is None:
                    return
                work[0](*work[1])
                self._progress = time.monotonic()
            except BaseException:  # a late cancellation, or a bug in the callable: the thread goes on
                log.debug("nbremote pool thread of %r caught an exception", self._name, exc_info=True)
            finally:
                work = None  # nothing of a finished call may linger on an idle thread

    def shutdown(self) -> None:
        """Drop queued work and let the threads end (running calls finish on their own)."""
        with self._lock:
            self._closed = True
            threads = self._threads
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._queued.clear()
        for _ in range(threads):
            self._queue.put(None)
