"""A training loop that survives the loss of a worker: ``ResumableLoop``.

::

    loop = ResumableLoop(stage1, stage2)          # RemoteModules that keep snapshots (snapshot_every=N)
    for step in loop.steps(1000):
        with loop:                                # a worker lost here: restarted, restored, rewound
            with dist_autograd.context() as ctx:
                loss = stage2(stage1(x[step])).sum()
                dist_autograd.backward(ctx, [loss])
                opt.step(ctx)

The ``with`` block is one step. When it raises ``WorkerLostError`` (a worker died mid-forward, -backward or
-step), the loop restarts every lost worker with ``rpc.restart_worker`` -- which rebuilds their modules from
the latest snapshots, with the optimizer state, under the same handles -- and, with ``rewind=True`` (the
default), loads the snapshot *of the same step* into the surviving modules too, so the whole model (and
every optimizer's state for it) is again of one step. The error is swallowed and ``steps()`` goes on from
the step after that snapshot: at most ``snapshot_every`` steps are done again (the step in progress
included). Anything else raised in the block propagates as usual, as does a loss after ``max_recoveries``.

Where the loop runs on a worker (a trainer driving a parameter server), the snapshots are the driver's:
the modules must keep them there (``RemoteModule(..., snapshot_every=N)`` in the notebook, handles sent to
the trainer). Given ``optimizer=``, the loop sends a copy of the trainer's ``DistributedOptimizer`` to the
driver, which from then on snapshots and restores its state too, and tells the driver of each step made
(one small call per step), so snapshots fall due as they would in the notebook. After a loss, recovery is
asked of the driver (only it can restart kernels); the trainer's handles, parameter RRefs given to the
optimizer and the optimizer work again (they name the same RRef ids). What it cannot do there: the loss of
the trainer's *own* kernel ends the loop with that kernel (restart the trainer from the notebook and call
its training function again: the modules it trains keep their snapshots on the driver); and several
trainers sharing modules do not rewind each other -- each goes on from the snapshot on its own count.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

from nbremote import rpc
from nbremote.errors import RRefLostError, SnapshotError, WorkerLostError
from nbremote.nn import _recovery
from nbremote.nn._recovery import RecoveryReport

__all__ = ["ResumableLoop"]


def recover(workers: list[str], module_ids: list[str], rewind: bool) -> tuple[int, list[RecoveryReport]]:
    """On the driver: restart ``workers`` (restoring what has snapshots), then rewind the modules of
    ``module_ids`` that survived to the step the restored ones came back at; returns that step."""
    reports = []
    for worker in workers:
        rpc.restart_worker(worker)
        reports.append(_recovery.last_report(worker) or RecoveryReport(worker))
    handles = _recovery.handles(module_ids)
    restored = [h for h in handles if h.on in workers]
    if not restored:
        raise SnapshotError(f"no module of this loop lived on {', '.join(workers)} with a snapshot: nothing to "
                            "resume from (keep snapshots: RemoteModule(..., snapshot_every=N))")
    step = min(_recovery.step_of(h) for h in restored)
    for handle in handles:
        if rewind and _recovery.step_of(handle) != step:
            handle.load_snapshot(step=step)
    return step, reports


class ResumableLoop:
    """``for step in loop.steps(n): with loop: ...`` -- see the module docstring."""

    def __init__(self, *modules: Any, optimizer: Any = None, max_recoveries: int = 3, rewind: bool = True) -> None:
        if not modules:
            raise ValueError("ResumableLoop needs the RemoteModules it trains (they keep the snapshots)")
        self.modules = modules
        self.optimizer = optimizer  # needed on a worker only (see the module docstring)
        self._optimizer_steps = 0
        self.max_recoveries = max_recoveries
        self.rewind = rewind
        self.recoveries: list[RecoveryReport] = []  # one per lost worker, in order
        self.steps_lost = 0  # steps done again after recoveries (the ones in progress included)
        self._next: int | None = None
        self._step = 0
        self._base = 0

    def _elsewhere(self) -> str | None:
        """The driver's name when this loop runs on a worker, else None."""
        driver = rpc.get_worker_info(0).name
        return None if rpc.get_worker_info().name == driver else driver

    def _module_step(self) -> int:
        ids = [m.module_rref._id for m in self.modules]
        driver = self._elsewhere()
        if driver is None:
            return _recovery.step_of(_recovery.handles(ids)[0])
        if self.optimizer is not None:
            rpc.rpc_sync(driver, _recovery.keep_optimizer, args=(self.optimizer,))
            self._optimizer_steps = self.optimizer.steps
        result: int = rpc.rpc_sync(driver, _recovery.steps_of, args=(ids[:1],))[0]
        return result

    def steps(self, total: int, start: int = 0) -> Iterator[int]:
        """The step numbers ``start .. total-1``, going back to the last snapshot after a recovery."""
        self._base = self._module_step() - start
        step = start
        while step < total:
            self._step = step
            yield step
            if self._next is not None:
                step, self._next = self._next, None
            else:
                step += 1

    def __enter__(self) -> ResumableLoop:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> bool:
        driver = self._elsewhere()
        if exc is None and driver is not None and self.optimizer is not None:
            made = self.optimizer.steps - self._optimizer_steps
            if made:  # the driver counts them for the modules' snapshots
                rpc.rpc_sync(driver, _recovery.stepped_elsewhere, args=(self.optimizer.remote_optimizers[0]._id, made))
                self._optimizer_steps = self.optimizer.steps
        if exc is None or not isinstance(exc, WorkerLostError) or isinstance(exc, RRefLostError):
            return False
        if len(self.recoveries) >= self.max_recoveries:
            exc.add_note(f"(ResumableLoop: not recovered, {self.max_recoveries} recoveries were made already)")
            return False
        lost = sorted({w for w in (exc.worker, *(s.name for s in _dead_workers())) if w is not None})
        ids = [m.module_rref._id for m in self.modules]
        if driver is None:
            step, reports = recover(lost, ids, self.rewind)
        else:  # a trainer on a worker: only the driver restarts kernels (see the module docstring)
            step, reports = rpc.rpc_sync(driver, recover, args=(lost, ids, self.rewind), timeout=0)
            if self.optimizer is not None:
                self._optimizer_steps = self.optimizer.steps
        self.recoveries += reports
        resume = step - self._base
        self.steps_lost += self._step + 1 - resume
        self._next = resume
        return True


def _dead_workers() -> list[Any]:
    try:
        return [s for s in rpc.worker_status() if s.state == "dead"]
    except RuntimeError:  # on a worker: the driver's view is not here; the error named the lost one
        return []
