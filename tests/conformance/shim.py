"""torch's module names pointed at nbremote's, in one process: what a user porting a torch program does.

A test module of torch's says ``import torch.distributed.rpc as rpc`` and ``from torch.distributed.rpc
import RRef``. :func:`install` puts an *overlay* in ``sys.modules`` (and on its parent package) under
each of the four names a port changes -- ``torch.distributed.rpc``, ``.autograd``, ``.optim``, ``.nn`` --
before the test modules are imported. An overlay's names are nbremote's where nbremote has them;
anything else (``rpc.api``'s internals, ``rpc.TensorPipeAgent``, ``dist_autograd._current_context``)
falls through to torch's own module and is recorded in :data:`FALLBACKS`, so a test that fails on
torch's internals says so. Start-up is the one thing replaced rather than mapped: ``init_rpc`` and
``shutdown`` come from ``ranks`` (the world is already running).

``torch.futures`` is not overlaid: an ``nbremote.rpc.Future`` is a ``torch.futures.Future`` when torch
is loaded, so torch's ``wait_all`` / ``collect_all`` take it as they are (and nbremote itself routes
``torch.futures.wait_all`` over its futures to ``rpc.wait_all``, which returns at the first error).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["FALLBACKS", "OVERLAID", "install"]

#: (torch module, nbremote module) for each name a port changes
OVERLAID = {
    "torch.distributed.rpc": "nbremote.rpc",
    "torch.distributed.autograd": "nbremote.autograd",
    "torch.distributed.optim": "nbremote.optim",
    "torch.distributed.nn": "nbremote.nn",
}

#: "torch.distributed.rpc._get_debug_info": names the tests took from torch because nbremote has none
FALLBACKS: set[str] = set()


def _overlay(name: str, torch_module: types.ModuleType, ours: types.ModuleType,
             replaced: dict[str, Callable[..., Any]]) -> types.ModuleType:
    """A plain module (so that cloudpickle pickles it by name, as any module): nbremote's names first,
    torch's behind them through a module ``__getattr__`` (recorded when used)."""
    overlay = types.ModuleType(name, f"{ours.__name__} under torch's name {name}")
    overlay.__path__ = list(getattr(torch_module, "__path__", []))  # submodules stay torch's (rpc.api, ...)
    public = getattr(ours, "__all__", None) or [n for n in vars(ours) if not n.startswith("_")]
    for attr in public:
        setattr(overlay, attr, getattr(ours, attr))
    for attr, value in replaced.items():
        setattr(overlay, attr, value)

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = getattr(torch_module, attr)
        FALLBACKS.add(f"{name}.{attr}")
        return value

    overlay.__getattr__ = __getattr__  # type: ignore[method-assign]
    overlay.__nbremote_overlay__ = True  # type: ignore[attr-defined]
    return overlay


def install(start_up: dict[str, Callable[..., Any]]) -> None:
    """Overlay torch's four modules in this process (idempotent); ``start_up`` replaces ``init_rpc``
    and ``shutdown`` of the rpc overlay."""
    import torch.distributed

    for name, ours_name in OVERLAID.items():
        if getattr(sys.modules.get(name), "__nbremote_overlay__", False):
            continue
        torch_module = importlib.import_module(name)  # torch's own first: its submodules must exist
        ours = importlib.import_module(ours_name)
        overlay = _overlay(name, torch_module, ours, start_up if name == "torch.distributed.rpc" else {})
        sys.modules[name] = overlay
        setattr(torch.distributed, name.rpartition(".")[2], overlay)
