"""What ``test_async_execution`` runs on workers (importable there: workers get the driver's sys.path)."""

from __future__ import annotations

import queue
import threading
from typing import Any

from nbremote import rpc

# Names of the threads that pickled an ``Observed`` value in this process, in order.
PICKLED_ON: list[str] = []


class Observed:
    """A value that notes which thread pickles it: the thread that sends the reply carrying it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        PICKLED_ON.append(threading.current_thread().name)
        return (Observed, (self.value,))


def pickled_on() -> list[str]:
    """The threads that pickled an ``Observed`` here since the last call (and forget them)."""
    names = list(PICKLED_ON)
    PICKLED_ON.clear()
    return names


_COMPLETER: queue.SimpleQueue[tuple[Any, Any, bool]] = queue.SimpleQueue()


def _complete_forever() -> None:
    while True:
        fut, value, fail = _COMPLETER.get()
        if fail:
            fut.set_exception(value)
        else:
            fut.set_result(value)


threading.Thread(target=_complete_forever, name="completer", daemon=True).start()


@rpc.functions.async_execution
def done_at_once(x: int) -> Any:
    fut: rpc.Future[Observed] = rpc.Future()
    fut.set_result(Observed(x + 1))
    return fut


@rpc.functions.async_execution
def failed_at_once() -> Any:
    fut: rpc.Future[int] = rpc.Future()
    fut.set_exception(KeyError("failed at once"))
    return fut


@rpc.functions.async_execution
def completed_by_a_thread(x: int, fail: bool = False) -> Any:
    """Completed by another thread of the user's (``completer``), as the batch programs complete theirs."""
    fut: rpc.Future[Observed] = rpc.Future()
    _COMPLETER.put((fut, KeyError("failed later") if fail else Observed(x + 1), fail))
    return fut


@rpc.functions.async_execution
def torch_future_completed_by_a_thread(x: int) -> Any:
    import torch

    fut: torch.futures.Future[Observed] = torch.futures.Future()
    _COMPLETER.put((fut, Observed(x + 1), False))
    return fut


@rpc.functions.async_execution
def a_nested_call(peer: str, x: int) -> Any:
    """A future nbremote completes itself, on whichever thread received the nested call's reply."""
    return rpc.rpc_async(peer, Observed, args=(x + 1,))


def torch_marked(x: int) -> Any:
    """Marked with torch's own decorator (the program kept ``torch.distributed.rpc.functions``)."""
    import torch

    fut: torch.futures.Future[int] = torch.futures.Future()
    fut.set_result(x * 2)
    return fut


try:
    from torch.distributed.rpc.functions import async_execution as _torch_async_execution

    torch_marked = _torch_async_execution(torch_marked)
except ImportError:  # torch without its RPC: the test that uses it is skipped
    pass


class Holder:
    """An RRef's value whose method is ``@async_execution``."""

    def plain(self, x: int) -> int:
        return x + 1

    @rpc.functions.async_execution
    def later(self, x: int) -> Any:
        fut: rpc.Future[Observed] = rpc.Future()
        _COMPLETER.put((fut, Observed(x + 1), False))
        return fut


def call_from_here(peer: str, fn: Any, *args: Any) -> Any:
    """Make the call from this worker (worker -> worker, worker -> driver); its value, unwrapped."""
    value = rpc.rpc_sync(peer, fn, args=args)
    return value.value if isinstance(value, Observed) else value
