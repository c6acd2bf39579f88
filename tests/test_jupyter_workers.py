"""The worker-management API the notebook layer stands on: status, resources, restart, interrupt.

Real kernels throughout: the session's ``world`` (worker1..worker3) plus workers these tests add and
remove themselves, and one kernel started beside nbremote and attached to it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import remote_fns as fns
from conftest import own_worker, pid_alive
from jupyter_client.manager import KernelManager

import nbremote
from nbremote import rpc
from nbremote.errors import UnknownWorkerError, WorkerError, WorkerLostError

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def spare() -> Iterator[str]:
    """A worker of this test's own (restarted, interrupted or killed by it), removed afterwards."""
    yield from own_worker("spare")


def _status(name: str) -> rpc.WorkerStatus:
    return {s.name: s for s in rpc.worker_status()}[name]


def test_worker_status_describes_every_worker(world: list[str]) -> None:
    rows = rpc.worker_status()
    assert [r.name for r in rows][:3] == world
    assert [r.rank for r in rows] == sorted(r.rank for r in rows)
    for row in rows[:3]:
        assert row.kind == "local" and row.state == "idle" and row.host
        assert row.pid == rpc.rpc_sync(row.name, fns.pid) and pid_alive(row.pid)
        assert row.log_path is not None and Path(row.log_path).exists()


def test_status_counts_calls_in_flight_and_total(world: list[str]) -> None:
    before = _status("worker2").calls_total
    fut = rpc.rpc_async("worker2", fns.sleep, args=(1.0,))
    time.sleep(0.2)
    busy = _status("worker2")
    assert busy.state == "busy" and busy.calls_in_flight == 1 and busy.calls_total == before + 1
    fut.wait()
    idle = _status("worker2")
    assert idle.state == "idle" and idle.calls_in_flight == 0 and idle.calls_total == before + 1


def test_worker_resources_lists_devices_and_owned_rrefs(world: list[str]) -> None:
    before = rpc.worker_resources("worker3")
    assert before.worker == "worker3" and before.devices[0].name == "cpu"
    rref = rpc.remote("worker3", dict, kwargs={"a": 1})
    rref.to_here()
    assert rpc.worker_resources("worker3").owned_rrefs == before.owned_rrefs + 1
    del rref


def test_worker_resources_lists_cuda_devices_where_torch_sees_them(world: list[str]) -> None:
    torch = pytest.importorskip("torch")
    rpc.rpc_sync("worker1", __import__, args=("torch",))  # devices come from a framework already loaded
    names = [d.name for d in rpc.worker_resources("worker1").devices]
    assert names == ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def test_a_killed_worker_shows_dead(world: list[str], spare: str) -> None:
    pid = _status(spare).pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _status(spare).state != "dead" and time.monotonic() < deadline:
        time.sleep(0.1)
    dead = _status(spare)
    assert dead.state == "dead" and "exited" in dead.detail


def test_restart_keeps_name_and_rank_and_gives_a_fresh_kernel(world: list[str], spare: str) -> None:
    rank, old_pid = rpc.get_worker_info(spare).id, rpc.rpc_sync(spare, fns.pid)
    rpc.run_cell(spare, "left_behind = 1")
    pending = rpc.rpc_async(spare, fns.sleep, args=(30,))
    time.sleep(0.2)
    info = rpc.restart_worker(spare)
    with pytest.raises(WorkerLostError, match="restart_worker"):
        pending.wait(5)
    assert info == rpc.get_worker_info(spare) and info.id == rank
    new_pid = rpc.rpc_sync(spare, fns.pid)
    assert new_pid != old_pid and not pid_alive(old_pid)
    assert _status(spare).pid == new_pid and _status(spare).state == "idle"
    names: list[str] = []
    rpc.run_cell(spare, "print('left_behind' in dir())", on_output=lambda w, t, c: names.append(c.get("text", "")))
    assert "".join(names).strip() == "False"
    # peers learnt the new kernel's address, and drop what they knew of the old one
    assert rpc.rpc_sync("worker1", fns.call_peer, args=(spare, fns.whoami)) == spare


def test_restart_fails_pending_calls_of_peers_too(world: list[str], spare: str) -> None:
    pending = rpc.rpc_async("worker1", fns.call_peer, args=(spare, fns.sleep, 30))
    time.sleep(0.5)
    rpc.restart_worker(spare)
    with pytest.raises(WorkerLostError, match=spare):
        pending.wait(10)


@pytest.fixture(scope="module")
def outside_kernel() -> Iterator[KernelManager]:
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(30)
    kc.stop_channels()
    yield km
    km.shutdown_kernel(now=True)


def test_an_attached_kernel_cannot_be_restarted_but_can_be_interrupted(world: list[str],
                                                                       outside_kernel: KernelManager) -> None:
    rpc.add_worker("outside", nbremote.AttachedKernel(outside_kernel.connection_file))
    try:
        assert _status("outside").kind == "attached"
        with pytest.raises(WorkerError, match=r"attached kernel.*remove_worker\('outside'\)") as info:
            rpc.restart_worker("outside")
        assert info.value.worker == "outside"
        run = rpc.run_cell("outside", "import time\nfor _ in range(300): time.sleep(0.1)", background=True,
                           on_output=lambda *a: None)
        time.sleep(0.5)
        rpc.interrupt_worker("outside")  # by interrupt_request on its control channel
        with pytest.raises(rpc.RemoteCellError, match="KeyboardInterrupt"):
            run.wait(10)
        assert rpc.rpc_sync("outside", fns.whoami) == "outside"
    finally:
        rpc.remove_worker("outside")


def test_interrupt_stops_the_cell_and_rpcs_go_on(world: list[str], spare: str) -> None:
    run = rpc.run_cell(spare, "import time\nfor _ in range(300): time.sleep(0.1)", background=True,
                       on_output=lambda *a: None)
    time.sleep(0.5)
    assert _status(spare).state == "busy"
    t0 = time.monotonic()
    assert rpc.rpc_sync(spare, fns.whoami) == spare  # served by the subshell while the cell runs
    assert time.monotonic() - t0 < 2
    rpc.interrupt_worker(spare)
    with pytest.raises(rpc.RemoteCellError, match="KeyboardInterrupt") as info:
        run.wait(10)
    assert info.value.outcomes[spare].ename == "KeyboardInterrupt"
    assert _status(spare).state == "idle"


def test_unknown_workers_are_named(world: list[str]) -> None:
    for action in (rpc.restart_worker, rpc.interrupt_worker):
        with pytest.raises(UnknownWorkerError, match=r"nobody.*known: driver, worker1"):
            action("nobody")


def test_status_shows_starting_while_a_worker_starts(world: list[str]) -> None:
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.extend(s.state for s in rpc.worker_status() if s.name == "newcomer")
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        rpc.add_worker("newcomer")
    finally:
        stop.set()
        watcher.join()
    seen.append(_status("newcomer").state)
    try:
        assert seen[0] == "starting" and seen[-1] == "idle"
    finally:
        rpc.remove_worker("newcomer")
