"""The driver's side of snapshots and recovery: which handles keep snapshots, when they are taken, and how a
replaced worker gets its modules and optimizer state back in place.

A handle keeps snapshots once asked (``RemoteModule(..., snapshot_every=N)``, ``net.keep_snapshots(...)``,
or a first ``net.snapshot()``); its *step* counts the ``DistributedOptimizer`` steps over its parameters
(``nbremote.optim.AFTER_STEP``), and every ``N``-th is followed by a snapshot -- after the step landed on
every owner, before the next one starts, so weights and moments are of one step. Snapshots due after one
step are taken in parallel.

Recovery is a hook of ``rpc.restart_worker`` (and so of the dashboard's restart button): once the fresh
kernel is up, every module that lived there and has a snapshot is rebuilt from its class and arguments,
loaded, and put back under its old RRef id, with the ids of the parameter RRefs handed out by
``remote_parameters()`` and of the local optimizers of the live ``DistributedOptimizer``\\ s over them
(rebuilt with their saved state) -- so ``net``, those parameter RRefs, the optimizer object, and copies of
them sent to other workers, work again, and the next step continues from the snapshot. What cannot be
restored is named in the :class:`RecoveryReport` (a module without snapshot, a module built by
``init_from_module_rref``, an optimizer over parameters no restored module owns); every other value of the
old kernel raises ``RRefLostError`` when used. One ``restart_worker`` restores the modules of that worker
only: the others keep their later weights (``ResumableLoop`` rewinds them to the same step).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from nbremote import rpc
from nbremote.errors import SnapshotError
from nbremote.nn import _snapshot
from nbremote.nn._snapshot import ModulePlan, OptimizerPlan, Snapshot
from nbremote.nn._stores import SnapshotStore, store_for
from nbremote.optim import AFTER_STEP, DistributedOptimizer, live_optimizers
from nbremote.rpc._core import held_reference, incarnation_of

# A handle (a RemoteModule) is typed ``Any`` here: RemoteModule derives from SnapshotMethods, so this
# module cannot import it.
Handle = Any

__all__ = ["RecoveryReport", "SnapshotMethods", "handles", "keep_optimizer", "last_report", "note_parameters",
           "protect", "step_of", "stepped_elsewhere", "steps_of", "track"]


@dataclass
class RecoveryReport:
    """What ``rpc.restart_worker`` brought back on ``worker``, and what it could not; ``str()`` reads as text."""

    worker: str
    restored: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def __str__(self) -> str:
        lines = [f"{self.worker}: restarted; {len(self.restored)} restored in {self.seconds:.2f} s"]
        lines += [f"  restored: {what}" for what in self.restored]
        lines += [f"  lost: {what}" for what in self.lost]
        lines.append("  lost: every other value of the old kernel (its RRefs raise RRefLostError when used)")
        return "\n".join(lines)

    _repr_pretty_ = lambda self, p, cycle: p.text(str(self))  # noqa: E731 -- IPython's display of it


@dataclass(eq=False)
class _Protection:
    worker: str
    store: SnapshotStore
    every: int | None
    step: int = 0


_lock = threading.Lock()
_protected: weakref.WeakKeyDictionary[Any, _Protection] = weakref.WeakKeyDictionary()  # handle -> its snapshots
_reports: dict[str, RecoveryReport] = {}
_handles: weakref.WeakSet[Any] = weakref.WeakSet()  # every handle built here: a lost one is named in the report
# RRef id -> the incarnation of the kernel its value was restored to. A restored value keeps its id, whose
# tag names the kernel it was first made on; the next restart must know it lives on the new one.
_moved: dict[str, str] = {}


def _lives_on(rref_id: str) -> str | None:
    return _moved.get(rref_id) or incarnation_of(rref_id)


def track(handle: Handle, every: int | None, to: Any) -> None:
    """A handle was built (``RemoteModule(...)``): name it if its worker is lost without a snapshot of it, and
    keep snapshots if ``snapshot_every`` / ``snapshot_to`` asked for them."""
    _handles.add(handle)
    rpc.on_worker_restart(_after_restart)
    if every is not None or to is not None:
        protect(handle, every, to, None)


def protect(handle: Handle, every: int | None, to: Any, keep: int | None) -> _Protection:
    """Keep snapshots of ``handle`` (again: change where and how often)."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"snapshot_every is a number of optimizer steps >= 1 (or None), not {every!r}")
    with _lock:
        old = _protected.get(handle)
        store = old.store if old is not None and to is None and keep is None else store_for(to, keep)
        # Steps made before it kept snapshots count too: those of the optimizers over its parameters.
        step = old.step if old else sum(opt.steps for opt, _ in _optimizers_of(handle))
        _protected[handle] = protection = _Protection(handle.on, store, every, step)
        if _after_step not in AFTER_STEP:
            AFTER_STEP.append(_after_step)
        rpc.on_worker_restart(_after_restart)
    return protection


def note_parameters(handle: Handle, rrefs: list[rpc.RRef[Any]]) -> None:
    """Remember the parameter RRefs ``remote_parameters()`` handed out: their ids are restored with the module."""
    state = handle.__dict__
    ids: dict[str, int] = state.setdefault("_nbremote_param_ids", {})
    refs: list[weakref.ref[rpc.RRef[Any]]] = state.setdefault("_nbremote_param_refs", [])
    refs[:] = [r for r in refs if r() is not None]
    for i, rref in enumerate(rrefs):  # parameters(recurse=False) is a prefix of parameters(): one index for both
        ids[rref._id] = i
        refs.append(weakref.ref(rref))


def _optimizers_of(handle: Handle) -> list[tuple[DistributedOptimizer, rpc.RRef[Any]]]:
    """The live DistributedOptimizers over ``handle``'s parameters, with their local optimizer on its owner."""
    ids = handle.__dict__.get("_nbremote_param_ids", {})
    found = []
    for opt in live_optimizers():
        if any(i in ids for i in opt.param_ids.get(handle.on, ())):
            found += [(opt, r) for r in opt.remote_optimizers if r.owner_name() == handle.on]
    return found


def _take(handle: Handle, protection: _Protection) -> rpc.Future[Snapshot]:
    optimizer_ids = [local._id for _, local in _optimizers_of(handle)]
    return rpc.rpc_async(handle.on, _snapshot.take, args=(handle.module_rref._id, optimizer_ids, protection.step))


def _after_step(opt: DistributedOptimizer) -> None:
    """Count the step for the handles it touched; take the snapshots that are due, in parallel."""
    with _lock:
        touched = [(h, p) for h, p in _protected.items() if p.worker in opt.param_ids
                   and any(i in h.__dict__.get("_nbremote_param_ids", {}) for i in opt.param_ids[p.worker])]
    due = []
    for handle, protection in touched:
        protection.step += 1
        if protection.every is not None and protection.step % protection.every == 0:
            due.append((protection, _take(handle, protection)))
    for protection, fut in due:
        protection.store.put(fut.wait())


class SnapshotMethods:
    """``RemoteModule``'s snapshot methods (a base class of it: they live here, beside what they drive)."""

    on: str
    module_rref: rpc.RRef[Any]

    def snapshot(self, to: Any = None) -> Snapshot:
        """Take a snapshot now (weights, training mode, and the DistributedOptimizers' state for its parameters),
        keep it (in the driver's memory, or where ``keep_snapshots(to=...)`` / ``snapshot_to=`` said; ``to``
        here sends this one elsewhere too) and return it. From now on ``rpc.restart_worker`` restores the module."""
        handle: Any = self
        protection = _protected.get(handle) or protect(handle, None, None, None)
        snap = _take(handle, protection).wait()
        protection.store.put(snap)
        if to is not None:
            store_for(to).put(snap)
        return snap

    def keep_snapshots(self, every: int | None = None, to: Any = None, *, keep: int | None = None) -> None:
        """Snapshot after every ``every``-th optimizer step over this module's parameters (None: on demand
        only), to ``to``: None (the driver's memory, the last ``keep``, default 2), a directory, or an fsspec
        URL (one per module). Takes no snapshot now; ``rpc.restart_worker`` restores from the latest."""
        handle: Any = self
        protect(handle, every, to, keep)

    @property
    def snapshots(self) -> SnapshotStore | None:
        """Where this handle's snapshots are kept (``.steps()``, ``.get(step)``), or None before any."""
        protection = _protected.get(self)
        return None if protection is None else protection.store

    def load_snapshot(self, source: Any = None, *, step: int | None = None,
                      optimizer: DistributedOptimizer | None = None) -> Snapshot:
        """Load a snapshot into the live module: the latest of this handle's own (``source=None``), or from
        a directory / URL / store / :class:`Snapshot` (one taken in an earlier world, say); ``step`` picks one.
        With ``optimizer``, its state for these parameters goes into that optimizer too (when the snapshot
        has it); without, optimizers this handle's snapshots were taken with are loaded. A snapshot of another
        class, keys or shapes raises ``SnapshotError`` naming them, and the module keeps its weights."""
        handle: Any = self
        protection = _protected.get(handle)
        if isinstance(source, Snapshot):
            snap = source
        elif source is not None:
            snap = store_for(source).get(step)
        elif protection is None:
            raise SnapshotError(f"{handle!r} has no snapshots of its own: pass source= (a directory, URL or Snapshot)")
        else:
            snap = protection.store.get(step)
        locals_ = [local for opt, local in _optimizers_of(handle) if optimizer is None or opt is optimizer]
        if optimizer is not None:
            mapping = {saved: locals_[0]._id for saved in snap.optimizers} if locals_ else {}
        else:
            mapping = {local._id: local._id for local in locals_}
        rpc.rpc_sync(handle.on, _snapshot.load, args=(handle.module_rref._id, snap, mapping))
        if protection is not None:
            protection.step = snap.step
        return snap


_kept: list[DistributedOptimizer] = []  # copies of optimizers made on workers (keep_optimizer)


def keep_optimizer(opt: DistributedOptimizer) -> None:
    """On the driver: keep this copy of a DistributedOptimizer made on a worker (a trainer's, sent by its
    ResumableLoop), so that its state is in the snapshots and restored with the modules it steps. The
    parameter RRefs it was made from came from the trainer's copies of the handles: the owners say which
    module and index each is."""
    if any(k.remote_optimizers[0]._id == opt.remote_optimizers[0]._id for k in _kept):
        return
    _kept.append(opt)
    for local in opt.remote_optimizers:
        worker = local.owner_name()
        with _lock:
            there = {h.module_rref._id: h for h, p in _protected.items() if p.worker == worker}
        if there:  # asked of the local optimizer: the parameter RRefs it was made from may be gone already
            found = rpc.rpc_sync(worker, _snapshot.locate, args=(local._id, list(there)))
            for param_id, place in zip(opt.param_ids[worker], found, strict=True):
                if place is not None:
                    there[place[0]].__dict__.setdefault("_nbremote_param_ids", {})[param_id] = place[1]


def stepped_elsewhere(first_local_id: str, steps: int) -> None:
    """On the driver: the kept optimizer whose first local optimizer is ``first_local_id`` made ``steps`` steps
    on its worker: count them for its modules and take the snapshots that fall due."""
    opt = next(k for k in _kept if k.remote_optimizers[0]._id == first_local_id)
    for _ in range(steps):
        opt.steps += 1
        _after_step(opt)


def handles(module_ids: list[str]) -> list[Any]:
    """This process's snapshot-keeping handles of the modules ``module_ids`` (RRef ids), in that order."""
    with _lock:
        by_id = {h.module_rref._id: h for h in _protected}
    missing = [i[:8] for i in module_ids if i not in by_id]
    if missing:
        raise SnapshotError(f"the modules {', '.join(missing)} keep no snapshots on {rpc.get_worker_info().name!r} "
                            "(RemoteModule(..., snapshot_every=N) or net.keep_snapshots(), on the driver)")
    return [by_id[i] for i in module_ids]


def step_of(handle: Any) -> int:
    """The optimizer steps counted for ``handle`` (set back to a snapshot's step when one is loaded)."""
    return _protected[handle].step


def steps_of(module_ids: list[str]) -> list[int]:
    """``step_of`` for the modules ``module_ids`` (called by a training loop that runs on a worker)."""
    return [step_of(h) for h in handles(module_ids)]


def last_report(worker: str) -> RecoveryReport | None:
    """The report of ``worker``'s last recovery by ``rpc.restart_worker`` (None if it had none)."""
    return _reports.get(worker)


def _after_restart(worker: str, replaced: str | None) -> None:
    """``rpc.restart_worker``'s hook: bring back what lived on ``worker``'s kernel ``replaced`` (an earlier
    worker of that name, removed and added again, is not this one) and has a snapshot."""
    t0 = time.perf_counter()
    report = _reports[worker] = RecoveryReport(worker)
    with _lock:
        protected = [(h, p) for h, p in _protected.items()
                     if p.worker == worker and _lives_on(h.module_rref._id) == replaced]
    kept = {id(h) for h, _ in protected}
    report.lost += [f"{h!r}: it had no snapshot (its handle raises RRefLostError)" for h in list(_handles)
                    if h.on == worker and id(h) not in kept and _lives_on(h.module_rref._id) == replaced]
    plans: dict[str, tuple[Any, ModulePlan]] = {}
    for handle, protection in protected:
        built_from = handle.__dict__.get("_nbremote_built_from")
        try:
            snap = protection.store.get()
        except SnapshotError as exc:
            report.lost.append(f"{handle!r}: {exc}")
            continue
        if built_from is None:
            report.lost.append(f"{handle!r}: made by init_from_module_rref, so its class and arguments are unknown")
            continue
        module_id, token, holder = held_reference(handle.module_rref)
        params = []
        for ref in handle.__dict__.get("_nbremote_param_refs", []):
            rref = ref()
            if rref is not None:
                param_id, param_token, param_holder = held_reference(rref)
                index = handle.__dict__["_nbremote_param_ids"][param_id]
                params.append((param_id, index, [(param_token, param_holder)]))
        plans[module_id] = handle, ModulePlan(module_id, [(token, holder)], built_from, handle.device, snap, params)
    optimizers: list[OptimizerPlan] = []
    for opt in live_optimizers():
        local = next((r for r in opt.remote_optimizers
                      if r.owner_name() == worker and _lives_on(r._id) == replaced), None)
        if local is None or any(o.optimizer_id == local._id for o in optimizers):  # none there, or a copy's twin
            continue
        where = {}
        for module_id, (handle, _) in plans.items():
            for param_id, i in handle.__dict__.get("_nbremote_param_ids", {}).items():
                where[param_id] = (module_id, i)
        if not all(i in where for i in opt.param_ids[worker]):
            report.lost.append(f"{opt!r}: its parameters on {worker} are not all of restored modules, so its state "
                               "there is lost (its step raises RRefLostError)")
            continue
        parts = [(module_id, plan.snapshot.optimizers[local._id]) for module_id, (_, plan) in plans.items()
                 if local._id in plan.snapshot.optimizers]
        if not parts:
            report.lost.append(f"{opt!r}: the snapshots hold no state of it (taken before it was made): "
                               "it starts afresh")
        local_id, token, holder = held_reference(local)
        optimizers.append(OptimizerPlan(local_id, [(token, holder)], (opt.optimizer_class, opt.args, opt.kwargs),
                                        [where[i] for i in opt.param_ids[worker]], parts))
    if plans:
        now_on = rpc.rpc_sync(worker, _snapshot.restore, args=([plan for _, plan in plans.values()], optimizers))
        _moved.update({i: now_on for i in [*plans, *(o.optimizer_id for o in optimizers)]})
    for handle, plan in plans.values():
        _protected[handle].step = plan.snapshot.step
    report.restored += [f"{handle!r} at step {plan.snapshot.step}" for handle, plan in plans.values()]
    report.restored += [f"{opt!r}'s state on {worker}" for opt in live_optimizers()
                        if any(r._id in {o.optimizer_id for o in optimizers} for r in opt.remote_optimizers)]
    report.seconds = time.perf_counter() - t0
