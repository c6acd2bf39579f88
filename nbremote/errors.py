"""Every error nbremote raises, in one tree.

::

    NbRemoteError
    ├── NotInitializedError         the API was used before init_rpc / after shutdown
    ├── WorkerError                 something is wrong with one worker (``.worker`` names it)
    │   ├── WorkerStartError        a kernel could not be started, attached or bootstrapped
    │   │   └── ServerError         a Jupyter server could not be reached or refused (URL, token, kernel name/id)
    │   ├── WorkerLostError         a worker died or was removed while calls were pending
    │   ├── RemoteDeviceError       a device the worker does not have, e.g. cuda:0 (also ValueError)
    │   ├── RemoteCellError         a ``%%remote`` / ``rpc.run_cell`` cell failed on a worker
    │   └── UnknownWorkerError      a name / rank / WorkerInfo that is not in the world (also KeyError)
    ├── RPCTimeoutError             a call ran past its timeout (also TimeoutError)
    ├── SerializationError          arguments or results could not be pickled / unpickled
    ├── ReloadMismatchError         ``RemoteModule.reload(strict=True)`` would lose keys (also ValueError)
    ├── RRefError                   misuse of an RRef (e.g. ``local_value()`` on a non-owner)
    │   └── RRefLostError           the RRef's owner kernel was replaced (restarted): its value is gone (``.worker``)
    ├── SnapshotError               a snapshot that does not fit the module (class, keys, shapes; also ValueError)
    ├── AutogradError               misuse of distributed autograd (unknown context, bad roots; also RuntimeError)
    ├── CallCancelledError          the call was cancelled (KeyboardInterrupt while waiting on it)
    └── ProtocolError               a malformed message from a peer

Exceptions raised by *user code* on a worker are not wrapped: they are re-raised on the caller
with their own type and message, and a :class:`RemoteTraceback` carrying the remote traceback
text is attached as ``__cause__`` (so a notebook shows both tracebacks).

The contract with code written for ``torch.distributed``, which catches ``RuntimeError``:

* every error nbremote raises is a ``RuntimeError`` (``NbRemoteError`` is one), as torch's RPC errors
  are; those with a plain Python meaning are that too -- an unknown worker a ``KeyError``, a timeout a
  ``TimeoutError``, a payload that cannot be pickled a ``TypeError`` -- so both ``except RuntimeError``
  (torch's) and ``except KeyError`` work;
* where torch turns a *user's* exception into a ``RuntimeError`` -- one raised by a ``then`` callback, or
  while a distributed backward pass computes gradients ("Error on Node 2: ...") -- nbremote keeps the
  exception, with its type, and makes it a ``RuntimeError`` too (:func:`also_runtime_error`): ``except
  ValueError`` and ``except RuntimeError`` both catch it, also after it crossed to another process.

torch's functions that do not raise ``RuntimeError`` keep their own types here as well: a rank that is
no int (``ValueError``), arguments of the wrong type (``TypeError``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AutogradError",
    "CallCancelledError",
    "NbRemoteError",
    "NotInitializedError",
    "ProtocolError",
    "RPCTimeoutError",
    "RRefError",
    "RRefLostError",
    "ReloadMismatchError",
    "RemoteCellError",
    "RemoteDeviceError",
    "RemoteError",
    "RemoteTraceback",
    "SerializationError",
    "ServerError",
    "SnapshotError",
    "UnknownWorkerError",
    "WorkerError",
    "WorkerLostError",
    "WorkerStartError",
    "also_runtime_error",
]


class NbRemoteError(RuntimeError):
    """Base class of every error nbremote itself raises (a ``RuntimeError``, as torch's RPC errors are)."""


class NotInitializedError(NbRemoteError, RuntimeError):
    """The RPC world is not running (never started, or already shut down)."""


class WorkerError(NbRemoteError):
    """An error about one worker; ``worker`` is its name."""

    def __init__(self, message: str, worker: str | None = None) -> None:
        super().__init__(message)
        self.worker = worker

    def __reduce__(self) -> tuple[Any, ...]:  # keep ``worker`` when the error crosses to another process
        return (type(self), (*self.args, self.worker))


class WorkerStartError(WorkerError):
    """A worker kernel could not be started, attached to, or bootstrapped."""


class ServerError(WorkerStartError):
    """A Jupyter server (Jupyter Server, Kernel Gateway, Enterprise Gateway) hosting a worker could not be
    reached or refused a request; the message names the fix (URL, token, kernel name or id). ``url`` is
    the server's, ``status`` the HTTP status when there was one."""

    def __init__(self, message: str, worker: str | None = None, *, url: str | None = None,
                 status: int | None = None) -> None:
        super().__init__(message, worker)
        self.url = url
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:
        return (_server_error, (self.args[0] if self.args else "", self.worker, self.url, self.status))


def _server_error(message: str, worker: str | None, url: str | None, status: int | None) -> ServerError:
    return ServerError(message, worker, url=url, status=status)


class WorkerLostError(WorkerError):
    """The worker died (or was removed) while a call to it was pending."""


class RemoteDeviceError(WorkerError, ValueError):
    """The requested device does not exist on the worker (e.g. ``cuda:0`` where CUDA is unavailable).

    Raised on the worker *before* a module is constructed there, and re-raised on the caller with this
    type; ``worker`` names the worker. Also a ``ValueError``: the ``remote_device`` argument is wrong.
    """


class RemoteCellError(WorkerError):
    """A cell failed on one or more workers; their tracebacks were shown with the cell's output.

    ``outcomes`` maps each worker of the run to its ``rpc.CellOutcome``.
    """

    def __init__(self, outcomes: dict[str, Any]) -> None:
        failed = [o for o in outcomes.values() if o.status in ("error", "lost", "aborted")]
        super().__init__(
            f"the cell failed on {', '.join(o.summary() for o in failed)} (see the output above)",
            failed[0].worker if failed else None)
        self.outcomes = outcomes

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.outcomes,))

    def _render_traceback_(self) -> list[str]:
        # IPython: the remote tracebacks are already in the cell's output; one line says it failed.
        return [f"{type(self).__name__}: {self}"]


class UnknownWorkerError(WorkerError, KeyError):
    """A destination that is not a member of the world."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class RPCTimeoutError(NbRemoteError, TimeoutError):
    """A call ran for longer than its timeout (message says "RPC ran for more than N ms")."""


class SerializationError(NbRemoteError, TypeError):
    """An argument or result could not be serialized or deserialized."""


class ReloadMismatchError(NbRemoteError, ValueError):
    """``RemoteModule.reload(strict=True)`` found keys that would not carry over; the old module was kept."""


class RRefError(NbRemoteError, RuntimeError):
    """An RRef was used in a way its location does not allow."""


class RRefLostError(RRefError, WorkerError):
    """The RRef names a value of an earlier kernel of its owner: that kernel died or was replaced
    (``rpc.restart_worker``), and the value went with it. Raised at once, by the new kernel, rather than
    waiting for a creation that will never come; ``worker`` names the owner."""


class SnapshotError(NbRemoteError, ValueError):
    """A snapshot that does not fit (another class, missing or unexpected keys, other shapes), or that
    cannot be found or read; the message names the keys. The module keeps its weights."""


class AutogradError(NbRemoteError, RuntimeError):
    """Distributed autograd was used in a way it cannot work (a RuntimeError, as in torch)."""


class CallCancelledError(NbRemoteError):
    """The call was cancelled because the thread waiting on it was interrupted."""


class ProtocolError(NbRemoteError):
    """A peer sent a message nbremote cannot understand."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a worker, attached as ``__cause__``."""

    def __init__(self, worker: str, text: str) -> None:
        super().__init__(worker, text)
        self.worker = worker
        self.text = text

    def __str__(self) -> str:
        return f"\n\nTraceback on worker {self.worker!r}:\n{self.text}"


class RemoteError(NbRemoteError):
    """Stands in for a remote exception whose type could not be rebuilt on the caller."""

    def __init__(self, worker: str, type_name: str, message: str) -> None:
        super().__init__(f"{type_name} on worker {worker!r}: {message} (Original exception on remote side was a "
                         f"{type_name}, which could not be rebuilt here; its traceback is attached as the cause)")
        self.worker = worker
        self.type_name = type_name
        self.remote_message = message

    def __reduce__(self) -> tuple[Any, ...]:  # re-raised by a nested call: it crosses again
        return (type(self), (self.worker, self.type_name, self.remote_message))


# -- user exceptions that torch would have made RuntimeErrors ---------------------------------------------------

_CONTEXT = "_nbremote_context"  # where a mixed exception keeps its message prefix (in its __dict__: it travels)
_mixed: dict[type, type] = {}


def also_runtime_error(exc: BaseException, context: str = "") -> BaseException:
    """``exc``, made a ``RuntimeError`` as well, its message prefixed with ``context`` (once).

    The result is an instance of a subclass of ``(its class, RuntimeError)`` (made once per class) with the
    same arguments, attributes, traceback and cause -- ``exc`` itself where Python lets its class be
    swapped, a copy where not (instances of built-in exceptions); pickled, it is rebuilt the same way.
    A ``RuntimeError`` is only given the prefix. An exception whose class cannot be rebuilt from its
    arguments becomes a ``RuntimeError`` whose cause it is.
    """
    if isinstance(exc, RuntimeError):
        if context and not getattr(exc, _CONTEXT, "") and hasattr(exc, "__dict__"):
            if type(exc) not in _mixed.values():  # only a mixed class shows the prefix
                exc = _mixed_copy(exc) or exc
            setattr(exc, _CONTEXT, context)
        return exc
    mixed = _mixed_copy(exc)
    if mixed is None:
        wrapper = RuntimeError(f"{context}{type(exc).__name__}: {exc}")
        wrapper.__cause__ = exc
        return wrapper
    if context and not getattr(mixed, _CONTEXT, ""):
        setattr(mixed, _CONTEXT, context)
    return mixed


def _mixed_copy(exc: BaseException) -> BaseException | None:
    cls = type(exc)
    try:
        mixed = _mixed.get(cls) or _mixed.setdefault(cls, _mix(cls))
    except TypeError:  # a layout or metaclass the mix-in cannot share
        return None
    try:
        exc.__class__ = mixed
        return exc
    except TypeError:  # an instance of a built-in class: copied
        pass
    try:
        copy: BaseException = mixed(*exc.args)
    except Exception:
        return None
    copy.__dict__.update(getattr(exc, "__dict__", {}))
    copy.__traceback__, copy.__cause__, copy.__context__ = exc.__traceback__, exc.__cause__, exc.__context__
    copy.__suppress_context__ = exc.__suppress_context__
    return copy


def _mix(cls: type[BaseException]) -> type:
    if issubclass(cls, RuntimeError) or issubclass(RuntimeError, cls):  # RuntimeError itself, or a base of it
        bases: tuple[type, ...] = (cls if issubclass(cls, RuntimeError) else RuntimeError,)  # (Exception)
    else:
        bases = (cls, RuntimeError)

    def __str__(self: BaseException) -> str:
        return getattr(self, _CONTEXT, "") + cls.__str__(self)

    def __reduce__(self: BaseException) -> tuple[Any, ...]:
        reduced = cls.__reduce__(self)
        if not isinstance(reduced, tuple) or reduced[0] is not type(self):  # a reduction of its own: keep it
            return reduced  # type: ignore[return-value]
        return (_rebuild_mixed, (cls, *reduced[1:]))

    return type(cls.__name__, bases, {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                      "__str__": __str__, "__reduce__": __reduce__})


def _rebuild_mixed(cls: type, args: tuple[Any, ...], state: dict[str, Any] | None = None) -> BaseException:
    exc: BaseException = cls(*args)
    if state:
        exc.__dict__.update(state)
    return also_runtime_error(exc)
