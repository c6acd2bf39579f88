"""torch adapter: a tensor crosses the wire as ONE out-of-band buffer and is rebuilt aliasing it.

torch's own pickling copies the storage into the pickle stream (4-5x slower for big tensors). Here a CPU
tensor travels as a ``PickleBuffer`` over a uint8 numpy view of its memory (no copy) plus dtype *name*,
shape, stride and flags; the receiver rebuilds it with ``torch.frombuffer`` over the received frame
(zero-copy; a read-only frame is copied first, since torch tensors are always writable). Reinterpreting
raw bytes keeps every dtype bit-exact, bfloat16 and float8 included, although numpy has no such dtype.

The common case -- a contiguous CPU tensor of a dtype numpy has -- goes through numpy on both sides
(``Tensor.numpy`` to send, ``np.frombuffer`` + ``torch.from_numpy`` to rebuild): the same bytes and
the same zero-copy aliasing with a fraction of the calls into torch's dispatcher. That matters more
than it looks: a call runs cold after its thread slept, and cold, the general path's ``detach`` /
``as_strided`` / ``view`` made a tensor cost about twice as much (measured on this project's 2-core VM,
a 32x16 float32 tensor after a 0.5 ms sleep: 71-77 us against 33-35 us to send, 66 against 32 us to
rebuild).

Strides: when the storage span from the first to the last element holds no more elements than the
tensor (contiguous, transposed / permuted, expanded), that span is shipped as is and rebuilt with
``as_strided``: no copy on either side, strides exact. A view with gaps (``x[:, ::2]``) would ship
unused bytes, so it is packed with ``.contiguous()`` (one copy) and rebuilt with ``empty_strided`` +
``copy_`` (one copy): strides still exact. The storage offset, and storage shared between tensors of
one message, are not kept: two views of one tensor arrive as two independent tensors.

Autograd: ``requires_grad`` is kept and the tensor arrives as a leaf; a non-leaf is detached (its graph
stays behind) and arrives as a leaf that requires grad. ``.grad`` and hooks are not sent (torch's own
pickling drops them too). A ``Parameter`` stays a ``Parameter``; instance attributes (``__dict__``) travel.
Inside a distributed autograd context, tensors that require grad are reported to the message's
``GradTrack`` on both sides (see ``nbremote.frameworks``), which is how their gradients find the way back.

Futures: :class:`FutureMirror` is what makes an ``nbremote.rpc.Future`` a ``torch.futures.Future`` in a
process that loaded torch (``nbremote.rpc._core.future`` mixes it in): torch's ``wait_all`` and
``collect_all`` take it, and read the state it mirrors into the C++ future when it completes. A C++ future
made in Python never holds an *error*, though (``set_exception`` stores the exception as a value that
``wait`` raises), and torch's ``collect_all`` returns early only on that error flag: ``wait_all`` over a
failed nbremote future and a pending one would wait for the pending one -- for ever, if it never ends.
:func:`route_wait_all` makes ``torch.futures.wait_all`` nbremote's for a list that holds one of its
futures (torch's own futures may be among them), so it returns at the first error as torch's RPC futures
make it; any other list goes to torch's function, unchanged.

Operators: torch's RPC matches a builtin operator (``torch.add``) against its TorchScript schemas before
sending it, and arguments none of them takes raise ``RuntimeError("Overloaded torch operator invoked from
Python failed to match any schema: ...")``; nbremote calls the function itself, whose Python binding raises
``TypeError``. :func:`schema_mismatch` builds torch's message from the same schemas without running
anything, for the caller to raise (``_core.serving``).

Sparse COO tensors travel as their indices and values (dense tensors, through this adapter: out of
band, zero-copy) plus size and flags, and are rebuilt with ``sparse_coo_tensor``; ``requires_grad`` and
the autograd tracking are kept as for dense ones (torch's own pickling drops ``requires_grad``).

Devices: a non-CPU tensor is copied to the CPU (unavoidable) and rebuilt on the same device when the
receiver has it, else on the CPU. Other sparse layouts, quantized, nested and meta tensors, subclasses
other than ``Parameter``, and tensors without plain storage (functorch wrappers) fall back to torch's
pickling.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.optim.optimizer as _optimizer

from nbremote.frameworks import (
    EXIT_GUARD,
    NUMPY_EXACT,
    Reducer,
    check_layout,
    row_major,
    storage_span,
    track_received,
    track_sent,
    writable_buffer,
)

__all__ = ["FutureMirror", "gradients", "own_gradient", "plain_step", "rebuild_sparse", "rebuild_tensor",
           "reduce_tensor", "reducers", "route_wait_all", "schema_mismatch"]

# Dtypes travel by name ("bfloat16"), not as torch.dtype objects: shorter and version-proof.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    dt: str(dt).removeprefix("torch.") for dt in vars(torch).values() if isinstance(dt, torch.dtype)
}


# What travels through numpy, by torch's name (uint16-64 came with torch 2.3).
_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name) for name in NUMPY_EXACT if isinstance(getattr(torch, name, None), torch.dtype)
}


def reduce_tensor(t: torch.Tensor) -> Any:
    """``(rebuild_tensor, args)`` for a dense tensor or ``Parameter``, ``(rebuild_sparse, args)`` for a sparse
    COO one; ``NotImplemented`` for the rest."""
    if t.layout is not torch.strided:
        return _reduce_sparse(t) if t.layout is torch.sparse_coo and type(t) is torch.Tensor else NotImplemented
    if t.is_quantized or t.is_nested or t.is_meta:
        return NotImplemented
    name = _DTYPE_NAMES.get(t.dtype)
    if name in _NUMPY_DTYPES and t.is_cpu and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        # The common case, through numpy (see the module's docstring). The array is the tensor's own
        # memory, from its first element; a contiguous tensor's span is its size, so it ships as is.
        try:
            array: Any = (t.detach() if t.requires_grad else t).numpy()  # Any: see the general path's
        except (RuntimeError, TypeError):
            pass  # no plain storage after all: the general path decides
        else:
            return rebuild_tensor, (
                pickle.PickleBuffer(array), name, tuple(t.shape), t.stride(), False,
                t.requires_grad, None, type(t) is torch.nn.Parameter, t.__dict__ or None, track_sent(t),
            )
    try:
        x = t.detach()
        # Lazy conjugate / negative views carry a flag, not the values: materialise them.
        if x.is_conj():
            x = x.resolve_conj()
        if x.is_neg():
            x = x.resolve_neg()
        shape = tuple(x.shape)
        stride = tuple(x.stride())
        packed = storage_span(shape, stride) > x.numel()
        if packed:
            flat = x.contiguous().reshape(-1)
        else:
            flat = x.as_strided((storage_span(shape, stride),), (1,), x.storage_offset())
        device = None
        if flat.device.type != "cpu":
            device = str(flat.device)
            flat = flat.cpu()
        raw: Any = flat.view(torch.uint8).numpy()  # Any: numpy types the buffer protocol only on 3.12+
        buffer = pickle.PickleBuffer(raw)
    except (RuntimeError, TypeError, ValueError):
        # No plain strided storage behind it (functorch wrappers, exotic backends): torch knows better.
        return NotImplemented
    dtype = name or str(t.dtype).removeprefix("torch.")
    state = t.__dict__ or None
    return rebuild_tensor, (
        buffer,
        dtype,
        shape,
        stride,
        packed,
        t.requires_grad,
        device,
        type(t) is torch.nn.Parameter,
        state,
        track_sent(t),
    )


def rebuild_tensor(
    buffer: Any,
    dtype: str,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    packed: bool,
    requires_grad: bool,
    device: str | None,
    parameter: bool,
    state: dict[str, Any] | None,
    grad_index: int | None = None,
) -> torch.Tensor:
    """Inverse of :func:`reduce_tensor`; aliases ``buffer`` when it is writable and on the CPU."""
    dt: torch.dtype = getattr(torch, dtype)
    target = _usable_device(device)
    data = writable_buffer(buffer)
    array = None if target is not None else row_major(data, _NUMPY_DTYPES.get(dtype), shape, packed)
    if array is not None:
        out = torch.from_numpy(array)
        if out.stride() != stride:  # transposed, permuted: a view, whose strides are vetted first
            check_layout(shape, stride, packed, data.nbytes, dt.itemsize)
            out = out.as_strided(shape, stride).detach()
    else:
        check_layout(shape, stride, packed, data.nbytes, dt.itemsize)
        out = _rebuild_general(data, dt, shape, stride, packed, target)
    if parameter:
        out = torch.nn.Parameter(out, requires_grad=requires_grad)
    elif requires_grad:
        out.requires_grad_(True)
    if state:
        out.__dict__.update(state)
    track_received(grad_index, out)
    return out


def _rebuild_general(data: memoryview, dt: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...],
                     packed: bool, target: torch.device | None) -> torch.Tensor:
    """A tensor over ``data`` (a validated layout) for what numpy cannot hold: other dtypes, devices,
    packed views, expanded views, empty tensors."""
    if data.nbytes == 0:  # torch.frombuffer refuses empty buffers
        return torch.empty_strided(shape, stride, dtype=dt, device=target)
    flat = torch.frombuffer(data, dtype=torch.uint8).view(dt)
    if target is not None:
        flat = flat.to(target)
    if packed:
        out = torch.empty_strided(shape, stride, dtype=dt, device=flat.device)
        return out.copy_(flat.view(shape))
    # detach(): a plain leaf, not an autograd view of the 1-D base.
    return flat.as_strided(shape, stride).detach()


def _reduce_sparse(t: torch.Tensor) -> Any:
    x = t.detach()
    coalesced = x.is_coalesced()
    # _indices()/_values() read an uncoalesced tensor as it is (indices() would refuse it); detached, so
    # that only the sparse tensor itself is tracked for autograd.
    return rebuild_sparse, (x._indices(), x._values(), tuple(x.shape), coalesced, t.requires_grad, track_sent(t))


def rebuild_sparse(indices: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...], coalesced: bool,
                   requires_grad: bool, grad_index: int | None = None) -> torch.Tensor:
    """Inverse of ``_reduce_sparse``: a sparse COO leaf over the received indices and values.

    The indices come from a peer: torch checks them against the shape (``check_invariants``, O(nnz)), as an
    index out of bounds would make later operations read or write outside the values."""
    out = torch.sparse_coo_tensor(indices, values, shape, is_coalesced=coalesced, check_invariants=True)
    if requires_grad:
        out.requires_grad_(True)
    track_received(grad_index, out)
    return out


def own_gradient(leaf: torch.Tensor, grad: torch.Tensor, shared: bool) -> torch.Tensor:
    """``grad`` itself when a context may keep it for ``leaf``, else a copy -- the rule of torch's
    AccumulateGrad for a first gradient: kept ("stolen") unless another leaf got the same tensor
    (``shared``) or its layout is not the leaf's (a dense gradient contiguous or strided like the leaf, a
    sparse one with contiguous indices and values); copied to a contiguous tensor otherwise."""
    if grad.layout is torch.sparse_coo:
        if shared or not (grad._indices().is_contiguous() and grad._values().is_contiguous()):
            return grad.clone()
        return grad
    if shared or not (grad.is_contiguous() or (grad.layout is torch.strided and grad.stride() == leaf.stride())):
        return grad.clone(memory_format=torch.contiguous_format)
    return grad


_ENGINE = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # types with no __torch_function__ of their own


def gradients(outputs: Sequence[Any], inputs: Sequence[Any], grad_outputs: Sequence[Any]) -> Sequence[Any]:
    """``torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True, allow_unused=True)``.

    For plain dense tensors this is the autograd engine's call that ``grad`` ends in, without ``grad``'s
    Python preparation (normalising the arguments, checking shapes that the engine checks again, looking
    for ``__torch_function__`` overrides): run cold, as a backward hop always is, that preparation cost
    ~115 us a pass (341 against 224 us for a ``Linear(256, 64)`` stage, median after 3 ms sleeps, this
    project's VM). Tensor subclasses and nested tensors, which the preparation is for, go through
    ``grad``.
    """
    if _ENGINE is None or not all(type(t) in _PLAIN and not t.is_nested
                                  for group in (outputs, inputs, grad_outputs) for t in group):
        return torch.autograd.grad(list(outputs), list(inputs), grad_outputs=list(grad_outputs), retain_graph=True,
                                   allow_unused=True)
    return _ENGINE.run_backward(tuple(outputs), tuple(grad_outputs), True, False, tuple(inputs), True, False)


def plain_step(optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    """``optimizer.step``, without torch's two wrappers whenever they have nothing to do.

    A built-in optimizer's ``step`` runs inside a wrapper that opens a profiler range and calls the step
    hooks, and one that sets the grad mode and marks graph breaks for dynamo. Run cold, after a wait -- as
    an owner's step in a distributed step always is -- they cost more than the update itself: SGD with
    momentum on a ``Linear(256, 64)`` took 281 us through ``step()`` against 130 us for its body alone
    (median after 3 ms sleeps, this project's VM). So the body runs under grad mode off alone, as the
    wrappers would run it, whenever they would do nothing else: no step hook (the optimizer's or a
    global one), no profiler running, not ``differentiable``, and ``step`` not replaced on the instance
    (an LR scheduler's counter does that). Otherwise, and for a class whose ``step`` is not wrapped the
    way torch's built-ins are (a subclass's own ``step``), it is ``optimizer.step()`` as it is.
    """
    outer = type(optimizer).step
    wrapped = getattr(outer, "__wrapped__", None)
    body = getattr(wrapped, "__wrapped__", None)
    if not (getattr(outer, "hooked", False) and _code_name(outer) == "wrapper" and _code_name(wrapped) == "_use_grad"
            and callable(body) and not hasattr(body, "__wrapped__")):
        return optimizer.step
    pre_hooks = getattr(_optimizer, "_global_optimizer_pre_hooks", None)
    post_hooks = getattr(_optimizer, "_global_optimizer_post_hooks", None)
    if pre_hooks is None or post_hooks is None:  # a torch that keeps them elsewhere: cannot tell, so wrap
        return optimizer.step
    profiling = torch._C._autograd._profiler_enabled

    def step() -> Any:
        if (pre_hooks or post_hooks or optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or optimizer.defaults.get("differentiable") or "step" in vars(optimizer) or profiling()):
            return optimizer.step()
        grad_mode = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        try:
            return body(optimizer)
        finally:
            torch.set_grad_enabled(grad_mode)

    return step


def _code_name(function: Any) -> str | None:
    code = getattr(function, "__code__", None)
    return None if code is None else str(code.co_name)


def _usable_device(device: str | None) -> torch.device | None:
    """``device`` if this process has it, else ``None`` (stay on the CPU)."""
    if device is None:
        return None
    dev = torch.device(device)
    backend = getattr(torch, dev.type, None)  # torch.cuda, torch.xpu, torch.mps, ...
    try:
        if backend is None or not backend.is_available():
            return None
        if dev.index is not None and dev.index >= backend.device_count():
            return None
    except (AttributeError, RuntimeError):
        return None
    return dev


def reducers() -> dict[type, Reducer]:
    return {torch.Tensor: reduce_tensor, torch.nn.Parameter: reduce_tensor}


class FutureMirror(torch.futures.Future):
    """The torch side of an nbremote Future: a CPU ``torch._C.Future`` completed when the nbremote one is.

    Mirroring costs ~0.8 us per future (creating and completing the C++ future). Only nbremote's own
    methods run on such a future (they come first in its MRO): the C++ state is for torch's functions
    that read it directly (``torch._C._collect_all``).
    """

    def _mirror_init(self) -> None:
        torch._C.Future.__init__(self, [])

    def _mirror_completion(self, result: Any, error: BaseException | None) -> None:
        if not EXIT_GUARD.enter():
            return  # the interpreter is exiting: no one waits on the C++ side any more (see ExitGuard)
        try:
            if error is None:
                torch._C.Future.set_result(self, result)
                return
            if not isinstance(error, Exception):  # torch's futures hold Exceptions (a KeyboardInterrupt is not one)
                error = RuntimeError(f"{type(error).__name__}: {error}")

            def raise_error(value: BaseException) -> None:  # what torch.futures.Future.set_exception installs
                raise value

            torch._C.Future._set_unwrap_func(self, raise_error)
            torch._C.Future.set_result(self, error)
        finally:
            EXIT_GUARD.leave()


def route_wait_all(wait_all: Callable[[list[Any]], list[Any]]) -> None:
    """Make ``torch.futures.wait_all`` call ``wait_all`` (nbremote's) for a list holding a :class:`FutureMirror`
    (an nbremote future), and torch's own function for any other list (module docstring). Idempotent.

    It replaces the attribute of the ``torch.futures`` module, so it reaches ``torch.futures.wait_all(...)``
    and not a ``from torch.futures import wait_all`` made before nbremote made its first future.
    """
    original = torch.futures.wait_all
    if getattr(original, "_nbremote_route", False):
        return

    @functools.wraps(original)
    def routed(futures: list[Any]) -> list[Any]:
        if any(isinstance(fut, FutureMirror) for fut in futures):
            return wait_all(list(futures))
        return original(futures)

    routed._nbremote_route = True  # type: ignore[attr-defined]
    torch.futures.wait_all = routed


def schema_mismatch(fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """What torch's RPC raises (as ``RuntimeError``) when builtin operator ``fn`` gets ``args``/``kwargs`` that
    none of its TorchScript schemas takes: the message of ``torch/csrc/jit/python/pybind_utils.cpp``'s
    ``getOpWithStack``, one schema's error or all of them under "Overloaded torch operator invoked from Python
    failed to match any schema". None if ``fn`` is no builtin operator, or if a schema takes them (torch would
    run it; the Python binding's ``TypeError`` stands). Matches only; runs nothing."""
    try:
        from torch.jit._builtins import _find_builtin

        name = _find_builtin(fn)
        schemas = [] if name is None else torch._C._jit_get_schemas_for_operator(name)
        check = torch._C._check_schema_allow_fake_script_object
    except (AttributeError, ImportError, RuntimeError):  # a torch without these private helpers: no mapping
        return None
    errors = []
    for schema in schemas:
        try:
            if check(schema, *args, **kwargs):
                return None
        except RuntimeError as exc:
            errors.append(str(exc))
    if not errors:
        return None
    if len(errors) == 1:
        return errors[0]
    return "Overloaded torch operator invoked from Python failed to match any schema:\n" + "\n\n".join(errors)
