"""``interface``: give a RemoteModule the exact ``forward`` signature of a class.

Without an interface a RemoteModule's ``forward`` / ``forward_async`` take ``(*args, **kwargs)`` and any
mistake surfaces on the worker. A class marked with :func:`interface` (usually the module class itself,
or a protocol-like class that only declares ``forward``) makes the RemoteModule expose that signature
exactly: ``inspect.signature(rm.forward)`` shows it, IDEs and debuggers see it, and a wrong call fails
*locally* with the ``TypeError`` Python would give, before anything is sent.

The methods are closures over an :class:`inspect.Signature` (``Signature.bind`` checks the call and
splits it back into positional and keyword arguments), not source text generated from a template as in
torch and the tensorplay seed. They delegate to ``self._forward_sync`` / ``self._forward_async``, so this
module knows nothing of RPC.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeGuard, TypeVar

__all__ = ["build_forward_methods", "interface", "interface_of", "interface_signature", "is_interface"]

_T = TypeVar("_T", bound=type)

_MARKER = "__nbremote_interface__"
# Classes marked by the tensorplay seed's own ``interface`` decorator are honoured too.
_SEED_MARKER = "__tensorplay_interface__"


def interface(cls: _T) -> _T:
    """Mark ``cls`` so that a RemoteModule built from it exposes its ``forward`` signature exactly.

    Use it on the module class (``RemoteModule("w/cpu", MyNet)`` then picks it up) or on a separate
    class passed as ``RemoteModule(..., module_interface_cls=Iface)``. ``forward`` must be defined and
    take ``self`` first; this is checked here so a bad interface fails where it is declared.
    """
    if not isinstance(cls, type):
        raise TypeError(f"interface() decorates a class, got {type(cls).__name__}")
    interface_signature(cls, _check_marker=False)
    setattr(cls, _MARKER, True)
    return cls


def is_interface(cls: object) -> TypeGuard[type]:
    """True if ``cls`` was marked with :func:`interface` (or the tensorplay seed's equivalent)."""
    return isinstance(cls, type) and bool(getattr(cls, _MARKER, False) or getattr(cls, _SEED_MARKER, False))


def interface_of(given: type | None, torch_spelling: type | None = None,
                 module_cls: object = None) -> tuple[type | None, inspect.Signature | None]:
    """A RemoteModule's interface and its signature: ``module_interface_cls`` given as such or by torch's name for
    it (``_module_interface_cls``, the keyword of torch's ``_RemoteModule`` and ``init_from_module_rref``), not
    both; else ``module_cls`` where it is marked; else none."""
    if torch_spelling is not None:
        if given is not None and given is not torch_spelling:
            raise TypeError("give the module's interface once: module_interface_cls= or _module_interface_cls= "
                            "(torch's spelling of the same argument), not both")
        given = torch_spelling
    if given is None and is_interface(module_cls):
        given = module_cls
    return given, None if given is None else interface_signature(given)


def interface_signature(cls: type, *, _check_marker: bool = True) -> inspect.Signature:
    """The signature of ``cls.forward``, ``self`` included."""
    if _check_marker and not is_interface(cls):
        raise TypeError(f"{cls.__qualname__} is not marked as an interface; decorate it with @nbremote.nn.interface")
    forward = inspect.getattr_static(cls, "forward", None)
    if forward is None or not callable(forward):
        raise TypeError(f"interface {cls.__qualname__} must define a forward method")
    signature = inspect.signature(forward)
    parameters = list(signature.parameters.values())
    if not parameters or parameters[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        raise TypeError(f"{cls.__qualname__}.forward must take self as its first parameter")
    return signature


def _future_of(annotation: Any) -> Any:
    if annotation is inspect.Signature.empty:
        return "Future"
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return f"Future[{text}]"


ForwardMethod = Callable[..., Any]


def build_forward_methods(signature: inspect.Signature) -> tuple[ForwardMethod, ForwardMethod]:
    """``(forward, forward_async)`` functions (self first) that check calls against ``signature``."""

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)  # a wrong call raises TypeError here, locally
        return self._forward_sync(bound.args[1:], bound.kwargs)

    def forward_async(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        return self._forward_async(bound.args[1:], bound.kwargs)

    forward.__signature__ = signature  # type: ignore[attr-defined]  # read by inspect.signature
    forward_async.__signature__ = signature.replace(  # type: ignore[attr-defined]
        return_annotation=_future_of(signature.return_annotation)
    )
    return forward, forward_async
