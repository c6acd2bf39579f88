"""Unit tests of nbremote.rpc._wire.serialize and the framework adapters (in-process, no kernels)."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nbremote.errors import SerializationError
from nbremote.rpc._wire import serialize
from nbremote.rpc._wire.serialize import dumps, loads

ROOT = Path(__file__).resolve().parents[1]
MB64 = 64 * 1024 * 1024


def receive(frames: list[Any], *, writable: bool = True) -> list[Any]:
    """What the transport hands to loads: writable memoryviews over fresh frames, or read-only bytes."""
    head = bytes(frames[0])
    if writable:
        return [head, *(memoryview(bytearray(f)) for f in frames[1:])]
    return [head, *(bytes(f) for f in frames[1:])]


def load(frames: list[Any]) -> Any:
    """loads(), typed Any for the assertions that follow."""
    return loads(frames)


def roundtrip(obj: Any, *, writable: bool = True) -> Any:
    return load(receive(dumps(obj), writable=writable))


def address_range(buf: Any) -> tuple[int, int]:
    view = np.frombuffer(buf, dtype=np.uint8)
    return view.ctypes.data, view.ctypes.data + view.nbytes


def assert_inside(ptr: int, buf: Any) -> None:
    lo, hi = address_range(buf)
    assert lo <= ptr < hi, "the rebuilt object does not alias the received buffer"


# --- numpy ----------------------------------------------------------------------------------------


def assert_same_array(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> None:
    assert type(b) is np.ndarray
    assert (b.dtype, b.shape) == (a.dtype, a.shape)
    assert b.tobytes() == a.tobytes()  # bit-exact, NaN included


NUMPY_CASES = {
    "float32-nan": np.array([1.5, np.nan, -np.inf, 0.0], dtype=np.float32),
    "float64-2d": np.random.default_rng(0).standard_normal((50, 40)),
    "float16": np.arange(600, dtype=np.float16),
    "int8": np.arange(-100, 100, dtype=np.int8),
    "uint16": np.arange(3000, dtype=np.uint16).reshape(30, 100),
    "complex128": np.arange(300) * (1 + 2j),
    "bool": np.arange(2000) % 3 == 0,
    "0-d": np.array(3.25),
    "empty": np.zeros((0, 5), dtype=np.int32),
    "fortran": np.asfortranarray(np.arange(2000.0).reshape(40, 50)),
    "strided-small": np.arange(20.0)[::3],
    "strided-large": np.arange(40000.0).reshape(200, 200)[::2, 1::3],
    "structured": np.zeros(100, dtype=[("a", "i4"), ("b", "f8")]),
}


@pytest.mark.parametrize("name", NUMPY_CASES)
def test_numpy_roundtrip(name: str) -> None:
    a = NUMPY_CASES[name]
    assert_same_array(a, roundtrip(a))


def test_numpy_large_goes_out_of_band_and_aliases_on_receive() -> None:
    a = np.ones(MB64 // 4, dtype=np.float32)
    frames = dumps(a)
    assert len(frames) == 2 and len(frames[0]) < 10_000
    assert address_range(frames[1])[0] == a.ctypes.data  # no copy on send either
    received = receive(frames)
    b = load(received)
    assert_inside(b.ctypes.data, received[1])
    assert b.flags.writeable and np.array_equal(a, b)


def test_numpy_noncontiguous_large_goes_out_of_band() -> None:
    a = np.arange(100_000.0)[::2]
    frames = dumps(a)
    assert len(frames) == 2 and len(frames[0]) < 1_000
    assert_same_array(a, load(receive(frames)))


# --- torch ----------------------------------------------------------------------------------------


def tensor_bits(t: Any) -> Any:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(a: Any, b: Any, *, requires_grad: bool | None = None) -> None:
    import torch

    assert type(b) is type(a)
    assert (b.dtype, b.shape, b.stride(), b.device) == (a.dtype, a.shape, a.stride(), a.device)
    assert b.requires_grad == (a.requires_grad if requires_grad is None else requires_grad)
    assert b.is_leaf
    assert torch.equal(tensor_bits(a), tensor_bits(b))  # bit-exact, NaN included


def torch_sample(dtype: Any) -> Any:
    import torch

    gen = torch.Generator().manual_seed(0)
    if dtype is torch.bool:
        return torch.randint(0, 2, (5, 7), generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(5, 7, generator=gen, dtype=torch.float64).to(dtype)
        t[0, 0] = float("nan")
        return t
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), (5, 7), generator=gen, dtype=dtype)


TORCH_DTYPES = [
    "float32", "float64", "float16", "bfloat16", "bool", "complex64", "complex128",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
]  # fmt: skip


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_dtypes(dtype: str) -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional framework")
    t = torch_sample(getattr(torch, dtype))
    for view in (t, t.T, t[::2, 1::3], t[1:, 2], t[3, 4]):
        assert_same_tensor(view, roundtrip(view))


TORCH_LAYOUTS = {
    "transpose": lambda torch: torch.arange(24.0).reshape(4, 6).T,
    "permute-3d": lambda torch: torch.arange(60.0).reshape(3, 4, 5).permute(2, 0, 1),
    "step-slice": lambda torch: torch.arange(100.0).reshape(10, 10)[1::3, ::2],
    "offset-slice": lambda torch: torch.arange(100.0)[37:60],
    "expand": lambda torch: torch.arange(3.0).expand(4, 3),
    "0-dim": lambda torch: torch.tensor(2.5),
    "empty": lambda torch: torch.zeros(0, 3),
    "empty-strided": lambda torch: torch.zeros(5, 0, 3).transpose(0, 2),
    "conj": lambda torch: (torch.arange(4.0) * (1 + 1j)).conj(),
    "large-step": lambda torch: torch.arange(4096.0).reshape(64, 64)[:, ::5],
    # contiguous, yet not row-major strides (a size-1 dim's stride is free): kept exactly
    "odd-unit-stride": lambda torch: torch.arange(32.0).reshape(32, 1).as_strided((32, 1), (1, 7)),
}


@pytest.mark.parametrize("name", TORCH_LAYOUTS)
def test_torch_layouts(name: str) -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional framework")
    t = TORCH_LAYOUTS[name](torch)
    out = roundtrip(t)
    if name == "conj":  # the lazy conjugate is materialised
        assert torch.equal(out, t.resolve_conj()) and not out.is_conj()
        return
    assert_same_tensor(t, out)


def test_torch_autograd_flags() -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional framework")
    leaf = torch.randn(4, 3, requires_grad=True)
    assert_same_tensor(leaf, roundtrip(leaf))
    nonleaf = leaf * 2
    out = roundtrip(nonleaf)
    assert out.is_leaf and out.requires_grad and out.grad_fn is None  # detached, documented
    assert torch.equal(out, nonleaf.detach())
    out.sum().backward()
    assert out.grad is not None


def test_torch_parameter() -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional framework")
    p = torch.nn.Parameter(torch.randn(3, 4))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    frozen.tag = "kept"  # instance attributes travel
    out_p, out_frozen = roundtrip((p, frozen))
    assert_same_tensor(p, out_p)
    assert_same_tensor(frozen, out_frozen)
    assert out_frozen.tag == "kept"


def test_torch_large_is_out_of_band_and_zero_copy_both_ways() -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional framework")
    t = torch.rand(MB64 // 4)
    frames = dumps(t)
    assert len(frames) == 2 and len(frames[0]) < 10_000
    assert address_range(frames[1])[0] == t.data_ptr()  # the frame is the tensor's memory
    received = receive(frames)
    out = load(received)
    assert_inside(out.data_ptr(), received[1])
    assert_same_tensor(t, out)


def test_torch_readonly_buffers_give_writable_copies() -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional framework")
    t = torch.zeros(1000)
    received = receive(dumps(t), writable=False)
    out = load(received)
    out += 1  # would write into an immutable bytes object if it aliased it
    assert received[1] == bytes(4000)
    lo, hi = address_range(received[1])
    assert not lo <= out.data_ptr() < hi


def test_torch_small_tensors_stay_in_band() -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional framework")
    frames = dumps([torch.ones(10), torch.ones(10, dtype=torch.bfloat16)])
    assert len(frames) == 1
    out = load(frames)
    out[0] += 1  # in-band buffers come back as writable bytearrays
    assert out[0].sum().item() == 20 and out[1].dtype is torch.bfloat16


def test_torch_rebuild_function_is_referenced_by_module() -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional framework")
    assert b"nbremote.frameworks._torch" in dumps(torch.ones(2))[0]


def test_torch_sparse_coo_keeps_requires_grad_and_refuses_bad_indices() -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional framework")
    from nbremote.frameworks import _torch

    sparse = torch.sparse_coo_tensor([[0, 1, 1], [2, 0, 2]], [3.2, 4.1, 5.3], (3, 3), requires_grad=True)
    out = roundtrip(sparse)  # torch's own pickling would drop requires_grad
    assert out.is_sparse and out.requires_grad and out.is_leaf and not out.is_coalesced()
    assert torch.equal(out.detach().to_dense(), sparse.detach().to_dense())
    assert roundtrip(sparse.detach().coalesce()).is_coalesced()
    assert _torch.reduce_tensor(sparse)[0] is _torch.rebuild_sparse
    rebuild = _torch.rebuild_sparse
    indices = torch.tensor([[0, 9], [2, 0]])  # a peer's index outside the shape
    with pytest.raises(RuntimeError, match="size is inconsistent with indices"):
        rebuild(indices, torch.tensor([1.0, 2.0]), (3, 3), False, False)


def test_torch_unhandled_kinds_fall_back_to_torch_pickling() -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional framework")
    csr = torch.eye(3).to_sparse_csr()
    out = roundtrip(csr)
    assert out.layout is torch.sparse_csr and torch.equal(out.to_dense(), torch.eye(3))
    from nbremote.frameworks import _torch

    assert _torch.reduce_tensor(csr) is NotImplemented

    tensor_type: Any = torch.Tensor

    class Tagged(tensor_type):  # a subclass other than Parameter: torch's own pickling keeps its type
        pass

    out = roundtrip(torch.arange(3.0).as_subclass(Tagged))
    assert type(out).__name__ == "Tagged" and torch.equal(out.as_subclass(torch.Tensor), torch.arange(3.0))


def test_torch_missing_device_falls_back_to_cpu() -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional framework")
    from nbremote.frameworks import _torch

    rebuild, args = _torch.reduce_tensor(torch.arange(4.0))
    args = (bytearray(args[0].raw()), *args[1:6], "cuda:0", *args[7:])
    out = rebuild(*args)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert out.device.type == expected and torch.equal(out.cpu(), torch.arange(4.0))


def test_torch_malformed_layout_from_peer_is_rejected() -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional framework")
    from nbremote.frameworks import _torch

    _, args = _torch.reduce_tensor(torch.arange(4.0))
    with pytest.raises(ValueError, match="needs 400 bytes"):
        _torch.rebuild_tensor(args[0].raw(), "float32", (10, 10), (10, 1), *args[4:])
    # the size matches the buffer (numpy would lay it out), the shape or the strides do not
    with pytest.raises(ValueError, match="unknown dimension"):
        _torch.rebuild_tensor(args[0].raw(), "float32", (-2, -2), (2, 1), *args[4:])
    with pytest.raises(ValueError, match="malformed tensor layout"):
        _torch.rebuild_tensor(args[0].raw(), "float32", (2, 2), (-1, 1), *args[4:])
    with pytest.raises(ValueError, match="needs 20 bytes"):
        _torch.rebuild_tensor(args[0].raw(), "float32", (2, 2), (3, 1), *args[4:])


# --- tensorplay -----------------------------------------------------------------------------------


def tp_bits(t: Any) -> bytes:
    import tensorplay as tp

    return bytes(t.detach().contiguous().reshape(-1).view(tp.uint8).numpy().tobytes())


def assert_same_tp(a: Any, b: Any, *, requires_grad: bool | None = None) -> None:
    assert type(b) is type(a)
    assert (b.dtype, tuple(b.shape), tuple(b.stride()), str(b.device)) == (
        a.dtype, tuple(a.shape), tuple(a.stride()), str(a.device)
    )  # fmt: skip
    assert b.requires_grad == (a.requires_grad if requires_grad is None else requires_grad)
    assert b.is_leaf
    assert tp_bits(a) == tp_bits(b)


TP_DTYPES = [
    "float32", "float64", "float16", "bfloat16", "bool", "complex64", "complex128", "complex32",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
]  # fmt: skip


@pytest.mark.parametrize("dtype", TP_DTYPES)
def test_tensorplay_dtypes(dtype: str) -> None:
    tp = pytest.importorskip("tensorplay", reason="tensorplay is an optional framework")
    t = (tp.arange(35, dtype=tp.float32).reshape(5, 7) * 0.37 - 4).to(getattr(tp, dtype))
    for view in (t, t.transpose(0, 1), t[::2, 1::3], t[1:, 2], t[3, 4], t[:0]):
        assert_same_tp(view, roundtrip(view))


def test_tensorplay_nan_and_expand() -> None:
    tp = pytest.importorskip("tensorplay", reason="tensorplay is an optional framework")
    t = tp.tensor([1.0, float("nan"), -float("inf")])
    assert_same_tp(t, roundtrip(t))
    e = t.expand(4, 3)
    assert_same_tp(e, roundtrip(e))


def test_tensorplay_autograd_and_parameter() -> None:
    tp = pytest.importorskip("tensorplay", reason="tensorplay is an optional framework")
    leaf = tp.ones(4, 3, requires_grad=True)
    assert_same_tp(leaf, roundtrip(leaf))
    out = roundtrip(leaf * 2)
    assert out.is_leaf and out.requires_grad
    p = tp.nn.Parameter(tp.ones(3, 4))
    frozen = tp.nn.Parameter(tp.zeros(2), requires_grad=False)
    out_p, out_frozen = roundtrip([p, frozen])
    assert_same_tp(p, out_p)
    assert_same_tp(frozen, out_frozen)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])  # raw bytes, and numpy's route
def test_tensorplay_large_is_out_of_band_and_zero_copy(dtype: str) -> None:
    tp = pytest.importorskip("tensorplay", reason="tensorplay is an optional framework")
    t = tp.ones(MB64 // 4, dtype=getattr(tp, dtype))
    frames = dumps(t)
    assert len(frames) == 2 and len(frames[0]) < 10_000
    assert address_range(frames[1])[0] == t.data_ptr()
    received = receive(frames)
    out = load(received)
    assert_inside(out.data_ptr(), received[1])
    assert out.dtype == t.dtype and tuple(out.shape) == (MB64 // 4,)


def test_tensorplay_contiguous_view_with_free_unit_dim_strides_keeps_them() -> None:
    tp = pytest.importorskip("tensorplay", reason="tensorplay is an optional framework")
    t = tp.arange(32, dtype=tp.float32).reshape(32, 1).as_strided((32, 1), (1, 7))
    assert_same_tp(t, roundtrip(t))


def test_tensorplay_readonly_buffers_give_writable_copies() -> None:
    tp = pytest.importorskip("tensorplay", reason="tensorplay is an optional framework")
    received = receive(dumps(tp.zeros(1000)), writable=False)
    out = load(received)
    out.add_(1)
    assert received[1] == bytes(4000)
    assert float(out.sum().item()) == 1000.0


def test_tensorplay_malformed_layout_from_peer_is_rejected() -> None:
    tp = pytest.importorskip("tensorplay", reason="tensorplay is an optional framework")
    from nbremote.frameworks import _tensorplay

    _, args = _tensorplay.reduce_tensor(tp.arange(4, dtype=tp.float32))
    with pytest.raises(ValueError, match="needs"):  # tensorplay's as_strided would read out of bounds
        _tensorplay.rebuild_tensor(args[0].raw(), "float32", (10, 10), (10, 1), *args[4:])
    # the size matches the buffer (numpy would lay it out), the strides do not
    with pytest.raises(ValueError, match="needs 20 bytes"):
        _tensorplay.rebuild_tensor(args[0].raw(), "float32", (2, 2), (3, 1), *args[4:])
    with pytest.raises(ValueError, match="malformed tensor layout"):
        _tensorplay.rebuild_tensor(args[0].raw(), "float32", (2, 2), (-1, 1), *args[4:])


# --- containers, code by value, laziness ------------------------------------------------------------


def test_nested_containers() -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional framework")
    payload: Any = {
        "layers": [(torch.randn(300, 4), np.arange(500.0)), (torch.randn(3, 5).T, {"b": torch.ones(2, 2)})],
        "meta": {"name": "x", "ids": {1, 2}},
    }
    out: Any = roundtrip(payload)
    assert_same_tensor(payload["layers"][0][0], out["layers"][0][0])
    assert_same_array(payload["layers"][0][1], out["layers"][0][1])
    assert_same_tensor(payload["layers"][1][1]["b"], out["layers"][1][1]["b"])
    assert out["meta"] == payload["meta"]


MAIN_SRC = textwrap.dedent(
    """
    SCALE = 3

    def scaled(x):
        return x * SCALE

    class Point:
        def __init__(self, x):
            self.x = x
        def double(self):
            return Point(self.x * 2)
    """
)


def main_namespace() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(MAIN_SRC, namespace)
    return namespace


def test_main_function_and_class_travel_by_value(tmp_path: Path) -> None:
    ns = main_namespace()
    frames = dumps((ns["scaled"], ns["Point"](5)))
    fn, point = load(receive(frames))
    assert fn(2) == 6 and point.double().x == 10
    # A fresh interpreter has neither definition: only by-value pickles can be loaded there.
    path = tmp_path / "frames.pkl"
    path.write_bytes(pickle.dumps([bytes(f) for f in frames]))
    script = (
        "import pickle, sys; from nbremote.rpc._wire.serialize import loads; "
        f"fn, p = loads(pickle.load(open({str(path)!r}, 'rb'))); print(fn(2), p.double().x, type(p).__name__)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["6", "10", "Point"]


def test_frameworks_are_never_imported_by_the_serializer() -> None:
    script = (
        "import sys, numpy as np; from nbremote.rpc._wire.serialize import dumps, loads; "
        "loads(dumps({'a': np.ones(5000), 'f': len})); "
        "print('torch' in sys.modules, 'tensorplay' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


# --- errors ---------------------------------------------------------------------------------------


class Holder:
    def __init__(self, inner: Any) -> None:
        self.inner = inner


class Slotted:
    __slots__ = ("first", "second")

    def __init__(self, first: Any, second: Any) -> None:
        self.first = first
        self.second = second


def error_of(obj: Any, *, named_roots: bool = True) -> SerializationError:
    with pytest.raises(SerializationError) as info:
        dumps(obj, named_roots=named_roots)
    assert info.value.__cause__ is not None  # the pickling error is chained
    return info.value


def test_unpicklable_lock_in_args() -> None:
    err = error_of({"args": (1, threading.Lock()), "kwargs": {}})
    message = str(err)
    assert "args[1]" in message and "`_thread.lock`" in message
    assert "cannot pickle" in message and "create the object on the worker" in message
    assert isinstance(err, TypeError)


def test_unpicklable_generator_in_kwargs() -> None:
    gen = (i for i in range(3))
    message = str(error_of({"args": (), "kwargs": {"opt": [1, 2, gen]}}))
    assert "kwargs['opt'][2]" in message and "`generator`" in message


def test_unpicklable_socket_in_object_attribute() -> None:
    with socket.socket() as sock:
        message = str(error_of({"args": (), "kwargs": {"opt": [0, 1, Holder(sock)]}}))
    assert "kwargs['opt'][2].inner" in message and "`socket.socket`" in message


def test_unpicklable_in_slots_and_sets() -> None:
    message = str(error_of({"args": (Slotted(1, threading.Lock()),)}))
    assert "args[0].second" in message and "`_thread.lock`" in message
    message = str(error_of({"kwargs": {"s": frozenset([threading.Lock()])}}))
    assert "kwargs['s']<element 0>" in message


def test_unpicklable_global_of_main_function() -> None:
    ns = main_namespace()
    exec("def uses_lock():\n    return LOCK.locked()", ns)
    ns["LOCK"] = threading.Lock()
    message = str(error_of({"args": (ns["uses_lock"],)}))
    assert "args[0].__globals__['LOCK']" in message and "`_thread.lock`" in message


def test_unnamed_root_and_top_level_culprit() -> None:
    assert "value[0]" in str(error_of([threading.Lock()], named_roots=False))
    assert "cannot serialize value:" in str(error_of(threading.Lock(), named_roots=False))


def test_unpickling_a_missing_class_raises_serialization_error() -> None:
    module = types.ModuleType("nbremote_ghost_module")
    exec("class Ghost:\n    pass", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        frames = dumps(module.Ghost())
    finally:
        del sys.modules[module.__name__]
    with pytest.raises(SerializationError, match="nbremote_ghost_module") as info:
        loads(receive(frames))
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert "importable in the receiving process" in str(info.value)


def test_loads_rejects_garbage() -> None:
    with pytest.raises(SerializationError):
        loads([b"not a pickle"])
    with pytest.raises(SerializationError):
        loads([])


def test_plain_calls_take_the_pickle_fast_path_and_load_like_the_full_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import operator

    import cloudpickle

    class NoFullPath(serialize._Pickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("a plain call took the full path")

    payload = {"fn": json.dumps, "args": ([1, "a", None, 2.5],), "kwargs": {"sort_keys": True}}
    with monkeypatch.context() as patched:
        patched.setattr(serialize, "_Pickler", NoFullPath)
        frames = dumps(payload, named_roots=True)
    assert len(frames) == 1
    back = load(receive(frames))
    assert back["fn"] is json.dumps and back["fn"](*back["args"], **back["kwargs"]) == '[1, "a", null, 2.5]'
    builtin = load(receive(dumps({"fn": operator.add, "args": (2, 3), "kwargs": {}}, named_roots=True)))
    assert builtin["fn"](*builtin["args"]) == 5
    # A function that is not what its module holds under its name cannot go by reference: the full path
    # (cloudpickle, by value) takes it, and it still works in a fresh interpreter.
    impostor = types.FunctionType((lambda x: x * 7).__code__, {}, "dumps")
    impostor.__module__, impostor.__qualname__ = "json", "dumps"
    back = load(receive(dumps({"fn": impostor, "args": (6,), "kwargs": {}}, named_roots=True)))
    assert back["fn"] is not json.dumps and back["fn"](*back["args"]) == 42
    # Modules registered to travel by value keep doing so.
    module = types.ModuleType("nbr_byvalue_mod")
    exec("def triple(x):\n    return 3 * x\n", module.__dict__)
    sys.modules[module.__name__] = module
    cloudpickle.register_pickle_by_value(module)
    try:
        stream = bytes(dumps({"fn": module.triple, "args": (2,), "kwargs": {}}, named_roots=True)[0])
        del sys.modules[module.__name__]  # as on a worker that never saw the module
        back = load([stream])
        assert back["fn"](*back["args"]) == 6
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        sys.modules.pop(module.__name__, None)


def test_arguments_the_fast_path_does_not_know_take_the_full_path() -> None:
    import json

    arr = np.arange(100_000, dtype=np.float64)
    frames = dumps({"fn": json.dumps, "args": (arr,), "kwargs": {}}, named_roots=True)
    assert len(frames) == 2, "a large array still goes out of band"
    assert np.array_equal(load(receive(frames))["args"][0], arr)
    with pytest.raises(SerializationError, match=r"args\[0\]"):
        dumps({"fn": json.dumps, "args": (threading.Lock(),), "kwargs": {}}, named_roots=True)


def test_calls_and_results_with_tensors_and_arrays_take_the_lean_pickler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call of an importable function, or a result, made of plain values, arrays and tensors is pickled by
    C pickle with the framework adapters, without cloudpickle; it loads exactly like the full path's."""
    torch = pytest.importorskip("torch")
    from nbremote.nn import _owner

    x = torch.randn(32, 16, requires_grad=True)
    big = np.arange(100_000, dtype=np.float32)
    payload = {"fn": _owner.forward, "args": ("id1", (x * 2,), {"scale": big}, "cpu", True), "kwargs": {}}
    result = (torch.nn.Linear(16, 4)(x), [big, 3], {"n": torch.arange(5)})

    class NoFullPath(serialize._Pickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("a payload of plain values, arrays and tensors took the full path")

    # A backward hop's arguments: its gradients by send and slot, in dicts keyed by int, three levels down.
    from nbremote import autograd

    hop = {"fn": autograd._backward_hop, "args": (7, (1, "driver", False, None), "w#0", {3: {0: x.detach()}}),
           "kwargs": {}}
    with monkeypatch.context() as patched:
        patched.setattr(serialize, "_Pickler", NoFullPath)
        lean_call, lean_result = dumps(payload, named_roots=True), dumps(result)
        lean_hop = dumps(hop, named_roots=True)
    assert torch.equal(load(receive(lean_hop))["args"][3][3][0], x.detach())
    full_call, full_result = dumps(payload, named_roots=True), dumps(result)
    assert len(lean_call) == len(full_call) == 3 and len(lean_result) == len(full_result) == 2  # out of band
    for lean, full in ((lean_call, full_call), (lean_result, full_result)):
        assert pickle.loads(bytes(lean[0]), buffers=lean[1:]).__class__ is load(receive(full)).__class__
    call = load(receive(lean_call))
    assert call["fn"] is _owner.forward and call["args"][0] == "id1" and call["args"][3:] == ("cpu", True)
    sent = call["args"][1][0]
    assert torch.equal(sent, x * 2) and sent.requires_grad and sent.is_leaf
    assert np.array_equal(call["args"][2]["scale"], big)
    back = load(receive(lean_result))
    assert torch.equal(back[0], result[0]) and back[0].requires_grad
    assert np.array_equal(back[1][0], big) and back[1][1] == 3 and torch.equal(back[2]["n"], torch.arange(5))


def test_a_tensor_with_attributes_takes_the_full_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attributes set on a tensor travel with it and may be anything (a class of the notebook's, which only
    cloudpickle sends by value): such a payload is left to the full path."""
    torch = pytest.importorskip("torch")

    t = torch.ones(3)
    t.note = {"step": 4}
    built: list[bool] = []

    class CountingPickler(serialize._Pickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(True)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(serialize, "_Pickler", CountingPickler)
    back = load(receive(dumps((t, 1))))
    assert built and torch.equal(back[0], t) and back[0].note == {"step": 4}


def test_a_refused_lean_attempt_leaves_no_tracked_tensor_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside an autograd context every tensor that requires grad is recorded once, in pickling order: if the
    lean pickler gives up after recording some, the full path's pickling records them again from scratch."""
    torch = pytest.importorskip("torch")
    from nbremote.frameworks import GradTrack, grad_tracking

    class GivesUp(serialize._LeanPickler):
        def dump(self, obj: Any) -> None:
            super().dump(obj)
            raise pickle.PicklingError("gave up late")

    monkeypatch.setattr(serialize, "_LeanPickler", GivesUp)
    x, y = torch.ones(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    track = GradTrack()
    token = grad_tracking.set(track)
    try:
        frames = dumps((x, y))
    finally:
        grad_tracking.reset(token)
    assert [id(t) for t in track.sent] == [id(x), id(y)]
    back = load(receive(frames))
    assert torch.equal(back[0], x) and torch.equal(back[1], y)


# -- imports a payload sets off ---------------------------------------------------------------------------------

_CIRCLE = {  # the shape of nbremote.nn's: the package imports rec -> snap, and snap imports what imports the package
    "__init__.py": "import time\ntime.sleep(0.1)\nfrom {pkg} import rec\n",
    "rec.py": "from {pkg}.snap import Plan\n",
    "snap.py": "import {pkg}_user\nclass Plan:\n    pass\n",
}


def _pickled_ref(module: str, name: str) -> bytes:
    """A pickle that names ``module.name`` (made by hand: the module must not be imported here first)."""
    return b"\x80\x04\x95" + len(f"{module}\n{name}\n".encode() + b"c.").to_bytes(8, "little") + \
        b"c" + f"{module}\n{name}\n".encode() + b"."


def test_two_payloads_that_import_a_circle_at_once_both_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two calls that reach a fresh kernel together, each importing part of one circle of modules (a restore
    and a forward, after rpc.restart_worker): Python hands one thread a half-made module; loads waits for the
    other thread's imports and tries again instead of failing the call."""
    pkg = "nbr_circle_" + os.urandom(4).hex()
    (tmp_path / pkg).mkdir()
    for name, text in _CIRCLE.items():
        (tmp_path / pkg / name).write_text(text.format(pkg=pkg))
    (tmp_path / f"{pkg}_user.py").write_text(f"import {pkg}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    results: dict[str, Any] = {}

    def load(key: str, module: str, name: str) -> None:
        try:
            results[key] = loads([_pickled_ref(module, name)])
        except Exception as exc:
            results[key] = exc

    through_package = threading.Thread(target=load, args=("a", f"{pkg}.rec", "Plan"))
    straight_in = threading.Thread(target=load, args=("b", f"{pkg}.snap", "Plan"))
    through_package.start()
    time.sleep(0.03)  # the package is being imported: the second goes straight to snap
    straight_in.start()
    through_package.join(20)
    straight_in.join(20)
    assert isinstance(results["a"], type) and results["a"] is results["b"], results


def test_a_circle_of_ones_own_fails_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = "nbr_selfcircle_" + os.urandom(4).hex()
    (tmp_path / f"{pkg}.py").write_text(f"from {pkg}_b import g\ndef f():\n    pass\n")
    (tmp_path / f"{pkg}_b.py").write_text(f"from {pkg} import f\ndef g():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    start = time.monotonic()
    with pytest.raises(SerializationError, match="partially initialized module"):
        loads([_pickled_ref(pkg, "f")])
    assert time.monotonic() - start < 2, "a plain circular import is the sender's bug: said at once"
