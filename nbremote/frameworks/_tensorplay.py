"""tensorplay adapter: the same wire format as the torch adapter (see ``_torch``), for tensorplay tensors.

tensorplay 1.0's own pickling (``TensorBase.__getstate__``) copies the data into a ``bytes`` object in
the pickle stream (0.16-0.4 s for 64 MB). Here a tensor travels as a ``PickleBuffer`` over
``x.as_strided(span).view(uint8).numpy()`` -- a zero-copy view of its memory -- and is rebuilt with
``tensorplay.frombuffer(...).view(dtype).as_strided(...)`` aliasing the received frame. The uint8 view
matters: ``Tensor.numpy()`` *converts* bfloat16 / complex32 / bcomplex32 to float32 / complex64 (a copy
that changes the bits), while raw bytes stay exact for every dtype.

A contiguous CPU tensor of a dtype numpy holds exactly (``NUMPY_EXACT``) takes numpy's route instead, as
with torch: ``Tensor.numpy()`` (zero-copy for those dtypes) to send, ``np.frombuffer`` +
``tensorplay.from_numpy`` to rebuild -- the same bytes and aliasing for less after a sleep (measured
cold, a 32x16 float32 tensor: 62 against 33 us to send, 41 against 16-35 us to rebuild).

Same choices as torch: the storage span is shipped when it has no gaps (zero-copy both ways, strides
exact), a view with gaps is packed (one copy on each side, rebuilt by ``copy_`` into a fresh strided span);
``requires_grad`` kept, tensors arrive as leaves (reported to a distributed autograd context's
``GradTrack`` like torch's); ``nn.Parameter`` stays a Parameter; ``__dict__`` travels.
Not zero-copy: read-only (``bytes``) frames -- ``tensorplay.frombuffer`` accepts them and would alias
immutable memory, so they are copied first; and CUDA tensors (``.cpu()`` on send, ``.to()`` on receive,
back on the CPU if the receiver has no such device). Sparse, quantized and meta tensors, and subclasses
other than Parameter, use tensorplay's own pickling.

tensorplay differs from torch in ways handled here: ``is_quantized`` is a method, a CPU device's index
is -1, ``device("cuda").index`` is 0, ``frombuffer`` rejects empty buffers, ``Device`` objects cannot be
pickled (devices travel as strings), views keep a PyCapsule in ``__dict__`` (not sent), ``empty_strided``
allocates only ``numel`` elements even for a gapped layout, and ``as_strided`` has no bounds check (so
the layout from the peer is checked first).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import tensorplay as tp

# The same function as tp.frombuffer, which tensorplay's __all__ does not list (mypy --strict objects).
from tensorplay._C import frombuffer

from nbremote.frameworks import (
    NUMPY_EXACT,
    Reducer,
    check_layout,
    row_major,
    storage_span,
    track_received,
    track_sent,
    writable_buffer,
)

__all__ = ["rebuild_tensor", "reduce_tensor", "reducers"]

_Parameter: Any = tp.nn.Parameter  # untyped in tensorplay's stubs

_DTYPE_NAMES: dict[Any, str] = {
    dt: str(dt).removeprefix("tensorplay.") for dt in vars(tp).values() if isinstance(dt, type(tp.float32))
}
_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name) for name in NUMPY_EXACT if isinstance(getattr(tp, name, None), type(tp.float32))
}


def reduce_tensor(t: Any) -> Any:
    """``(rebuild_tensor, args)`` for a dense tensor or ``Parameter``; ``NotImplemented`` for the rest."""
    if t.layout != tp.strided or t.is_quantized() or t.is_meta:
        return NotImplemented
    # Views keep private dunder entries (e.g. '__tp_impl_capsule__', an unpicklable PyCapsule) in __dict__.
    state = {k: v for k, v in t.__dict__.items() if not k.startswith("__")} or None
    name = _DTYPE_NAMES.get(t.dtype)  # once: each .dtype makes an object, and hashing it is a Python call
    if name in _NUMPY_DTYPES and t.is_cpu and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        try:
            array: Any = (t.detach() if t.requires_grad else t).numpy()
        except (RuntimeError, TypeError):
            pass  # the general path decides
        else:
            return rebuild_tensor, (
                pickle.PickleBuffer(array), name, tuple(t.shape), tuple(t.stride()), False,
                t.requires_grad, None, type(t) is _Parameter, state, track_sent(t),
            )
    try:
        x = t.detach()
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
        buffer = pickle.PickleBuffer(flat.view(tp.uint8).numpy())
    except (RuntimeError, TypeError, ValueError):
        return NotImplemented
    dtype = name or str(t.dtype).removeprefix("tensorplay.")
    return rebuild_tensor, (
        buffer,
        dtype,
        shape,
        stride,
        packed,
        t.requires_grad,
        device,
        type(t) is _Parameter,
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
) -> Any:
    """Inverse of :func:`reduce_tensor`; aliases ``buffer`` when it is writable and on the CPU."""
    dt = getattr(tp, dtype)
    target = _usable_device(device)
    data = writable_buffer(buffer)
    array = None if target is not None else row_major(data, _NUMPY_DTYPES.get(dtype), shape, packed)
    if array is not None:
        out = tp.from_numpy(array)
        if tuple(out.stride()) != tuple(stride):  # a view: strides checked first (as_strided has no bounds check)
            check_layout(shape, stride, packed, data.nbytes, dt.itemsize)
            out = out.as_strided(shape, stride, 0).detach()
    else:
        check_layout(shape, stride, packed, data.nbytes, dt.itemsize)
        out = _rebuild_general(data, dt, shape, stride, packed, target)
    if parameter:
        out = _Parameter(out, requires_grad=requires_grad)
    elif requires_grad:
        out.requires_grad_(True)
    if state:
        out.__dict__.update(state)
    track_received(grad_index, out)
    return out


def _rebuild_general(data: memoryview, dt: Any, shape: tuple[int, ...], stride: tuple[int, ...], packed: bool,
                     target: Any) -> Any:
    """A tensor over ``data`` (a validated layout) for what numpy cannot hold (see ``_torch``)."""
    if data.nbytes == 0:  # tensorplay.frombuffer refuses empty buffers
        return tp.empty_strided(shape, stride, dtype=dt, device=target)
    flat = frombuffer(data, dtype=tp.uint8).view(dt)
    if target is not None:
        flat = flat.to(target)
    if packed:
        # Not tp.empty_strided: in tensorplay 1.0 it allocates numel elements, not the strided span,
        # so copying into a gapped layout writes past the allocation (heap corruption).
        base = tp.empty(storage_span(shape, stride), dtype=dt, device=flat.device)
        out = base.as_strided(shape, stride, 0)
        out.copy_(flat.view(shape))
        return out.detach()
    return flat.as_strided(shape, stride, 0).detach()


def _usable_device(device: str | None) -> Any:
    """``tensorplay.device(device)`` if this process has it, else ``None`` (stay on the CPU)."""
    if device is None:
        return None
    dev = tp.device(device)
    try:
        if dev.type != "cuda" or not tp.cuda.is_available() or dev.index >= tp.cuda.device_count():
            return None
    except (AttributeError, RuntimeError):
        return None
    return dev


def reducers() -> dict[type, Reducer]:
    return {tp.Tensor: reduce_tensor, _Parameter: reduce_tensor}
