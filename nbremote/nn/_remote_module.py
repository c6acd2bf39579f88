"""``RemoteModule``: a Module living in a worker kernel, driven from the notebook like a local one.

Semantics follow ``torch.distributed.nn.RemoteModule``: the constructor builds ``module_cls(*args,
**kwargs)`` on the worker named by ``remote_device`` and keeps an RRef to it; ``forward`` /
``forward_async`` / ``__call__`` run it there through ``nbremote.rpc``; ``remote_parameters`` gives
parameter RRefs for a distributed optimizer; ``train`` / ``eval`` / ``training`` act on the remote
module. Methods of ``nn.Module`` that would need the module here raise ``ValueError``; the useful ones
have explicit remote counterparts (``remote_state_dict``, ``remote_load_state_dict``, ``remote_to``).

Design decisions:

* **One handle class, one framework base mixed in lazily.** A local model must be able to hold
  RemoteModules as submodules, in torch *and* tensorplay. ``RemoteModule.__new__`` looks at
  ``module_cls``'s MRO (by name, no import) and returns an instance of a cached subclass
  ``RemoteModule[torch]`` = ``(RemoteModule, torch.nn.Module)`` or ``RemoteModule[tensorplay]``. So
  ``isinstance(rm, RemoteModule)`` always holds, ``isinstance(rm, torch.nn.Module)`` holds for torch
  modules, a parent's ``__setattr__`` registers it, ``parent.train()`` reaches the worker, and
  ``import nbremote.nn`` imports no framework. A ``module_cls`` that is a factory function rather
  than a class gives a plain RemoteModule (usable as an attribute, not registered as a submodule).
* **Composition rules for a local parent.** The handle holds no local tensors. When a parent walks its
  tree (``parent.parameters()``, ``parent.modules()``), the handle is a leaf with no parameters; called
  directly, ``rm.named_modules()`` raises like the other unsupported methods. ``parent.to()`` /
  ``.cuda()`` / ``.double()`` leave the remote part where it is (use ``remote_to``), and
  ``parent.state_dict()`` raises, since silently leaving remote weights out of a checkpoint would be
  worse than an error.
* **Methods are closures, not generated source.** ``forward`` / ``forward_async`` come from
  :mod:`._interface`; with an interface they carry its exact signature.
* **Travelling.** Passed in an RPC, a handle carries only ``_PICKLED_ATTRIBUTES`` (the module itself
  stays where it is; the RRef forks) and is rebuilt by :func:`_rebuild_remote_module`, methods
  included. Plain ``pickle`` refuses it with :class:`SerializationError`, because a handle outside
  nbremote's RPC would be a dangling reference (so ``copy.deepcopy`` of a model holding one fails
  too). RPC pickling is recognised by :func:`nbremote.rpc.is_rpc_pickling`.
* **No device maps.** Outputs of a CUDA-placed module always come back to CPU (torch only did that
  without a device map, and only for tuples); inputs on CPU always go to the device.
* **Seeing, reloading, keeping it.** ``remote_summary()``: class, mode, placement, a row per parameter in
  one call (``_inspect``), rendered by ``_repr_html_`` and the ``nbremote.jupyter`` panel; history and
  metrics come from ``Watched``, snapshots from ``_recovery.SnapshotMethods``. A handle remembers
  ``module_cls``, args and kwargs: ``reload()`` rebuilds the module from the class's *current* definition
  (re-running the cell that defines it is enough), weights carried across, switching once it exists.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from nbremote import rpc
from nbremote.errors import SerializationError
from nbremote.nn import _inspect, _owner, _recovery, _reload
from nbremote.nn._device import parse_remote_device
from nbremote.nn._frameworks import framework_of_class, grad_enabled, module_base
from nbremote.nn._interface import build_forward_methods, interface_of, interface_signature
from nbremote.nn._meter import ForwardMeter, ForwardStats
from nbremote.nn._summary import ModuleSummary, to_html
from nbremote.nn._unsupported import UNSUPPORTED, unsupported
from nbremote.nn._watched import Watched
from nbremote.rpc._core import introspection

__all__ = ["RemoteModule"]

_R = TypeVar("_R", bound="RemoteModule")

# The attributes that travel when a handle is sent to another worker; everything else a handle holds
# (the framework Module's bookkeeping, the bound forward methods) is rebuilt on arrival.
_PICKLED_ATTRIBUTES = ("on", "device", "framework", "module_type", "module_interface_cls", "module_rref")


# (handle class, framework) -> its variant. A cache that must be one per process: every handle of a
# framework has to share one class, or type checks and ``type(a) is type(b)`` would differ between them.
_variants: dict[tuple[type, str], type] = {}
_variants_lock = threading.Lock()


def _framework_class(cls: type[_R], framework: str | None) -> type[_R]:
    """``cls`` with ``framework``'s ``nn.Module`` mixed in (``cls`` itself for ``None``)."""
    cls = _handle_class(cls)
    if framework is None:
        return cls
    with _variants_lock:
        variant = _variants.get((cls, framework))
        if variant is None:
            base = module_base(framework)
            namespace = {"__module__": cls.__module__, "__qualname__": f"{cls.__qualname__}[{framework}]",
                         "_nbremote_handle_class": cls}
            variant = _variants[cls, framework] = (
                cls if issubclass(cls, base) else type(cls.__name__, (cls, base), namespace)
            )
    return variant


class RemoteModule(_recovery.SnapshotMethods, Watched):
    """A handle to ``module_cls(*args, **kwargs)`` built on, and run by, another worker.

    Args:
        remote_device: ``"<worker>/<device>"``, ``"<worker>"`` (cpu), ``"rank:<N>/<device>"``; devices
            are ``cpu``, ``cuda``, ``cuda:<index>``.
        module_cls: a ``torch.nn.Module`` or ``tensorplay.nn.Module`` subclass (classes defined in the
            notebook travel by value), or any callable returning such a module.
        args, kwargs: constructor arguments.
        module_interface_cls: a class marked with :func:`~nbremote.nn.interface` whose ``forward``
            signature ``forward`` / ``forward_async`` expose; by default ``module_cls`` itself when it
            is marked, else ``(*args, **kwargs)``. Torch's keyword ``_module_interface_cls`` is a synonym.
        snapshot_every, snapshot_to: keep snapshots (``keep_snapshots``): after every N-th optimizer step,
            in the driver's memory (default), a directory or an fsspec URL; ``rpc.restart_worker`` restores
            the module from the latest in place.
    """

    # Declared for type checkers; instances set them in _attach.
    on: str
    device: str
    framework: str
    module_type: str
    module_interface_cls: type | None
    module_rref: rpc.RRef[Any]

    def __new__(
        cls,
        remote_device: str,
        module_cls: Callable[..., Any],
        args: tuple[Any, ...] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        module_interface_cls: type | None = None,
        snapshot_every: int | None = None,
        snapshot_to: Any = None,
        _module_interface_cls: type | None = None,
    ) -> RemoteModule:
        del remote_device, args, kwargs, module_interface_cls, snapshot_every, snapshot_to, _module_interface_cls
        return object.__new__(_framework_class(cls, framework_of_class(module_cls)))

    def __init__(
        self,
        remote_device: str,
        module_cls: Callable[..., Any],
        args: tuple[Any, ...] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        module_interface_cls: type | None = None,
        snapshot_every: int | None = None,
        snapshot_to: Any = None,
        _module_interface_cls: type | None = None,
    ) -> None:
        place = parse_remote_device(remote_device)
        if not callable(module_cls):
            raise TypeError(f"module_cls must be a Module class (or a callable), got {type(module_cls).__name__}")
        # Check the interface before anything is built remotely: a bad one is a local mistake.
        module_interface_cls, signature = interface_of(module_interface_cls, _module_interface_cls, module_cls)
        module_rref, info = rpc.rpc_sync(
            place.worker,
            _owner.create_module,
            args=(module_cls, tuple(args or ()), dict(kwargs or {}), place, framework_of_class(module_cls)),
        )
        self._attach(module_rref, info, module_interface_cls, signature)
        self.__dict__["_nbremote_built_from"] = (module_cls, tuple(args or ()), dict(kwargs or {}))
        _recovery.track(self, snapshot_every, snapshot_to)  # snapshots, if asked; named if its worker is lost

    def _attach(
        self,
        module_rref: rpc.RRef[Any],
        info: _owner.ModuleInfo,
        module_interface_cls: type | None,
        signature: inspect.Signature | None,
    ) -> None:
        """Initialise the handle: the framework Module's state, the declared attributes, the methods."""
        super().__init__()  # the framework Module's __init__ (object's for a plain RemoteModule)
        state = self.__dict__  # direct writes: no framework __setattr__ bookkeeping for plain values
        state["on"] = module_rref.owner_name()
        state["device"] = info.device
        state["framework"] = info.framework
        state["module_type"] = info.type_name
        state["module_interface_cls"] = module_interface_cls
        state["module_rref"] = module_rref
        state["_nbremote_meter"] = ForwardMeter()
        if signature is not None:
            forward, forward_async = build_forward_methods(signature)
            state["forward"] = forward.__get__(self)
            state["forward_async"] = forward_async.__get__(self)

    # -- running the module ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the remote module's forward on ``args`` / ``kwargs`` and wait for the result."""
        return self._forward_sync(args, kwargs)

    def forward_async(self, *args: Any, **kwargs: Any) -> rpc.Future[Any]:
        """Start the remote forward; returns a Future of its result."""
        return self._forward_async(args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def remote_forward(self, *args: Any, **kwargs: Any) -> rpc.RRef[Any]:
        """Run the remote forward and keep its output where it is computed: an RRef to it, at once.

        For pipelines: hand it to the next stage's ``forward`` / ``forward_async`` / ``remote_forward``; that
        stage's worker fetches the activation from this one directly, not through the caller, and under
        ``dist_autograd`` its gradient goes back the same way. Arguments that are RRefs are fetched alike.
        An error of the forward surfaces where the RRef is first used.
        """
        self.__dict__["_nbremote_meter"].started()
        return rpc.remote(self.on, _owner.forward, args=(self.module_rref._id, args, kwargs, self.device,
                                                         grad_enabled(self.framework)))

    def _forward_sync(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        meter: ForwardMeter = self.__dict__["_nbremote_meter"]
        meter.started()
        start = time.perf_counter()
        result = rpc.rpc_sync(self.on, _owner.forward, args=(self.module_rref._id, args, kwargs, self.device,
                                                             grad_enabled(self.framework)))
        meter.finished(time.perf_counter() - start)
        return result

    def _forward_async(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> rpc.Future[Any]:
        meter: ForwardMeter = self.__dict__["_nbremote_meter"]
        meter.started()
        start = time.perf_counter()
        rref = self.module_rref  # held by the callback until the call is done: the owner gets only its id
        fut = rpc.rpc_async(self.on, _owner.forward,
                            args=(rref._id, args, kwargs, self.device, grad_enabled(self.framework)))
        fut.add_done_callback(lambda _: meter.finished(time.perf_counter() - start) if rref else None)
        return fut

    @property
    def forward_stats(self) -> ForwardStats:
        """How many forwards this handle made, and the last one's latency in seconds (None before any)."""
        meter: ForwardMeter = self.__dict__["_nbremote_meter"]
        return meter.snapshot()

    # -- what torch's RemoteModule offers ------------------------------------------------------------------
    def remote_parameters(self, recurse: bool = True) -> list[rpc.RRef[Any]]:
        """RRefs to the remote module's parameters (e.g. for a DistributedOptimizer)."""
        result: list[rpc.RRef[Any]] = rpc.rpc_sync(
            self.on, _owner.parameter_rrefs, args=(self.module_rref, bool(recurse))
        )
        _recovery.note_parameters(self, result)  # restored under the same ids with the module
        return result

    def get_module_rref(self) -> rpc.RRef[Any]:
        """The RRef to the remote module itself."""
        return self.module_rref

    def train(self: _R, mode: bool = True) -> _R:
        """Set the remote module's training mode; returns this handle."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        rpc.rpc_sync(self.on, _owner.set_training, args=(self.module_rref, mode))
        return self

    def eval(self: _R) -> _R:
        """``train(False)``."""
        return self.train(False)

    @property
    def training(self) -> bool:
        """The remote module's training flag, read from the worker."""
        result: bool = rpc.rpc_sync(self.on, _owner.get_training, args=(self.module_rref,))
        return result

    @training.setter
    def training(self, mode: bool) -> None:
        # The framework Module's __init__ sets ``training = True`` before the handle is attached;
        # the remote module has its own flag, so that write is ignored. Later writes reach the worker.
        if "module_rref" in self.__dict__:
            self.train(mode)

    # -- explicit remote counterparts of unsupported methods --------------------------------------------
    def remote_state_dict(self) -> dict[str, Any]:
        """A CPU copy of the remote module's ``state_dict()``."""
        result: dict[str, Any] = rpc.rpc_sync(self.on, _owner.get_state_dict, args=(self.module_rref,))
        return result

    def remote_load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """``load_state_dict`` on the remote module; returns its (missing_keys, unexpected_keys)."""
        return rpc.rpc_sync(self.on, _owner.load_state_dict, args=(self.module_rref, dict(state_dict), strict))

    def remote_to(self: _R, device: str) -> _R:
        """Move the remote module to another device of its worker (``"cpu"``, ``"cuda:1"``, ...)."""
        place = parse_remote_device(f"{self.on}/{device}")
        self.__dict__["device"] = rpc.rpc_sync(self.on, _owner.move_module, args=(self.module_rref, place))
        return self

    def remote_summary(self, *, history: bool = False, lease: float | None = None, reader: str = "") -> ModuleSummary:
        """The remote module's class, mode, device and parameters (shape, dtype, norms...), in one call;
        with ``history=True`` its :class:`~nbremote.history.ModuleHistory` too (``lease``: see
        :meth:`remote_history`)."""
        with introspection():  # looking at the module is not a call a status display should count
            summary: ModuleSummary = rpc.rpc_sync(self.on, _inspect.summarize,
                                                  args=(self.module_rref, self.device, history, lease, reader))
        self.__dict__["device"] = summary.device  # another handle may have moved it
        return summary

    def reload(
        self,
        module_cls: Callable[..., Any] | None = None,
        args: tuple[Any, ...] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        strict: bool = False,
    ) -> _reload.ReloadReport:
        """Rebuild the remote module from a (new) class on the same worker and device, keeping its weights.

        By default the class is the current definition of the one this handle was built from (re-run
        the cell that defines it, then ``net.reload()``) with the same constructor arguments; pass
        ``module_cls`` / ``args`` / ``kwargs`` to change them. Every ``state_dict`` entry whose name and
        shape match is copied, and the training mode is kept; the returned report names what did not
        carry over (``strict=True`` refuses such a reload). If building the new module fails, the error
        is raised and this handle keeps the old module, unchanged. Other handles to the old module
        (copies sent to workers, ``init_from_module_rref``) keep pointing at the old one.
        """
        built_from = self.__dict__.get("_nbremote_built_from")
        if built_from is None:
            if module_cls is None or args is None:
                raise ValueError(
                    f"this handle to {self.module_type} on {self.on!r} was not built by RemoteModule(...), so it "
                    "does not know the constructor; pass module_cls= and args= (and kwargs=) to reload")
            built_from = (module_cls, (), {})
        old_cls, old_args, old_kwargs = built_from
        new_cls = module_cls if module_cls is not None else _reload.current_definition(old_cls)
        new_args = tuple(old_args if args is None else args)
        new_kwargs = dict(old_kwargs if kwargs is None else kwargs)
        if framework_of_class(new_cls) not in (None, self.framework):
            raise TypeError(f"cannot reload {self.module_type} (a {self.framework} module) from {new_cls!r}, "
                            f"a {framework_of_class(new_cls)} class: a handle keeps its framework")
        try:
            module_rref, info, report = rpc.rpc_sync(
                self.on, _reload.rebuild, args=(self.module_rref, new_cls, new_args, new_kwargs, self.device, strict))
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"(reloading {self.module_type} on {self.on!r} failed; the old module is still in "
                             "place and this handle still uses it)")
            raise
        if info.framework != self.framework:  # a factory built another framework's module: drop it
            raise TypeError(f"cannot reload {self.module_type} (a {self.framework} module) as {info.type_name}, "
                            f"a {info.framework} module: a handle keeps its framework; the old module is kept")
        state = self.__dict__
        state["module_rref"] = module_rref
        state["module_type"] = info.type_name
        state["device"] = info.device
        state["_nbremote_built_from"] = (new_cls, new_args, new_kwargs)
        return report

    @property
    def remote_device(self) -> str:
        """``"<worker>/<device>"`` of the remote module as this handle last knew it."""
        return f"{self.on}/{self.device}"

    # -- a second handle -----------------------------------------------------------------------------------
    @classmethod
    def init_from_module_rref(
        cls: type[_R],
        remote_device: str,
        module_rref: rpc.RRef[Any],
        module_interface_cls: type | None = None,
        _module_interface_cls: type | None = None,
    ) -> _R:
        """A new handle to the module ``module_rref`` points at (no copy of the module is made).

        The module runs where it lives, on the RRef's owner, whatever worker ``remote_device`` names (as in
        torch, where only its device part is used): a handle made on worker2 from an RRef that worker1 owns
        runs worker1's module.
        """
        place = parse_remote_device(remote_device)
        owner = module_rref.owner()
        module_interface_cls, signature = interface_of(module_interface_cls, _module_interface_cls)
        info: _owner.ModuleInfo = rpc.rpc_sync(owner.name, _owner.describe_module, args=(module_rref, place.device))
        handle = object.__new__(_framework_class(cls, info.framework))
        handle._attach(module_rref, info, module_interface_cls, signature)
        return handle

    # -- travelling ------------------------------------------------------------------------------------------
    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        if not rpc.is_rpc_pickling():
            raise SerializationError(
                "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC "
                f"(nbremote's, as an argument or result of a call; this one's module is on worker "
                f"{self.__dict__.get('on', '?')!r}); to keep the module, fetch remote_state_dict(), or pass "
                "get_module_rref() and use RemoteModule.init_from_module_rref"
            )
        attributes = tuple(self.__dict__[name] for name in _PICKLED_ATTRIBUTES)
        return (_rebuild_remote_module, (_handle_class(type(self)), *attributes))

    def __repr__(self) -> str:
        get = self.__dict__.get  # a half-built handle (failed __init__) must still have a repr
        return f"RemoteModule({get('module_type', '?')} on {get('on', '?')}/{get('device', '?')})"

    def _repr_html_(self) -> str:
        """The module's summary as an HTML table (for notebooks; a dead worker gives a one-line note)."""
        try:
            return to_html(self.remote_summary())
        except Exception as exc:  # a repr must never raise
            import html

            return f"<pre>{html.escape(repr(self))}: cannot read the remote module ({html.escape(str(exc))})</pre>"

    # -- composing into a local model --------------------------------------------------------------------
    def named_modules(
        self, memo: set[Any] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Any]]:
        """Raises when called directly; as part of a local parent's walk the handle is a leaf."""
        # Not a generator itself, so that the direct call raises at once rather than when iterated.
        if memo is None:
            unsupported("named_modules")(self)
        return _leaf(self, memo if memo is not None else set(), prefix, remove_duplicate)

    def _apply(self: _R, fn: Callable[..., Any], recurse: bool = True) -> _R:
        # A parent's .to() / .cuda() / .double() reach here: the handle has no local tensors to convert
        # and the remote module stays where it was placed (remote_to moves it explicitly).
        del fn, recurse
        return self


def _leaf(handle: RemoteModule, memo: set[Any], prefix: str, remove_duplicate: bool) -> Iterator[tuple[str, Any]]:
    if handle not in memo:
        if remove_duplicate:
            memo.add(handle)
        yield prefix, handle


def _handle_class(cls: type[_R]) -> type[_R]:
    """The class a framework variant was made from (the class itself if it is not a variant)."""
    made_from: type[_R] = cls.__dict__.get("_nbremote_handle_class", cls)
    return made_from


# Installed after the class body so that names like ``type`` and ``float`` do not shadow the builtins
# inside it (annotations in the body would otherwise resolve to the refusing methods).
for _name, _hint in UNSUPPORTED.items():
    setattr(RemoteModule, _name, unsupported(_name, _hint))
del _name, _hint


def _rebuild_remote_module(
    cls: type[RemoteModule],
    on: str,
    device: str,
    framework: str,
    module_type: str,
    module_interface_cls: type | None,
    module_rref: rpc.RRef[Any],
) -> RemoteModule:
    """Rebuild a handle that arrived in an RPC message (runs in the receiving process)."""
    del on  # the RRef knows its owner
    signature = None if module_interface_cls is None else interface_signature(module_interface_cls)
    handle = object.__new__(_framework_class(cls, framework))
    handle._attach(module_rref, _owner.ModuleInfo(framework, module_type, device), module_interface_cls, signature)
    return handle
