"""rpc_sync / rpc_async / Future / errors / output against real worker kernels."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import remote_fns as fns

from nbremote import rpc
from nbremote.errors import RemoteTraceback, SerializationError, UnknownWorkerError

pytestmark = pytest.mark.timeout(60)


def test_rpc_sync_runs_on_the_named_worker(world: list[str]) -> None:
    assert [rpc.rpc_sync(w, fns.whoami) for w in world] == world
    pids = {rpc.rpc_sync(w, fns.pid) for w in world}
    assert len(pids) == 3 and os.getpid() not in pids


def test_destination_by_name_rank_and_workerinfo(world: list[str]) -> None:
    info = rpc.get_worker_info("worker2")
    assert info == rpc.WorkerInfo("worker2", 2)
    assert rpc.get_worker_info() == rpc.WorkerInfo("driver", 0)
    assert rpc.rpc_sync(2, fns.whoami) == "worker2"
    assert rpc.rpc_sync(info, fns.whoami) == "worker2"
    assert [w.name for w in rpc.workers()] == ["driver", *world]


def test_kwargs_and_builtins(world: list[str]) -> None:
    assert rpc.rpc_sync("worker1", fns.add, args=(2,), kwargs={"b": 3}) == 5
    assert rpc.rpc_sync("worker1", sorted, args=([3, 1, 2],), kwargs={"reverse": True}) == [3, 2, 1]


def test_self_call_runs_in_the_driver(world: list[str]) -> None:
    assert rpc.rpc_sync("driver", fns.pid) == os.getpid()
    assert rpc.rpc_async(0, fns.add, args=(1, 2)).wait() == 3
    with pytest.raises(ZeroDivisionError, match="self"):
        rpc.rpc_sync("driver", fns.fail, args=("zero", "self"))


def test_worker_self_call(world: list[str]) -> None:
    assert rpc.rpc_sync("worker1", fns.call_peer, args=("worker1", fns.whoami)) == "worker1"


def test_rpc_async_future_api(world: list[str]) -> None:
    fut = rpc.rpc_async("worker1", fns.sleep, args=(0.3,))
    assert not fut.done()
    with pytest.raises(RuntimeError, match="before the future completed"):
        fut.value()
    assert fut.wait() == 0.3
    assert fut.done() and fut.value() == 0.3
    seen: list[float] = []
    done = threading.Event()
    fut.add_done_callback(lambda f: (seen.append(f.value()), done.set()))
    assert done.wait(5) and seen == [0.3]
    chained = rpc.rpc_async("worker2", fns.add, args=(1, 1)).then(lambda f: f.value() * 10)
    assert chained.wait() == 20
    # a callback may itself make blocking RPCs: callbacks do not run on the IO thread
    nested = rpc.rpc_async("worker2", fns.add, args=(1, 1)).then(
        lambda f: rpc.rpc_sync("worker3", fns.add, args=(f.value(), 1)))
    assert nested.wait() == 3


def test_errors_are_sticky_and_typed(world: list[str]) -> None:
    fut = rpc.rpc_async("worker2", fns.fail, args=("key", "missing"))
    for _ in range(2):
        with pytest.raises(KeyError, match="missing"):
            fut.wait()
    failing_then = fut.then(lambda f: f.value())
    with pytest.raises(KeyError):
        failing_then.wait()
    raising_cb = rpc.rpc_async("worker2", fns.add, args=(1, 1)).then(lambda f: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        raising_cb.wait()


def test_remote_exception_keeps_type_message_and_traceback(world: list[str]) -> None:
    with pytest.raises(ValueError, match="bad value 42") as info:
        rpc.rpc_sync("worker3", fns.fail, args=("value", "bad value 42"))
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert cause.worker == "worker3"
    assert "remote_fns.py" in cause.text and "in fail" in cause.text
    assert "worker3" in str(cause)
    notes = getattr(info.value, "__notes__", [])
    assert any("worker3" in n and "fail" in n for n in notes)


def test_unpicklable_remote_exception_arrives_by_name(world: list[str]) -> None:
    from nbremote.errors import RemoteError

    with pytest.raises(RemoteError, match=r"Unpicklable.*worker1.*has a lock"):
        rpc.rpc_sync("worker1", fns.raise_unpicklable)


def test_unknown_destination_lists_known_workers(world: list[str]) -> None:
    with pytest.raises(UnknownWorkerError, match=r"could not find destination 'nobody'.*known: driver, worker1, wor"):
        rpc.rpc_sync("nobody", fns.whoami)
    with pytest.raises(UnknownWorkerError, match="could not find destination 17") as info:
        rpc.rpc_sync(17, fns.whoami)
    assert isinstance(info.value, KeyError) and isinstance(info.value, RuntimeError)  # torch's type, and Python's
    with pytest.raises(ValueError, match="worker name, rank or WorkerInfo"):  # torch's ValueError for a float rank
        rpc.rpc_sync(1.5, fns.whoami)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        rpc.rpc_sync("worker1", 42)  # type: ignore[arg-type]


def test_unpicklable_argument_names_type_and_path(world: list[str]) -> None:
    lock = threading.Lock()
    with pytest.raises(SerializationError, match=r"args\[1\].*lock"):
        rpc.rpc_sync("worker1", fns.add, args=(1, lock))
    with pytest.raises(SerializationError, match=r"kwargs\['b'\]\[0\].*lock"):
        rpc.rpc_async("worker1", fns.add, args=(1,), kwargs={"b": [lock]})
    assert rpc.rpc_sync("worker1", fns.add, args=(1, 1)) == 2  # nothing was half-sent


def test_unpicklable_result_is_a_serialization_error(world: list[str]) -> None:
    with pytest.raises(SerializationError, match="cannot be sent back"):
        rpc.rpc_sync("worker1", threading.Lock)


def test_notebook_defined_function_and_class_travel_by_value(world: list[str]) -> None:
    ns: dict[str, object] = {"__name__": "__main__"}
    exec(
        "import math\n"
        "class Point:\n"
        "    def __init__(self, x, y): self.x, self.y = x, y\n"
        "    def norm(self): return math.hypot(self.x, self.y)\n"
        "def make_point(x, y):\n"
        "    return Point(x, y)\n"
        "def norm_of(p):\n"
        "    return p.norm()\n",
        ns,
    )
    p = rpc.rpc_sync("worker1", ns["make_point"], args=(3, 4))  # type: ignore[arg-type]
    assert type(p).__name__ == "Point" and (p.x, p.y) == (3, 4)
    assert rpc.rpc_sync("worker2", ns["norm_of"], args=(ns["Point"](6, 8),)) == 10.0  # type: ignore[operator]


def test_nested_containers_and_numpy(world: list[str]) -> None:
    value = {"a": [np.arange(10), (np.ones((3, 4), dtype=np.float16)[:, ::2], "x")], "b": {1: None}}
    out = rpc.rpc_sync("worker2", fns.echo, args=(value,))
    np.testing.assert_array_equal(out["a"][0], value["a"][0])
    np.testing.assert_array_equal(out["a"][1][0], value["a"][1][0])
    assert out["a"][1][1] == "x" and out["b"] == {1: None}


def test_64mb_array_echo_is_bit_exact(world: list[str]) -> None:
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 2**63, size=8 << 20, dtype=np.uint64)  # 64 MB
    out = rpc.rpc_sync("worker1", fns.echo, args=(arr,))
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert out.tobytes() == arr.tobytes()
    out[0] = 1  # received arrays are writable


def test_64mb_tensor_echo_is_bit_exact(world: list[str]) -> None:
    torch = pytest.importorskip("torch", reason="torch extra not installed")
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(16 << 20, generator=gen)  # 64 MB of float32
    out = rpc.rpc_sync("worker2", fns.echo, args=(t,))
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.int32), t.view(torch.int32))
    strided = torch.arange(24.0, dtype=torch.bfloat16).reshape(4, 6).t()[::2]
    strided.requires_grad_(True)
    back = rpc.rpc_sync("worker3", fns.echo, args=(strided,))
    assert back.dtype == torch.bfloat16 and back.shape == strided.shape and back.stride() == strided.stride()
    assert back.requires_grad and torch.equal(back.detach(), strided.detach())


def test_rpc_async_snapshots_arguments(world: list[str]) -> None:
    arr = np.zeros(1 << 20)
    fut = rpc.rpc_async("worker1", fns.echo, args=(arr,))
    arr += 1  # changing the array after the call returns must not change what was sent
    assert fut.wait().sum() == 0


def test_remote_output_appears_labelled_in_order(world: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert rpc.rpc_sync("worker2", fns.chatty, args=(3,)) == 3
    out, err = capsys.readouterr()
    assert out == "[worker2] line 0\n[worker2] line 1\n[worker2] line 2\n"
    assert err == "[worker2] to stderr\n"
    fut = rpc.rpc_async("worker3", fns.chatty, args=(2,))
    fut.wait()
    out, _ = capsys.readouterr()
    assert out == "[worker3] line 0\n[worker3] line 1\n"


def test_output_of_nested_calls_reaches_the_driver(world: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rpc.rpc_sync("worker1", fns.call_peer, args=("worker2", fns.chatty, 1))
    out, _ = capsys.readouterr()
    assert out == "[worker1] [worker2] line 0\n"


def test_thousand_concurrent_calls_over_three_workers(world: list[str]) -> None:
    futs = [rpc.rpc_async(world[i % 3], fns.add, args=(i, 1)) for i in range(1000)]
    assert [f.wait() for f in futs] == [i + 1 for i in range(1000)]
    owners = [rpc.rpc_async(world[i % 3], fns.whoami) for i in range(30)]
    assert [f.wait() for f in owners] == [world[i % 3] for i in range(30)]


def test_worker_to_worker_call_is_direct(world: list[str]) -> None:
    assert rpc.rpc_sync("worker1", fns.call_peer, args=("worker2", fns.whoami)) == "worker2"
    assert rpc.rpc_sync("worker1", fns.call_peer, args=(3, fns.whoami)) == "worker3"


def test_nested_calls_a_b_a_do_not_deadlock(world: list[str]) -> None:
    assert rpc.rpc_sync("worker1", fns.ping_pong, args=("worker2", 4)) == [
        "worker1", "worker2", "worker1", "worker2", "worker1"]
    futs = [rpc.rpc_async("worker1", fns.ping_pong, args=("worker2", 3)) for _ in range(20)]
    assert all(len(f.wait()) == 4 for f in futs)


def test_calls_are_served_while_a_worker_runs_long_work(world: list[str]) -> None:
    slow = rpc.rpc_async("worker3", fns.sleep, args=(2.0,))
    t0 = time.monotonic()
    assert rpc.rpc_sync("worker3", fns.add, args=(1, 2)) == 3
    assert time.monotonic() - t0 < 1.5
    assert slow.wait() == 2.0


def test_async_execution_replies_when_the_returned_future_completes(world: list[str]) -> None:
    assert rpc.rpc_sync("worker1", fns.add_later, args=("worker2", 1, 2)) == 30
    futs = [rpc.rpc_async("worker1", fns.add_later, args=("worker3", i, 1)) for i in range(200)]
    assert [f.wait() for f in futs] == [(i + 1) * 10 for i in range(200)]
    with pytest.raises(KeyError, match="async missing"):
        rpc.rpc_sync("worker1", fns.async_fails, args=("worker2",))
    with pytest.raises(TypeError, match="marked @async_execution but returned int"):
        rpc.rpc_sync("worker1", fns.async_wrong_type)
    rref = rpc.remote("worker1", fns.add_later, args=("worker2", 2, 2))
    assert rref.to_here() == 40


@pytest.mark.parametrize("bad", ["10", [1], float("nan"), True])
def test_bad_timeout_values_are_refused(world: list[str], bad: object) -> None:
    with pytest.raises(TypeError, match="timeout is a number of seconds"):
        rpc.rpc_sync("worker1", fns.add, args=(1, 2), timeout=bad)  # type: ignore[arg-type]


def test_negative_timeout_means_the_default(world: list[str]) -> None:
    assert rpc.rpc_sync("worker1", fns.sleep, args=(0.1,), timeout=-5) == 0.1


def test_self_call_shares_no_memory_with_the_caller(world: list[str]) -> None:
    arr = np.zeros(1 << 16)
    out = rpc.rpc_sync("driver", fns.echo, args=(arr,))
    out += 1
    assert arr.sum() == 0 and out.sum() == arr.size


def test_membership_and_shutdown_belong_to_the_driver(world: list[str]) -> None:
    with pytest.raises(RuntimeError, match="'worker1' is a worker: only the driver shuts the world down"):
        rpc.rpc_sync("worker1", rpc.shutdown)
    with pytest.raises(RuntimeError, match="only the driver changes the world's membership"):
        rpc.rpc_sync("worker1", rpc.add_worker, args=("sneaky",))
    assert rpc.rpc_sync("worker1", fns.whoami) == "worker1"


def test_a_torch_operator_given_arguments_no_schema_takes_raises_torchs_runtime_error(world: list[str]) -> None:
    """torch's RPC matches a builtin operator's arguments against its schemas: RuntimeError "... failed to
    match any schema"; nbremote's is that error and still the TypeError Python raised, from a worker and from
    the driver itself. Other functions' TypeErrors, and operators whose arguments a schema takes, are as they
    were."""
    import torch

    for dst in ("worker1", "driver"):
        with pytest.raises(RuntimeError, match="Overloaded torch operator invoked from Python failed to match any "
                                               "schema") as info:
            rpc.rpc_sync(dst, torch.add, args=())
        assert isinstance(info.value, TypeError) and "aten::add.Tensor(Tensor self, Tensor other" in str(info.value)
    with pytest.raises(RuntimeError, match="failed to match any schema"):
        rpc.remote("worker2", torch.add, args=(None,)).to_here()
    with pytest.raises(TypeError) as info:
        rpc.rpc_sync("worker1", fns.add, args=(1,))  # a Python function's TypeError stays just that
    assert not isinstance(info.value, RuntimeError)
    with pytest.raises(RuntimeError, match="size of tensor"):  # torch's own RuntimeError, unchanged
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(3), torch.ones(2)))
    assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)), torch.full((2,), 2.0))


@pytest.mark.timeout(30)  # a hang fails here, not after the module's minute
def test_torch_futures_wait_all_returns_at_the_first_error(world: list[str]) -> None:
    """``torch.futures.wait_all`` over nbremote futures returns at the first error, as over torch's RPC
    futures, though others never finish (torch's own function would wait for them: a C++ future made in
    Python never holds an error flag); lists of torch's futures alone still go to torch's function."""
    import torch

    never: rpc.Future[int] = rpc.Future()  # an nbremote future nothing completes
    never_torch: torch.futures.Future[int] = torch.futures.Future()
    failing = rpc.rpc_async("worker2", fns.fail, args=("value", "first error"))
    with pytest.raises(ValueError, match="first error"):
        torch.futures.wait_all([never, failing, never_torch])
    done = torch.futures.Future()
    done.set_result(5)
    assert torch.futures.wait_all([rpc.rpc_async("worker1", fns.add, args=(1, 1)), done]) == [2, 5]
    assert torch.futures.wait_all([done]) == [5]
    assert torch.futures.wait_all.__wrapped__.__module__ == "torch.futures"  # torch's, for torch's lists
    never.set_result(0)
    never_torch.set_result(0)
