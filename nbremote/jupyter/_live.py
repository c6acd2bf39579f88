"""Keeping a widget live while the notebook's main thread is busy: a refresh thread per widget.

While a cell runs, the kernel's main thread executes it and handles no widget messages; a widget that
only refreshes when asked (a button) freezes for the whole cell. A :class:`Ticker` calls the widget's
refresh on a daemon thread of the driver every ``interval`` seconds instead; ipywidgets sends the
resulting state changes from that thread (comm sends are thread-safe in ipykernel 7), so the frontend
updates while the cell runs. Refresh errors are the widget's to show: the ticker only keeps time.
:class:`LiveBox` is the base of the panel and the dashboard: closing one stops its ticker and closes
the widgets it is made of (ipywidgets would leave them open).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets


class Ticker:
    """Calls ``tick()`` every ``interval`` seconds on a thread of its own until ``stop()``."""

    def __init__(self, tick: Callable[[], None], interval: float, name: str) -> None:
        if interval <= 0:
            raise ValueError(f"a refresh interval is a positive number of seconds, got {interval!r}")
        self.interval = interval
        self._tick = tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nbremote-live-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._tick()
            except Exception:  # the widget shows its own errors; the clock must keep going
                continue

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(self.interval + 5)


def close_children(widget: Any) -> None:
    """Close every widget below ``widget`` (ipywidgets closes a box, not what it contains)."""
    for child in getattr(widget, "children", ()):
        close_children(child)
        child.close()


class LiveBox(widgets.VBox):
    """A box that may refresh itself on a :class:`Ticker`; closing it stops the ticker and its parts."""

    _ticker: Ticker | None = None

    def stop_ticker(self) -> None:
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None

    def close(self) -> None:
        self.stop_ticker()
        close_children(self)
        super().close()
