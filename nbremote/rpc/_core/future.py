"""``Future``: the result of an asynchronous call, shaped like ``torch.futures.Future``.

Errors are sticky: every ``wait()``/``value()`` of a failed future raises the same exception.
Callbacks (``then``, ``add_done_callback``) run on a small callback thread, never on the driver's IO
thread, so a callback may itself make blocking RPCs. While a thread waits, a KeyboardInterrupt
(the notebook's stop button) calls the future's ``on_interrupt`` hook, which cancels the remote call.

A blocking call may give its future a *pump*: the calling thread then receives its own reply (on a
socket of its own, see ``_transport``) instead of sleeping until the IO thread delivers it, which saves
a thread hop per call. Only that thread pumps; anyone else waits as usual.

A future made by a call carries a ``label`` (worker, function). Presentation layers that want to show
long waits (the notebook's inline status) register one *wait hook* with :func:`set_wait_hook`: it is
called when a thread starts blocking on a pending future and returns what to call when the wait
ends. The RPC layer itself shows nothing and imports no notebook code; a done future never calls it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
S = TypeVar("S")

_NOT_SET: Any = object()
_callbacks = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="nbremote-callback")

#: called with a pending future when a thread starts waiting on it; returns the "wait ended" callback
WaitHook = Callable[["Future[Any]"], Callable[[], None] | None]
_wait_hook: list[WaitHook] = []  # zero or one element: a list keeps the binding itself constant


def set_wait_hook(hook: WaitHook | None) -> WaitHook | None:
    """Install ``hook`` (``None`` removes it) and return the one it replaces."""
    previous = _wait_hook[0] if _wait_hook else None
    _wait_hook[:] = [] if hook is None else [hook]
    return previous


def _begin_wait(fut: Future[Any]) -> Callable[[], None] | None:
    if not _wait_hook:
        return None
    try:
        return _wait_hook[0](fut)
    except Exception:  # a display problem must never break a call
        return None


class Future(Generic[T]):
    """A value that will arrive; made by ``rpc_async`` (and by ``then``)."""

    def __init__(self, *, on_interrupt: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        # Made by the first thread that sleeps on this future: a blocking call's own thread receives its
        # reply (the pump) and most futures are never waited on by anyone else.
        self._cond: threading.Condition | None = None
        self._result: T = _NOT_SET
        self._error: BaseException | None = None
        self._done = False
        self._callbacks: list[Callable[[Future[T]], None]] = []
        self.on_interrupt = on_interrupt
        self.label: tuple[str, str] | None = None  # (worker, function) of the call that made it
        self._pump: Callable[[float], None] | None = None
        self._pump_thread: int | None = None
        self._hooks: list[Callable[[Future[T]], None]] = []  # run by the completing thread (see wait_all)

    def set_pump(self, pump: Callable[[float], None]) -> None:
        """``pump(seconds)`` receives what arrived for this future, waiting at most that long; it is
        called by this thread (the one that made the call) while it waits."""
        self._pump, self._pump_thread = pump, threading.get_ident()

    # -- reading --------------------------------------------------------------------------------
    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> T:
        """Block until the value arrives and return it; raise the call's error if it failed."""
        if not self._done:
            ended = _begin_wait(self)
            try:
                if self._pump is not None and self._pump_thread == threading.get_ident():
                    self._pump_until_done(self._pump, timeout)
                else:
                    with self._lock:
                        if self._cond is None:
                            self._cond = threading.Condition(self._lock)
                        if not self._cond.wait_for(lambda: self._done, timeout):
                            raise TimeoutError(f"Future not done after {timeout} s")
            except KeyboardInterrupt as exc:
                if self.on_interrupt is not None:
                    self.on_interrupt()
                    if self.label is not None:
                        worker, fn = self.label
                        exc.add_note(f"nbremote cancelled {fn} on {worker!r}: it stops there at its next Python "
                                     "bytecode; if it is blocked in C code it runs on until that call returns -- "
                                     f"rpc.restart_worker({worker!r}) stops it for good")
                raise
            finally:
                if ended is not None:
                    with contextlib.suppress(Exception):
                        ended()
        if self._error is not None:
            raise self._error
        return self._result

    def _pump_until_done(self, pump: Callable[[float], None], timeout: float | None) -> None:
        # Slices: a reply that never comes (a lost worker, a timeout) completes the future from the IO
        # thread, which the next slice sees.
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"Future not done after {timeout} s")
            pump(left)

    def value(self) -> T:
        """The value of a completed future (raises its error); torch's ``Future.value``."""
        if not self._done:
            raise RuntimeError("Future.value() called before the future completed; use wait()")
        return self.wait()

    def exception(self) -> BaseException | None:
        return self._error

    # -- completing -----------------------------------------------------------------------------
    def set_result(self, result: T) -> None:
        self._complete(result, None)

    def set_exception(self, error: BaseException) -> None:
        self._complete(_NOT_SET, error)

    def _complete(self, result: T, error: BaseException | None) -> bool:
        with self._lock:
            if self._done:
                return False
            self._result, self._error, self._done = result, error, True
            callbacks, self._callbacks = self._callbacks, []
            # Nothing to interrupt or pump any more; and a call's interrupt hook refers back to this future
            # (through its pending entry): without this, the value would live until the cyclic GC runs --
            # a buffer lent by shared memory among it.
            self.on_interrupt = None
            self._pump = None
            hooks, self._hooks = self._hooks, []
            if self._cond is not None:
                self._cond.notify_all()
        for hook in hooks:
            hook(self)
        for cb in callbacks:
            _callbacks.submit(cb, self)
        return True

    def _on_complete(self, hook: Callable[[Future[T]], None]) -> None:
        """Run ``hook(self)`` when the future completes, on the thread that completes it (at once if it
        has). Internal: a hook must be trivial and never block -- the completing thread is often the IO
        thread. User callbacks go through ``add_done_callback``."""
        with self._lock:
            if not self._done:
                self._hooks.append(hook)
                return
        hook(self)

    # -- chaining -------------------------------------------------------------------------------
    def add_done_callback(self, callback: Callable[[Future[T]], None]) -> None:
        """Run ``callback(self)`` once the future completes (at once, on a callback thread, if it has)."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        _callbacks.submit(callback, self)

    def then(self, callback: Callable[[Future[T]], S]) -> Future[S]:
        """A new future holding ``callback(self)``'s return value (or the exception it raised)."""
        chained: Future[S] = Future(on_interrupt=self.on_interrupt)
        chained.label = self.label

        def run(fut: Future[T]) -> None:
            try:
                chained.set_result(callback(fut))
            except BaseException as exc:  # the callback's error belongs to the chained future
                chained.set_exception(exc)

        self.add_done_callback(run)
        return chained

    def __repr__(self) -> str:
        state = "pending" if not self._done else ("error" if self._error is not None else "done")
        return f"<nbremote Future {state}>"


def wait_all(futures: Sequence[Future[Any]]) -> list[Any]:
    """The values of all ``futures``, in order; the first error raised as soon as one fails.

    As ``torch.futures.wait_all``. No thread hop: the futures wake this thread directly, and a single
    future is simply waited on (so a blocking call's own reply is received by this thread).
    """
    futures = list(futures)
    if len(futures) < 2:
        return [fut.wait() for fut in futures]
    _wait_until(futures, lambda fut: fut.exception() is not None)
    for fut in futures:
        error = fut.exception()
        if error is not None:
            raise error
    return [fut.wait() for fut in futures]


def settle_all(futures: Sequence[Future[Any]], *, unless: tuple[type[BaseException], ...] = ()) -> list[BaseException]:
    """Wait until every future has finished, failed or not; their errors, in order (none: all succeeded).

    ``wait_all`` raises at the first error while the others may still run; a caller that must not go on
    while any of them runs (an optimizer step across owners, as torch's ``_wait_for_all``) settles them
    all first. An error of a type in ``unless`` ends the wait at once and comes first (a lost worker: no
    point waiting for the rest to report it). The notebook's stop button cancels what still runs.
    """
    futures = list(futures)
    fatal = _wait_until(futures, lambda fut: isinstance(fut.exception(), unless))
    errors = [] if fatal is None else [fatal]
    for fut in futures:
        error = fut.exception() if fut.done() else None
        if error is not None and error is not fatal:
            errors.append(error)
    return errors


def _wait_until(futures: list[Future[Any]], stop: Callable[[Future[Any]], bool]) -> BaseException | None:
    """Wait until every future is done, or one is done for which ``stop`` is true: then its error, if any.

    The notebook's stop button (KeyboardInterrupt) cancels what is still running remotely.
    """
    ready = threading.Event()
    left = [len(futures)]
    lock = threading.Lock()
    stopped: list[Future[Any]] = []

    def finished(fut: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            if stop(fut):
                stopped.append(fut)
            if left[0] == 0 or stopped:
                ready.set()

    for fut in futures:
        fut._on_complete(finished)
    me = threading.get_ident()
    try:
        for fut in futures:  # a blocking call's reply comes to this thread's own socket only: receive it here
            pump = fut._pump if fut._pump_thread == me else None
            while pump is not None and not fut.done() and not ready.is_set():
                pump(0.05)  # slices: another future's failure (``stop``) ends the wait meanwhile
        if futures:
            ready.wait()
    except KeyboardInterrupt:
        for fut in futures:
            if not fut.done() and fut.on_interrupt is not None:
                fut.on_interrupt()
        raise
    return stopped[0].exception() if stopped else None
