"""RRefs: creation, proxies, passing between workers, and distributed reference counting."""

from __future__ import annotations

import gc
import pickle
import time
from typing import Any

import pytest
import remote_fns as fns

from nbremote import rpc
from nbremote.errors import RRefError
from nbremote.rpc._core import current_agent

pytestmark = pytest.mark.timeout(90)


def test_remote_returns_at_once_and_to_here_fetches(world: list[str]) -> None:
    t0 = time.monotonic()
    rref = rpc.remote("worker1", fns.sleep, args=(0.5,))
    assert time.monotonic() - t0 < 0.4
    assert rref.owner() == rpc.WorkerInfo("worker1", 1) and rref.owner_name() == "worker1"
    assert not rref.is_owner()
    assert rref.to_here() == 0.5
    assert rref.confirmed_by_owner()


def test_local_value_only_on_owner(world: list[str]) -> None:
    rref = rpc.remote("worker2", fns.make_list, args=(3,))
    with pytest.raises(RRefError, match=r"only available on the RRef's owner 'worker2'.*to_here"):
        rref.local_value()
    local = rpc.RRef([1, 2])
    assert local.is_owner() and local.owner_name() == "driver" and local.local_value() == [1, 2]
    assert local.to_here() == [1, 2]


def test_creation_error_surfaces_on_first_use(world: list[str]) -> None:
    rref = rpc.remote("worker1", fns.fail, args=("value", "cannot build"))
    with pytest.raises(ValueError, match="cannot build"):
        rref.to_here()
    assert not rref.confirmed_by_owner()
    with pytest.raises(ValueError, match="cannot build"):
        rref.rpc_sync().anything()


def test_proxies_call_methods_on_the_owner(world: list[str]) -> None:
    counter = rpc.remote("worker3", fns.Counter, args=(10,))
    assert counter.rpc_sync().incr() == 11
    assert counter.rpc_async().incr(5).wait() == 16
    value_rref = counter.remote().incr(1)
    assert value_rref.owner_name() == "worker3" and value_rref.to_here() == 17
    assert counter.to_here().value == 17


def test_to_here_timeout(world: list[str]) -> None:
    rref = rpc.remote("worker2", fns.sleep, args=(2.0,))
    with pytest.raises(TimeoutError, match="ran for more than 300 ms"):
        rref.to_here(timeout=0.3)
    assert rref.to_here() == 2.0


def test_rref_passed_worker1_to_worker2_resolves_there(world: list[str]) -> None:
    rref = rpc.remote("worker1", fns.make_list, args=(4,))
    assert rpc.rpc_sync("worker2", fns.rref_owner_name, args=(rref,)) == "worker1"
    assert rpc.rpc_sync("worker2", fns.rref_to_here, args=(rref,)) == [0, 1, 2, 3]
    # made on worker1, returned to the driver, handed to worker3
    made_there = rpc.rpc_sync("worker1", fns.make_rref_here, args=("on worker1",))
    assert made_there.owner_name() == "worker1"
    assert rpc.rpc_sync("worker3", fns.rref_to_here, args=(made_there,)) == "on worker1"
    # the owner receiving its own RRef sees the value itself
    assert rpc.rpc_sync("worker1", fns.rref_to_here, args=(made_there,)) == "on worker1"
    rrefs = [rpc.remote(w, fns.add, args=(i, 0)) for i, w in enumerate(world)]
    assert rpc.rpc_sync("worker2", fns.sum_rrefs, args=(rrefs,)) == 0 + 1 + 2


def test_plain_pickle_of_an_rref_is_refused(world: list[str]) -> None:
    with pytest.raises(RRefError, match="only be pickled by nbremote's RPC"):
        pickle.dumps(rpc.remote("worker1", fns.make_list, args=(1,)))


def _settled_table_size(worker: str) -> int:
    gc.collect()
    return int(rpc.rpc_sync(worker, fns.rref_table_size))


def test_owner_frees_values_when_references_are_dropped(world: list[str]) -> None:
    base = _settled_table_size("worker2")
    rrefs = [rpc.remote("worker2", fns.make_list, args=(10,)) for _ in range(50)]
    assert [r.to_here() for r in rrefs[:3]] == [list(range(10))] * 3
    assert _settled_table_size("worker2") == base + 50
    forwarded = rpc.rpc_sync("worker3", fns.echo, args=(rrefs[:10],))  # forks held by the driver again
    del rrefs
    assert _settled_table_size("worker2") == base + 10
    del forwarded
    assert _settled_table_size("worker2") == base


def test_an_rref_lent_to_its_owner_by_a_blocking_call_can_be_kept_there(world: list[str]) -> None:
    # rpc_sync brings the RRef to its owner without a reference-count message ahead of the call (the
    # caller's reference holds the value until the reply); the owner counts the copy it keeps all the same.
    rref = rpc.remote("worker2", fns.make_list, args=(5,))
    base = _settled_table_size("worker2")
    assert rpc.rpc_sync("worker2", fns.keep, args=(rref,)) == 2  # the caller's token and the lent one
    assert rref.rpc_sync().copy() == [0, 1, 2, 3, 4]  # a proxy's blocking call lends it too
    del rref
    assert _settled_table_size("worker2") == base, "the kept copy holds the value"
    assert rpc.rpc_sync("worker2", fns.kept_values) == [[0, 1, 2, 3, 4]]
    rpc.rpc_sync("worker2", fns.drop_kept)
    assert _settled_table_size("worker2") == base - 1


@pytest.mark.timeout(180)
def test_ten_thousand_rrefs_do_not_grow_owner_memory(world: list[str]) -> None:
    base_entries = _settled_table_size("worker1")
    payload = 1000  # each value is a list of 1000 ints: ~36 KB, 360 MB if none were freed

    def churn(n: int) -> None:
        for _start in range(0, n, 500):
            batch = [rpc.remote("worker1", fns.make_list, args=(payload,)) for _ in range(500)]
            batch[-1].to_here()
            del batch
            gc.collect()

    churn(2000)  # warm the owner's allocator
    rss_before = rpc.rpc_sync("worker1", fns.rss_bytes)
    churn(10_000)
    assert _settled_table_size("worker1") == base_entries
    growth = rpc.rpc_sync("worker1", fns.rss_bytes) - rss_before
    assert growth < 40 << 20, f"owner RSS grew by {growth / 2**20:.1f} MB over 10,000 RRefs"


def _collect_while_holding_the_table_lock() -> tuple[int, int]:
    """On a worker: a garbage collection that frees an RRef of ours while this very thread holds the owner
    table's lock -- what a collection triggered by an allocation inside the table does. It must not wait
    for that lock (a self-deadlock: seen as a RemoteModule creation that never answered)."""
    agent = current_agent()
    rref = rpc.RRef([1, 2, 3])
    before = len(agent.table)
    with agent.table._lock:
        del rref
        gc.collect()
    deadline = time.monotonic() + 5
    while len(agent.table) >= before and time.monotonic() < deadline:  # released on the IO thread's tick
        time.sleep(0.02)
    return before, len(agent.table)


def test_an_rref_collected_inside_the_owner_table_lock_is_released_later(world: list[str]) -> None:
    before, after = rpc.rpc_sync("worker1", _collect_while_holding_the_table_lock, timeout=20)
    assert after == before - 1
    assert rpc.rpc_sync("worker1", fns.whoami) == "worker1"


class Held:
    """A value of a type of this module's own, for ``_get_type``."""


def types_seen_from(owner: str) -> list[Any]:
    """On any member: ``_get_type`` of RRefs ``owner`` holds, asked blocking, by Future, and with a timeout."""
    import torch

    tensor, held = rpc.remote(owner, torch.add, args=(torch.ones(2), 1)), rpc.remote(owner, Held)
    pending = tensor._get_type(timeout=10, blocking=False)
    return [tensor._get_type(), pending.wait(), tensor._get_type(blocking=False) is pending,
            held._get_type(timeout=10, blocking=True), held._get_type(blocking=False).wait()]


def test_get_type_answers_the_type_of_the_value_from_any_member(world: list[str]) -> None:
    """torch's ``RRef._get_type(timeout, blocking)``: the referenced value's type, or a Future of it that is the
    same every time (asked of the owner once), wherever the caller and the owner are."""
    import torch

    expected = [torch.Tensor, torch.Tensor, True, Held, Held]
    assert types_seen_from("worker1") == expected  # the driver asks a worker
    assert rpc.rpc_sync("worker1", types_seen_from, args=("worker2",)) == expected  # a worker asks a worker
    assert rpc.rpc_sync("worker3", types_seen_from, args=("driver",)) == expected  # a worker asks the driver
    fut = rpc.remote("worker2", fns.make_list, args=(2,))._get_type(blocking=False)
    assert isinstance(fut, rpc.Future) and isinstance(fut, torch.futures.Future) and fut.wait() is list
    owned = rpc.RRef(Held())
    assert owned._get_type() is Held and owned._get_type(blocking=False).wait() is Held
