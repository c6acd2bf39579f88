"""``rpc.functions.async_execution``: a remote function that returns a Future instead of a value.

As in torch: decorate a function that returns an ``nbremote.rpc.Future``; when it runs as an RPC the
reply is sent once that future completes, and the worker's thread is free in the meantime (so one
worker can hold thousands of such calls, e.g. batching requests or waiting on other workers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "_nbremote_async_execution"


def async_execution(fn: F) -> F:
    """Mark ``fn`` (which returns a Future) so RPC replies with the future's value, not the future."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper  # type: ignore[return-value]


def is_async_execution(fn: object) -> bool:
    return bool(getattr(fn, _MARK, False))
