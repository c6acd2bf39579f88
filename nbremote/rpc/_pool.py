"""The threads that run what callers send: a few at once, more only when queued work waits.

A ``ThreadPoolExecutor`` starts a thread for every submit that finds none idle, up to its maximum:
a burst of a thousand small calls (one batch of them arrives at once) got 128 threads contending for
the GIL, switching more than working. Here ``CORE`` threads take the queue in order; a new thread is
started only when queued calls wait and no call has finished for ``GROW_AFTER`` -- every thread is
busy with something long or blocked (a ``sleep``, a nested call back to its caller) -- up to
``MAX_THREADS``, so
nested A->B->A calls still cannot deadlock, and long calls do not starve short ones for long. The
owner's timer calls :meth:`Pool.check` (the IO thread's tick); threads above ``CORE`` leave after
``IDLE_EXIT`` seconds without work.

A call cancelled by an asynchronous exception (``PyThreadState_SetAsyncExc``, see ``_serving``) may
land just after its function returned: the loop swallows it there and takes the next call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Pool"]

log = logging.getLogger("nbremote")

CORE = 4
MAX_THREADS = 128
GROW_AFTER = 0.02  # s without a finished call, while calls wait, before one more thread is started
IDLE_EXIT = 30.0  # s a thread above CORE waits for work before it leaves


class Pool:
    """Runs ``submit``ted callables on its threads, in order of arrival (thread-safe)."""

    def __init__(self, name: str, core: int = CORE, max_threads: int = MAX_THREADS) -> None:
        self._name = name
        self._core = core
        self._max = max_threads
        self._cond = threading.Condition()
        self._queue: deque[tuple[float, Callable[..., Any], tuple[Any, ...]]] = deque()
        self._threads = 0
        self._idle = 0
        self._ids = 0
        self._closed = False
        self._progress = time.monotonic()  # when a call last finished (or the queue was last empty)

    @property
    def threads(self) -> int:
        return self._threads

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"nbremote's pool of {self._name!r} is shut down")
            self._queue.append((time.monotonic(), fn, args))
            if self._idle:
                self._cond.notify()
            elif self._threads < self._core:
                self._start()

    def check(self, now: float) -> None:
        """Start one more thread if the oldest queued call has waited too long (from a timer)."""
        with self._cond:
            if (self._queue and not self._idle and self._threads < self._max
                    and now - max(self._queue[0][0], self._progress) > GROW_AFTER):
                self._start()

    def _start(self) -> None:  # the caller holds the lock
        self._threads += 1
        self._ids += 1
        threading.Thread(target=self._run, name=f"nbremote-{self._name}_{self._ids}", daemon=True).start()

    def _next(self) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
        with self._cond:
            self._progress = time.monotonic()  # this thread just finished a call (or starts)
            while not self._queue:
                if self._closed:
                    self._threads -= 1
                    return None
                self._idle += 1
                woken = self._cond.wait(IDLE_EXIT)
                self._idle -= 1
                if not woken and not self._queue and self._threads > self._core:
                    self._threads -= 1
                    return None
            _, fn, args = self._queue.popleft()
            return fn, args

    def _run(self) -> None:
        while True:
            work = None
            try:
                work = self._next()
                if work is None:
                    return
                work[0](*work[1])
            except BaseException:  # a late cancellation, or a bug in the callable: the thread goes on
                log.debug("nbremote pool thread of %r caught an exception", self._name, exc_info=True)
            finally:
                work = None  # nothing of a finished call may linger on an idle thread

    def shutdown(self) -> None:
        """Drop queued work and let the threads end (running calls finish on their own)."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
