"""What a member ran lately -- its task stream -- recorded while a dashboard reads it.

Dask's dashboard shows, per worker, a bar for every task it ran in the last seconds; a person sees at a
glance which worker is the bottleneck and what it spends its time on. :class:`TaskLog` keeps that here:
for every call this member served, what ran (``name`` lets the function say better than its own name:
a RemoteModule's forward says ``Stage.forward``), when it started on the wall clock (lanes of workers
on one host line up; across hosts they are as aligned as the hosts' clocks), how long it took, and who
called. The ring holds the last :data:`TASKS` calls: memory stays bounded whatever the call rate.

**Off unless read.** As for a module's history (``nbremote.history``), recording runs under a lease that
each read renews (``read(..., lease=seconds)``); with none, serving a call pays one attribute test (the
server picks the timed runner only while ``on``) and the lease lapses by itself when no dashboard reads.
The dashboard's own reads are not recorded (they would draw a bar per refresh on every worker).

A call may also mark parts of itself as tasks of their own (``rpc.task("device")``): a stage that waits
for a device shows the device's busy time apart from the call that waited for it (notebook 4).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

__all__ = ["LEASE", "TASKS", "Task", "TaskLog", "name"]

TASKS = 4096  # tasks kept per member
LEASE = 10.0  # seconds the stream is recorded after a read, when no other read renews it

_current = threading.local()  # the name the running call gave its task (see name)


class Task(NamedTuple):
    """One call served: its start (wall clock, seconds), duration (seconds), what ran, and its caller."""

    start: float
    seconds: float
    what: str
    caller: str


def name(what: str) -> None:
    """Called by a served function to name its task in the stream (``"Stage.forward"``); cheap when nobody
    reads the stream (one thread-local write)."""
    _current.name = what


class TaskLog:
    """This member's recent tasks; ``on`` while a reader's lease holds (checked when a call is served)."""

    def __init__(self) -> None:
        self.on = False
        self._until = 0.0
        self._leases: dict[str, float] = {}  # reader -> monotonic deadline
        self._lock = threading.Lock()
        self._ring: collections.deque[Task] = collections.deque(maxlen=TASKS)
        self.served = 0  # calls served while recording

    def renew(self, lease: float, reader: str = "") -> None:
        """``reader`` wants the stream recorded for ``lease`` more seconds from now (0: no longer). Each reader
        has its lease (two dashboards: closing one leaves the other's); recording goes on while any holds."""
        with self._lock:  # against a call ending meanwhile that saw the old lease lapsed (see end)
            now = time.monotonic()
            self._leases = {r: until for r, until in self._leases.items() if until > now and r != reader}
            if lease > 0:
                self._leases[reader] = now + lease
            self._until = max(self._leases.values(), default=0.0)
            self.on = bool(self._leases)

    def begin(self, caller: str) -> tuple[float, float]:
        _current.name, _current.caller = None, caller
        return time.time(), time.perf_counter()

    def end(self, started: tuple[float, float], fn: str, caller: str, quiet: bool = False) -> None:
        seconds = time.perf_counter() - started[1]
        what = getattr(_current, "name", None) or fn
        _current.name = _current.caller = None
        with self._lock:
            if not quiet:
                self._ring.append(Task(started[0], seconds, what, caller))
                self.served += 1
            if time.monotonic() > self._until:  # nobody read for a whole lease: stop
                self.on = False

    @contextlib.contextmanager
    def span(self, what: str) -> Iterator[None]:
        """Record what runs inside as a task of its own (``rpc.task``): part of a call (a device's busy time,
        not the wait for it), or work outside calls (caller "-")."""
        if not self.on:
            yield
            return
        wall, start = time.time(), time.perf_counter()
        try:
            yield
        finally:
            task = Task(wall, time.perf_counter() - start, what, getattr(_current, "caller", None) or "-")
            with self._lock:
                self._ring.append(task)

    def since(self, start: float) -> tuple[Task, ...]:
        """The tasks that ended after ``start`` (wall clock), oldest first."""
        with self._lock:
            return tuple(t for t in self._ring if t.start + t.seconds > start)
