"""``nbremote.optim.DistributedOptimizer``: one local optimizer per owner of the parameters, stepping on
the gradients of a distributed autograd context -- shaped like ``torch.distributed.optim``.

::

    opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.05)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)

The constructor groups the parameter RRefs by owner and builds ``optimizer_class(params, *args,
**kwargs)`` *on each owner* (any ``torch.optim`` optimizer, or tensorplay's for tensorplay models), in
parallel; a constructor error is raised here with its own type and the worker named. ``step`` runs
every owner's local step in parallel: the context's gradients are put into ``.grad`` for the step and
the previous ``.grad`` restored after it, so ``.grad`` never shows distributed gradients; parameters
with no gradient in the context are skipped (their ``.grad`` is ``None`` during the step). As in torch,
steps of all local optimizers of one process take one lock: two trainers stepping on one parameter
server apply both updates, one after the other, with none lost.

An update is never dropped quietly: an owner on which the context was already released (its gradients
went with it) fails the step with :class:`~nbremote.errors.AutogradError`, and ``step`` returns or
raises only once every owner's step has finished, as torch's does -- when one owner fails, the others'
updates have landed (or failed too) before the error reaches the caller, not later, racing the
context's release and the next iteration. The exception is an owner whose kernel died: its
``WorkerLostError`` is raised at once (the fault table's promise), and the step counts as lost.

What a lost worker's recovery needs of an optimizer (``nbremote.nn``'s snapshots, which live above this
module): every live one is listed by :func:`live_optimizers`, keeps how it was built (``optimizer_class``,
``args``, ``kwargs``, and its parameter RRefs' ids by owner), counts its ``steps``, and runs the
:data:`AFTER_STEP` hooks after each step that landed -- between steps, where a snapshot is consistent.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from nbremote import history, rpc
from nbremote.autograd import _context, _run_pass
from nbremote.errors import AutogradError, WorkerLostError
from nbremote.frameworks import optimizer_step
from nbremote.rpc._core import current_agent, owned_value, settle_all, wait_all

__all__ = ["AFTER_STEP", "DistributedOptimizer", "live_optimizers"]

# One per process, as torch's: local optimizers that share parameters must not step at the same time.
_STEP_LOCK = threading.Lock()

# Run (with the optimizer) after each of its steps that landed on every owner: how snapshots are taken
# between steps (nbremote.nn). A hook's error is the step's caller's: the step itself has landed.
AFTER_STEP: list[Callable[[DistributedOptimizer], None]] = []
_LIVE: weakref.WeakSet[DistributedOptimizer] = weakref.WeakSet()


def live_optimizers() -> list[DistributedOptimizer]:
    """The DistributedOptimizers of this process that are still referenced."""
    return list(_LIVE)


class _LocalOptimizer:
    """Lives on the owner of the parameters; steps them on one context's gradients."""

    def __init__(self, optimizer_class: Callable[..., Any], params: list[Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self.params = params
        self.optim = optimizer_class(params, *args, **kwargs)
        self._step = optimizer_step(self.optim)  # torch's own optimizers: without wrappers that do nothing

    def step(self, context_id: int) -> int:
        """Apply the context's gradients; returns how many parameters had one."""
        agent = current_agent()
        ctx = agent.grad.get(context_id)
        if ctx is None and agent.grad.released(context_id):
            # Not "no gradients here": they were here and went with the context. Skipping would lose
            # this owner's update without a word while the other owners apply theirs.
            raise AutogradError(
                f"DistributedOptimizer.step: distributed autograd context {context_id} was released on "
                f"{agent.name!r} before the step, and its gradients with it (the context was "
                "exited, or a worker that took part in it was lost); step inside the `with` block, after "
                "backward")
        grads = [None if ctx is None else ctx.gradient_of(p) for p in self.params]
        if all(g is None for g in grads):
            return 0
        with _STEP_LOCK:
            saved = [p.grad for p in self.params]
            try:
                for p, g in zip(self.params, grads, strict=True):
                    p.grad = g
                with history.step(self.params):  # records the step where a panel watches these parameters
                    self._step()
            finally:
                for p, g in zip(self.params, saved, strict=True):
                    p.grad = g
        return sum(g is not None for g in grads)


def _new_local_optimizer(optimizer_class: Callable[..., Any], params_rref: list[rpc.RRef[Any]],
                         args: tuple[Any, ...], kwargs: dict[str, Any]) -> rpc.RRef[_LocalOptimizer]:
    """Runs on the owner: build the optimizer over the parameters it owns."""
    return rpc.RRef(_LocalOptimizer(optimizer_class, [r.local_value() for r in params_rref], args, kwargs))


def _local_step(optimizer_id: str, context_id: int) -> int:
    """Runs on the owner. The optimizer comes by its RRef's id: the calling DistributedOptimizer holds the
    RRef for the whole step, so no reference needs to travel (and be counted) with every step."""
    optimizer: _LocalOptimizer = owned_value(optimizer_id)
    return optimizer.step(context_id)


class DistributedOptimizer:
    """``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)``; ``step(context_id)``."""

    def __init__(self, optimizer_class: Callable[..., Any], params_rref: Iterable[rpc.RRef[Any]],
                 *args: Any, **kwargs: Any) -> None:
        if not callable(optimizer_class):
            raise TypeError(f"optimizer_class must be an optimizer class such as torch.optim.SGD, "
                            f"got {type(optimizer_class).__name__}")
        by_owner: dict[str, list[rpc.RRef[Any]]] = {}
        for i, rref in enumerate(params_rref):
            if not isinstance(rref, rpc.RRef):
                raise TypeError(f"params_rref[{i}] is a {type(rref).__name__}, not an RRef: pass RRefs to the "
                                "parameters, e.g. remote_module.remote_parameters() or [rpc.RRef(p) for p in ...]")
            by_owner.setdefault(rref.owner_name(), []).append(rref)
        if not by_owner:
            raise ValueError("DistributedOptimizer got an empty parameter list")
        futures = [rpc.rpc_async(owner, _new_local_optimizer, args=(optimizer_class, rrefs, args, kwargs))
                   for owner, rrefs in by_owner.items()]
        self.remote_optimizers: list[rpc.RRef[_LocalOptimizer]] = wait_all(futures)
        self.optimizer_class, self.args, self.kwargs = optimizer_class, args, kwargs
        self.param_ids = {owner: [r._id for r in rrefs] for owner, rrefs in by_owner.items()}
        self.steps = 0
        _LIVE.add(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy sent to another process steps the same local optimizers: it is a live optimizer there too.
        self.__dict__.update(state)
        _LIVE.add(self)

    def _stepped(self) -> None:
        self.steps += 1
        for hook in list(AFTER_STEP):
            hook(self)

    def step(self, context_id: int) -> None:
        """Step every owner's parameters on the gradients of ``context_id`` (in parallel)."""
        agent = current_agent()
        _context(agent, context_id, "DistributedOptimizer.step")
        # Sent from this thread at once, before the local step: every owner steps while this one does. The
        # last one's reply comes to this thread's own socket (a blocking call's way), which saves the hand-over
        # from the receiving thread for it (the step's only one when one owner is remote, as a trainer's).
        remote = [opt for opt in self.remote_optimizers if not opt.is_owner()]
        futures = [agent.call(opt.owner_name(), _local_step, (opt._id, context_id), now=True,
                              snapshot=opt is not remote[-1]) for opt in remote]
        errors: list[BaseException] = []
        for opt in self.remote_optimizers:  # the caller's own parameters: stepped here meanwhile
            if opt.is_owner():
                try:
                    _local_step(opt._id, context_id)
                except Exception as exc:
                    errors.append(exc)
        errors += settle_all(futures, unless=(WorkerLostError,))  # a dead owner: the step is lost, say so
        if errors:
            raise errors[0]
        self._stepped()

    def backward_and_step(self, context_id: int, roots: Sequence[Any], retain_graph: bool = False) -> None:
        """``dist_autograd.backward(context_id, roots)``, each owner stepping its parameters as soon as its part
        of the pass is over -- no round of step calls after it: the step overlaps the rest of the backward.

        For models where the pass reaches every owner once: a chain of stages (a split model), a pipeline of
        them (every micro-batch's gradients reach a stage in one message), a parameter server. An owner the
        pass reaches a second time has stepped already, so that pass fails with an ``AutogradError`` saying
        so (that owner's step missed the second part of its gradients): use ``dist_autograd.backward``, then
        :meth:`step`. Not in torch's API.
        """
        steps: dict[str, list[str]] = {}
        for opt in self.remote_optimizers:
            steps.setdefault(opt.owner_name(), []).append(opt._id)
        _run_pass(current_agent(), context_id, roots, retain_graph, steps, "DistributedOptimizer.backward_and_step")
        self._stepped()

    def __repr__(self) -> str:
        owners = ", ".join(opt.owner_name() for opt in self.remote_optimizers)
        return f"DistributedOptimizer(on {owners})"
