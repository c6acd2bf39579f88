"""After a worker is lost: what was not restored fails at once and says so; what had a snapshot comes back
in place (``rpc.restart_worker``), bit for bit, and training goes on."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import remote_fns as fns
import torch

import nbremote.autograd as dist_autograd
from nbremote import rpc
from nbremote.errors import RRefLostError, WorkerLostError
from nbremote.nn import RemoteModule, ResumableLoop, last_report
from nbremote.optim import DistributedOptimizer

from . import fault_fns as ffns
from .conftest import failure_of

pytestmark = pytest.mark.timeout(120)

FAST = 2.5  # s: "at once", with slack for this loaded 2-core machine


def test_handles_of_a_restarted_worker_without_snapshots_fail_at_once(world: list[str], victim: str,
                                                                      record: Callable[..., None]) -> None:
    net = RemoteModule(f"{victim}/cpu", torch.nn.Linear, args=(4, 2))
    rref = rpc.remote(victim, list, args=([1, 2],))
    slot = rpc.rpc_sync("worker1", ffns.keep, args=(rref,))  # a copy held by another worker
    assert rref.to_here() == [1, 2]
    try:
        rpc.restart_worker(victim)
        report = last_report(victim)
        assert report is not None and report.lost == [f"{net!r}: it had no snapshot (its handle raises RRefLostError)"]
        restarted = time.monotonic()
        exc, to_error = failure_of(lambda: net(torch.ones(1, 4)), restarted)
        assert isinstance(exc, RRefLostError) and exc.worker == victim, repr(exc)
        assert "restart_worker('victim')" in str(exc) and "had no snapshot" in str(exc), str(exc)
        assert to_error < FAST, "a module of an earlier kernel must fail at once, not after the call timeout"
        for use in (net.remote_parameters, net.remote_state_dict, lambda: net.train(False)):
            lost, _ = failure_of(use, restarted)
            assert isinstance(lost, RRefLostError) and "had no snapshot" in str(lost), repr(lost)
        for use in (rref.to_here, lambda: rpc.rpc_sync("worker1", ffns.kept_to_here, args=(slot,))):
            t0 = time.monotonic()
            lost, elapsed = failure_of(use, t0)
            assert isinstance(lost, RRefLostError) and lost.worker == victim, repr(lost)
            assert "earlier kernel of 'victim'" in str(lost) and elapsed < FAST, (str(lost), elapsed)
        # the new kernel works: new values, new modules
        assert rpc.remote(victim, list, args=([3],)).to_here() == [3]
        assert RemoteModule(f"{victim}/cpu", torch.nn.Linear, args=(4, 2))(torch.ones(1, 4)).shape == (1, 2)
    finally:
        rpc.rpc_sync("worker1", ffns.drop_kept)
    record("use of a module/RRef made before rpc.restart_worker (no snapshot)", "RRefLostError at once", exc,
           to_error, None, "the module and values of the old kernel (named)")


def _step(first: RemoteModule, second: RemoteModule, opt: DistributedOptimizer, step: int) -> float:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
    with dist_autograd.context() as ctx:
        loss = second(first(x)).pow(2).mean()
        dist_autograd.backward(ctx, [loss])
        opt.step(ctx)
    return float(loss.item())


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _killed_at(where: str, victim: str, flag: Path, run: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """Run ``run`` in a thread, kill -9 ``victim`` once it stopped ``where`` (forward/backward/step); returns
    what ``run`` raised and the seconds from the kill to the error."""
    pid = rpc.rpc_sync(victim, ffns.pid)
    rpc.rpc_sync(victim, ffns.pause_at, args=(where, str(flag)))
    outcome: list[tuple[BaseException | None, float]] = []

    def target() -> None:
        try:
            run()
            outcome.append((None, time.monotonic()))
        except BaseException as exc:
            outcome.append((exc, time.monotonic()))

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.monotonic() + 30
    while not flag.exists():
        assert time.monotonic() < deadline, f"the victim never reached its {where}"
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(30)
    exc, when = outcome[0]
    return exc, when - killed


@pytest.mark.parametrize("where", ["forward", "backward", "step"])
def test_kill_9_mid_training_then_restart_restores_the_module_and_adam_bit_for_bit(
        world: list[str], victim: str, where: str, tmp_path: Path, record: Callable[..., None]) -> None:
    first = RemoteModule("worker1/cpu", ffns.PausableStage, snapshot_every=2)
    second = RemoteModule(f"{victim}/cpu", ffns.PausableStage, snapshot_every=2)
    params = [*first.remote_parameters(), *second.remote_parameters()]
    opt = DistributedOptimizer(ffns.PausableAdam, params, lr=0.01)
    for s in range(4):  # snapshots after steps 2 and 4
        _step(first, second, opt, s)
    snap = second.snapshots.get()
    assert snap.step == 4 and len(snap.optimizers) == 1
    # The reference: step 5 as it goes without a fault, then both modules back to step 4.
    reference_loss = _step(first, second, opt, 4)
    reference = second.remote_state_dict()
    first.load_snapshot(step=4)
    second.load_snapshot(step=4)
    assert _same(second.remote_state_dict(), snap.state)

    exc, to_error = _killed_at(where, victim, tmp_path / "paused", lambda: _step(first, second, opt, 4))
    assert isinstance(exc, WorkerLostError) and exc.worker == victim, repr(exc)
    assert to_error < FAST
    t0 = time.monotonic()
    rpc.restart_worker(victim)
    recovery = time.monotonic() - t0
    report = last_report(victim)
    assert report is not None and not report.lost and len(report.restored) == 2, str(report)
    # the weights are the snapshot's, bit for bit; so are Adam's moments (through the same optimizer object)
    assert _same(second.remote_state_dict(), snap.state)
    (local,) = [r for r in opt.remote_optimizers if r.owner_name() == victim]
    live = rpc.rpc_sync(victim, fns.optimizer_state, args=(local._id,))
    (part,) = snap.optimizers.values()
    assert sorted(live) == sorted(part.state) == [0, 1]
    assert all(torch.equal(live[p][k], part.state[p][k]) for p in live for k in ("step", "exp_avg", "exp_avg_sq"))
    # the handles work again, and the next step is exactly the one the fault interrupted
    first.load_snapshot(step=4)  # the survivor stepped (mid-step case) or not: back to the same step
    assert _step(first, second, opt, 4) == reference_loss
    assert _same(second.remote_state_dict(), reference), "the step after recovery differs from the reference"
    assert [p.to_here().shape for p in params[2:]] == [(4, 4), (4,)], "the parameter RRefs work again"
    assert _step(first, second, opt, 5) > 0 and second.snapshots.steps() == [4, 6]  # and training goes on
    record(f"kill -9 mid-{where}, then rpc.restart_worker (snapshot_every=2)",
           "WorkerLostError; module + Adam restored bit for bit", exc, to_error, recovery,
           "the step in progress (redone bit for bit)")


def test_a_resumable_loop_survives_a_kill_9_and_the_loss_curve_goes_on(world: list[str], victim: str,
                                                                        record: Callable[..., None]) -> None:
    every, total, kills = 3, 12, (4, 9)  # the second kill hits modules restored by the first
    first = RemoteModule("worker2/cpu", ffns.PausableStage, snapshot_every=every)
    second = RemoteModule(f"{victim}/cpu", ffns.PausableStage, snapshot_every=every)
    opt = DistributedOptimizer(torch.optim.Adam, [*first.remote_parameters(), *second.remote_parameters()], lr=0.05)
    # the same training without a fault, from the same weights on workers that stay up: the curve to match
    ref_first = RemoteModule("worker3/cpu", ffns.PausableStage)
    ref_second = RemoteModule("worker3/cpu", ffns.PausableStage)
    ref_first.remote_load_state_dict(first.remote_state_dict())
    ref_second.remote_load_state_dict(second.remote_state_dict())
    ref_opt = DistributedOptimizer(torch.optim.Adam, [*ref_first.remote_parameters(), *ref_second.remote_parameters()],
                                   lr=0.05)
    clean = [_step(ref_first, ref_second, ref_opt, step) for step in range(total)]
    losses: dict[int, float] = {}
    loop = ResumableLoop(first, second)
    killed, recovered = 0.0, []
    for step in loop.steps(total):
        with loop:
            if step in kills and len(loop.recoveries) == kills.index(step):
                os.kill(rpc.rpc_sync(victim, ffns.pid), signal.SIGKILL)
                killed = time.monotonic()
            losses[step] = _step(first, second, opt, step)
            if len(recovered) < len(loop.recoveries):
                recovered.append(time.monotonic() - killed)
    assert [r.worker for r in loop.recoveries] == [victim, victim]
    assert all(not r.lost and len(r.restored) == 2 for r in loop.recoveries), loop.recoveries
    assert 2 <= loop.steps_lost <= 2 * every, loop.steps_lost
    assert [losses[step] for step in range(total)] == clean, "the loss curve is the one without the fault"
    record(f"kill -9 inside ResumableLoop, twice (snapshot_every={every})", "recovered in the loop, no error",
           "none", None, max(recovered), f"{loop.steps_lost} step(s) done again (at most {every} per kill)")



def test_a_resumable_loop_on_a_trainer_worker_survives_its_parameter_servers_death(
        world: list[str], victim: str, record: Callable[..., None]) -> None:
    every, total, kill_at = 2, 10, 5
    server = RemoteModule(f"{victim}/cpu", ffns.PausableStage, snapshot_every=every)  # snapshots kept here
    reference = RemoteModule("worker3/cpu", ffns.PausableStage, snapshot_every=every)
    reference.remote_load_state_dict(server.remote_state_dict())
    clean, _, _, _ = rpc.rpc_sync("worker2", ffns.train_as_trainer, args=(reference, 0, total, -1), timeout=0)
    losses, steps_lost, recoveries, recovered = rpc.rpc_sync(
        "worker1", ffns.train_as_trainer, args=(server, rpc.rpc_sync(victim, ffns.pid), total, kill_at), timeout=0)
    assert recoveries == 1 and 1 <= steps_lost <= every, (recoveries, steps_lost)
    report = last_report(victim)
    assert report is not None and not report.lost and len(report.restored) == 2, str(report)  # module + Adam
    assert losses == clean, "the trainer's loss curve is the one without the fault"
    record(f"kill -9 of a parameter server under a trainer's ResumableLoop (snapshot_every={every})",
           "recovered through the driver, no error", "none", None, recovered,
           f"{steps_lost} step(s) done again (at most {every})")


def test_a_tensorplay_module_and_its_adam_come_back_too(world: list[str], victim: str) -> None:
    tp = pytest.importorskip("tensorplay")
    net = RemoteModule(f"{victim}/cpu", tp.nn.Linear, args=(4, 2), snapshot_every=1)
    opt = DistributedOptimizer(tp.optim.Adam, net.remote_parameters(), lr=0.1)
    for _ in range(2):
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [net(tp.ones(3, 4)).sum()])
            opt.step(ctx)
    snap = net.snapshots.get()
    assert snap.step == 2 and snap.nbytes >= 4 * (8 + 2) * 3  # weights, exp_avg, exp_avg_sq (float32)
    os.kill(rpc.rpc_sync(victim, ffns.pid), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not any(s.name == victim and s.state == "dead" for s in rpc.worker_status()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    rpc.restart_worker(victim)
    report = last_report(victim)
    assert report is not None and len(report.restored) == 2 and not report.lost, str(report)
    state = net.remote_state_dict()
    assert all(bool((state[k] == snap.state[k]).all()) for k in snap.state)
    with dist_autograd.context() as ctx:  # the optimizer steps on, from the restored moments
        dist_autograd.backward(ctx, [net(tp.ones(3, 4)).sum()])
        opt.step(ctx)
    assert net.snapshots.steps() == [2, 3]
