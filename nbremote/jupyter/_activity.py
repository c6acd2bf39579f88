"""What the dashboard makes of a worker's successive activity reads: CPU %, calls/s, the tasks in view.

Pure bookkeeping over :class:`~nbremote.rpc.WorkerActivity` values (tested with hand-made ones): CPU %
and calls/s are the differences between two reads over the wall time between them; the tasks are kept
while they end inside the dashboard's window (memory bounded by the window and the worker's own ring),
each once -- reads overlap by a second, so a task that ended while the previous read was under way is not
lost.
"""

from __future__ import annotations

from nbremote import rpc

__all__ = ["ActivityTrack"]

OVERLAP = 1.0  # seconds each read reaches back before the previous one


class ActivityTrack:
    """One worker's activity as the dashboard follows it."""

    def __init__(self, since: float = 0.0) -> None:
        self.start = since  # tasks that ended before this (wall clock) are not shown
        self.last: rpc.WorkerActivity | None = None
        self.cpu_percent: float | None = None
        self.calls_per_s: float | None = None
        self.tasks: dict[tuple[float, str, str], rpc.Task] = {}  # by (start, what, caller), oldest first

    @property
    def since(self) -> float:
        """Where the next read should start (wall clock)."""
        return self.start if self.last is None else max(self.start, self.last.wall - OVERLAP)

    def add(self, now: rpc.WorkerActivity, window: float) -> None:
        last = self.last
        if last is not None and now.wall > last.wall:
            elapsed = now.wall - last.wall
            self.cpu_percent = 100.0 * max(0.0, now.cpu_seconds - last.cpu_seconds) / elapsed
            self.calls_per_s = max(0, now.served - last.served) / elapsed
        self.last = now
        for task in now.tasks:
            self.tasks.setdefault((task.start, task.what, task.caller), task)
        horizon = now.wall - window
        for key in [k for k, t in self.tasks.items() if t.start + t.seconds < horizon]:
            del self.tasks[key]

    def in_view(self) -> list[rpc.Task]:
        return sorted(self.tasks.values())
