"""Every rank calls every other: workers call the driver (rank 0), and RRefs the driver owns are real.

Workers reach the driver through the comm the driver opened on them (the driver is not a kernel); the
driver serves those calls on its executor, never on its main thread, so a notebook cell may be busy.
"""

from __future__ import annotations

import gc
import operator
import os
import time

import numpy as np
import pytest
import remote_fns as fns
from conftest import run_script

from nbremote import rpc
from nbremote.errors import RPCTimeoutError
from nbremote.rpc._core import current_agent

pytestmark = pytest.mark.timeout(60)


def _driver_table_size() -> int:
    for _ in range(3):
        gc.collect()
        time.sleep(0.2)  # releases from workers are on their way
    return len(current_agent().table)


def test_a_worker_calls_the_driver_by_name_and_rank(world: list[str]) -> None:
    assert rpc.rpc_sync("worker1", fns.call_peer, args=("driver", fns.pid)) == os.getpid()
    assert rpc.rpc_sync("worker2", fns.call_peer, args=(0, fns.whoami)) == "driver"
    assert rpc.rpc_sync("worker3", fns.call_peer_async, args=("driver", fns.add, 2, 3)) == 5
    arr = np.arange(300_000, dtype=np.float32)  # out-of-band buffers, both ways
    assert np.array_equal(rpc.rpc_sync("worker1", fns.call_peer, args=("driver", fns.echo, arr)), arr)


def test_the_driver_serves_off_its_main_thread_while_the_main_thread_is_busy(world: list[str]) -> None:
    fut = rpc.rpc_async("worker1", fns.call_peer, args=("driver", fns.served_where))
    start = time.monotonic()
    spins = 0
    while time.monotonic() - start < 2.0:  # a "cell" busy in Python on the main thread
        spins += 1
    busy_until = time.monotonic()
    thread, on_main, served_at = fut.wait()
    assert not on_main and thread.startswith("nbremote-driver")
    assert served_at < busy_until, "the call waited for the main thread"


def test_a_driver_owned_rref_is_a_reference_not_a_copy(world: list[str]) -> None:
    counter = fns.Counter(0)
    rref = rpc.RRef(counter)
    assert rpc.rpc_sync("worker1", fns.rref_owner_name, args=(rref,)) == "driver"
    futs = [rpc.rpc_async(w, fns.incr_many, args=(rref, 100)) for w in ("worker1", "worker2")]
    assert max(f.wait() for f in futs) == 200
    assert counter.value == 200, "two workers mutated the driver's object through its RRef"
    assert rpc.rpc_sync("worker3", fns.rref_to_here, args=(rref,)).value == 200  # to_here: a copy
    counter.incr(5)
    assert rpc.rpc_sync("worker3", fns.rref_to_here, args=(rref,)).value == 205


def test_workers_create_rrefs_owned_by_the_driver(world: list[str]) -> None:
    rref = rpc.rpc_sync("worker2", fns.remote_on_peer, args=("driver", fns.Counter, 7))
    assert rref.owner_name() == "driver" and rref.is_owner()
    assert rref.local_value().incr() == 8
    assert rpc.rpc_sync("worker1", fns.incr_many, args=(rref, 2)) == 10


def test_driver_owned_values_are_freed_when_workers_drop_them(world: list[str]) -> None:
    base = _driver_table_size()
    rrefs = [rpc.RRef([i]) for i in range(20)]
    held = rpc.rpc_sync("worker1", fns.echo, args=(rrefs,))  # forks: worker1 held them, then sent them back
    assert [r.owner_name() for r in held[:2]] == ["driver", "driver"]
    assert _driver_table_size() == base + 20
    del rrefs
    assert _driver_table_size() == base + 20, "the returned forks still hold every value"
    del held
    assert _driver_table_size() == base


def test_errors_and_timeouts_of_worker_to_driver_calls(world: list[str]) -> None:
    with pytest.raises(ZeroDivisionError, match="raised by the driver"):
        rpc.rpc_sync("worker1", fns.call_peer, args=("driver", fns.fail, "zero", "raised by the driver"))
    with pytest.raises(RPCTimeoutError, match=r"ran for more than 300 ms.*sleep on 'driver'"):
        rpc.rpc_sync("worker2", fns.call_peer_with_timeout, args=("driver", fns.sleep, 0.3, 1.5))


def test_output_of_calls_the_driver_serves_lands_in_the_calling_cell() -> None:
    # A fresh driver process: pytest's capture would replace the stdout that nbremote wraps.
    result = run_script("""
        import sys
        sys.path.insert(0, "tests")
        import remote_fns as fns
        from nbremote import rpc
        rpc.init_rpc("driver", workers=["w1"])
        print(rpc.rpc_sync("w1", fns.call_peer, args=("driver", fns.shout, "hello from the driver")))
        print("outside a call")
        rpc.shutdown()
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[w1] [driver] hello from the driver", "21", "outside a call"]


def test_nested_driver_worker_driver_chains(world: list[str]) -> None:
    assert rpc.rpc_sync("worker1", fns.ping_pong, args=("driver", 4)) == [
        "worker1", "driver", "worker1", "driver", "worker1"]
    futs = [rpc.rpc_async(w, fns.ping_pong, args=("driver", 3)) for w in world for _ in range(10)]
    assert all(len(f.wait()) == 4 for f in futs)


_seen: list[int] = []  # filled on the driver by calls from workers (they import this module by name)


def _record(i: int) -> int:
    _seen.append(i)
    return i


def test_many_concurrent_worker_to_driver_calls(world: list[str]) -> None:
    _seen.clear()
    futs = [rpc.rpc_async(world[i % 3], fns.call_peer_async, args=("driver", _record, i)) for i in range(300)]
    assert [f.wait() for f in futs] == list(range(300))
    assert sorted(_seen) == list(range(300))


def _shell_socket_drops() -> bool:
    """On a worker: whether its kernel's shell socket would drop what it cannot queue for a caller."""
    import zmq
    from IPython import get_ipython

    return bool(get_ipython().kernel.shell_stream.socket.getsockopt(zmq.SNDHWM))


def test_bursts_of_calls_from_every_worker_to_the_driver_all_arrive(world: list[str]) -> None:
    """Every worker sends 2,000 calls to the driver at once while the driver calls them (torch's stress test
    does this, each rank to the next). A kernel's shell socket is a ROUTER: it dropped, without a word, what
    its queue to a caller could not hold (1,000 messages by default), and those calls never returned."""
    assert not any(rpc.rpc_sync(w, _shell_socket_drops) for w in world)
    bursts = [rpc.rpc_async(w, fns.burst_to, args=("driver", 2000)) for w in world]
    mine = [rpc.rpc_async(world[i % len(world)], operator.add, args=(i, 1)) for i in range(2000)]
    assert [f.wait() for f in mine] == [i + 1 for i in range(2000)]
    assert [f.wait() for f in bursts] == [2000] * len(world)
