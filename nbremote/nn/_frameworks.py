"""The few framework-specific facts RemoteModule needs, for torch and tensorplay.

Each question is a small function keyed by a framework name (``"torch"`` / ``"tensorplay"``):
is this class a Module of a supported framework, which ``Module`` base class to compose with, does a
device exist, and moving the tensors of a nested structure (tuples, lists, dicts, namedtuples) to a
device and back. Frameworks are imported lazily with :mod:`importlib` and only when their own objects
are at hand, so ``import nbremote.nn`` imports neither and a tensorplay-only worker never imports
torch. Classes are recognised by walking their MRO for the framework's ``Module`` by *name*, which
needs no import at all (if a class derives from ``torch.nn.Module``, torch is already loaded anyway).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from nbremote.nn._device import RemoteDevice, RemoteDeviceError

__all__ = [
    "FRAMEWORKS",
    "check_device",
    "framework_of_class",
    "grad_enabled",
    "inputs_to_device",
    "module_base",
    "no_grad",
    "outputs_to_cpu",
]

FRAMEWORKS = ("torch", "tensorplay")

# (module, qualname) of each framework's Module base class, as it appears in an MRO.
_MODULE_BASES: dict[tuple[str, str], str] = {
    ("torch.nn.modules.module", "Module"): "torch",
    ("tensorplay.nn.modules.module", "Module"): "tensorplay",
}


def framework_of_class(cls: object) -> str | None:
    """``"torch"`` / ``"tensorplay"`` if ``cls`` is a subclass of that framework's Module, else None."""
    if not isinstance(cls, type):
        return None
    for base in cls.__mro__:
        framework = _MODULE_BASES.get((base.__module__, base.__qualname__))
        if framework is not None:
            return framework
    return None


def _library(framework: str) -> ModuleType:
    if framework not in FRAMEWORKS:
        raise ValueError(f"unsupported framework {framework!r}; nbremote.nn supports {', '.join(FRAMEWORKS)}")
    # sys.modules first: every forward asks (grad_enabled), and import_module runs the import machinery
    return sys.modules.get(framework) or importlib.import_module(framework)


def module_base(framework: str) -> type:
    """The framework's ``nn.Module`` class (imports the framework)."""
    base: type = importlib.import_module(f"{_library(framework).__name__}.nn").Module
    return base


def _cuda_library(framework: str | None) -> tuple[str, ModuleType]:
    """The framework that answers CUDA questions: the module's own, else torch, else tensorplay."""
    candidates = (framework,) if framework is not None else FRAMEWORKS
    for name in candidates:
        if name is None:
            continue
        try:
            return name, _library(name)
        except ImportError:
            continue
    raise ModuleNotFoundError(f"none of {', '.join(candidates)} is installed, so CUDA cannot be used")


def check_device(place: RemoteDevice, framework: str | None, worker: str) -> None:
    """Raise :class:`RemoteDeviceError` if ``place.device`` does not exist in this process.

    Runs on the worker before the module is built, so a missing GPU is an error that names the worker
    and what it has, not a crash inside the constructor or ``.to()``.
    """
    if place.device_type == "cpu":
        return
    name, lib = _cuda_library(framework)
    fix = f"use '{worker}/cpu' or a worker that has a GPU"
    if not lib.cuda.is_available():
        raise RemoteDeviceError(
            f"worker {worker!r} has no CUDA device ({name}.cuda.is_available() is False there); {fix}",
            worker=worker,
        )
    count = int(lib.cuda.device_count())
    index = place.device_index if place.device_index is not None else 0
    if index >= count:
        raise RemoteDeviceError(
            f"worker {worker!r} has {count} CUDA device(s) (cuda:0..cuda:{count - 1}); "
            f"{place.device!r} does not exist there",
            worker=worker,
        )


def _map_tensors(value: Any, tensor_type: type, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every tensor in nested tuples / namedtuples / lists / dicts; keep the rest."""
    if isinstance(value, tensor_type):
        return fn(value)
    if isinstance(value, tuple):
        items = [_map_tensors(item, tensor_type, fn) for item in value]
        # A namedtuple's constructor takes fields positionally; a plain tuple takes one iterable.
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_map_tensors(item, tensor_type, fn) for item in value]
    if isinstance(value, dict):
        mapped = {key: _map_tensors(item, tensor_type, fn) for key, item in value.items()}
        return mapped if type(value) is dict else type(value)(mapped)
    return value


def _tensor_type(framework: str) -> type:
    tensor: type = _library(framework).Tensor
    return tensor


def inputs_to_device(value: Any, device: str, framework: str) -> Any:
    """Move the CPU tensors in ``value`` (args tuple or kwargs dict, any nesting) to ``device``."""
    return _map_tensors(value, _tensor_type(framework), lambda t: t if t.is_cuda else t.to(device))


def outputs_to_cpu(value: Any, framework: str) -> Any:
    """Bring every CUDA tensor in a forward's result back to CPU, whatever its structure."""
    return _map_tensors(value, _tensor_type(framework), lambda t: t.cpu() if t.is_cuda else t)


def grad_enabled(framework: str | None) -> bool:
    """Whether ``framework`` records gradients in this thread now (its ``torch.no_grad()`` and kin)."""
    if framework not in FRAMEWORKS:
        return True
    return bool(_library(framework).is_grad_enabled())


def no_grad(framework: str) -> Any:
    """``framework.no_grad()``: a context without gradient recording."""
    return _library(framework).no_grad()
