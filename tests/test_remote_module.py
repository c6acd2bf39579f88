"""``nbremote.nn.RemoteModule`` against real worker kernels, for torch and for tensorplay modules.

Every kernel test runs twice (``fw`` = torch / tensorplay) on the session's ``world`` (driver +
worker1..worker3). Module classes live at this module's top level so the workers import them by name;
notebook-defined classes are simulated by executing a cell's source as ``__main__`` (they then travel by
value, as from a notebook). Expected values come from running the same weights locally.
"""

from __future__ import annotations

import collections
import gc
import importlib
import inspect
import pickle
import subprocess
import sys
import time
import weakref
from types import ModuleType
from typing import Any

import pytest
import tensorplay
import torch

import nbremote.nn
from nbremote import rpc
from nbremote.errors import SerializationError, UnknownWorkerError
from nbremote.nn import RemoteDeviceError, RemoteModule, interface
from nbremote.nn._device import parse_remote_device
from nbremote.nn._frameworks import _map_tensors, check_device, inputs_to_device, outputs_to_cpu
from nbremote.nn._interface import build_forward_methods, interface_signature, is_interface

pytestmark = pytest.mark.timeout(60)

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: runs on a GPU machine")

# -- module classes, once per framework (workers import them from this module) --------------------------


def _define(nn: ModuleType, prefix: str) -> dict[str, type]:
    class Affine(nn.Module):  # type: ignore[name-defined,misc]
        """``forward(x, scale=1.0, *, shift=None)``: args and kwargs both matter."""

        def __init__(self, n_in: int, n_out: int, *, bias: bool = True) -> None:
            super().__init__()
            self.linear = nn.Linear(n_in, n_out, bias=bias)

        def forward(self, x: Any, scale: float = 1.0, *, shift: Any = None) -> Any:
            y = self.linear(x) * scale
            return y if shift is None else y + shift

    class Structured(nn.Module):  # type: ignore[name-defined,misc]
        """Nested inputs, and an output of the shape selected by ``kind``."""

        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, pair: tuple[Any, Any], extra: dict[str, Any], kind: str = "tensor") -> Any:
            y = self.linear(pair[0]) + pair[1] + extra["bias"][0]
            if kind == "tuple":
                return y, (y * 2, [y * 3])
            if kind == "dict":
                return {"y": y, "nested": {"twice": y * 2}}
            return y

    class Where(nn.Module):  # type: ignore[name-defined,misc]
        """Returns the worker it ran on, to see where a forward really ran."""

        def forward(self, x: Any) -> tuple[str, Any]:
            return rpc.get_worker_info().name, x * 2

    class Stage(nn.Module):  # type: ignore[name-defined,misc]
        def __init__(self, n_in: int, n_out: int) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(n_in, n_out), nn.ReLU(), nn.Dropout(0.5))

        def forward(self, x: Any) -> Any:
            return self.body(x)

    class Broken(nn.Module):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            raise BrokenConstructorError("cannot build this module")

    made = {"Affine": Affine, "Structured": Structured, "Where": Where, "Stage": Stage, "Broken": Broken}
    for name, cls in made.items():
        cls.__name__ = cls.__qualname__ = f"{prefix}{name}"  # importable by name from this module
        globals()[cls.__name__] = cls
    return made


class BrokenConstructorError(Exception):
    pass


MODULES = {"torch": _define(torch.nn, "Torch"), "tensorplay": _define(tensorplay.nn, "Tensorplay")}


def not_a_module() -> dict[str, int]:
    return {"not": 1}


# -- helpers that run on the owner, to observe it independently of the handle ---------------------------


def owner_training(module_rref: rpc.RRef[Any]) -> bool:
    return bool(module_rref.local_value().training)


def owner_state(module_rref: rpc.RRef[Any]) -> tuple[str, str, list[list[float]]]:
    module = module_rref.local_value()
    params = [p.detach().reshape(-1).tolist() for p in module.parameters()]
    return rpc.get_worker_info().name, type(module).__name__, params


def call_forward_here(handle: RemoteModule, x: Any) -> tuple[str, bool, str, Any]:
    """Runs on another worker: use a handle that arrived as an argument."""
    return rpc.get_worker_info().name, isinstance(handle, RemoteModule), handle.on, handle(x)


def travelled_attributes(handle: RemoteModule) -> list[str]:
    return sorted(k for k in vars(handle) if not k.startswith("_"))


def give_back(handle: RemoteModule) -> RemoteModule:
    return handle


def build_and_run_there(framework: str, x: Any) -> tuple[str, Any]:
    """Runs on a worker: that worker creates a RemoteModule on another worker and drives it."""
    rm = RemoteModule("worker2/cpu", MODULES[framework]["Where"])
    return rm.on, rm(x)


def second_handle_there(remote_device: str, module_rref: rpc.RRef[Any], x: Any) -> Any:
    return RemoteModule.init_from_module_rref(remote_device, module_rref)(x)


# -- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture(params=["torch", "tensorplay"])
def fw(request: pytest.FixtureRequest, world: list[str]) -> ModuleType:
    """The framework under test (its top-level module); depends on the kernel world."""
    lib = importlib.import_module(request.param)
    lib.manual_seed(0)
    return lib


def classes(fw: ModuleType) -> dict[str, type]:
    return MODULES[fw.__name__]


def close(a: Any, b: Any) -> bool:
    return bool(a.shape == b.shape and type(a) is type(b) and not a.is_cuda and tensor_lib(a).allclose(a, b))


def tensor_lib(t: Any) -> ModuleType:
    return torch if isinstance(t, torch.Tensor) else tensorplay


def local_copy(fw: ModuleType, rm: RemoteModule, cls: type, *args: Any, **kwargs: Any) -> Any:
    """The same module built here, with the remote module's weights."""
    local = cls(*args, **kwargs)
    local.load_state_dict(rm.remote_state_dict())
    return local


# -- pure: no kernel needed -----------------------------------------------------------------------------


def test_public_names_match_all() -> None:
    exported = {name for name in dir(nbremote.nn) if not name.startswith("_")}
    assert set(nbremote.nn.__all__) == {"RemoteModule", "RemoteDeviceError", "interface", "RemoteDevice",
                                        "parse_remote_device", "ModuleSummary", "ParameterInfo", "ForwardStats",
                                        "ReloadReport", "ReloadMismatchError", "Snapshot", "SnapshotStore",
                                        "MemoryStore", "DirectoryStore", "RecoveryReport", "ResumableLoop",
                                        "RemoteSequential", "last_report"}
    assert set(nbremote.nn.__all__) <= exported
    assert all(getattr(nbremote.nn, name) is not None for name in nbremote.nn.__all__)


def test_remote_module_before_init_rpc_says_what_to_do() -> None:
    code = (
        "import torch\n"
        "from nbremote.nn import RemoteModule\n"
        "try:\n"
        "    RemoteModule('worker1/cpu', torch.nn.Linear, args=(2, 2))\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.startswith("NotInitializedError") and "init_rpc" in out.stdout


def test_import_nbremote_nn_imports_no_framework() -> None:
    code = "import sys, nbremote.nn; print(sorted({'torch', 'tensorplay'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


@interface
class Iface:
    def forward(self, x: torch.Tensor, scale: float = 1.0, *, shift: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


def test_interface_marks_and_checks_the_class() -> None:
    assert is_interface(Iface) and not is_interface(object) and not is_interface(Iface())
    with pytest.raises(TypeError, match="must define a forward"):
        interface(type("NoForward", (), {}))
    with pytest.raises(TypeError, match="decorates a class"):
        interface(lambda x: x)  # type: ignore[type-var]
    with pytest.raises(TypeError, match="not marked as an interface"):
        interface_signature(type("Plain", (), {"forward": lambda self, x: x}))


def test_built_methods_have_the_exact_signature_and_bind_locally() -> None:
    forward, forward_async = build_forward_methods(interface_signature(Iface))
    calls: list[tuple[Any, ...]] = []

    class Recorder:
        def _forward_sync(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
            calls.append(("sync", args, kwargs))
            return "ran"

        def _forward_async(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
            calls.append(("async", args, kwargs))
            return "started"

    handle = Recorder()
    bound = forward.__get__(handle)
    assert str(inspect.signature(bound)) == str(inspect.signature(Iface().forward))
    assert "Future[" in str(inspect.signature(forward_async.__get__(handle)).return_annotation)
    assert bound(1, shift=3) == "ran"
    assert bound(1, scale=2) == "ran"
    assert forward_async.__get__(handle)(x=1) == "started"
    assert calls == [("sync", (1,), {"shift": 3}), ("sync", (1, 2), {}), ("async", (1,), {})]
    for wrong in [(), (1, 2, 3), (1,)]:
        kwargs = {"nope": 1} if wrong == (1,) else {}
        with pytest.raises(TypeError):
            bound(*wrong, **kwargs)
    assert len(calls) == 3  # nothing was sent for the wrong calls


def test_tensor_structures_are_mapped_and_preserved() -> None:
    point = collections.namedtuple("point", "x y")
    t = torch.ones(2)
    value = (t, [t, {"a": t, "b": 3}], point(t, "s"), collections.OrderedDict(k=t))
    seen: list[Any] = []
    mapped = _map_tensors(value, torch.Tensor, lambda x: seen.append(x) or x * 2)
    assert len(seen) == 5 and isinstance(mapped, tuple) and isinstance(mapped[2], point)
    assert isinstance(mapped[3], collections.OrderedDict) and mapped[1][1]["b"] == 3 and mapped[2].y == "s"
    assert all(bool((x == 2).all()) for x in (mapped[0], mapped[1][0], mapped[1][1]["a"], mapped[2].x))
    assert inputs_to_device(value, "cpu", "torch")[1][1]["a"] is t  # already on the device: untouched
    assert outputs_to_cpu({"out": (t,)}, "torch")["out"][0] is t
    tp_value = {"x": [tensorplay.ones(2)]}
    assert outputs_to_cpu(tp_value, "tensorplay")["x"][0] is tp_value["x"][0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a process without a GPU")
def test_check_device_without_gpu_names_the_worker_and_the_fix() -> None:
    check_device(parse_remote_device("w/cpu"), None, "w")  # cpu always exists
    with pytest.raises(RemoteDeviceError, match=r"worker 'w' has no CUDA device .*use 'w/cpu'"):
        check_device(parse_remote_device("w/cuda:1"), "tensorplay", "w")


# -- construction and the device string -----------------------------------------------------------------


@pytest.mark.parametrize("bad", ["a/b/c", "/", "/cpu", "w/", "w/cpu2", "w/foo"])
def test_malformed_remote_device_raises_value_error(fw: ModuleType, bad: str) -> None:
    with pytest.raises(ValueError, match=r"malformed remote_device .*accepted forms"):
        RemoteModule(bad, fw.nn.Linear, args=(2, 2))


@pytest.mark.parametrize("form", ["worker1/cpu", "worker1", "rank:1/cpu", "rank:1"])
def test_accepted_forms_place_the_module_on_worker1(fw: ModuleType, form: str) -> None:
    rm = RemoteModule(form, fw.nn.Linear, args=(3, 2))
    assert (rm.on, rm.device, rm.remote_device) == ("worker1", "cpu", "worker1/cpu")
    assert rpc.rpc_sync("worker1", owner_state, args=(rm.get_module_rref(),))[:2] == ("worker1", "Linear")


@pytest.mark.parametrize("unknown", ["worker9/cpu", "rank:42/cpu"])
def test_unknown_worker_lists_the_known_workers(fw: ModuleType, unknown: str) -> None:
    with pytest.raises(UnknownWorkerError) as info:
        RemoteModule(unknown, fw.nn.Linear, args=(2, 2))
    assert all(name in str(info.value) for name in ("worker1", "worker2", "worker3"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a worker without a GPU")
def test_cuda_on_a_worker_without_gpu_is_a_typed_error(fw: ModuleType) -> None:
    with pytest.raises(RemoteDeviceError) as info:
        RemoteModule("worker1/cuda:0", fw.nn.Linear, args=(2, 2))
    assert info.value.worker == "worker1" and isinstance(info.value, ValueError)
    assert "worker1" in str(info.value)
    assert f"{fw.__name__}.cuda.is_available() is False there" in str(info.value)


def test_framework_variant_composes_with_its_own_framework(fw: ModuleType) -> None:
    rm = RemoteModule("worker1/cpu", fw.nn.Linear, args=(2, 2))
    assert isinstance(rm, RemoteModule) and isinstance(rm, fw.nn.Module)
    other = tensorplay if fw is torch else torch
    assert not isinstance(rm, other.nn.Module)
    assert repr(rm) == "RemoteModule(Linear on worker1/cpu)"


def test_result_that_is_not_a_module_names_its_type(world: list[str]) -> None:
    with pytest.raises(ValueError, match=r"instance of builtins\.dict"):
        RemoteModule("worker1/cpu", not_a_module)


def test_constructor_errors_arrive_with_their_own_type(fw: ModuleType) -> None:
    with pytest.raises(BrokenConstructorError, match="cannot build this module"):
        RemoteModule("worker1/cpu", classes(fw)["Broken"])


def test_class_defined_in_the_notebook(fw: ModuleType) -> None:
    cell = (
        "class NotebookNet(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.linear = nn.Linear(3, 2)\n"
        "    def forward(self, x):\n"
        "        return self.linear(x) + 100\n"
    )
    namespace: dict[str, Any] = {"__name__": "__main__", "nn": fw.nn}
    exec(cell, namespace)  # a notebook cell: the class lives in __main__ and travels by value
    cls = namespace["NotebookNet"]
    rm = RemoteModule("worker2/cpu", cls)
    x = fw.randn(4, 3)
    local = cls()
    local.load_state_dict(rm.remote_state_dict())
    assert close(rm(x), local(x))


# -- forward --------------------------------------------------------------------------------------------


def test_forward_round_trip_with_args_and_kwargs(fw: ModuleType) -> None:
    cls = classes(fw)["Affine"]
    rm = RemoteModule("worker1/cpu", cls, args=(4, 3), kwargs={"bias": True})
    local = local_copy(fw, rm, cls, 4, 3)
    x, shift = fw.randn(5, 4), fw.randn(5, 3)
    assert close(rm.forward(x), local(x))
    assert close(rm.forward(x, 2.0, shift=shift), local(x, 2.0, shift=shift))
    assert close(rm(x, scale=-1.0), local(x, scale=-1.0))
    fut = rm.forward_async(x, 3.0, shift=shift)
    assert isinstance(fut, rpc.Future)
    assert close(fut.wait(), local(x, 3.0, shift=shift))


def test_many_forward_async_in_flight(fw: ModuleType) -> None:
    cls = classes(fw)["Affine"]
    rm = RemoteModule("worker3/cpu", cls, args=(4, 4))
    local = local_copy(fw, rm, cls, 4, 4)
    xs = [fw.randn(2, 4) for _ in range(20)]
    futures = [rm.forward_async(x, float(i)) for i, x in enumerate(xs)]
    assert all(close(f.wait(), local(x, float(i))) for i, (f, x) in enumerate(zip(futures, xs, strict=True)))


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict"])
def test_nested_inputs_and_any_output_structure(fw: ModuleType, kind: str) -> None:
    cls = classes(fw)["Structured"]
    rm = RemoteModule("worker1/cpu", cls)
    local = local_copy(fw, rm, cls)
    pair, extra = (fw.randn(2, 4), fw.randn(2, 4)), {"bias": [fw.randn(4)]}
    got, want = rm(pair, extra, kind=kind), local(pair, extra, kind=kind)
    if kind == "tensor":
        assert close(got, want)
    elif kind == "tuple":
        assert isinstance(got, tuple) and isinstance(got[1], tuple) and isinstance(got[1][1], list)
        assert close(got[0], want[0]) and close(got[1][0], want[1][0]) and close(got[1][1][0], want[1][1][0])
    else:
        assert set(got) == {"y", "nested"} and close(got["nested"]["twice"], want["nested"]["twice"])


def test_interface_gives_the_exact_signature_and_local_type_errors(fw: ModuleType) -> None:
    cls = classes(fw)["Affine"]
    rm = RemoteModule("worker1/cpu", cls, args=(4, 3), module_interface_cls=Iface)
    assert str(inspect.signature(rm.forward)) == str(inspect.signature(Iface().forward))
    assert list(inspect.signature(rm.forward_async).parameters) == ["x", "scale", "shift"]
    local = local_copy(fw, rm, cls, 4, 3)
    x, shift = fw.randn(2, 4), fw.randn(2, 3)
    assert close(rm.forward(x, 2.0, shift=shift), local(x, 2.0, shift=shift))
    assert close(rm(x, shift=shift), local(x, shift=shift))
    assert close(rm.forward_async(x=x, scale=0.5).wait(), local(x, scale=0.5))
    with pytest.raises(TypeError):
        rm.forward(x, 1.0, shift)  # shift is keyword-only
    with pytest.raises(TypeError):
        rm(x, bogus=1)


def test_interface_on_the_module_class_itself(fw: ModuleType) -> None:
    marked = interface(classes(fw)["Where"])
    try:
        rm = RemoteModule("worker2/cpu", marked)
        assert list(inspect.signature(rm.forward).parameters) == ["x"]
        with pytest.raises(TypeError):
            rm.forward()
        assert rm(fw.ones(1))[0] == "worker2"
    finally:
        del marked.__nbremote_interface__  # type: ignore[attr-defined]  # keep the shared class unmarked


def test_torch_spelling_of_the_interface_keyword(world: list[str]) -> None:
    """torch's ``_RemoteModule`` and ``init_from_module_rref`` call it ``_module_interface_cls``."""
    rm = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 3), _module_interface_cls=Iface)
    assert rm.module_interface_cls is Iface
    assert list(inspect.signature(rm.forward).parameters) == ["x", "scale", "shift"]
    twin = RemoteModule.init_from_module_rref("worker1/cpu", rm.get_module_rref(), _module_interface_cls=Iface)
    assert twin.module_interface_cls is Iface
    assert list(inspect.signature(twin.forward).parameters) == ["x", "scale", "shift"]
    x = torch.ones(2, 4)
    assert torch.equal(twin.forward(x), rm(x))
    with pytest.raises(TypeError, match="give the module's interface once"):
        RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 3), module_interface_cls=Iface,
                     _module_interface_cls=type("Other", (Iface,), {"__nbremote_interface__": True}))


# -- state on the owner ---------------------------------------------------------------------------------


def test_train_and_eval_are_seen_on_the_owner(fw: ModuleType) -> None:
    rm = RemoteModule("worker2/cpu", classes(fw)["Stage"], args=(8, 8))
    rref = rm.get_module_rref()
    assert rm.training and rpc.rpc_sync("worker2", owner_training, args=(rref,))
    assert rm.eval() is rm
    assert not rpc.rpc_sync("worker2", owner_training, args=(rref,)) and not rm.training
    x = fw.randn(16, 8)
    assert close(rm(x), rm(x))  # dropout is off on the owner
    assert rm.train() is rm and rpc.rpc_sync("worker2", owner_training, args=(rref,))
    assert rm.train(False) is rm and not rm.training
    rm.training = True
    assert rpc.rpc_sync("worker2", owner_training, args=(rref,))
    with pytest.raises(ValueError, match="boolean"):
        rm.train("yes")  # type: ignore[arg-type]


def test_remote_parameters_are_rrefs_to_the_remote_parameters(fw: ModuleType) -> None:
    rm = RemoteModule("worker1/cpu", classes(fw)["Stage"], args=(3, 2))
    rrefs = rm.remote_parameters()
    assert len(rrefs) == 2 and all(isinstance(r, rpc.RRef) and r.owner_name() == "worker1" for r in rrefs)
    _, _, owner_params = rpc.rpc_sync("worker1", owner_state, args=(rm.get_module_rref(),))
    assert [r.to_here().detach().reshape(-1).tolist() for r in rrefs] == owner_params
    assert rm.remote_parameters(recurse=False) == []  # Stage's parameters all live in submodules


def test_get_module_rref_points_at_the_module(fw: ModuleType) -> None:
    rm = RemoteModule("worker3/cpu", fw.nn.Linear, args=(2, 5))
    rref = rm.get_module_rref()
    assert isinstance(rref, rpc.RRef) and rref.owner_name() == "worker3"
    assert rpc.rpc_sync("worker3", owner_state, args=(rref,))[:2] == ("worker3", "Linear")


def test_state_dict_counterparts(fw: ModuleType) -> None:
    rm = RemoteModule("worker1/cpu", fw.nn.Linear, args=(3, 2))
    state = rm.remote_state_dict()
    assert set(state) == {"weight", "bias"}
    zeros = {"weight": fw.zeros(2, 3), "bias": fw.ones(2)}
    rm.remote_load_state_dict(zeros)
    assert close(rm(fw.randn(4, 3)), fw.ones(4, 2))
    with pytest.raises(RuntimeError):
        rm.remote_load_state_dict({"weight": fw.zeros(2, 3)})  # strict: bias is missing
    result = rm.remote_load_state_dict({"weight": fw.zeros(2, 3)}, strict=False)
    assert list(result.missing_keys) == ["bias"]


def test_remote_to_cpu_and_to_a_missing_gpu(fw: ModuleType) -> None:
    rm = RemoteModule("worker1/cpu", fw.nn.Linear, args=(2, 2))
    assert rm.remote_to("cpu") is rm and rm.device == "cpu"
    with pytest.raises(ValueError, match="malformed"):
        rm.remote_to("tpu")
    if not fw.cuda.is_available():
        with pytest.raises(RemoteDeviceError, match="worker1"):
            rm.remote_to("cuda:0")


_watched: dict[int, weakref.ref[Any]] = {}  # on the owner: modules a test watches die


def watch_module(module_rref: rpc.RRef[Any]) -> int:
    module = module_rref.local_value()
    _watched[id(module)] = weakref.ref(module)
    return id(module)


def module_alive(key: int) -> bool:
    gc.collect()
    return _watched[key]() is not None


def test_dropping_the_handles_frees_the_remote_module(fw: ModuleType) -> None:
    rm = RemoteModule("worker3/cpu", fw.nn.Linear, args=(2, 2), module_interface_cls=Iface)
    twin = RemoteModule.init_from_module_rref("worker3/cpu", rm.get_module_rref())
    key = rpc.rpc_sync("worker3", watch_module, args=(rm.get_module_rref(),))
    del rm
    gc.collect()  # the interface's bound methods make a cycle
    assert rpc.rpc_sync("worker3", module_alive, args=(key,))  # the twin still holds it
    del twin
    gc.collect()
    deadline = time.monotonic() + 20  # the release message is asynchronous
    while rpc.rpc_sync("worker3", module_alive, args=(key,)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rpc.rpc_sync("worker3", module_alive, args=(key,))


# -- methods that cannot be honoured remotely -----------------------------------------------------------

UNSUPPORTED = [
    "to",
    "cuda",
    "cpu",
    "half",
    "float",
    "double",
    "bfloat16",
    "type",
    "apply",
    "register_buffer",
    "register_parameter",
    "add_module",
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_backward_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
    "register_state_dict_pre_hook",
    "register_load_state_dict_post_hook",
    "state_dict",
    "load_state_dict",
    "named_parameters",
    "buffers",
    "named_buffers",
    "children",
    "named_children",
    "modules",
    "named_modules",
    "requires_grad_",
    "zero_grad",
    "share_memory",
    "extra_repr",
]


@pytest.fixture(scope="module", params=["torch", "tensorplay"])
def shared_rm(request: pytest.FixtureRequest, world: list[str]) -> RemoteModule:
    lib = importlib.import_module(request.param)
    return RemoteModule("worker1/cpu", lib.nn.Linear, args=(2, 2))


@pytest.mark.parametrize("method", UNSUPPORTED)
def test_unsupported_methods_raise_value_error_naming_the_method(shared_rm: RemoteModule, method: str) -> None:
    with pytest.raises(ValueError, match=rf"Method ``{method}`` not supported for RemoteModule.*worker1"):
        getattr(shared_rm, method)()


def test_parameters_points_to_remote_parameters(shared_rm: RemoteModule) -> None:
    with pytest.raises(ValueError, match=r"Please use ``remote_parameters`` instead.*remote_parameters\(\) gives"):
        shared_rm.parameters()  # type: ignore[attr-defined]


def test_state_dict_and_to_suggest_the_remote_counterparts(shared_rm: RemoteModule) -> None:
    with pytest.raises(ValueError, match=r"remote_state_dict\(\)"):
        shared_rm.state_dict()  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"remote_to\(device\)"):
        shared_rm.to("cpu")  # type: ignore[attr-defined]


# -- travelling -----------------------------------------------------------------------------------------


def test_plain_pickle_is_refused(shared_rm: RemoteModule) -> None:
    with pytest.raises(SerializationError, match="RemoteModule can only be pickled when using RPC"):
        pickle.dumps(shared_rm)
    with pytest.raises(TypeError):  # SerializationError is also a TypeError, as pickle's own errors are
        pickle.dumps([shared_rm])


def test_three_workers_module_on_worker1_handle_sent_to_worker2(fw: ModuleType) -> None:
    rm = RemoteModule("worker1/cpu", classes(fw)["Where"])
    x = fw.randn(3)
    here, is_handle, owner, (ran_on, y) = rpc.rpc_sync("worker2", call_forward_here, args=(rm, x))
    assert (here, is_handle, owner, ran_on) == ("worker2", True, "worker1", "worker1")
    assert close(y, x * 2)


def test_only_declared_attributes_travel_and_handles_come_back(fw: ModuleType) -> None:
    rm = RemoteModule("worker1/cpu", fw.nn.Linear, args=(2, 2), module_interface_cls=Iface)
    rm.__dict__["scratch"] = "stays here"
    assert rpc.rpc_sync("worker3", travelled_attributes, args=(rm,)) == [
        "device",
        "forward",
        "forward_async",
        "framework",
        "module_interface_cls",
        "module_rref",
        "module_type",
        "on",
    ]
    back = rpc.rpc_sync("worker2", give_back, args=(rm,))
    assert type(back) is type(rm) and back is not rm and "scratch" not in vars(back)
    assert inspect.signature(back.forward) == inspect.signature(rm.forward)
    x = fw.randn(1, 2)
    assert close(back(x), rm(x))


def test_a_worker_can_create_and_drive_a_remote_module(fw: ModuleType) -> None:
    x = fw.randn(2)
    owner, (ran_on, y) = rpc.rpc_sync("worker3", build_and_run_there, args=(fw.__name__, x))
    assert (owner, ran_on) == ("worker2", "worker2") and close(y, x * 2)


def test_init_from_module_rref_makes_a_second_handle(fw: ModuleType) -> None:
    rm = RemoteModule("worker1/cpu", classes(fw)["Stage"], args=(4, 4))
    twin = RemoteModule.init_from_module_rref("worker1/cpu", rm.get_module_rref())
    assert isinstance(twin, fw.nn.Module) and twin.get_module_rref() is rm.get_module_rref()
    twin.eval()
    assert not rm.training  # one module, two handles
    x = fw.randn(2, 4)
    assert close(twin(x), rm(x))
    by_rank = RemoteModule.init_from_module_rref("rank:1", rm.get_module_rref())
    assert close(by_rank(x), rm(x))
    on_worker2 = rpc.rpc_sync("worker2", second_handle_there, args=("worker1/cpu", rm.get_module_rref(), x))
    assert close(on_worker2, rm(x))
    elsewhere = RemoteModule.init_from_module_rref("worker2/cpu", rm.get_module_rref())  # as torch: the module
    assert elsewhere.on == "worker1" and close(elsewhere(x), rm(x))  # runs on its owner, whatever worker is named


# -- composition: a model split across kernels ----------------------------------------------------------


def _pipeline(fw: ModuleType) -> tuple[Any, Any]:
    """(split model: local layer -> worker1 stage -> worker2 stage, the same model run locally)."""
    nn, stage = fw.nn, classes(fw)["Stage"]

    class Split(nn.Module):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(6, 8)
            self.stage1 = RemoteModule("worker1/cpu", stage, args=(8, 8))
            self.stage2 = RemoteModule("worker2/cpu", stage, args=(8, 3))

        def forward(self, x: Any) -> Any:
            return self.stage2(self.stage1(self.head(x)))

    split = Split()
    local = nn.Sequential(nn.Linear(6, 8), stage(8, 8), stage(8, 3))
    local[0].load_state_dict(split.head.state_dict())
    local[1].load_state_dict(split.stage1.remote_state_dict())
    local[2].load_state_dict(split.stage2.remote_state_dict())
    return split, local


def test_two_stage_pipeline_matches_the_local_model(fw: ModuleType) -> None:
    split, local = _pipeline(fw)
    split.eval()  # reaches both workers through the parent's train(False)
    local.eval()
    assert not split.stage1.training and not split.stage2.training
    x = fw.randn(5, 6)
    assert close(split(x), local(x))


def test_local_parent_sees_the_handles_as_leaf_submodules(fw: ModuleType) -> None:
    split, _ = _pipeline(fw)
    assert [name for name, _ in split.named_children()] == ["head", "stage1", "stage2"]
    assert [name for name, _ in split.named_parameters()] == ["head.weight", "head.bias"]
    assert [name for name, _ in split.named_modules()] == ["", "head", "stage1", "stage2"]
    assert "(stage1): RemoteModule(" in repr(split) and "on worker1/cpu" in repr(split)
    with pytest.raises(ValueError, match="remote_state_dict"):
        split.state_dict()  # a checkpoint silently missing the remote weights would be worse
    split.zero_grad()  # walks the local parameters only
    assert split.train() is split and split.stage2.training
    with pytest.raises(ValueError, match="``apply``"):
        split.apply(lambda m: None)  # would need to run on the workers
    assert split.to("cpu") is split  # converts the local part; the remote parts stay where they are
    assert tuple(split(fw.randn(2, 6)).shape) == (2, 3)


# -- CUDA (skipped without a GPU) -----------------------------------------------------------------------


@NEEDS_CUDA
@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict"])
def test_cuda_inputs_moved_and_outputs_back_on_cpu(world: list[str], kind: str) -> None:
    rm = RemoteModule("worker1/cuda:0", MODULES["torch"]["Structured"])
    local = MODULES["torch"]["Structured"]()
    local.load_state_dict(rm.remote_state_dict())
    pair, extra = (torch.randn(2, 4), torch.randn(2, 4)), {"bias": [torch.randn(4)]}
    got, want = rm(pair, extra, kind=kind), local(pair, extra, kind=kind)
    flat_got = (
        [got]
        if kind == "tensor"
        else [got[0], got[1][0], got[1][1][0]]
        if kind == "tuple"
        else [got["y"], got["nested"]["twice"]]
    )
    flat_want = (
        [want]
        if kind == "tensor"
        else [want[0], want[1][0], want[1][1][0]]
        if kind == "tuple"
        else [want["y"], want["nested"]["twice"]]
    )
    for g, w in zip(flat_got, flat_want, strict=True):
        assert g.device.type == "cpu" and torch.allclose(g, w, atol=1e-5)


@NEEDS_CUDA
def test_cuda_module_lives_on_the_gpu_and_remote_to_moves_it(world: list[str]) -> None:
    rm = RemoteModule("worker2/cuda:0", torch.nn.Linear, args=(4, 4))
    assert rpc.rpc_sync("worker2", _param_device, args=(rm.get_module_rref(),)) == "cuda:0"
    assert rm.remote_to("cpu").device == "cpu"
    assert rpc.rpc_sync("worker2", _param_device, args=(rm.get_module_rref(),)) == "cpu"
    assert rm(torch.randn(1, 4)).device.type == "cpu"
    with pytest.raises(RemoteDeviceError, match="worker2"):
        rm.remote_to(f"cuda:{torch.cuda.device_count()}")


def _param_device(module_rref: rpc.RRef[Any]) -> str:
    return str(next(module_rref.local_value().parameters()).device)
