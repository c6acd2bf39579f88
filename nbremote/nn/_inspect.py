"""Owner-side inspection of a RemoteModule's module: its summary, and the gradient norms seam.

Runs on the worker that owns the module (called by RPC, by reference, like ``_owner``). One call
returns the whole :class:`~nbremote.nn._summary.ModuleSummary` so that a live panel refreshing every
second costs one round trip. Norms are computed in float32 on the parameter's own device and only the
numbers travel.

**Gradient norms come from one function**, :func:`gradient_norms`: a parameter's ``.grad`` where it
has one (local training on the worker), else the gradient distributed autograd gave it in the last
context that was released (distributed autograd keeps gradients in contexts, never in ``.grad``).
"""

from __future__ import annotations

from typing import Any

from nbremote import rpc
from nbremote.autograd import last_gradient
from nbremote.history import recorder
from nbremote.nn import _owner
from nbremote.nn._summary import ModuleSummary, ParameterInfo

__all__ = ["gradient_norms", "summarize"]


def _norm(tensor: Any) -> float:
    return float(tensor.detach().float().norm())


def _dtype(tensor: Any, framework: str) -> str:
    return str(tensor.dtype).removeprefix(f"{framework}.")


def gradient_norms(module: Any) -> dict[str, float]:
    """L2 norm of each parameter's gradient, by parameter name, where a gradient exists.

    ``.grad`` first; else the parameter's gradient from the last released distributed autograd context.
    """
    norms = {}
    for name, p in module.named_parameters():
        grad = p.grad if p.grad is not None else last_gradient(p)
        if grad is not None:
            norms[name] = _norm(grad)
    return norms


def summarize(module_rref: rpc.RRef[Any], device: str, history: bool = False,
              lease: float | None = None, reader: str = "") -> ModuleSummary:
    """Everything the panel shows about the module, computed where it lives (its history too, if asked:
    ``lease`` as for ``nbremote.history.read``)."""
    module = _owner.module_of(module_rref)
    framework = _owner.framework_of_module(module)
    grads = gradient_norms(module)
    params = tuple(
        ParameterInfo(name, tuple(int(d) for d in p.shape), _dtype(p, framework), str(p.device),
                      bool(p.requires_grad), int(p.numel()), _norm(p), grads.get(name))
        for name, p in module.named_parameters())
    recorded = recorder.history(module, lease, reader) if history else None
    return ModuleSummary(rpc.get_worker_info().name, type(module).__qualname__, framework,
                         _owner.placement(module, device), bool(module.training), params, recorded)
