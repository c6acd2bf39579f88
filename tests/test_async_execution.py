"""``@rpc.functions.async_execution`` at the cost of a plain call (issue 40): which thread replies, and what travels.

The reply to such a call goes out from the thread that completes its future -- the serving thread itself when
the future is done on return, the user's thread that calls ``set_result`` -- as torch sends it, with no hop to
another thread; only a future that nbremote completes on a thread of its own (a nested call's reply) is
answered from a callback thread, never from the thread that received that reply. A value that notes the
thread pickling it (``async_fns.Observed``) shows where each reply left. Timing is in
``benchmarks/bench_reinforce.py``, not here.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import sys
import types
import xml.etree.ElementTree
from typing import Any

import async_fns as afns
import cloudpickle
import pytest

from nbremote import rpc
from nbremote.rpc._core.serving import is_async_execution
from nbremote.rpc._wire import serialize

pytestmark = pytest.mark.timeout(60)


def _pickled_on(worker: str) -> list[str]:
    return afns.pickled_on() if worker == "driver" else rpc.rpc_sync(worker, afns.pickled_on)


def test_a_future_done_on_return_is_answered_by_the_serving_thread(world: list[str]) -> None:
    _pickled_on("worker1")
    assert rpc.rpc_sync("worker1", afns.done_at_once, args=(1,)).value == 2
    (thread,) = _pickled_on("worker1")
    assert thread.startswith("nbremote-worker1_")  # a thread of the executor, as a plain call's reply
    with pytest.raises(KeyError, match="failed at once"):
        rpc.rpc_sync("worker1", afns.failed_at_once)


def test_a_future_completed_by_a_users_thread_is_answered_from_that_thread(world: list[str]) -> None:
    _pickled_on("worker1")
    assert rpc.rpc_sync("worker1", afns.completed_by_a_thread, args=(1,)).value == 2
    assert rpc.rpc_async("worker1", afns.completed_by_a_thread, args=(2,)).wait().value == 3
    assert rpc.rpc_sync("worker1", afns.torch_future_completed_by_a_thread, args=(3,)).value == 4
    assert _by_completer_or_server(_pickled_on("worker1"), "worker1", 3)
    with pytest.raises(KeyError, match="failed later"):
        rpc.rpc_sync("worker1", afns.completed_by_a_thread, args=(0, True))
    futs = [rpc.rpc_async("worker2", afns.completed_by_a_thread, args=(i,)) for i in range(100)]
    assert [f.wait().value for f in futs] == list(range(1, 101))
    assert _by_completer_or_server(_pickled_on("worker2"), "worker2", 100)


def _by_completer_or_server(threads: list[str], worker: str, calls: int) -> bool:
    """Each reply left from the thread that completed its future (``completer``) -- or, where that thread was
    quicker than the call's return, from the serving thread, which found the future done: never from a thread
    in between (the callback pool)."""
    return len(threads) == calls and all(t == "completer" or t.startswith(f"nbremote-{worker}_") for t in threads)


@pytest.mark.parametrize("server", ["worker1", "driver"])
def test_a_future_nbremote_completes_is_answered_from_a_callback_thread(world: list[str], server: str) -> None:
    """The nested call's reply arrives on a thread of nbremote's (the driver's IO thread, a receiving one): the
    reply to the outer call is pickled and sent from a callback thread, never there (or from the serving thread,
    when the nested reply came before the outer call returned its future)."""
    _pickled_on(server)
    caller = "worker2" if server == "worker1" else "worker1"
    for x in range(20):
        assert rpc.rpc_sync(caller, afns.call_from_here, args=(server, afns.a_nested_call, "worker3", x)) == x + 1
    threads = _pickled_on(server)
    assert len(threads) == 20
    assert all(t.startswith(("nbremote-callback", f"nbremote-{server}_")) for t in threads), threads


def test_rref_proxy_methods_marked_async_execution_reply_from_the_completing_thread(world: list[str]) -> None:
    rref = rpc.remote("worker1", afns.Holder)
    _pickled_on("worker1")
    assert rref.rpc_sync().later(1).value == 2
    assert rref.rpc_async().later(2).wait().value == 3
    assert _by_completer_or_server(_pickled_on("worker1"), "worker1", 2)
    assert rref.remote().later(3).to_here().value == 4
    assert rref.rpc_sync().plain(4) == 5
    assert rpc.rpc_sync("worker2", afns.call_from_here, args=("worker1", afns.completed_by_a_thread, 5)) == 6


def test_torchs_own_decorator_is_honoured(world: list[str]) -> None:
    pytest.importorskip("torch.distributed.rpc")
    assert is_async_execution(afns.torch_marked)
    assert rpc.rpc_sync("worker1", afns.torch_marked, args=(21,)) == 42


# -- the decorator: a marked copy, no wrapper ---------------------------------------------------------------


def test_the_decorator_marks_a_copy_and_leaves_the_function_as_it_was() -> None:
    y = 5

    def f(a: int, b: int = 2, *, c: int = 3) -> int:
        """Adds."""
        return a + b + c + y

    f.extra = "kept"  # type: ignore[attr-defined]
    g = rpc.functions.async_execution(f)
    assert g is not f and is_async_execution(g) and not is_async_execution(f)
    assert (g.__name__, g.__qualname__, g.__doc__, g.__module__, g.extra) == (  # type: ignore[attr-defined]
        f.__name__, f.__qualname__, f.__doc__, f.__module__, "kept")
    assert inspect.signature(g) == inspect.signature(f)
    assert g(1) == f(1) == 11 and g(1, 1, c=1) == 8
    # A function that travels by value travels once: a wrapper carried it a second time, in its closure.
    assert len(serialize.dumps((g, (), {}))[0]) <= len(serialize.dumps((f, (), {}))[0]) + 64


def test_the_decorator_wraps_what_is_not_a_plain_function() -> None:
    marked = rpc.functions.async_execution(sorted)
    assert is_async_execution(marked) and not is_async_execution(sorted)
    assert marked([2, 1]) == [1, 2]


# -- functions that travel by value: the submodules they reach ----------------------------------------------


def _cloudpickles_own() -> Any:
    """cloudpickle's ``_find_imported_submodules`` as it ships (nbremote replaces it in the module)."""
    source = inspect.getsource(sys.modules["cloudpickle.cloudpickle"])
    start = source.index("def _find_imported_submodules")
    namespace: dict[str, Any] = {"types": types, "sys": sys}
    exec(source[start:source.index("\n\n\n", start)], namespace)  # cloudpickle's own code, as it ships
    return namespace["_find_imported_submodules"]


def test_by_value_functions_record_the_submodules_cloudpickle_would() -> None:
    pytest.importorskip("torch.distributed.rpc")
    import torch.distributed.rpc  # loaded, so that a function may reach it

    assert sys.modules["cloudpickle.cloudpickle"]._find_imported_submodules is serialize._imported_submodules

    def uses_torch() -> Any:
        return torch.futures.Future(), torch.nn.functional.relu, torch.distributed.rpc

    def uses_others() -> Any:
        return concurrent.futures.ThreadPoolExecutor, xml.etree.ElementTree

    original = _cloudpickles_own()
    dependencies = [torch, concurrent, xml, types]
    for fn in (uses_torch, uses_others):
        ours = serialize._imported_submodules(fn.__code__, dependencies)
        assert sorted(m.__name__ for m in ours) == sorted(m.__name__ for m in original(fn.__code__, dependencies))
    names = {m.__name__ for m in serialize._imported_submodules(uses_torch.__code__, dependencies)}
    assert {"torch.futures", "torch.nn", "torch.nn.functional", "torch.distributed", "torch.distributed.rpc"} <= names
    restored = cloudpickle.loads(cloudpickle.dumps(uses_torch))
    assert restored()[2] is torch.distributed.rpc
