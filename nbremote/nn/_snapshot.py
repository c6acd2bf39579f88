"""Snapshots of a RemoteModule, taken and loaded on its owner: the weights, the training mode, and the state
the ``DistributedOptimizer``\\ s keep on that owner for its parameters (Adam's moments and step counts).

Runs on the owner (by RPC, by reference), under the optimizers' step lock (``nbremote.optim._STEP_LOCK``):
a snapshot is never taken while a step of this process changes the parameters, so weights and moments
belong to the same step. Everything is *copied* there (``clone``) before the reply leaves: the reply's
buffers are sent while training goes on, and must not change under it.

A snapshot names the module's class, its step (the optimizer steps its handle has counted) and, per local
optimizer, which of its parameter positions are this module's parameters (by their index in
``module.parameters()``), with their state and the optimizer's ``param_groups`` (learning rates...).
Loading checks class, keys and shapes *before* anything is written: a snapshot that does not fit raises
:class:`SnapshotError` naming the keys, and the module keeps its weights. :func:`restore` rebuilds the
modules and optimizers of a replaced kernel under their old RRef ids (``rpc._core.adopt``), so every handle
the driver holds to them works again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nbremote import rpc
from nbremote.errors import RRefLostError, SnapshotError
from nbremote.nn import _owner
from nbremote.nn._device import RemoteDevice
from nbremote.nn._frameworks import framework_of_class, outputs_to_cpu
from nbremote.nn._summary import shape
from nbremote.optim import _STEP_LOCK, _LocalOptimizer
from nbremote.rpc._core import adopt, current_agent, owned_value

__all__ = ["OptimizerPart", "Snapshot", "load", "locate", "restore", "take"]


@dataclass(frozen=True)
class OptimizerPart:
    """What one local optimizer keeps for a module's parameters: ``positions`` maps its parameter positions
    to indices in ``module.parameters()``; ``state`` is by position; ``groups`` its hyperparameters."""

    positions: dict[int, int]
    state: dict[int, dict[str, Any]]
    groups: list[dict[str, Any]]


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy of a remote module at a step (CPU tensors; picklable, so a file holds one)."""

    worker: str
    module_type: str  # the class's qualified name
    step: int
    training: bool
    state: dict[str, Any]
    optimizers: dict[str, OptimizerPart] = field(default_factory=dict)  # by the local optimizer's RRef id
    taken: float = 0.0  # time.time() on the owner

    @property
    def nbytes(self) -> int:
        tensors = [*self.state.values(), *(v for part in self.optimizers.values()
                                           for st in part.state.values() for v in st.values())]
        sizes = (getattr(t, "nbytes", 0) for t in tensors)
        return sum(int(n() if callable(n) else n) for n in sizes)  # tensorplay's is a method

    def __repr__(self) -> str:
        moments = sum(len(part.state) for part in self.optimizers.values())
        extra = f", optimizer state for {moments} parameter(s)" if moments else ""
        return (f"Snapshot({self.module_type} from {self.worker} at step {self.step}: {len(self.state)} tensor(s), "
                f"{self.nbytes / 1e6:.1f} MB{extra})")


def _copy(value: Any) -> Any:
    return value.detach().clone() if hasattr(value, "detach") else value


def _cpu_copies(values: Mapping[Any, Any], framework: str) -> dict[Any, Any]:
    result: dict[Any, Any] = outputs_to_cpu({k: _copy(v) for k, v in values.items()}, framework)
    return result


def take(module_id: str, optimizer_ids: list[str], step: int) -> Snapshot:
    """Copy the module's state and its parameters' optimizer state, between steps."""
    module = _owner.module_of(module_id)
    framework = _owner.framework_of_module(module)
    index = {id(p): i for i, p in enumerate(module.parameters())}
    with _STEP_LOCK:
        state = _cpu_copies(module.state_dict(), framework)
        parts = {}
        for opt_id in optimizer_ids:
            local: _LocalOptimizer = owned_value(opt_id)
            positions = {pos: index[id(p)] for pos, p in enumerate(local.params) if id(p) in index}
            if positions:
                optim = local.optim
                parts[opt_id] = OptimizerPart(
                    positions,
                    {pos: _cpu_copies(optim.state[local.params[pos]], framework) for pos in positions
                     if local.params[pos] in optim.state},
                    [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups])
    return Snapshot(rpc.get_worker_info().name, type(module).__qualname__, step, bool(module.training), state, parts,
                    time.time())


def locate(optimizer_id: str, module_ids: list[str]) -> list[tuple[str, int] | None]:
    """For each parameter of the local optimizer ``optimizer_id``, in its order: which of the modules
    ``module_ids`` it is a parameter of, and at which index of its ``parameters()`` (None: of none). For an
    optimizer made elsewhere, from parameter RRefs the driver never saw (and that may be gone by now)."""
    where = {}
    for module_id in module_ids:
        try:
            module = _owner.module_of(module_id)
        except RRefLostError:  # a module of an earlier kernel of this worker's name: not one of these
            continue
        where.update({id(p): (module_id, i) for i, p in enumerate(module.parameters())})
    local: _LocalOptimizer = owned_value(optimizer_id)
    return [where.get(id(p)) for p in local.params]


def _check(module: Any, snap: Snapshot, where: str) -> None:
    """Refuse a snapshot that does not fit ``module`` (nothing is written before this passes)."""
    kind = type(module).__qualname__
    if snap.module_type != kind:
        raise SnapshotError(f"the snapshot is of a {snap.module_type} (step {snap.step}, from {snap.worker}); the "
                            f"module on {where!r} is a {kind}: its weights were kept")
    current = module.state_dict()
    missing = [k for k in current if k not in snap.state]
    unexpected = [k for k in snap.state if k not in current]
    mismatched = [f"{k} {shape(snap.state[k].shape)} -> {shape(v.shape)}" for k, v in current.items()
                  if k in snap.state and tuple(snap.state[k].shape) != tuple(v.shape)]
    if missing or unexpected or mismatched:
        parts = [f"{label}: {', '.join(keys)}" for label, keys in (
            ("missing from the snapshot", missing), ("not in the module", unexpected),
            ("other shapes (snapshot -> module)", mismatched)) if keys]
        raise SnapshotError(f"the snapshot of {snap.module_type} (step {snap.step}) does not fit the {kind} on "
                            f"{where!r}: {'; '.join(parts)}. Its weights were kept")


def _load_optimizer(local: _LocalOptimizer, params: list[Any], part: OptimizerPart) -> None:
    """Put ``part``'s state into ``local`` for the module parameters ``params`` (by module index). Keyed by the
    parameters themselves, so it fits an optimizer whose positions differ (one built in a new world)."""
    optim = local.optim
    stepped = {id(p) for p in local.params}
    for pos, index in part.positions.items():
        param = params[index]
        if id(param) not in stepped:
            continue
        st = part.state.get(pos)
        if st is None:  # not stepped yet at the snapshot's step: no state then, none now
            optim.state.pop(param, None)
        else:  # "step" stays where the optimizer keeps it (a CPU tensor for torch's)
            optim.state[param] = {k: v.to(param.device, copy=True) if k != "step" and hasattr(v, "to") else _copy(v)
                                  for k, v in st.items()}
    if len(part.groups) == len(optim.param_groups):  # learning rates a scheduler changed, and the like
        for group, saved in zip(optim.param_groups, part.groups, strict=True):
            group.update(saved)


def load(module_id: str, snap: Snapshot, optimizers: Mapping[str, str]) -> None:
    """Load ``snap`` into the live module (checked first), and its optimizer parts into the local optimizers
    ``optimizers`` maps to (snapshot's optimizer id -> the live local optimizer's id)."""
    module = _owner.module_of(module_id)
    where = rpc.get_worker_info().name
    _check(module, snap, where)
    with _STEP_LOCK:
        module.load_state_dict(snap.state)
        module.train(snap.training)
        params = list(module.parameters())
        for saved_id, live_id in optimizers.items():
            if saved_id in snap.optimizers:
                _load_optimizer(owned_value(live_id), params, snap.optimizers[saved_id])


@dataclass(frozen=True)
class ModulePlan:
    """How to bring one module back on a fresh kernel (made by the driver, see ``_recovery``)."""

    module_id: str
    tokens: list[tuple[str, str]]
    built_from: tuple[Any, tuple[Any, ...], dict[str, Any]]
    device: str
    snapshot: Snapshot
    params: list[tuple[str, int, list[tuple[str, str]]]]  # (RRef id, index in parameters(), tokens)


@dataclass(frozen=True)
class OptimizerPlan:
    """How to bring one local optimizer back: over which modules' parameters, with which saved parts."""

    optimizer_id: str
    tokens: list[tuple[str, str]]
    recipe: tuple[Any, tuple[Any, ...], dict[str, Any]]  # optimizer_class, args, kwargs
    params: list[tuple[str, int]]  # (module id, index in its parameters()), in the optimizer's order
    parts: list[tuple[str, OptimizerPart]]  # (module id, that module's saved part)


def restore(modules: list[ModulePlan], optimizers: list[OptimizerPlan]) -> str:
    """On a fresh kernel: rebuild each module from its class and arguments, load its snapshot, and put it,
    its parameters and the local optimizers over them back under their old RRef ids. Returns this kernel's
    incarnation (where those ids live from now on)."""
    where = rpc.get_worker_info().name
    built: dict[str, Any] = {}
    for plan in modules:
        module_cls, args, kwargs = plan.built_from
        module, _ = _owner.build_module(module_cls, args, kwargs, RemoteDevice(where, plan.device),
                                        framework_of_class(module_cls))
        _check(module, plan.snapshot, where)
        module.load_state_dict(plan.snapshot.state)
        module.train(plan.snapshot.training)
        built[plan.module_id] = module
    owned = {module_id: list(module.parameters()) for module_id, module in built.items()}
    locals_ = []
    for oplan in optimizers:
        optimizer_class, args, kwargs = oplan.recipe
        local = _LocalOptimizer(optimizer_class, [owned[m][i] for m, i in oplan.params], args, kwargs)
        for module_id, part in oplan.parts:
            _load_optimizer(local, owned[module_id], part)
        locals_.append(local)
    # Last: a restore that failed half way leaves nothing adopted (the driver reports it lost).
    for oplan, local in zip(optimizers, locals_, strict=True):
        adopt(oplan.optimizer_id, local, oplan.tokens)
    for plan in modules:
        adopt(plan.module_id, built[plan.module_id], plan.tokens)
        for param_id, i, tokens in plan.params:
            adopt(param_id, owned[plan.module_id][i], tokens)
    return current_agent().table.incarnation
