"""What runs on the worker that owns a RemoteModule's module (the *owner*).

The driver (or any peer holding a handle) calls these module-level functions with ``rpc.rpc_sync`` /
``rpc.rpc_async``; they travel by reference, so they must stay importable from ``nbremote.nn`` on every
worker. Each takes the module's RRef and reads the module with ``module_of`` (its ``local_value()``, with
an error that speaks of the module when it was lost with an earlier kernel of this worker).

Where the module is placed is recorded here, in a weak table on the owner, and not only in the handles:
handles are copied to other workers, and after ``remote_to`` moved the module, every handle must move
its inputs to the *new* device. A handle's own ``device`` is the fallback for modules this table never
saw (an RRef to a module made by user code, wrapped with ``init_from_module_rref``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from nbremote import rpc
from nbremote.errors import RRefLostError
from nbremote.nn._device import RemoteDevice
from nbremote.nn._frameworks import (
    FRAMEWORKS,
    check_device,
    framework_of_class,
    inputs_to_device,
    no_grad,
    outputs_to_cpu,
)
from nbremote.rpc._core import owned_value, tasks

__all__ = [
    "ModuleInfo",
    "build_module",
    "create_module",
    "describe_module",
    "forward",
    "framework_of_module",
    "get_state_dict",
    "get_training",
    "load_state_dict",
    "move_module",
    "parameter_rrefs",
    "placement",
    "set_training",
]

# module -> device string; weak so that a module freed by RRef counting leaves no trace.
_placements: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


class ModuleInfo(NamedTuple):
    """What a handle needs to know about the module it points at."""

    framework: str
    type_name: str
    device: str


def _here() -> str:
    return rpc.get_worker_info().name


def module_of(module: rpc.RRef[Any] | str) -> Any:
    """The module a handle points at, by its RRef or the RRef's id; a module of an earlier kernel of this
    worker (it was restarted and the module not restored) is an ``RRefLostError`` that says so."""
    try:
        return owned_value(module if isinstance(module, str) else module._id)
    except RRefLostError:
        where = _here()
        raise RRefLostError(
            f"this RemoteModule's module lived on an earlier kernel of {where!r}, which died or was replaced by "
            f"rpc.restart_worker({where!r}); the module had no snapshot, so it was not restored and the handle "
            "points at nothing. Build it again with RemoteModule(...); with snapshots (net.snapshot(), or "
            "RemoteModule(..., snapshot_every=N)) restart_worker restores it in place", where) from None


def _framework_of(module: object, where: str) -> str:
    framework = framework_of_class(type(module))
    if framework is None:
        kind = type(module)
        raise ValueError(
            f"Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, a Module of a "
            f"supported framework ({', '.join(f'{f}.nn.Module' for f in FRAMEWORKS)}), but on {where} it "
            f"returned an instance of {kind.__module__}.{kind.__qualname__}"
        )
    return framework


def create_module(
    module_cls: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    place: RemoteDevice,
    framework_hint: str | None,
) -> tuple[rpc.RRef[Any], ModuleInfo]:
    """Check the device, build ``module_cls(*args, **kwargs)``, place it, and return an RRef to it.

    The device is checked *before* the constructor runs, so a missing GPU neither wastes a build nor
    crashes half way through one. Constructor errors propagate with their own type.
    """
    module, info = build_module(module_cls, args, kwargs, place, framework_hint)
    return rpc.RRef(module), info


def build_module(module_cls: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 place: RemoteDevice, framework_hint: str | None) -> tuple[Any, ModuleInfo]:
    """``create_module`` without the RRef (a module restored under its old RRef id gets none)."""
    where = _here()
    check_device(place, framework_hint, where)
    module = module_cls(*args, **kwargs)
    framework = _framework_of(module, where)
    if place.device != "cpu":
        module.to(place.device)
    _placements[module] = place.device
    return module, ModuleInfo(framework, type(module).__qualname__, place.device)


def framework_of_module(module: object) -> str:
    """The module's framework (``"torch"`` / ``"tensorplay"``); a clear error for anything else."""
    return _framework_of(module, _here())


def placement(module: object, default: str) -> str:
    """The device the module was placed on (``default`` for modules this owner never placed)."""
    return _placements.get(module, default)


def describe_module(module_rref: rpc.RRef[Any], device: str) -> ModuleInfo:
    """For ``init_from_module_rref``: check the RRef holds a Module and say what it is."""
    module = module_of(module_rref)
    framework = _framework_of(module, _here())
    return ModuleInfo(framework, type(module).__qualname__, _placements.get(module, device))


def forward(module_id: str, args: tuple[Any, ...], kwargs: dict[str, Any], device: str, grad: bool = True) -> Any:
    """Run the module on ``args`` / ``kwargs`` (the hot path: keep it short).

    The module comes by its RRef's *id*, not the RRef: an RRef sent to its own owner would be forked
    (a reference count added, then removed) on every forward, for nothing -- the calling handle holds
    its own reference until the call is done (``RemoteModule._forward_*``).

    The module is *called* (not ``.forward``) so hooks that code on the owner registered on it run, as
    they would for a local call. On a CUDA placement CPU inputs go to the device and every tensor of the
    result comes back to CPU, whatever the result's structure. ``grad=False`` (the caller was inside
    ``torch.no_grad()``) runs it without recording gradients, as the same call would locally.
    """
    module = module_of(module_id)
    tasks.name(f"{type(module).__qualname__}.forward")  # what the dashboard's task stream calls this call
    placed = _placements.get(module, device)
    if any(type(a) is rpc.RRef for a in args) or any(type(v) is rpc.RRef for v in kwargs.values()):
        args, kwargs = _fetched(args, kwargs)
    if not grad:
        with no_grad(_framework_of(module, _here())):
            return _run(module, placed, args, kwargs)
    return _run(module, placed, args, kwargs)


def _fetched(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The values of the RRefs among a forward's arguments (an earlier stage's ``remote_forward`` output),
    fetched here from their owners directly: a pipeline's activations do not pass through the caller."""
    args = tuple(a.to_here() if type(a) is rpc.RRef else a for a in args)
    kwargs = {k: v.to_here() if type(v) is rpc.RRef else v for k, v in kwargs.items()}
    return args, kwargs


def _run(module: Any, placed: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if placed == "cpu":
        return module(*args, **kwargs)
    framework = _framework_of(module, _here())
    args = inputs_to_device(args, placed, framework)
    kwargs = inputs_to_device(kwargs, placed, framework)
    return outputs_to_cpu(module(*args, **kwargs), framework)


def parameter_rrefs(module_rref: rpc.RRef[Any], recurse: bool) -> list[rpc.RRef[Any]]:
    """One owner RRef per parameter, in ``module.parameters(recurse)`` order."""
    return [rpc.RRef(param) for param in module_of(module_rref).parameters(recurse)]


def set_training(module_rref: rpc.RRef[Any], mode: bool) -> None:
    module_of(module_rref).train(mode)


def get_training(module_rref: rpc.RRef[Any]) -> bool:
    return bool(module_of(module_rref).training)


def get_state_dict(module_rref: rpc.RRef[Any]) -> dict[str, Any]:
    """A CPU copy of the state dict.

    Copied (``clone``) and not merely referenced: the reply's buffers are sent asynchronously, and a
    training step running on the owner meanwhile must not change what the caller receives.
    """
    module = module_of(module_rref)
    framework = _framework_of(module, _here())
    state = {name: value.detach().clone() for name, value in module.state_dict().items()}
    result: dict[str, Any] = outputs_to_cpu(state, framework)
    return result


def load_state_dict(module_rref: rpc.RRef[Any], state_dict: Mapping[str, Any], strict: bool) -> Any:
    """``module.load_state_dict`` on the owner; returns its (missing_keys, unexpected_keys) result."""
    return module_of(module_rref).load_state_dict(state_dict, strict=strict)


def move_module(module_rref: rpc.RRef[Any], place: RemoteDevice) -> str:
    """Move the module to another device of its owner (checked first) and record the new placement."""
    module = module_of(module_rref)
    framework = _framework_of(module, _here())
    check_device(place, framework, _here())
    module.to(place.device)
    _placements[module] = place.device
    return place.device
