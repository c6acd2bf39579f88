"""DistributedDataParallel inside a distributed backward: its reducer runs, as under torch's engine.

torch's DDP all-reduces gradients from hooks that its C++ ``Reducer`` puts on the gradient-accumulation
node (``AccumulateGrad``) of each parameter; the reducer copies each gradient into a bucket, all-reduces a
bucket once all of its gradients are in (divided by the world size), and writes the averages back when
the engine's pass ends. nbremote's local pass computes leaf gradients with ``autograd.grad``, which never
runs those nodes: the hooks would not fire, and each replica would keep its own gradient -- a silent
divergence (issue 40). torch's own distributed engine runs the nodes and has the reducer read and write
the context's gradients instead of ``.grad``.

Here, a pass that reaches a parameter of a live DDP module runs torch's real backward instead
(``torch.autograd.backward(..., inputs=leaves)``): the accumulation nodes run, the reducer's C++ hooks fire
and its end-of-pass callback writes the averaged gradients, bucket order, division and communication
hook included, because it *is* the reducer. The leaves' ``.grad`` is set aside first and put back after,
and what the pass left there is what the context keeps (copied: a DDP gradient may be a view of a bucket
the next pass overwrites). Such passes take a process-wide lock: the reducer serves one pass at a time,
and ``.grad`` is borrowed.

Which parameters are DDP's: ``DistributedDataParallel.__init__`` is wrapped (on the first pass in this
process) to record each new instance's parameters; instances made before that are found once, by a scan
of the garbage collector's objects, when some process group exists (a DDP cannot exist without one).
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["accumulated_gradients", "data_parallel"]

_lock = threading.RLock()  # one DDP pass at a time in this process (see the module's docstring)
_state: dict[str, bool] = {"watching": False}
# id(parameter) -> (the parameter, its DDP module), both weakly: a module that is gone manages nothing.
_managed: dict[int, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}


def _record(ddp: Any) -> None:
    keys = [id(p) for p in ddp.module.parameters() if p.requires_grad]

    def forget(ref: weakref.ref[Any]) -> None:  # the module is gone: its entries go (unless an id was reused)
        for key in keys:
            entry = _managed.get(key)
            if entry is not None and entry[1] is ref:
                _managed.pop(key, None)

    module_ref = weakref.ref(ddp, forget)
    for param in ddp.module.parameters():
        if param.requires_grad:
            _managed[id(param)] = (weakref.ref(param), module_ref)


def _watch() -> None:
    """Record DDP modules from now on, and those that exist already (once per process)."""
    with _lock:
        if _state["watching"]:
            return
        ddp_class = torch.nn.parallel.DistributedDataParallel
        original = ddp_class.__init__

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            _record(self)

        init.__wrapped__ = original  # type: ignore[attr-defined]
        ddp_class.__init__ = init  # type: ignore[method-assign]
        if _any_group():
            for obj in gc.get_objects():
                if issubclass(type(obj), ddp_class):  # type(): isinstance reads __class__, which some objects warn on
                    _record(obj)
        _state["watching"] = True


def _any_group() -> bool:
    """Whether this process has made a process group (a DDP module needs one), default or not."""
    if not dist.is_available():
        return False
    groups = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return bool(groups) if groups is not None else True  # unknown (another torch): scan to be safe


def data_parallel(leaves: Sequence[Any]) -> list[Any]:
    """The live DDP modules that manage some of ``leaves`` (parameters of this process), each once."""
    if not _state["watching"]:
        _watch()
    if not _managed:
        return []
    found: dict[int, Any] = {}
    for leaf in leaves:
        entry = _managed.get(id(leaf))
        if entry is None:
            continue
        param, module = entry[0](), entry[1]()
        if param is leaf and module is not None:
            found[id(module)] = module
        elif param is not leaf:  # another tensor took the id of a parameter that is gone
            _managed.pop(id(leaf), None)
    return list(found.values())


def accumulated_gradients(outputs: Sequence[Any], inputs: Sequence[Any],
                          grad_outputs: Sequence[Any]) -> list[Any]:
    """The gradients of ``inputs`` (leaves; None where unreached) from torch's own backward, which runs the
    accumulation nodes and so every hook on them (DDP's reducer), the graph retained; ``.grad`` of each input
    is as it was afterwards."""
    with _lock:
        saved = [leaf.grad for leaf in inputs]
        for leaf in inputs:
            leaf.grad = None
        try:
            torch.autograd.backward(list(outputs), list(grad_outputs), retain_graph=True, inputs=list(inputs))
            return [None if leaf.grad is None else leaf.grad.clone() for leaf in inputs]
        finally:
            for leaf, grad in zip(inputs, saved, strict=True):
                leaf.grad = grad
