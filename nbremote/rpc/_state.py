"""The one current agent of this process, which the torch-style free functions delegate to.

This is the only module-level state of the RPC layer, and it holds a single object with an explicit
lifecycle: ``set_current`` at ``init_rpc`` (or worker bootstrap), ``clear`` at ``shutdown``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from nbremote.errors import NotInitializedError

if TYPE_CHECKING:
    from nbremote.rpc._agent import Agent

_lock = threading.Lock()
_current: list[Agent] = []  # zero or one element: a list keeps the binding itself constant


def current() -> Agent:
    """The running agent, or a clear error saying what to do."""
    if not _current:
        raise NotInitializedError(
            "nbremote RPC is not initialized: call rpc.init_rpc('driver', workers=[...]) first "
            "(after rpc.shutdown() a new init_rpc starts a new world)")
    return _current[0]


def current_or_none() -> Agent | None:
    return _current[0] if _current else None


def set_current(agent: Agent) -> None:
    with _lock:
        if _current and _current[0] is not agent and _current[0].running:
            raise RuntimeError(
                f"nbremote RPC is already initialized here as {_current[0].name!r}; call rpc.shutdown() first")
        _current[:] = [agent]


def clear(agent: Agent) -> None:
    with _lock:
        if _current and _current[0] is agent:
            _current.clear()
