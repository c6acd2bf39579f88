"""Long waits show progress: an inline status for a slow call, a progress bar for many futures.

:class:`WaitStatus` is the RPC layer's wait hook (``rpc.set_wait_hook``), installed by
``%load_ext nbremote``. It only watches waits of the notebook's *main thread* (what the user is
looking at; refresh threads and callbacks wait silently) and costs two dict operations per wait. One
monitor thread looks at the open waits a few times a second: a wait older than ``threshold`` gets a
status line in the cell that is waiting (worker, function, elapsed time), updated while it lasts and
finalised when it ends (done or failed, and how long it took). Displays are made in the waiting
cell's context (``contextvars``), which is how ipykernel routes output from other threads.

:func:`wait_all` waits on many futures behind a ``tqdm.auto`` bar (the notebook widget bar in
JupyterLab, text elsewhere); interrupting it cancels the calls that are still pending.
"""

from __future__ import annotations

import contextvars
import html
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from nbremote import rpc


class _Wait:
    def __init__(self, fut: rpc.Future[Any]) -> None:
        self.fut = fut
        self.start = time.monotonic()
        self.ctx = contextvars.copy_context()
        self.display_id: str | None = None
        self.lock = threading.Lock()
        self.ended = False

    def what(self) -> str:
        if self.fut.label is None:
            return "a future"
        worker, fn = self.fut.label
        return f"{fn} on {worker}"


def _bundle(text: str, colour: str) -> dict[str, str]:
    return {"text/plain": text,
            "text/html": f'<span style="font-size:12px;color:{colour}">{html.escape(text)}</span>'}


class WaitStatus:
    """The wait hook: a live status line for main-thread waits longer than ``threshold`` seconds."""

    def __init__(self, threshold: float = 2.0, tick: float = 0.25) -> None:
        self.threshold = threshold
        self.tick = tick
        self._waits: dict[int, _Wait] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ids = iter(range(1, 1 << 62))

    def __call__(self, fut: rpc.Future[Any]) -> Callable[[], None] | None:
        if threading.current_thread() is not threading.main_thread():
            return None
        wait = _Wait(fut)
        with self._lock:
            self._waits[id(wait)] = wait
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._watch, name="nbremote-wait-status", daemon=True)
                self._thread.start()
        return lambda: self._end(wait)

    def _watch(self) -> None:
        while True:
            time.sleep(self.tick)
            with self._lock:
                waits = list(self._waits.values())
            now = time.monotonic()
            for wait in waits:
                if now - wait.start >= self.threshold:
                    self._show(wait, now)

    def _show(self, wait: _Wait, now: float) -> None:
        from IPython.display import display, update_display

        with wait.lock:
            if wait.ended:
                return
            bundle = _bundle(f"\u23f3 waiting for {wait.what()}: {now - wait.start:.0f} s", "#555")
            if wait.display_id is None:
                wait.display_id = f"nbremote-wait-{next(self._ids)}"
                wait.ctx.run(display, bundle, raw=True, display_id=wait.display_id)
            else:
                wait.ctx.run(update_display, bundle, raw=True, display_id=wait.display_id)

    def _end(self, wait: _Wait) -> None:
        with self._lock:
            self._waits.pop(id(wait), None)
        with wait.lock:
            wait.ended = True
            if wait.display_id is None:
                return
            from IPython.display import update_display

            elapsed = time.monotonic() - wait.start
            if not wait.fut.done():
                text, colour = f"\u2717 stopped waiting for {wait.what()} after {elapsed:.1f} s", "#b26a00"
            elif wait.fut.exception() is not None:
                error = type(wait.fut.exception()).__name__
                text, colour = f"\u2717 {wait.what()} failed after {elapsed:.1f} s ({error})", "#b00020"
            else:
                text, colour = f"\u2713 {wait.what()} done in {elapsed:.1f} s", "#1b7f3b"
            wait.ctx.run(update_display, _bundle(text, colour), raw=True, display_id=wait.display_id)


def wait_all(futures: Sequence[rpc.Future[Any]], desc: str | None = None, timeout: float | None = None) -> list[Any]:
    """Wait for every future behind a progress bar; return their values in order (raise the first error).

    A KeyboardInterrupt (the notebook's stop button) cancels the calls still pending and is re-raised.
    """
    done: queue.SimpleQueue[rpc.Future[Any]] = queue.SimpleQueue()
    for fut in futures:
        fut.add_done_callback(done.put)
    deadline = None if timeout is None else time.monotonic() + timeout
    with tqdm(total=len(futures), desc=desc or f"{len(futures)} call(s)", unit="call") as bar:
        try:
            for _ in futures:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    done.get(timeout=left)
                except queue.Empty:
                    pending = sum(not f.done() for f in futures)
                    raise TimeoutError(
                        f"{pending} of {len(futures)} future(s) still pending after {timeout} s") from None
                bar.update(1)
        except KeyboardInterrupt:
            for fut in futures:
                if not fut.done() and fut.on_interrupt is not None:
                    fut.on_interrupt()
            raise
    return [fut.wait() for fut in futures]
