"""A worker killed, paused, restarted behind our back or silent: a typed error fast, the rest unharmed,
and a replacement that works (``rpc.restart_worker`` + a fresh RemoteModule)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import remote_fns as fns
import torch
from jupyter_client import KernelManager
from test_autograd import SlowSGD, SlowStage, TorchStage, _fails_fast_when_killed

import nbremote
import nbremote.autograd as dist_autograd
from nbremote import rpc
from nbremote.errors import RPCTimeoutError, WorkerLostError
from nbremote.nn import RemoteModule
from nbremote.optim import DistributedOptimizer

from . import fault_fns as ffns
from .conftest import failure_of, worker_names

pytestmark = pytest.mark.timeout(90)

FAST = 2.5  # s: "within ~2 s" for a dead worker, with slack for this loaded 2-core machine
MB64 = 64 << 20


def victim_pid(name: str) -> int:
    pid: int = rpc.rpc_sync(name, ffns.pid)
    return pid


def others_unaffected(world: list[str]) -> None:
    assert [rpc.rpc_sync(w, fns.whoami) for w in world] == world
    assert rpc.rpc_sync("worker1", fns.call_peer, args=("worker2", fns.whoami)) == "worker2"


def shm_of(pid: int) -> list[str]:
    """Shared-memory segments a process made (named ``nbr-<pid>-...``, see rpc._shm)."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"nbr-{pid}-*"))


def recover(name: str, old_pid: int) -> float:
    """Restart ``name``, check the old process and its shared memory are gone and a fresh RemoteModule
    works there; returns the seconds it took."""
    t0 = time.monotonic()
    rpc.restart_worker(name)
    module = RemoteModule(f"{name}/cpu", torch.nn.Linear, args=(4, 2))
    out = module(torch.ones(3, 4))
    elapsed = time.monotonic() - t0
    assert out.shape == (3, 2)
    assert victim_pid(name) != old_pid
    assert shm_of(old_pid) == [], "the dead worker's shared memory was left behind"
    return elapsed


ATTEMPTS = 3  # a kill meant to land mid-transfer can come too late on a busy machine; the test then retries


def _restarted(name: str) -> int:
    rpc.restart_worker(name)
    return victim_pid(name)


def kill_when(pid: int, ready: Callable[[], bool], timeout: float = 30) -> float:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, "the fault's moment never came"
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def test_kill_9_mid_call(world: list[str], victim: str, record: Callable[..., None]) -> None:
    pid = victim_pid(victim)
    pending = [rpc.rpc_async(victim, fns.sleep, args=(30,)) for _ in range(3)]
    time.sleep(0.3)
    killed = kill_when(pid, lambda: True)
    errors = [failure_of(lambda f=f: f.wait(10), killed) for f in pending]  # type: ignore[misc]
    for exc, _ in errors:
        assert isinstance(exc, WorkerLostError) and exc.worker == victim, repr(exc)
        assert "restart_worker('victim')" in str(exc)
    to_error = max(t for _, t in errors)
    assert to_error < FAST
    others_unaffected(world)
    record("kill -9 mid-call (3 calls pending)", "WorkerLostError", errors[0][0], to_error, recover(victim, pid),
           "the 3 pending calls (failed typed)")


def test_kill_9_while_a_64_mb_argument_is_sent(world: list[str], victim: str, record: Callable[..., None]) -> None:
    pid = victim_pid(victim)
    arg = torch.ones(MB64 // 4)
    for _ in range(ATTEMPTS):
        fut = rpc.rpc_async(victim, ffns.swallow, args=(arg,))
        killed = kill_when(pid, lambda: True)  # rpc_async returned: the 64 MB are on their way
        exc, to_error = failure_of(lambda: fut.wait(10), killed)  # noqa: B023 -- called at once
        if exc is not None:
            break
        assert fut.value() == MB64  # it all arrived before the kill landed: intact; try again
        pid = _restarted(victim)
    assert isinstance(exc, WorkerLostError) and exc.worker == victim, repr(exc)
    assert to_error < FAST
    others_unaffected(world)
    assert rpc.rpc_sync("worker1", ffns.swallow, args=(arg,)) == MB64  # the same transfer elsewhere is fine
    record("kill -9 mid-transfer, 64 MB argument driver->worker", "WorkerLostError", exc, to_error,
           recover(victim, pid), "the call (failed typed)")


def test_kill_9_while_a_64_mb_result_is_sent(world: list[str], victim: str, tmp_path: Path,
                                            record: Callable[..., None]) -> None:
    pid = victim_pid(victim)
    for attempt in range(ATTEMPTS):
        flag = tmp_path / f"result-ready-{attempt}"
        fut = rpc.rpc_async(victim, ffns.big_result, args=(MB64, str(flag)))
        killed = kill_when(pid, flag.exists)  # the worker returned its 64 MB tensor: it is being sent now
        exc, to_error = failure_of(lambda: fut.wait(10), killed)  # noqa: B023 -- called at once
        if exc is not None:
            break
        assert fut.value().numel() == MB64 // 4  # it all arrived before the kill landed: intact; try again
        pid = _restarted(victim)
    assert isinstance(exc, WorkerLostError) and exc.worker == victim, repr(exc)
    assert to_error < FAST
    others_unaffected(world)
    record("kill -9 mid-transfer, 64 MB result worker->driver", "WorkerLostError", exc, to_error,
           recover(victim, pid), "the call (failed typed)")


def test_kill_9_during_a_distributed_backward(world: list[str], victim: str, record: Callable[..., None]) -> None:
    pid = victim_pid(victim)
    slow = RemoteModule(f"{victim}/cpu", SlowStage)
    fast = RemoteModule("worker1/cpu", TorchStage, args=(4, 4))

    def run() -> None:
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [slow(fast(torch.randn(2, 4))).sum()])

    exc, to_error = _fails_fast_when_killed(pid, run)
    assert isinstance(exc, WorkerLostError) and exc.worker == victim, repr(exc)
    assert to_error < FAST
    others_unaffected(world)
    assert fast(torch.ones(1, 4)).shape == (1, 4)  # the survivor's module still serves
    record("kill -9 during dist_autograd.backward", "WorkerLostError", exc, to_error, recover(victim, pid),
           "the backward; the victim's module (the survivors' context released)")


def test_kill_9_during_an_optimizer_step(world: list[str], victim: str, record: Callable[..., None]) -> None:
    pid = victim_pid(victim)
    stage = RemoteModule(f"{victim}/cpu", TorchStage, args=(2, 2))
    other = RemoteModule("worker2/cpu", TorchStage, args=(2, 2))
    opt = DistributedOptimizer(SlowSGD, [*stage.remote_parameters(), *other.remote_parameters()], lr=0.1)

    def run() -> None:
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [(stage(torch.ones(1, 2)) + other(torch.ones(1, 2))).sum()])
            opt.step(context_id)

    exc, to_error = _fails_fast_when_killed(pid, run)
    assert isinstance(exc, WorkerLostError) and exc.worker == victim, repr(exc)
    assert to_error < FAST
    others_unaffected(world)
    assert other(torch.ones(1, 2)).shape == (1, 2)
    record("kill -9 during DistributedOptimizer.step", "WorkerLostError", exc, to_error, recover(victim, pid),
           "the step; the victim's parameters")


def test_kill_9_of_an_owner_whose_rrefs_others_hold(world: list[str], victim: str,
                                                   record: Callable[..., None]) -> None:
    pid = victim_pid(victim)
    rref = rpc.remote(victim, fns.make_list, args=(5,))
    slot = rpc.rpc_sync("worker1", ffns.keep, args=(rref,))
    assert rpc.rpc_sync("worker1", ffns.kept_to_here, args=(slot,)) == [0, 1, 2, 3, 4]
    try:
        killed = kill_when(pid, lambda: True)
        exc, to_error = failure_of(lambda: rpc.rpc_sync("worker1", ffns.kept_to_here, args=(slot,)), killed)
        assert isinstance(exc, WorkerLostError) and exc.worker == victim, repr(exc)
        assert to_error < FAST
        here, _ = failure_of(rref.to_here, killed)
        assert isinstance(here, WorkerLostError) and here.worker == victim, repr(here)
        others_unaffected(world)
    finally:
        rpc.rpc_sync("worker1", ffns.drop_kept)
    record("kill -9 of an RRef owner (RRef held by worker1)", "WorkerLostError on every holder", exc, to_error,
           recover(victim, pid), "the owned values (their RRefs fail typed)")


def test_a_call_that_never_answers_times_out_and_is_cancelled_there(world: list[str], tmp_path: Path,
                                                                     record: Callable[..., None]) -> None:
    flag = tmp_path / "finished"
    t0 = time.monotonic()
    exc, elapsed = failure_of(lambda: rpc.rpc_sync("worker3", fns.busy_loop, args=(3.0, str(flag)), timeout=1.0), t0)
    assert isinstance(exc, RPCTimeoutError) and "RPC ran for more than 1000 ms" in str(exc), repr(exc)
    assert elapsed < 1.0 + FAST
    assert rpc.rpc_sync("worker3", fns.add, args=(1, 2)) == 3
    time.sleep(3.5)
    assert not flag.exists(), "the timed-out call kept running on the worker"
    record("a call that never answers (timeout=1 s)", "RPCTimeoutError, cancelled there", exc, elapsed - 1.0, None,
           "the call (cancelled on the worker)")


def test_a_call_stuck_in_c_past_its_timeout_fails_typed_and_restart_stops_it(
        world: list[str], victim: str, record: Callable[..., None]) -> None:
    pid = victim_pid(victim)
    t0 = time.monotonic()
    exc, elapsed = failure_of(lambda: rpc.rpc_sync(victim, time.sleep, args=(60,), timeout=1.0), t0)
    assert isinstance(exc, RPCTimeoutError) and f"rpc.restart_worker({victim!r}) stops it" in str(exc), repr(exc)
    assert elapsed < 1.0 + FAST
    assert rpc.rpc_sync(victim, fns.add, args=(1, 1)) == 2  # still served, by another thread
    record("a call blocked in C (time.sleep(60)), timeout=1 s", "RPCTimeoutError naming restart_worker", exc,
           elapsed - 1.0, recover(victim, pid), "the call; the stuck thread (until the restart)")


def test_a_pause_shorter_than_the_heartbeat_limit_is_waited_out(world: list[str], victim: str,
                                                                 record: Callable[..., None]) -> None:
    pid = victim_pid(victim)
    fut = rpc.rpc_async(victim, ffns.sleep_then, args=(0.2, "done"))
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(3.0)  # six heartbeat intervals, well under the 10 s limit of a kernel we started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert fut.wait(10) == "done"
    assert rpc.rpc_sync(victim, fns.add, args=(2, 3)) == 5
    record("SIGSTOP 3 s then SIGCONT (kernel nbremote started)", "nothing: the call finishes late", None, None,
           None, "nothing")


def test_a_pause_shorter_than_the_limit_is_waited_out_by_other_workers_too(world: list[str], victim: str) -> None:
    """Another worker's link to the victim once gave up after its own 1.5 s heartbeat limit, on a busy machine
    too: the driver polls the victim's process and tells the others when it dies, so they wait as it does."""
    caller = world[0]
    assert rpc.rpc_sync(caller, ffns.call_from_here, args=(victim, fns.add, 1, 2)) == 3  # its link is open
    pid = victim_pid(victim)
    fut = rpc.rpc_async(caller, ffns.call_from_here, args=(victim, ffns.sleep_then, 0.2, "done"))
    time.sleep(0.1)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(3.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert fut.wait(10) == "done"
    assert rpc.rpc_sync(caller, ffns.call_from_here, args=(victim, fns.add, 2, 3)) == 5


def test_a_pause_past_the_heartbeat_limit_loses_the_worker_until_restarted(
        world: list[str], victim: str, record: Callable[..., None]) -> None:
    pid = victim_pid(victim)
    rref = rpc.remote(victim, fns.make_list, args=(3,))
    assert rref.to_here() == [0, 1, 2]
    fut = rpc.rpc_async(victim, ffns.sleep_then, args=(0.2, "done"))
    stopped = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        exc, to_error = failure_of(lambda: fut.wait(20), stopped)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert isinstance(exc, WorkerLostError) and "heartbeat" in str(exc) and "paused" in str(exc), repr(exc)
    assert 9 < to_error < 10 + FAST
    time.sleep(1.0)  # resumed: it stays lost, it may have missed messages meanwhile
    for use in (lambda: rpc.rpc_sync(victim, fns.whoami), rref.to_here):
        later, _ = failure_of(use, time.monotonic())
        assert isinstance(later, WorkerLostError) and "restart_worker('victim')" in str(later), repr(later)
    others_unaffected(world)
    record("SIGSTOP 12 s then SIGCONT (kernel nbremote started)", "WorkerLostError after 10 s, stays lost", exc,
           to_error, recover(victim, pid), "the pending call and the worker's values")


# -- kernels nbremote did not start ----------------------------------------------------------------------------


@pytest.fixture
def kernel() -> Iterator[KernelManager]:
    """A kernel someone else started (a plain KernelManager), attached as 'att'; removed afterwards."""
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)
    try:
        yield km
    finally:
        if "att" in worker_names():
            rpc.remove_worker("att")
        km.shutdown_kernel(now=True)


def attach_with_module(km: KernelManager) -> tuple[float, RemoteModule]:
    t0 = time.monotonic()
    rpc.add_worker("att", nbremote.AttachedKernel(km.connection_file))
    module = RemoteModule("att/cpu", torch.nn.Linear, args=(4, 2))
    assert module(torch.ones(1, 4)).shape == (1, 2)
    return time.monotonic() - t0, module


def test_a_kernel_restarted_behind_our_back_reports_its_rrefs_and_modules_lost(
        world: list[str], kernel: KernelManager, record: Callable[..., None]) -> None:
    _, module = attach_with_module(kernel)
    rref = rpc.remote("att", fns.make_list, args=(3,))
    assert rref.to_here() == [0, 1, 2]
    kernel.restart_kernel(now=True)  # by its own KernelManager: same ports, new process, nbremote not there
    restarted = time.monotonic()
    exc, to_error = failure_of(lambda: module(torch.ones(1, 4)), restarted)
    assert isinstance(exc, WorkerLostError) and "restarted" in str(exc), repr(exc)
    assert to_error < FAST, "a restart must be noticed within the session check, not by a 60 s timeout"
    for use in (rref.to_here, lambda: rpc.rpc_sync("att", fns.whoami)):
        later, _ = failure_of(use, time.monotonic())
        assert isinstance(later, WorkerLostError) and "restarted" in str(later), repr(later)
    others_unaffected(world)
    rpc.remove_worker("att")
    recovery, _ = attach_with_module(kernel)
    record("attached kernel restarted behind the driver's back", "WorkerLostError ('restarted') at next use", exc,
           to_error, recovery, "its RRefs and modules (reported lost)")


def test_an_attached_kernel_paused_past_its_heartbeat_is_lost_and_can_be_attached_again(
        world: list[str], kernel: KernelManager, record: Callable[..., None]) -> None:
    attach_with_module(kernel)
    pid = rpc.rpc_sync("att", ffns.pid)
    fut = rpc.rpc_async("att", ffns.sleep_then, args=(0.2, "done"))
    stopped = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        exc, to_error = failure_of(lambda: fut.wait(20), stopped)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert isinstance(exc, WorkerLostError) and "heartbeat" in str(exc), repr(exc)
    assert to_error < 1.5 + FAST  # no process to poll: the short heartbeat limit applies
    rpc.remove_worker("att")
    recovery, _ = attach_with_module(kernel)  # the same, resumed kernel attaches again
    record("attached kernel SIGSTOPped 1.5 s+ then SIGCONT", "WorkerLostError after 1.5 s; re-attach", exc,
           to_error, recovery, "the pending call and the driver's values there")


# -- the driver itself --------------------------------------------------------------------------------------


def test_the_driver_sigkilled_takes_every_kernel_it_started(record: Callable[..., None]) -> None:
    from test_lifecycle import kill_driver_and_wait_for_workers

    survivors, seconds = kill_driver_and_wait_for_workers(5)
    assert survivors == [], "worker kernels outlived their driver"
    record("driver SIGKILLed (2 kernels)", "every kernel exits within 5 s", "all exited", seconds, None,
           "the whole world (by design)")

