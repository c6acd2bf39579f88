"""``nbremote.autograd``: distributed autograd across kernels, shaped like ``torch.distributed.autograd``.

::

    import nbremote.autograd as dist_autograd
    with dist_autograd.context() as context_id:
        loss = model(x).sum()                    # RemoteModules / RPCs inside are recorded
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)                     # nbremote.optim.DistributedOptimizer

How it works (the RPC layer records, this module runs the pass; see ``nbremote.rpc._core.gradctx``):

* Inside a context, every RPC whose arguments or result hold tensors that require grad is recorded on
  both ends, in both directions and across hops: the sender keeps the tensors it sent (a *send*), the
  receiver gets them as leaves that remember which send they came from.
* ``backward`` runs a *local pass* from the roots: one ``autograd.grad`` over this process's part of
  the graph, with every leaf it reaches as an input. Gradients of the process's own leaves (parameters)
  accumulate in the context; gradients of leaves that arrived by RPC go back to their sender, which
  runs a local pass from the tensors of that send -- and so on, across the world. The pass returns
  when every hop it started has finished, so an error anywhere (a worker dying included) surfaces in
  the ``backward`` call with its own type. An error raised while computing gradients is also made a
  ``RuntimeError`` saying where, as torch's ("Error on Node 2: ...", see ``nbremote.errors``).
* Local passes keep the graph (several sends may share parts of it); it is freed when the context
  exits. Without ``retain_graph`` a send used by one backward refuses a second one, as torch does.
* Gradients live in the context (``get_gradients``), never in ``.grad``: concurrent contexts of
  several trainers against one parameter server do not mix.
* Leaving the ``with`` block releases the context here and, through the workers it touched, everywhere
  (fire and forget: a dead worker cannot hold it up).

Works for torch and tensorplay tensors (both have ``autograd.grad`` and a walkable ``grad_fn`` graph).
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import itertools
import logging
import random
from collections.abc import Mapping, Sequence
from types import ModuleType, TracebackType
from typing import Any

from nbremote import rpc
from nbremote.errors import AutogradError, NbRemoteError, also_runtime_error
from nbremote.frameworks import tensor_key
from nbremote.rpc._core import Agent, current_agent, gradctx, wait_all

__all__ = ["backward", "context", "get_gradients", "last_gradient"]

log = logging.getLogger("nbremote")

_pass_ids = itertools.count(random.getrandbits(32) << 20)  # one per backward call, unique enough per world
_NODE = "_nbremote_node"  # the rank whose local pass raised an error (kept in its __dict__: it travels)


class context:  # lower case: torch's spelling, ``with dist_autograd.context() as context_id``
    """A distributed autograd context: ``with context() as context_id:`` records the RPCs made inside."""

    def __enter__(self) -> int:
        agent = current_agent()
        active = gradctx.current.get()
        if active is not None:
            raise AutogradError(
                f"Already have an autograd context id for this thread: context {active}. Contexts do not nest; "
                "finish the step in that context (backward, optimizer step) and exit it first")
        self._agent = agent
        self._id = agent.grad.new().id
        self._token = gradctx.current.set(self._id)
        return self._id

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        gradctx.current.reset(self._token)
        _release(self._agent, self._id, origin=None)


def _context(agent: Agent, context_id: object, what: str) -> gradctx.Context:
    if isinstance(context_id, bool) or not isinstance(context_id, int):
        raise TypeError(f"{what}: incompatible function arguments: context_id is the int that "
                        f"`with dist_autograd.context() as context_id` gives, not {type(context_id).__name__}")
    ctx = agent.grad.get(context_id)
    if ctx is None:
        raise AutogradError(
            f"{what}: Could not find autograd context with id: {context_id} on {agent.name!r} (it was never "
            "created or has already exited); call it inside `with dist_autograd.context() as context_id:`")
    return ctx


def backward(context_id: int, roots: Sequence[Any], retain_graph: bool = False) -> None:
    """Run the backward pass from ``roots`` (scalar tensors) across every worker the context touched.

    Gradients accumulate in the context on each worker (see :func:`get_gradients`). Blocks until the
    whole distributed pass is done; an error on any worker is raised here with its own type.
    """
    agent = current_agent()
    ctx = _context(agent, context_id, "dist_autograd.backward")
    tensors = _check_roots(roots)
    lib = _library_of(tensors, "dist_autograd.backward")
    try:
        _local_pass(agent, ctx, lib, tensors, [lib.ones_like(t) for t in tensors], next(_pass_ids), retain_graph)
    except NbRemoteError:  # nbremote's own (a lost worker, a timeout): RuntimeErrors already, as they are
        raise
    except Exception as exc:  # from computing gradients, here or on another rank: torch's RuntimeError, with
        raise also_runtime_error(exc, f"Error on Node {getattr(exc, _NODE, agent.rank)}: ") from None  # its type


def get_gradients(context_id: int) -> Mapping[Any, Any]:
    """This worker's gradients in the context: ``{tensor: gradient}`` for the leaves that got one.

    A read-only mapping looked up by tensor identity (as torch's dict is): ``grads[param]``.
    """
    return _context(current_agent(), context_id, "dist_autograd.get_gradients").gradients()


def last_gradient(tensor: Any) -> Any:
    """The gradient ``tensor`` got in this process's newest context that gave it one, or None.

    Not in torch's API: what a live view (the module panel) shows between training steps, when the
    step's context -- and with it ``get_gradients`` -- is gone, or still on its way out here (a context's
    release reaches the other workers asynchronously).
    """
    return current_agent().grad.last_gradient(tensor)


# -- the pass ---------------------------------------------------------------------------------------------


def _check_roots(roots: object) -> list[Any]:
    if _is_tensor(roots):
        roots = [roots]
    # The messages carry torch's wording too, for code that matches it.
    if not isinstance(roots, (list, tuple)):
        raise TypeError(f"dist_autograd.backward: incompatible function arguments: roots is a list of scalar "
                        f"tensors, not {type(roots).__name__}")
    if not roots:
        raise AutogradError("dist_autograd.backward: No tensors provided for gradient computation; pass the loss, "
                            "e.g. backward(context_id, [loss])")
    for i, root in enumerate(roots):
        if not _is_tensor(root):
            raise TypeError(f"dist_autograd.backward: incompatible function arguments: roots[{i}] is a "
                            f"{type(root).__name__}, not a tensor")
        if not root.requires_grad:
            raise AutogradError(
                f"dist_autograd.backward: requires_grad not set on roots[{i}], so no graph leads to it; compute "
                "it from tensors that require grad (parameters, RemoteModule outputs) inside the context")
        if root.numel() != 1:
            raise AutogradError(
                f"dist_autograd.backward: roots[{i}] of shape {tuple(root.shape)} is not a scalar, all roots need "
                "to be scalar (reduce it first, e.g. loss.sum() or loss.mean())")
        if root.grad_fn is None:
            raise AutogradError(
                f"dist_autograd.backward: roots[{i}] does not have a valid gradient function: it is a leaf "
                "tensor, not computed from anything; back-propagate from the loss computed from it")
    return list(roots)


def _is_tensor(x: object) -> bool:
    return type(x).__module__.partition(".")[0] in ("torch", "tensorplay") and hasattr(x, "requires_grad")


def _library_of(tensors: Sequence[Any], what: str) -> ModuleType:
    names = {type(t).__module__.partition(".")[0] for t in tensors}
    if len(names) != 1:
        raise TypeError(f"{what}: the tensors mix frameworks ({', '.join(sorted(names))})")
    return importlib.import_module(names.pop())


def _leaves(outputs: Sequence[Any]) -> list[Any]:
    """Every leaf that requires grad and that ``outputs`` depend on (outputs that are leaves included)."""
    found: dict[int, Any] = {}
    seen: set[int] = set()
    nodes: list[Any] = []  # keeps visited nodes alive, so their ids stay unique during the walk
    stack = []
    for t in outputs:
        if t.grad_fn is None:
            if t.requires_grad:
                found[tensor_key(t)] = t
        else:
            stack.append(t.grad_fn)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if leaf is not None:
            found.setdefault(tensor_key(leaf), leaf)
        else:
            stack.extend(child for child, _ in node.next_functions)
    return list(found.values())


def _local_pass(agent: Agent, ctx: gradctx.Context, lib: ModuleType, outputs: Sequence[Any],
                grad_outputs: Sequence[Any], pass_id: int, retain_graph: bool) -> None:
    """Back-propagate through this process's graph; send what reaches leaves from RPCs to their senders."""
    leaves = _leaves(outputs)
    if not leaves:
        return
    # retain_graph=True: other sends of this context may lead into the same part of the graph later in
    # this very pass; the context's release frees it.
    try:
        grads = lib.autograd.grad(list(outputs), leaves, grad_outputs=list(grad_outputs), retain_graph=True,
                                  allow_unused=True)
    except Exception as exc:  # the rank it happened on travels with it (backward's "Error on Node N")
        with contextlib.suppress(AttributeError):
            setattr(exc, _NODE, getattr(exc, _NODE, agent.rank))
        raise
    routes: dict[tuple[str, int], dict[int, Any]] = {}
    given = collections.Counter(id(g) for g in grads if g is not None)  # one tensor for several leaves: copied
    for leaf, grad in zip(leaves, grads, strict=True):
        if grad is None:
            continue
        recv = ctx.recv_of(leaf)
        if recv is None:
            ctx.accumulate(leaf, grad, given[id(grad)] > 1)
        else:
            routes.setdefault((recv.sender, recv.send_id), {})[recv.index] = grad
    calls = [(sender, (ctx.id, send_id, slots, pass_id, retain_graph)) for (sender, send_id), slots in routes.items()]
    if len(calls) == 1:  # the usual chain: one hop back, received by this thread itself
        rpc.rpc_sync(calls[0][0], _backward_from_send, args=calls[0][1])
    else:
        wait_all([rpc.rpc_async(sender, _backward_from_send, args=args) for sender, args in calls])


def _backward_from_send(ctx_id: int, send_id: int, slots: dict[int, Any], pass_id: int, retain_graph: bool) -> None:
    """Runs on the process that sent tensors: continue the pass from them with the gradients that came back."""
    agent = current_agent()
    ctx = agent.grad.get(ctx_id)
    if ctx is None:
        raise AutogradError(f"distributed autograd context {ctx_id} is gone on {agent.name!r}: it was released "
                            "before the backward pass reached it (keep backward inside the `with` block)")
    send = ctx.send(send_id)
    if send is None:
        raise AutogradError(f"{agent.name!r} has no record of send {send_id} in autograd context {ctx_id}")
    with ctx.lock:
        if send.consumed_by not in (None, pass_id):
            raise AutogradError(
                f"Trying to backward through the graph a second time in autograd context {ctx_id} (on "
                f"{agent.name!r}): the first backward freed it; pass retain_graph=True to dist_autograd.backward "
                "if you need to backward twice")
        if not retain_graph:
            send.consumed_by = pass_id
    outputs = [send.tensors[i] for i in slots]
    grads = [g if g.device == t.device else g.to(t.device) for t, g in zip(outputs, slots.values(), strict=True)]
    _local_pass(agent, ctx, _library_of(outputs, "dist_autograd.backward"), outputs, grads, pass_id, retain_graph)


def _rref_backward(rref: rpc.RRef[Any], context_id: int, retain_graph: bool) -> None:
    """Runs on an RRef's owner for ``RRef.backward(context_id)``: the pass starts from the value."""
    value = rref.local_value()
    if not _is_tensor(value):
        raise AutogradError(f"RRef should contain a tensor for .backward(): {rref!r} holds a {type(value).__name__}")
    backward(context_id, [value], retain_graph)


gradctx.set_rref_backward(_rref_backward)


# -- release ------------------------------------------------------------------------------------------------


def _release(agent: Agent, ctx_id: int, origin: str | None) -> None:
    """Forget the context here and tell everyone it touched (who tell theirs); never blocks."""
    ctx = agent.grad.release(ctx_id)
    if ctx is None or not agent.running:
        return
    for peer in ctx.peers - {agent.name, origin}:
        try:
            rpc.rpc_async(peer, _release_from, args=(ctx_id, agent.name))
        except NbRemoteError:  # a peer that left or died holds nothing any more
            log.debug("could not release autograd context %s on %r", ctx_id, peer, exc_info=True)


def _release_from(ctx_id: int, origin: str) -> None:
    """Runs on a peer: release the context there (and onwards)."""
    _release(current_agent(), ctx_id, origin)
