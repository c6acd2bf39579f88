"""What ``bench_reinforce.py``'s call-cost part runs in both worlds, importable by name on every side.

The same bodies serve torch.distributed.rpc and nbremote: each world's functions are marked with its own
``async_execution`` (``TORCH`` / ``NBREMOTE`` below), and return ``torch.futures.Future`` objects, as a torch
program does (nbremote's own Future is measured too, as ``*_nb``). A future "completed later" is completed by
a thread of the user's (``completer``), as the batch programs' are; ``hop`` is the plain call that waits for
that same thread (the hop the async variant cannot avoid, without ``async_execution``).
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

CASES = ("plain", "ae_done", "hop", "ae_thread", "proxy_plain", "proxy_ae")
NBREMOTE_ONLY = ("ae_done_nb", "ae_thread_nb")  # nbremote's own Future (torch's RPC takes only torch's)

_COMPLETER: queue.SimpleQueue[Any] = queue.SimpleQueue()


def _complete_forever() -> None:
    while True:
        _COMPLETER.get().set_result(None)


threading.Thread(target=_complete_forever, name="completer", daemon=True).start()


def plain() -> None:
    return None


def hop() -> None:
    fut: torch.futures.Future[None] = torch.futures.Future()
    _COMPLETER.put(fut)
    fut.wait()


def _done() -> Any:
    fut: torch.futures.Future[None] = torch.futures.Future()
    fut.set_result(None)
    return fut


def _later() -> Any:
    fut: torch.futures.Future[None] = torch.futures.Future()
    _COMPLETER.put(fut)
    return fut


def _done_nb() -> Any:
    from nbremote import rpc

    fut: rpc.Future[None] = rpc.Future()
    fut.set_result(None)
    return fut


def _later_nb() -> Any:
    from nbremote import rpc

    fut: rpc.Future[None] = rpc.Future()
    _COMPLETER.put(fut)
    return fut


# Each world's marked functions, by name: both worlds' picklers send an importable function by reference, and
# torch's finds it by its ``__qualname__`` (so a marked function must be the module's attribute of its name).
def _torch_async(fn: Callable[..., Any]) -> Callable[..., Any]:
    import torch.distributed.rpc as rpc

    return rpc.functions.async_execution(fn)


def _nbremote_async(fn: Callable[..., Any]) -> Callable[..., Any]:
    from nbremote import rpc

    return rpc.functions.async_execution(fn)


@_torch_async
def torch_ae_done() -> Any:
    return _done()


@_torch_async
def torch_ae_thread() -> Any:
    return _later()


@_nbremote_async
def nbremote_ae_done() -> Any:
    return _done()


@_nbremote_async
def nbremote_ae_thread() -> Any:
    return _later()


@_nbremote_async
def nbremote_ae_done_nb() -> Any:
    return _done_nb()


@_nbremote_async
def nbremote_ae_thread_nb() -> Any:
    return _later_nb()


class TorchHolder:
    def plain(self) -> None:
        return None

    @_torch_async
    def ae(self) -> Any:
        return _done()


class NbremoteHolder:
    def plain(self) -> None:
        return None

    @_nbremote_async
    def ae(self) -> Any:
        return _done()


_RREFS: dict[tuple[str, str], Any] = {}


def operation(world: str, peer: str, case: str) -> Callable[[], Any]:
    """One call of ``case`` from this process to ``peer``, in ``world``."""
    if world == "torch":
        import torch.distributed.rpc as rpc
    else:
        from nbremote import rpc  # type: ignore[no-redef]
    holder = TorchHolder if world == "torch" else NbremoteHolder
    if case.startswith("proxy_"):
        if (world, peer) not in _RREFS:
            _RREFS[(world, peer)] = rpc.remote(peer, holder)
        proxy = _RREFS[(world, peer)].rpc_sync()
        method = getattr(proxy, case.removeprefix("proxy_"))
        return lambda: method()
    fn = {"plain": plain, "hop": hop}.get(case) or globals()[f"{world}_{case}"]
    return lambda: rpc.rpc_sync(peer, fn)


def block(world: str, peer: str, case: str, calls: int) -> float:
    """Median time of one call (us) over ``calls`` blocking calls, after a warm-up."""
    op = operation(world, peer, case)
    for _ in range(min(50, calls)):
        op()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def forget() -> None:
    """Drop the RRefs ``operation`` made (before the world shuts down)."""
    _RREFS.clear()
