"""The calls this process made and waits for: ids, deadlines and counts -- bookkeeping, no I/O.

:class:`PendingCalls` gives each call its id when it is registered and keeps its :class:`Pending` entry
until something takes it out: its reply (``take``), its deadline (``expired``), its peer's loss
(``for_peer``), a cancellation, or the agent closing (``clear``). It completes no future and sends
nothing: whoever takes an entry out settles it. It also counts the calls made to each peer, for status
displays. Tested with plain values (``tests/test_units.py``), like distributed's ``WorkerState``.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from nbremote.rpc._core.future import Future

__all__ = ["Pending", "PendingCalls", "copied", "fn_name", "introspecting", "introspection"]

# Calls made while this is set are nbremote looking at itself (a panel or dashboard refreshing): they do
# not count in the calls a status display reports.
introspecting: contextvars.ContextVar[bool] = contextvars.ContextVar("nbremoteintrospecting", default=False)


def fn_name(fn: object) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return str(name) if name else type(fn).__name__


def copied(frames: Sequence[Any]) -> list[Any]:
    """The frames with every out-of-band buffer copied (frames[0], the pickle stream, is bytes already)."""
    return [frames[0], *(bytearray(f) for f in frames[1:])] if frames else []  # writable, like received frames


@contextlib.contextmanager
def introspection() -> Iterator[None]:
    """Calls made inside are not counted in ``PendingCalls.counts`` (status displays must not count themselves)."""
    token = introspecting.set(True)
    try:
        yield
    finally:
        introspecting.reset(token)




@dataclass(eq=False)
class Pending:
    """One call waiting for its reply."""

    fut: Future[Any]
    peer: str
    fn: str
    timeout: float
    deadline: float | None
    ctx: contextvars.Context  # the calling cell's context: its output is replayed there
    autograd: int | None = None  # the distributed autograd context the call was made in
    counted: bool = True  # False for introspection (status displays do not count themselves)
    line_start: dict[str, bool] | None = None  # by stream: whether its text so far ended a line (made on first out)


class PendingCalls:
    """Pending calls by id (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, Pending] = {}
        self._ids = itertools.count(1)
        self._made: collections.Counter[str] = collections.Counter()  # per peer, for status displays

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, pending: Pending) -> int:
        """Register a call; returns its id (unique in this process, which is what replies name)."""
        with self._lock:
            call_id = next(self._ids)
            self._pending[call_id] = pending
            if pending.counted:
                self._made[pending.peer] += 1
        return call_id

    def get(self, call_id: int) -> Pending | None:
        """The call, left pending (its output arrives before its reply)."""
        with self._lock:
            return self._pending.get(call_id)

    def take(self, call_id: int) -> Pending | None:
        """The call, no longer pending; None if it is not (timed out or cancelled already)."""
        with self._lock:
            return self._pending.pop(call_id, None)

    def for_peer(self, peer: str, only: int | None = None) -> list[Pending]:
        """Take out the calls pending on ``peer`` (only call ``only``, if given)."""
        with self._lock:
            ids = [cid for cid, p in self._pending.items() if p.peer == peer and (only is None or cid == only)]
            return [self._pending.pop(cid) for cid in ids]

    def expired(self, now: float) -> list[tuple[int, Pending]]:
        """Take out the calls whose deadline has passed at ``now``, with their ids."""
        with self._lock:
            ids = [cid for cid, p in self._pending.items() if p.deadline is not None and now > p.deadline]
            return [(cid, self._pending.pop(cid)) for cid in ids]

    def clear(self) -> list[Pending]:
        """Take out every pending call."""
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        return pending

    def snapshot(self) -> dict[int, Pending]:
        """The calls pending now, by id (a copy; ids only grow, so a later snapshot tells the calls made since)."""
        with self._lock:
            return dict(self._pending)

    def counts(self, peer: str) -> tuple[int, int]:
        """(calls in flight, calls made) to ``peer``, introspection not counted."""
        with self._lock:
            in_flight = sum(1 for p in self._pending.values() if p.peer == peer and p.counted)
        return in_flight, self._made[peer]

    def wait_idle(self, timeout: float | None) -> None:
        """Wait until no call is pending (``timeout`` seconds at most; None: as long as it takes).

        Calls made meanwhile are waited for too. Failures belong to whoever made the call: not raised here.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                futures = [p.fut for p in self._pending.values()]
            if not futures:
                return
            for fut in futures:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                with contextlib.suppress(Exception):
                    fut.wait(left)
            if deadline is not None and time.monotonic() >= deadline:
                return
