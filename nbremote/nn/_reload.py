"""Live class reloading: rebuild a RemoteModule's module from a new class, keeping its weights.

Runs on the owner (by RPC, by reference). The new module is built on the same device *beside* the old
one; only when it was built does anything change hands: every ``state_dict`` entry whose name and
shape both match is copied across, the training mode too, and the caller swaps its handle over to the
new module. If the constructor raises, or ``strict`` is asked for and the keys differ, the error goes
back to the caller and the old module stays exactly as it was (the new one is dropped with its RRef).

The report names every key that did not carry over: *missing* (the new class has it, the old state does
not: it keeps the new class's initial value), *unexpected* (only the old state has it: dropped) and
*mismatched* (both have it with different shapes: the new initial value is kept).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nbremote import rpc
from nbremote.errors import ReloadMismatchError
from nbremote.nn import _owner
from nbremote.nn._device import RemoteDevice
from nbremote.nn._frameworks import framework_of_class
from nbremote.nn._summary import shape

__all__ = ["ReloadMismatchError", "ReloadReport", "current_definition", "rebuild"]


def current_definition(obj: Callable[..., Any]) -> Callable[..., Any]:
    """The object now bound to ``obj``'s module and qualified name (a re-run notebook cell's new class).

    In IPython ``sys.modules["__main__"]`` is the notebook's namespace, so a class defined in a cell is
    found there too. Objects that cannot be looked up by name (local classes) are returned as they are.
    """
    found: Any = sys.modules.get(getattr(obj, "__module__", None) or "")
    for part in str(getattr(obj, "__qualname__", "<locals>")).split("."):
        if found is None or part == "<locals>":
            return obj
        found = getattr(found, part, None)
    return found if callable(found) else obj


@dataclass(frozen=True)
class ReloadReport:
    """What a reload carried across (``RemoteModule.reload``); ``str()`` reads as a sentence."""

    worker: str
    device: str
    old_type: str
    new_type: str
    loaded: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]

    @property
    def complete(self) -> bool:
        """Every key of the old state went into the new module and the new module needed nothing else."""
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        parts = [f"reloaded {self.new_type} on {self.worker}/{self.device} "
                 f"(was {self.old_type}): {len(self.loaded)} tensor(s) carried over"]
        if self.missing:
            parts.append(f"missing from the old state, left as initialised: {', '.join(self.missing)}")
        if self.unexpected:
            parts.append(f"not in the new class, dropped: {', '.join(self.unexpected)}")
        if self.mismatched:
            parts.append("shape changed, left as initialised: " + ", ".join(
                f"{name} {shape(old)} -> {shape(new)}" for name, old, new in self.mismatched))
        return "; ".join(parts)


def _compare(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[list[str], list[str], list[str], list[Any]]:
    loaded, mismatched = [], []
    for key in new:
        if key in old:
            old_shape, new_shape = tuple(old[key].shape), tuple(new[key].shape)
            if old_shape == new_shape:
                loaded.append(key)
            else:
                mismatched.append((key, old_shape, new_shape))
    missing = [k for k in new if k not in old]
    unexpected = [k for k in old if k not in new]
    return loaded, missing, unexpected, mismatched


Rebuilt = tuple[rpc.RRef[Any], _owner.ModuleInfo, "ReloadReport"]


def rebuild(old_rref: rpc.RRef[Any], module_cls: Callable[..., Any], args: tuple[Any, ...],
            kwargs: Mapping[str, Any], device: str, strict: bool) -> Rebuilt:
    """Build ``module_cls(*args, **kwargs)`` where the old module is and carry its state across."""
    old = _owner.module_of(old_rref)
    where = rpc.get_worker_info().name
    place = RemoteDevice(where, _owner.placement(old, device))
    new_rref, info = _owner.create_module(module_cls, args, kwargs, place, framework_of_class(module_cls))
    new = new_rref.local_value()
    old_state, new_state = old.state_dict(), new.state_dict()
    loaded, missing, unexpected, mismatched = _compare(old_state, new_state)
    report = ReloadReport(where, place.device, type(old).__qualname__, type(new).__qualname__, tuple(loaded),
                          tuple(missing), tuple(unexpected), tuple((k, tuple(o), tuple(n)) for k, o, n in mismatched))
    if strict and not report.complete:
        raise ReloadMismatchError(f"{report}. The old module was kept; reload with strict=False to accept this")
    new.load_state_dict({key: old_state[key] for key in loaded}, strict=False)
    new.train(bool(old.training))
    return new_rref, info, report
