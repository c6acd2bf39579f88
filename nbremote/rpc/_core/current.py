"""This process's one member of the world (its agent), which the torch-style free functions delegate to.

This is the only module-level state of the RPC layer, and it holds a single object with an explicit
lifecycle: ``set_current`` at ``init_rpc`` (or worker bootstrap), ``clear`` at ``shutdown``.

The slot is typed with :class:`Member`: what the modules below the agent (``rref``, ``resources``) use of
it, so that they need not import the agent, which imports them. The agent is a ``Member``; the floors
above it take it as an ``Agent`` with ``agent.current_agent()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from nbremote.errors import NotInitializedError
from nbremote.rpc._core.future import Future
from nbremote.rpc._core.members import WorkerInfo
from nbremote.rpc._core.owners import OwnerTable
from nbremote.rpc._core.tasks import TaskLog

__all__ = ["Member", "References", "Serving", "clear", "current", "current_or_none", "set_current"]


class References(Protocol):
    """This process's side of reference counting, as RRef objects use it (``rref.RefCounts``)."""

    def fork(self, owner: str, rref_id: str, token: str, holder: str) -> None:
        """Count a new reference at its owner before the message carrying it leaves."""

    def release(self, owner: str, rref_id: str, token: str) -> None:
        """A reference was dropped (a finalizer's call: never blocks, never raises)."""


class Serving(Protocol):
    """What ``resources`` reads of a member's server (``serving.Server``)."""

    tasks: TaskLog  # what it ran lately (see ``tasks``)


class Member(Protocol):
    """What the modules below the agent use of this process's member (``agent.Agent`` is one)."""

    name: str
    info: WorkerInfo
    table: OwnerTable  # the values it owns (see ``owners``)
    default_timeout: float

    @property
    def server(self) -> Serving:
        """What serves the calls sent to it (``serving.Server``)."""

    @property
    def refs(self) -> References:
        """The references it holds to values of others (see ``rref``)."""

    @property
    def running(self) -> bool: ...

    def timeout(self, timeout: float | None) -> float:
        """A call's timeout in seconds: negative (or None) means the world's default, 0 means none."""

    def call(self, to: object, fn: Callable[..., Any], args: Sequence[Any] = (),
             kwargs: dict[str, Any] | None = None, timeout: float | None = -1.0, *,
             rref: tuple[str, str] | None = None, snapshot: bool = True) -> Future[Any]:
        """Start ``fn(*args, **kwargs)`` on ``to``; the future completes with its result or error."""

    def remote(self, to: object, fn: Callable[..., Any], args: Sequence[Any] = (),
               kwargs: dict[str, Any] | None = None, timeout: float | None = -1.0) -> Any:
        """Create ``fn(*args, **kwargs)`` on ``to`` and return an RRef to it at once (``rref.RRef``)."""


_lock = threading.Lock()
_current: list[Member] = []  # zero or one element: a list keeps the binding itself constant


def _not_initialized() -> NotInitializedError:
    return NotInitializedError(
        "nbremote RPC is not initialized: call rpc.init_rpc('driver', workers=[...]) first "
        "(after rpc.shutdown() a new init_rpc starts a new world)")


def current() -> Member:
    """The running member, or a clear error saying what to do."""
    if not _current:
        raise _not_initialized()
    return _current[0]


def current_or_none() -> Member | None:
    return _current[0] if _current else None


def set_current(member: Member) -> None:
    with _lock:
        if _current and _current[0] is not member and _current[0].running:
            raise RuntimeError(
                f"nbremote RPC is already initialized here as {_current[0].name!r}; call rpc.shutdown() first")
        _current[:] = [member]


def clear(member: Member) -> None:
    with _lock:
        if _current and _current[0] is member:
            _current.clear()
