"""``Future``: the result of an asynchronous call, shaped like ``torch.futures.Future``.

Errors are sticky: every ``wait()``/``value()`` of a failed future raises the same exception.
Callbacks (``then``, ``add_done_callback``) run on a small callback thread, never on the driver's IO
thread, so a callback may itself make blocking RPCs. While a thread waits, a KeyboardInterrupt
(the notebook's stop button) calls the future's ``on_interrupt`` hook, which cancels the remote call.

A blocking call may give its future a *pump*: the calling thread then receives its own reply (on a
socket of its own, see ``_transport``) instead of sleeping until the IO thread delivers it, which saves
a thread hop per call. Only that thread pumps; anyone else waits as usual.

A thread that serves calls (a ``_core.pool`` thread) may register *blocking hooks* with
:func:`on_blocking`: every wait on a pending future here (``wait``, ``wait_all``, ``settle_all``) runs
between them, so that the pool knows the thread is blocked -- a handler waiting on a nested call is not
working, and must not hold a place that the call it waits for may need (see ``_core.pool``).

Work that must follow a future at once but may be heavy (the reply of an ``@async_execution`` call: pickling
its value, sending it) registers with :meth:`Future._run_when_done`: it runs on the thread that completes the
future when that is user code (``set_result``, ``set_exception``, a ``then`` callback's result) -- as torch runs
a future's callbacks inline, and without the hop to the callback thread, which cost ~0.3-0.6 ms per call
here -- and goes to the callback thread, as before, when nbremote completes it on a thread of its own (the IO
thread delivering a reply, a timeout), which must never pickle or send a user's value.

A future made by a call carries a ``label`` (worker, function). Presentation layers that want to show
long waits (the notebook's inline status) register one *wait hook* with :func:`set_wait_hook`: it is
called when a thread starts blocking on a pending future and returns what to call when the wait
ends. The RPC layer itself shows nothing and imports no notebook code; a done future never calls it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from nbremote.errors import also_runtime_error
from nbremote.frameworks import future_mirror, route_torch_wait_all

T = TypeVar("T")
S = TypeVar("S")

_NOT_SET: Any = object()
# A thread that pumps its own socket for a future's completion polls it this long at a time: a completion
# that comes by another thread (a lost worker, a timeout) wakes it, or is seen within one slice.
PUMP_SLICE = 0.05
_callbacks = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="nbremote-callback")

#: called with a pending future when a thread starts waiting on it; returns the "wait ended" callback
WaitHook = Callable[["Future[Any]"], Callable[[], None] | None]
_wait_hook: list[WaitHook] = []  # zero or one element: a list keeps the binding itself constant


def set_wait_hook(hook: WaitHook | None) -> WaitHook | None:
    """Install ``hook`` (``None`` removes it) and return the one it replaces."""
    previous = _wait_hook[0] if _wait_hook else None
    _wait_hook[:] = [] if hook is None else [hook]
    return previous


_blocking = threading.local()  # .hooks: (on_block, on_unblock) of a thread that serves calls


def on_blocking(block: Callable[[], None], unblock: Callable[[], None]) -> None:
    """Have this thread call ``block()`` before it blocks on a pending future and ``unblock()`` after."""
    _blocking.hooks = (block, unblock)


@contextlib.contextmanager
def _blocked() -> Iterator[None]:
    hooks = getattr(_blocking, "hooks", None)
    if hooks is None:
        yield
        return
    hooks[0]()
    try:
        yield
    finally:
        hooks[1]()


def _begin_wait(fut: Future[Any]) -> Callable[[], None] | None:
    if not _wait_hook:
        return None
    try:
        return _wait_hook[0](fut)
    except Exception:  # a display problem must never break a call
        return None


class Future(Generic[T]):
    """A value that will arrive; made by ``rpc_async`` (and by ``then``).

    In a process that loaded torch, a new Future is also a ``torch.futures.Future`` (see ``_variant``).
    """

    _mirror_completion: Callable[[Any, BaseException | None], None] | None = None  # the torch variant's
    # Whether user code completed it (``set_result``, ``set_exception``, a ``then`` callback): see _run_when_done.
    # A class attribute until then: most futures are completed by nbremote and never pay for the field.
    _by_user = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Future[T]:
        del args, kwargs  # __init__'s
        if cls is Future:
            cls = _variant[0] if _variant else _torch_variant()
        return super().__new__(cls)  # torch._C.Future's for the variant

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
        called by this thread (the one that made the call) while it waits. Completed by another thread,
        the future calls ``pump.wake()`` where the pump has one (else the wait sees it within a slice)."""
        self._pump, self._pump_thread = pump, threading.get_ident()

    # -- reading --------------------------------------------------------------------------------
    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> T:
        """Block until the value arrives and return it; raise the call's error if it failed."""
        if not self._done:
            ended = _begin_wait(self)
            hooks = getattr(_blocking, "hooks", None)
            if hooks is not None:
                hooks[0]()
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
                if hooks is not None:
                    hooks[1]()
                if ended is not None:
                    with contextlib.suppress(Exception):
                        ended()
        if self._error is not None:
            raise self._error
        return self._result

    def _pump_until_done(self, pump: Callable[[float], None], timeout: float | None) -> None:
        # Slices: a future completed by another thread (a lost worker, a timeout) wakes the pump, or the next
        # slice sees it.
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            left = PUMP_SLICE if deadline is None else min(PUMP_SLICE, deadline - time.monotonic())
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
        """Complete the future with ``result``; a future completes once (RuntimeError, as in torch)."""
        if not self._complete(result, None, by_user=True):
            raise RuntimeError("Future can only be marked completed once (it already holds a result or an error)")

    def set_exception(self, error: BaseException) -> None:
        """Complete the future with ``error``, which ``wait()`` raises; a future completes once."""
        if not isinstance(error, BaseException):
            raise TypeError(f"set_exception takes an exception, not {type(error).__name__}")
        if not self._complete(_NOT_SET, error, by_user=True):
            raise RuntimeError("Future can only be marked completed once (it already holds a result or an error)")

    def _complete(self, result: T, error: BaseException | None, *, by_user: bool = False) -> bool:
        """Complete the future unless it is done already (False then): how nbremote itself completes the
        futures of calls, where a reply, a timeout and a lost worker may race. ``by_user``: user code completes it
        on a thread of its own (see ``_run_when_done``)."""
        with self._lock:
            if self._done:
                return False
            self._result, self._error, self._done = result, error, True
            if by_user:
                self._by_user = True
            callbacks, self._callbacks = self._callbacks, []
            # Nothing to interrupt or pump any more; and a call's interrupt hook refers back to this future
            # (through its pending entry): without this, the value would live until the cyclic GC runs --
            # a buffer lent by shared memory among it.
            self.on_interrupt = None
            pump, self._pump = self._pump, None
            hooks, self._hooks = self._hooks, []
            if self._cond is not None:
                self._cond.notify_all()
        if pump is not None and self._pump_thread != threading.get_ident():  # it may be waiting on its socket
            wake = getattr(pump, "wake", None)
            if wake is not None:
                wake()
        if self._mirror_completion is not None:
            self._mirror_completion(result, error)
        for hook in hooks:
            hook(self)
        for cb in callbacks:
            _callbacks.submit(cb, self)
        return True

    def _fail(self, error: BaseException) -> bool:
        """``_complete`` with an error."""
        return self._complete(_NOT_SET, error)

    def _on_complete(self, hook: Callable[[Future[T]], None]) -> None:
        """Run ``hook(self)`` when the future completes, on the thread that completes it (at once if it
        has). Internal: a hook must be trivial and never block -- the completing thread is often the IO
        thread. User callbacks go through ``add_done_callback``."""
        with self._lock:
            if not self._done:
                self._hooks.append(hook)
                return
        hook(self)

    def _run_when_done(self, run: Callable[[Future[T]], None]) -> None:
        """Run ``run(self)`` once the future completes: at once on this thread if it has; on the completing thread
        if user code completes it; else on a callback thread (a bounded pool, not the IO thread; see the module's
        docstring). Internal; ``run`` must not raise."""
        with self._lock:
            if not self._done:
                self._hooks.append(functools.partial(_run_or_hand, run))
                return
        run(self)

    # -- chaining -------------------------------------------------------------------------------
    def add_done_callback(self, callback: Callable[[Future[T]], None]) -> None:
        """Run ``callback(self)`` once the future completes (at once, on a callback thread, if it has)."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        _callbacks.submit(callback, self)

    def then(self, callback: Callable[[Future[T]], S]) -> Future[S]:
        """A new future holding ``callback(self)``'s return value, or the exception it raised (made a
        ``RuntimeError`` too, as torch's ``then`` does, see ``nbremote.errors``)."""
        if not callable(callback):
            raise TypeError(f"then() takes a callable, called with this future once it completes; got "
                            f"{type(callback).__name__} (incompatible function arguments.)")
        chained: Future[S] = Future(on_interrupt=self.on_interrupt)
        chained.label = self.label

        def run(fut: Future[T]) -> None:
            try:
                chained._complete(callback(fut), None, by_user=True)  # on a callback thread: may block
            except Exception as exc:  # the callback's error belongs to the chained future: a RuntimeError,
                chained._complete(_NOT_SET, also_runtime_error(exc), by_user=True)  # as torch makes it, that
            except BaseException as exc:  # keeps its type
                chained._complete(_NOT_SET, exc, by_user=True)

        self.add_done_callback(run)
        return chained

    def __repr__(self) -> str:
        state = "pending" if not self._done else ("error" if self._error is not None else "done")
        return f"<nbremote Future {state}>"


def _run_or_hand(run: Callable[[Future[Any]], None], fut: Future[Any]) -> None:
    """``Future._run_when_done``'s hook, on the completing thread."""
    if fut._by_user:
        run(fut)
    else:
        _callbacks.submit(run, fut)


_variant: list[type[Future[Any]]] = []  # Future with torch's future mixed in, once torch is loaded


def _torch_variant() -> type[Future[Any]]:
    """``Future`` + ``frameworks._torch.FutureMirror`` if torch is loaded (built once), else ``Future``.

    Decided per new future, so an nbremote that never sees torch never imports it; once torch is loaded
    every new future is a ``torch.futures.Future`` too, which ``torch.futures.wait_all`` and
    ``collect_all`` (C++ functions that take only torch's futures) accept.
    """
    mirror = future_mirror()
    if mirror is None:
        return Future
    with _variant_lock:
        if not _variant:
            def __init__(self: Any, *, on_interrupt: Callable[[], None] | None = None) -> None:
                self._mirror_init()
                Future.__init__(self, on_interrupt=on_interrupt)

            _variant.append(type("Future", (Future, mirror), {
                "__init__": __init__, "__module__": __name__, "__qualname__": "Future",
                "_mirror_completion": mirror._mirror_completion}))  # over Future's None, which comes first
            route_torch_wait_all(wait_all)
    return _variant[0]


_variant_lock = threading.Lock()


def wait_all(futures: Sequence[Future[Any]]) -> list[Any]:
    """The values of all ``futures``, in order; the first error raised as soon as one fails.

    As ``torch.futures.wait_all``, which is this function for a list that holds an nbremote future (see
    ``frameworks._torch.route_wait_all``); ``torch.futures.Future`` objects of torch's own may be among them.
    No thread hop: the futures wake this thread directly, and a single future is simply waited on (so a
    blocking call's own reply is received by this thread).
    """
    futures = list(futures)
    if len(futures) < 2:
        return [fut.wait() for fut in futures]
    _wait_until(futures, lambda fut: _error_of(fut) is not None)
    for fut in futures:
        error = _error_of(fut) if fut.done() else None
        if error is not None:
            raise error
    return [fut.wait() for fut in futures]


def _error_of(fut: Any) -> BaseException | None:
    """The error of a done future: nbremote's keeps it, a ``torch.futures.Future`` of torch's raises it."""
    if isinstance(fut, Future):
        return fut.exception()
    try:
        fut.wait()
    except BaseException as exc:
        return exc
    return None


def _when_done(fut: Any, hook: Callable[[Any], None]) -> None:
    """``hook(fut)`` on the thread that completes ``fut`` (at once if done): nbremote's ``_on_complete``, or
    torch's ``add_done_callback`` for a future of torch's (which runs it inline the same way)."""
    if isinstance(fut, Future):
        fut._on_complete(hook)
    else:
        fut.add_done_callback(hook)


def settle_all(futures: Sequence[Future[Any]], *, unless: tuple[type[BaseException], ...] = ()) -> list[BaseException]:
    """Wait until every future has finished, failed or not; their errors, in order (none: all succeeded).

    ``wait_all`` raises at the first error while the others may still run; a caller that must not go on
    while any of them runs (an optimizer step across owners, as torch's ``_wait_for_all``) settles them
    all first. An error of a type in ``unless`` ends the wait at once and comes first (a lost worker: no
    point waiting for the rest to report it). The notebook's stop button cancels what still runs.
    """
    futures = list(futures)
    fatal = _wait_until(futures, lambda fut: isinstance(_error_of(fut), unless))
    errors = [] if fatal is None else [fatal]
    for fut in futures:
        error = _error_of(fut) if fut.done() else None
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
        _when_done(fut, finished)
    me = threading.get_ident()
    try:
        if futures and not ready.is_set():
            with _blocked():
                for fut in futures:  # a blocking call's reply comes to this thread's own socket only: receive it
                    pump = fut._pump if isinstance(fut, Future) and fut._pump_thread == me else None  # here
                    while pump is not None and not fut.done() and not ready.is_set():
                        pump(0.05)  # slices: another future's failure (``stop``) ends the wait meanwhile
                ready.wait()
    except KeyboardInterrupt:
        for fut in futures:
            cancel = getattr(fut, "on_interrupt", None)  # a future of torch's has none
            if not fut.done() and cancel is not None:
                cancel()
        raise
    return _error_of(stopped[0]) if stopped else None
