"""Framework adapters: how tensors of each framework cross the wire.

Each adapter module (``_torch``, ``_tensorplay``, ``_numpy``) imports its framework at the top and exposes
``reducers() -> dict[type, Reducer]``: exact tensor type -> function returning a pickle reduce tuple (or
``NotImplemented`` to let the framework's own pickling handle the object). The rebuild functions named in
those tuples live in the same modules, so a receiving process imports them (and the framework) by module
path.

:class:`ReducerTable` loads an adapter only once its framework is already in ``sys.modules``: nbremote
never imports torch or tensorplay itself, and a process that never touched a framework cannot be sending
its tensors. Lookups are by exact type, so the per-object cost on the pickling hot path is one dict probe.

Futures: :func:`future_mirror` gives the torch side of an ``nbremote.rpc.Future`` once torch is loaded
(``_torch.FutureMirror``), so that nbremote's futures are ``torch.futures.Future`` objects there, and
:func:`route_torch_wait_all` has ``torch.futures.wait_all`` return at the first error of one of them.

Operators: :func:`operator_mismatch` gives torch's RPC error for a torch builtin operator called with
arguments none of its schemas takes (``_torch.schema_mismatch``).

Backward passes: :func:`gradients` computes leaf gradients without touching ``.grad``; where a pass reaches
parameters of a ``DistributedDataParallel`` module (:func:`data_parallel`), :func:`accumulated_gradients`
runs torch's own backward so that DDP's reducer all-reduces them (``_ddp``).

While a message of a distributed autograd context is pickled or unpickled, :data:`grad_tracking` holds
a :class:`GradTrack`: adapters hand it every tensor that requires grad (sending) and every such tensor
they rebuilt (receiving), by position, so the RPC layer can route gradients back across processes.
"""

from __future__ import annotations

import atexit
import contextvars
import importlib
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "EXIT_GUARD",
    "NUMPY_EXACT",
    "ExitGuard",
    "GradTrack",
    "Reducer",
    "ReducerTable",
    "accumulated_gradients",
    "check_layout",
    "data_parallel",
    "future_mirror",
    "grad_tracking",
    "gradients",
    "operator_mismatch",
    "optimizer_step",
    "own_gradient",
    "route_torch_wait_all",
    "row_major",
    "storage_span",
    "tensor_key",
    "track_received",
    "track_sent",
    "writable_buffer",
]

#: The dtypes, by name, that numpy holds bit for bit and both frameworks name alike: a contiguous CPU tensor
#: of one of them travels through numpy (``Tensor.numpy`` / ``np.frombuffer`` + ``from_numpy``), which costs
#: a fraction of the framework's own view calls (see ``_torch``). The others (bfloat16, float8, complex32,
#: ...) keep to the raw-bytes path: numpy has no such dtype, and tensorplay's ``numpy()`` converts them.
NUMPY_EXACT = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
               "float16", "float32", "float64", "complex64", "complex128")

#: ``reduce(obj)`` returns ``(callable, args)`` like ``__reduce__``, or ``NotImplemented``.
Reducer = Callable[[Any], Any]

# (module that must already be imported, adapter module that handles its objects)
_ADAPTERS: tuple[tuple[str, str], ...] = (
    ("numpy", "nbremote.frameworks._numpy"),
    ("torch", "nbremote.frameworks._torch"),
    ("tensorplay", "nbremote.frameworks._tensorplay"),
)


class ReducerTable:
    """Exact type -> reducer, growing as frameworks appear in ``sys.modules``."""

    def __init__(self) -> None:
        self._loaded: set[str] = set()
        self._lock = threading.Lock()
        self.by_type: dict[type, Reducer] = {}

    def refresh(self) -> dict[type, Reducer]:
        """Load the adapters of newly imported frameworks; return the (shared) table.

        Called once per ``dumps``, not per object: once every adapter is loaded it is one comparison.
        """
        if len(self._loaded) == len(_ADAPTERS):
            return self.by_type
        modules = sys.modules
        for framework, adapter in _ADAPTERS:
            if framework in self._loaded or framework not in modules:
                continue
            with self._lock:
                if framework in self._loaded:
                    continue
                try:
                    found = importlib.import_module(adapter).reducers()
                except (ImportError, AttributeError):
                    # The framework may be half-imported (another thread is importing it right now): its
                    # objects cannot be in our payload yet, so try again on the next dumps.
                    continue
                # Replace rather than mutate: a concurrent dumps may be iterating over the old table.
                self.by_type = {**self.by_type, **found}
                self._loaded.add(framework)
        return self.by_type


def future_mirror() -> Any:
    """``_torch.FutureMirror`` if torch is loaded (and fully imported), else None; imports nothing else."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "futures"):  # absent, or half-imported by another thread
        return None
    adapter: Any = importlib.import_module("nbremote.frameworks._torch")
    return adapter.FutureMirror


class ExitGuard:
    """Keeps C++ future completions out of the interpreter's finalization.

    Completing a torch future (``set_result``) releases the GIL and takes it back. A daemon thread (nbremote's
    IO thread, completing a late reply) that takes it back once the interpreter is finalizing is ended by
    ``pthread_exit``, whose unwinding through torch's C++ frame calls ``std::terminate``: the process aborted
    at exit ("terminate called without an active exception", 2 runs in 3 of the DDP+RPC program). At exit
    (``atexit`` runs before finalizing), completions in flight are waited for, briefly, and later ones leave
    the C++ side alone. It is registered when nbremote is imported (the main thread, early): registered by the
    first completion instead, a daemon thread importing the torch adapter as the program ended registered it
    too late (1 run in ~100 under load).
    """

    WAIT = 2.0  # s at most that exit waits for completions in flight

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = 0
        self._closed = False
        atexit.register(self.close)

    def enter(self) -> bool:
        """Whether a C++ completion may start now (then :meth:`leave` after it)."""
        with self._lock:
            if self._closed or sys.is_finalizing():
                return False
            self._busy += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._busy -= 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
        deadline = time.monotonic() + self.WAIT
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.001)


EXIT_GUARD = ExitGuard()


def route_torch_wait_all(wait_all: Callable[[list[Any]], list[Any]]) -> None:
    """Have ``torch.futures.wait_all`` call ``wait_all`` for a list holding an nbremote future (torch is loaded:
    called where the first such future is made; see ``_torch.route_wait_all``)."""
    adapter: Any = importlib.import_module("nbremote.frameworks._torch")
    adapter.route_wait_all(wait_all)


def operator_mismatch(fn: Any, args: Sequence[Any], kwargs: Any) -> str | None:
    """torch's RPC error for ``fn(*args, **kwargs)`` where ``fn`` is a torch builtin operator and none of its
    schemas takes these arguments; None otherwise (torch not loaded included). Called on a ``TypeError``."""
    if "torch" not in sys.modules or not str(getattr(fn, "__module__", None) or "").startswith("torch"):
        return None
    adapter: Any = importlib.import_module("nbremote.frameworks._torch")
    mismatch: str | None = adapter.schema_mismatch(fn, args, kwargs or {})
    return mismatch


def own_gradient(leaf: Any, grad: Any, shared: bool) -> Any:
    """The gradient a distributed autograd context keeps for ``leaf`` (see ``_torch.own_gradient``; a
    tensorplay gradient is kept as it is)."""
    if type(grad).__module__.partition(".")[0] != "torch":
        return grad
    adapter: Any = importlib.import_module("nbremote.frameworks._torch")
    return adapter.own_gradient(leaf, grad, shared)


def gradients(lib: Any, outputs: Sequence[Any], inputs: Sequence[Any], grad_outputs: Sequence[Any]) -> Sequence[Any]:
    """``lib.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True, allow_unused=True)``; for torch by
    its engine's own call where ``grad``'s Python preparation has nothing to do (``_torch.gradients``)."""
    if getattr(lib, "__name__", None) != "torch":
        return lib.autograd.grad(list(outputs), list(inputs), grad_outputs=list(grad_outputs),
                                 retain_graph=True, allow_unused=True)
    adapter: Any = importlib.import_module("nbremote.frameworks._torch")
    return adapter.gradients(outputs, inputs, grad_outputs)


def data_parallel(lib: Any, leaves: Sequence[Any]) -> list[Any]:
    """The live ``DistributedDataParallel`` modules that manage some of ``leaves`` (this process's parameters in
    a backward pass); always empty for other frameworks (see ``_ddp``)."""
    if getattr(lib, "__name__", None) != "torch" or not leaves:
        return []
    adapter: Any = importlib.import_module("nbremote.frameworks._ddp")
    found: list[Any] = adapter.data_parallel(leaves)
    return found


def accumulated_gradients(outputs: Sequence[Any], inputs: Sequence[Any], grad_outputs: Sequence[Any]) -> list[Any]:
    """Like :func:`gradients` (torch only), but by torch's own backward, which runs the hooks of the
    accumulation nodes -- a DDP reducer's all-reduce -- with ``.grad`` set aside (see ``_ddp``)."""
    adapter: Any = importlib.import_module("nbremote.frameworks._ddp")
    found: list[Any] = adapter.accumulated_gradients(outputs, inputs, grad_outputs)
    return found


def optimizer_step(optimizer: Any) -> Callable[[], Any]:
    """What calls ``optimizer.step()`` most cheaply: for torch's own optimizers its body without the wrappers
    that have nothing to do (``_torch.plain_step``), for any other optimizer its ``step`` as it is."""
    if not type(optimizer).__module__.startswith("torch.optim."):
        return optimizer.step
    adapter: Any = importlib.import_module("nbremote.frameworks._torch")
    return adapter.plain_step(optimizer)


def storage_span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Number of elements between a tensor's first and last element, inclusive (0 when it has none).

    Assumes non-negative strides (torch and tensorplay have no negative ones).
    """
    if 0 in shape:
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def row_major(data: memoryview, dtype: np.dtype[Any] | None, shape: tuple[int, ...], packed: bool) -> Any:
    """The received ``data`` as a numpy array of ``shape``, row-major, when it holds every element of the
    tensor exactly once in a dtype numpy has (contiguous, transposed, permuted: numpy's route, see
    ``_torch``); else None (an empty, packed or expanded layout, or another dtype: the raw-bytes route).
    numpy's ``reshape`` checks the shape; strides other than row-major are the caller's to check."""
    if dtype is None or packed or not data.nbytes or math.prod(shape) * dtype.itemsize != data.nbytes:
        return None
    return np.frombuffer(data, dtype).reshape(shape)


def check_layout(
    shape: tuple[int, ...], stride: tuple[int, ...], packed: bool, nbytes: int, itemsize: int
) -> None:
    """Raise ``ValueError`` unless a buffer of ``nbytes`` holds exactly this tensor (packed, or its span).

    The layout comes from a peer, and ``as_strided`` (tensorplay's has no bounds check) or a strided copy
    would otherwise read or write outside the received buffer.
    """
    if len(shape) != len(stride) or min(shape, default=0) < 0 or min(stride, default=0) < 0:
        raise ValueError(f"malformed tensor layout: shape {shape}, stride {stride}")
    needed = math.prod(shape) if packed else storage_span(shape, stride)
    if needed * itemsize != nbytes:
        raise ValueError(
            f"tensor of shape {shape}, stride {stride} needs {needed * itemsize} bytes, got {nbytes}"
        )


def writable_buffer(buf: Any) -> memoryview:
    """A flat byte view of ``buf`` that tensors may alias: ``buf`` itself, or a private copy if read-only.

    Received frames are writable memoryviews (zero-copy). ``bytes`` or other read-only buffers must be
    copied: torch would only warn, and tensorplay would silently write into an immutable object.
    """
    view = memoryview(buf)
    if view.readonly:
        view = memoryview(bytearray(view))
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


class GradTrack:
    """The tensors that require grad in one message of a distributed autograd context."""

    def __init__(self) -> None:
        self.sent: list[Any] = []  # sending: in pickling order; the index travels with each tensor
        self.received: dict[int, Any] = {}  # receiving: index -> the rebuilt leaf

    def __bool__(self) -> bool:
        return bool(self.sent or self.received)


#: set by the RPC layer around pickling / unpickling a message of an autograd context
grad_tracking: contextvars.ContextVar[GradTrack | None] = contextvars.ContextVar("nbremote_grad_tracking", default=None)


def track_sent(tensor: Any) -> int | None:
    """Sending: the index of ``tensor`` in this message's tracked tensors, or None when not tracked."""
    track = grad_tracking.get()
    if track is None or not tensor.requires_grad:
        return None
    track.sent.append(tensor)
    return len(track.sent) - 1


def track_received(index: int | None, tensor: Any) -> None:
    """Receiving: ``tensor`` (a leaf that requires grad) was sent as tracked tensor ``index``."""
    track = grad_tracking.get()
    if index is not None and track is not None:
        track.received[index] = tensor


def tensor_key(tensor: Any) -> int:
    """A key naming one tensor, whatever Python object wraps it.

    torch hands out the same Python object for a tensor every time (``id`` will do); tensorplay's
    autograd graph hands out a fresh wrapper of a leaf on every ``node.variable``, and its
    ``_impl_id`` names the underlying tensor.
    """
    key = getattr(tensor, "_impl_id", None)
    return key if isinstance(key, int) else id(tensor)
