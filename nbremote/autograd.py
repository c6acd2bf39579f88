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
  accumulate in the context; gradients of leaves that arrived by RPC go to their sender as a *hop* (all
  of one sender's in one message), where a local pass from the tensors of those sends runs -- and so on,
  across the world. A hop reports to the root when it is over, with the hops it started, and the root
  returns when none is left (``rpc._core.gradctx.Pass``): nothing waits for the hops down a chain to
  unwind, and no thread blocks per hop. An error anywhere (a worker dying included) surfaces in the
  ``backward`` call with its own type. An error raised while computing gradients is also made a
  ``RuntimeError`` saying where, as torch's ("Error on Node 2: ...", see ``nbremote.errors``).
* Local passes keep the graph (several sends may share parts of it); it is freed when the context
  exits. Without ``retain_graph`` a send used by one backward refuses a second one, as torch does.
* Gradients live in the context (``get_gradients``), never in ``.grad``: concurrent contexts of
  several trainers against one parameter server do not mix. As in torch, a leaf's tensor hooks
  (``register_hook``) change the gradient it gets, and the post hooks of its accumulation node run when
  it gets one.
* A parameter of a ``DistributedDataParallel`` module is the exception: its reducer all-reduces from hooks
  on the accumulation nodes, so a local pass that reaches one runs torch's own backward, and the context
  keeps the averaged gradient the reducer leaves (``.grad`` is put back as it was; ``frameworks._ddp``).
  The replicas train as under torch's engine, which has the reducer write to the context instead.
* Leaving the ``with`` block releases the context here and, through the workers it touched, everywhere
  (news sent at once, waiting for no answer: a dead worker cannot hold it up; passed on, it rides with the
  next message).

Works for torch and tensorplay tensors (both have ``autograd.grad`` and a walkable ``grad_fn`` graph).
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import itertools
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType, TracebackType
from typing import Any

from nbremote.errors import AutogradError, NbRemoteError, RPCTimeoutError, also_runtime_error
from nbremote.frameworks import accumulated_gradients, data_parallel, gradients, tensor_key
from nbremote.rpc._core import Agent, RRef, current_agent, gradctx, owned_value

__all__ = ["backward", "context", "get_gradients", "last_gradient"]

log = logging.getLogger("nbremote")

# One per backward call, unique enough per world. From the OS (``secrets``), never the global ``random``:
# the user's seeded stream must not move because nbremote was imported (issue 40).
_pass_ids = itertools.count(secrets.randbits(32) << 20)
_hop_ids = itertools.count()  # a hop is named by the process that sends it and this count
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
        _release(self._agent, self._id)


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
    _run_pass(current_agent(), context_id, roots, retain_graph, None, "dist_autograd.backward")


# What a pass's hops carry along: (pass id, its root, retain_graph, the optimizers each process steps as
# soon as its part of the pass is over -- by process, their ids; None: nobody steps, see
# DistributedOptimizer.backward_and_step).
Plan = tuple[int, str, bool, "dict[str, list[str]] | None"]


def _run_pass(agent: Agent, context_id: int, roots: Sequence[Any], retain_graph: bool,
              steps: dict[str, list[str]] | None, what: str) -> None:
    """Run a backward pass rooted here; ``steps``: see :data:`Plan`."""
    ctx = _context(agent, context_id, what)
    tensors = _check_roots(roots)
    lib = _library_of(tensors, what)
    run = gradctx.Pass(next(_pass_ids))
    plan: Plan = (run.id, agent.name, retain_graph, steps)
    with ctx.lock:
        ctx.passes[run.id] = run
    try:
        pumps: list[Callable[[float], None]] = []
        hops = _local_pass(agent, ctx, lib, tensors, [lib.ones_like(t) for t in tensors], plan, pumps)
        if pumps:  # our one hop's report comes to this thread's own socket: it receives it while it waits
            run.done.set_pump(pumps[0])
        _step_here(agent, ctx, plan)
        run.started(hops)
        timeout = agent.default_timeout or None
        try:
            run.done.wait(timeout)
        except TimeoutError:
            raise RPCTimeoutError(
                f"{what} ran for more than {timeout:.0f} s: the hops on {', '.join(run.out())} did not report; "
                "check what those workers are doing (rpc.worker_status())") from None
    except NbRemoteError:  # nbremote's own (a lost worker, a timeout): RuntimeErrors already, as they are
        raise
    except Exception as exc:  # from computing gradients, here or on another rank: torch's RuntimeError, with
        error = also_runtime_error(exc, f"Error on Node {getattr(exc, _NODE, agent.rank)}: ")  # its type
        raise error from error.__cause__  # (the remote traceback, where it came from another rank)
    finally:
        with ctx.lock:
            ctx.passes.pop(run.id, None)


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


def _leaves(outputs: Sequence[Any]) -> dict[int, tuple[Any, Any]]:
    """Every leaf that requires grad and that ``outputs`` depend on (outputs that are leaves included), by
    ``tensor_key``: ``(leaf, its gradient-accumulation node, or None for an output that is the leaf)``."""
    found: dict[int, tuple[Any, Any]] = {}
    seen: set[int] = set()
    nodes: list[Any] = []  # keeps visited nodes alive, so their ids stay unique during the walk
    stack = []
    for t in outputs:
        if t.grad_fn is None:
            if t.requires_grad:
                found[tensor_key(t)] = (t, None)
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
            found.setdefault(tensor_key(leaf), (leaf, node))
        else:
            stack.extend(child for child, _ in node.next_functions)
    return found


def _hooked(t: Any) -> bool:
    """A leaf with tensor hooks (``register_hook``): they run on its gradient, so it goes through autograd."""
    return t.grad_fn is None and bool(getattr(t, "_backward_hooks", None))


def _run_post_hooks(lib: ModuleType, leaf: Any, node: Any, grad: Any) -> None:
    """Run the post hooks of ``leaf``'s gradient-accumulation node (``node.register_hook(hook)``), as torch's
    distributed engine does when it accumulates into the context: ``hook((), (grad,))``. The node itself
    never runs here (it would write ``.grad``). torch has no getter for them: registering a hook returns a
    handle to the node's dict of Python post hooks; the probe is removed at once (~1.6 us a leaf, where
    autograd.grad takes ~10 us a leaf of small tensors)."""
    if node is None:  # an output that is the leaf: its node, if it has one -- torch's graph API reaches it
        edge = getattr(getattr(lib.autograd, "graph", None), "get_gradient_edge", None)  # through a view (~7 us),
        if edge is None or leaf.layout != lib.strided:  # which a sparse tensor has not: its hooks cannot be
            return  # reached from Python, and torch gives no other way
        node = getattr(edge(leaf), "node", None)
    register = getattr(node, "register_hook", None)  # tensorplay's nodes have none
    if register is None:
        return
    probe = register(_no_hook)
    try:
        hooks = [hook for key, hook in probe.hooks_dict_ref().items() if key != probe.id]
    finally:
        probe.remove()
    for hook in hooks:
        hook((), (grad,))


def _no_hook(*args: Any) -> None:
    return None


def _local_pass(agent: Agent, ctx: gradctx.Context, lib: ModuleType, outputs: Sequence[Any],
                grad_outputs: Sequence[Any], plan: Plan,
                pumps: list[Callable[[float], None]] | None = None) -> list[tuple[str, str]]:
    """Back-propagate through this process's graph; send what reaches leaves from RPCs to their senders, one
    hop per sender. Returns the hops started, ``[(hop id, process)]``. ``pumps`` (the root's): where a single
    hop goes on this thread's own socket, the pump that receives its report is added to it."""
    grads: dict[int, tuple[Any, Any]] = {}  # tensor_key(leaf) -> (leaf, its gradient in this pass)
    through = [(t, g) for t, g in zip(outputs, grad_outputs, strict=True) if t.grad_fn is not None or _hooked(t)]
    leaves = _leaves([t for t, _ in through])
    accumulated = False  # gradients from the engine's own accumulation (hooks and all): see DDP below
    if leaves:
        # retain_graph=True: other sends of this context may lead into the same part of the graph later in
        # this very pass; the context's release frees it.
        args = ([t for t, _ in through], [leaf for leaf, _ in leaves.values()], [g for _, g in through])
        try:
            # Parameters of a DDP module: its reducer all-reduces them from hooks on their accumulation
            # nodes, which only torch's own backward runs (frameworks._ddp). (Leaves that came by RPC are
            # fresh tensors: never a DDP module's.)
            accumulated = bool(data_parallel(lib, args[1]))
            found = accumulated_gradients(*args) if accumulated else gradients(lib, *args)
        except Exception as exc:  # the rank it happened on travels with it (backward's "Error on Node N")
            with contextlib.suppress(AttributeError):
                setattr(exc, _NODE, getattr(exc, _NODE, agent.rank))
            raise
        grads = {key: (leaf, g) for (key, (leaf, _)), g in zip(leaves.items(), found, strict=True) if g is not None}
    for t, g in zip(outputs, grad_outputs, strict=True):
        if t.grad_fn is None and t.requires_grad and not _hooked(t):  # an output that is a leaf: its gradient
            known = grads.get(tensor_key(t))  # is given
            grads[tensor_key(t)] = (t, g if known is None else known[1] + g)
    routes: dict[str, dict[int, dict[int, Any]]] = {}  # sender -> send id -> slot -> gradient
    own = []  # this process's leaves (parameters): (key, leaf, gradient)
    for key, (leaf, grad) in grads.items():
        recv = ctx.recv_of(leaf)
        if recv is None:
            own.append((key, leaf, grad))
        else:
            # Several leaves may stand for one slot: copies of one tensor forwarded here in several calls
            # all name the send it came from (``agf``); their gradients add up.
            slots = routes.setdefault(recv.sender, {}).setdefault(recv.send_id, {})
            slots[recv.index] = grad if recv.index not in slots else slots[recv.index] + grad
    hops = []
    single = pumps is not None and len(routes) == 1
    for sender, sends in routes.items():  # first: the senders' parts of the pass start while ours ends
        hop = f"{agent.name}#{next(_hop_ids)}"
        pump = agent.notify(sender, _backward_hop, (ctx.id, plan, hop, sends), own=single)
        if pump is not None and pumps is not None:
            pumps.append(pump)
        hops.append((hop, sender))
    # Then the parameters' gradients and their post hooks (~150 us for a stage of four leaves, cold: off the
    # pass's path now), before the report that ends this hop. Sent gradients are never written: a tensor
    # several leaves got is copied for each.
    given = collections.Counter(id(g) for _, g in grads.values())
    for key, leaf, grad in own:
        ctx.accumulate(leaf, grad, given[id(grad)] > 1)
        if not accumulated:  # else the engine ran them, with the nodes
            _run_post_hooks(lib, leaf, leaves[key][1] if key in leaves else None, grad)
    return hops


def _step_here(agent: Agent, ctx: gradctx.Context, plan: Plan) -> None:
    """Where the pass steps optimizers as it goes: step this process's, once its part of the pass is over."""
    steps = plan[3]
    ids = None if steps is None else steps.get(agent.name)
    if not ids:
        return
    with ctx.lock:
        ctx.stepped.add(plan[0])
    for optimizer_id in ids:
        owned_value(optimizer_id).step(ctx.id)


def _backward_hop(ctx_id: int, plan: Plan, hop: str, sends: dict[int, dict[int, Any]]) -> None:
    """Runs on the process that sent tensors: continue the pass from them with the gradients that came back,
    then report to the root (the hops this one started, or what it raised)."""
    agent = current_agent()
    hops: list[tuple[str, str]] = []
    error: BaseException | None = None
    try:
        hops = _hop_pass(agent, ctx_id, plan, sends)
    except Exception as exc:
        error = exc
    agent.report_hop(plan[1], ctx_id, plan[0], hop, hops, error)


def _hop_pass(agent: Agent, ctx_id: int, plan: Plan, sends: dict[int, dict[int, Any]]) -> list[tuple[str, str]]:
    pass_id, retain_graph = plan[0], plan[2]
    ctx = agent.grad.get(ctx_id)
    if ctx is None:
        raise AutogradError(f"distributed autograd context {ctx_id} is gone on {agent.name!r}: it was released "
                            "before the backward pass reached it (keep backward inside the `with` block)")
    if pass_id in ctx.stepped:
        raise AutogradError(
            f"DistributedOptimizer.backward_and_step: the backward pass reached {agent.name!r} a second time after "
            "its optimizer had stepped, so that step missed gradients; backward_and_step needs every worker with "
            "parameters reached once (a chain or a pipeline of stages): use dist_autograd.backward, then "
            "optimizer.step")
    outputs, grads = [], []
    for send_id, slots in sends.items():
        send = ctx.send(send_id)
        if send is None:
            raise AutogradError(f"{agent.name!r} has no record of send {send_id} in autograd context {ctx_id}")
        with ctx.lock:
            if send.consumed_by not in (None, pass_id):
                raise AutogradError(
                    f"Trying to backward through the graph a second time in autograd context {ctx_id} (on "
                    f"{agent.name!r}): the first backward freed it; pass retain_graph=True to "
                    "dist_autograd.backward if you need to backward twice")
            if not retain_graph:
                send.consumed_by = pass_id
        for i, g in slots.items():
            t = send.tensors[i]
            outputs.append(t)
            grads.append(g if g.device == t.device else g.to(t.device))
    hops = _local_pass(agent, ctx, _library_of(outputs, "dist_autograd.backward"), outputs, grads, plan)
    _step_here(agent, ctx, plan)
    return hops


def _rref_backward(rref: RRef[Any], context_id: int, retain_graph: bool) -> None:
    """Runs on an RRef's owner for ``RRef.backward(context_id)``: the pass starts from the value."""
    value = rref.local_value()
    if not _is_tensor(value):
        raise AutogradError(f"RRef should contain a tensor for .backward(): {rref!r} holds a {type(value).__name__}")
    backward(context_id, [value], retain_graph)


gradctx.set_rref_backward(_rref_backward)


# -- release ------------------------------------------------------------------------------------------------


def _release(agent: Agent, ctx_id: int) -> None:
    """Forget the context here and tell everyone it touched (who tell theirs); never blocks."""
    agent.release_context(ctx_id, None)
