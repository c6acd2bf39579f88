"""Payload (de)serialization: cloudpickle protocol 5 with out-of-band buffers.

``dumps`` returns frames: ``frames[0]`` is the pickle stream, ``frames[1:]`` the large buffers it refers
to, in order, ready to travel as a Jupyter message's binary buffers without being copied. numpy arrays go
out of band by themselves (protocol 5); tensors of torch and tensorplay would not (their pickling copies
the storage in-band), so a ``reducer_override`` sends them to the adapters in ``nbremote.frameworks``,
which are loaded only once their framework is already imported. Buffers under 1 KiB stay in-band: a
separate frame (and its HMAC digest) costs more than copying them. ``bytearray`` payloads stay in-band
(the C pickler handles them before ``reducer_override``); wrap large ones in ``pickle.PickleBuffer``.

``loads`` passes the received frames to pickle as its buffers, so arrays and tensors alias them.

Functions and classes defined in ``__main__`` (notebook cells) travel by value, as cloudpickle does.
Failures become :class:`SerializationError`; on the sending side the payload is searched for the part
that cannot be pickled, and the message names its path (``kwargs['opt'][2].attr``) and type.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import io
import pickle
import reprlib
import sys
import time
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import cloudpickle

from nbremote.errors import SerializationError
from nbremote.frameworks import Reducer, ReducerTable, grad_tracking

__all__ = ["dumps", "loads", "sending_to"]

#: set by the agent while it pickles a message, to the name of the process the message goes to (what an
#: RRef's ``__reduce__`` needs to count the reference it forks; see ``nbremote.rpc.is_rpc_pickling``)
sending_to: contextvars.ContextVar[str | None] = contextvars.ContextVar("nbremote_sending_to", default=None)

_INBAND_MAX = 1024  # bytes; smaller buffers are copied into the pickle stream
_PLAIN = frozenset({type(None), bool, int, float, complex, str})  # need nothing but pickle (results, mostly)
_BY_NAME = frozenset({types.FunctionType, types.BuiltinFunctionType})  # what pickle saves by reference
# Modules cloudpickle was told to pickle by value (None: this cloudpickle keeps them elsewhere, so no
# payload is taken for plain, see _plain_call).
_BY_VALUE: set[str] | None = getattr(getattr(cloudpickle, "cloudpickle", None), "_PICKLE_BY_VALUE_MODULES", None)
# What _plain finds, in rising order of need: anything else (cloudpickle), only plain values (C pickle),
# plain values and arrays or tensors (C pickle with the framework adapters).
_OTHER, _BARE, _ADAPTED = 0, 1, 2
_PLAIN_KEYS = frozenset({str, int})  # dict keys C pickle takes as cloudpickle would
_PLAIN_ITEMS = 64  # items of a container that _plain looks at before it settles for the full path
_SEARCH_BUDGET = 2000  # objects the failure search may try to pickle before it gives up narrowing
# What Python says when another thread is importing, at that moment, a module that a payload names, in a
# circle with what this thread imports (two calls that arrive together at a fresh kernel -- a restored
# module's restore and a forward -- each importing a part of nbremote.nn): the import is not wrong, only
# early, so ``loads`` waits for those imports and tries again, for up to ``_IMPORT_RACE_WAIT`` seconds.
_IMPORT_RACE = ("partially initialized module", "deadlock detected by _ModuleLock")
_IMPORT_RACE_WAIT = 30.0
_SEND_HINT = (
    "pass something picklable, or create the object on the worker (e.g. inside the function you call)"
)
_RECV_HINT = (
    "every module, class and function the payload refers to must be importable in the receiving process: "
    "the RPC pickler does not serialize the code of those of importable modules, only their names (install "
    "or define them there, or define them in __main__ so that they travel by value)"
)

# One table per process: it only caches which adapters are loaded; it holds no per-call state.
_REDUCERS = ReducerTable()


def _imported_submodules(code: types.CodeType, top_level_dependencies: Iterable[Any]) -> list[types.ModuleType]:
    """cloudpickle's ``_find_imported_submodules``, found by lookups in ``sys.modules`` instead of a scan of it.

    A function that travels by value records the loaded submodules it may reach as attributes of a package it
    uses (``torch.futures`` from ``torch``: every dotted name whose parts are all among its code's names), so
    that the receiver imports them. cloudpickle tests every name in ``sys.modules`` against every package the
    function uses, on every call: with torch loaded (~1,300 modules) that cost 1.3 ms per call of a ``__main__``
    function using ``torch.`` -- more than the call itself, and what made pytorch/examples' batch reinforce
    slower in its batching mode than without (issue 40). Here each package's submodules are looked up from
    the code's names (``package.name``, then below each found one): the same modules, in microseconds.
    """
    names = set(code.co_names)
    found: list[types.ModuleType] = []
    for dependency in top_level_dependencies:
        if not (isinstance(dependency, types.ModuleType) and getattr(dependency, "__package__", None)):
            continue
        below = [dependency.__name__]
        while below:
            parent = below.pop()
            for name in names:
                dotted = f"{parent}.{name}"
                module = sys.modules.get(dotted)
                if module is not None:
                    found.append(module)
                    below.append(dotted)
    return found


# cloudpickle's own, replaced where it is what this was written against (same arguments, same modules found)
_cloudpickle_module = getattr(cloudpickle, "cloudpickle", None)
if callable(getattr(_cloudpickle_module, "_find_imported_submodules", None)):
    _cloudpickle_module._find_imported_submodules = _imported_submodules  # type: ignore[union-attr]


# cloudpickle ships no type information: its Pickler is Any (an error only under --strict).
class _Pickler(cloudpickle.Pickler):  # type: ignore[misc, unused-ignore]
    """cloudpickle's Pickler plus an exact-type dispatch to the framework adapters."""

    def __init__(self, file: io.BytesIO, reducers: dict[type, Reducer], **kwargs: Any) -> None:
        super().__init__(file, protocol=5, **kwargs)
        self._reducers = reducers

    def reducer_override(self, obj: Any) -> Any:
        # Hot path: called for every object that is not a builtin container or scalar.
        reduce = self._reducers.get(type(obj))
        if reduce is not None:
            reduced = reduce(obj)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)


def dumps(obj: object, *, named_roots: bool = False) -> list[memoryview | bytes]:
    """Serialize ``obj`` into ``[pickle stream, *out-of-band buffers]``.

    With ``named_roots=True``, ``obj`` is a dict whose str keys name the roots of error paths (``args``,
    ``kwargs``). Raises :class:`SerializationError` naming the offending object when ``obj`` cannot be
    pickled. The buffers alias the objects' memory: do not mutate those objects until the frames are sent.
    """
    if type(obj) in _PLAIN:
        return [pickle.dumps(obj, protocol=5)]
    reducers = _REDUCERS.refresh()
    plain = _plain_call(obj, reducers) if named_roots else _plain(obj, 2, reducers)
    if plain == _BARE:
        # Plain values only (a call of an importable function with such arguments, or such a result):
        # pickle's C code alone pickles them as cloudpickle would (the function by reference). Anything
        # it refuses (a function that is not what its module has under its name) takes the full path,
        # which also explains a failure.
        try:
            return [pickle.dumps(obj, protocol=5)]
        except Exception:  # not contextlib.suppress: it costs three Python calls on every call's way out
            pass
    frames: list[memoryview | bytes] = []

    def keep(buffer: pickle.PickleBuffer) -> bool:
        view = buffer.raw()
        if view.nbytes < _INBAND_MAX:
            return True  # in-band
        frames.append(view)
        return False

    if plain == _ADAPTED:
        # The same with arrays and tensors among the values: C pickle with our adapters and nothing of
        # cloudpickle's (whose pickler costs more to make and to run than such a payload).
        track = grad_tracking.get()
        tracked = 0 if track is None else len(track.sent)
        stream = io.BytesIO()
        try:
            _LeanPickler(stream, reducers, buffer_callback=keep).dump(obj)
            return [stream.getvalue(), *frames]
        except Exception:  # the full path pickles it all again: what this attempt recorded goes
            frames.clear()
            if track is not None:
                del track.sent[tracked:]
    stream = io.BytesIO()
    try:
        _Pickler(stream, reducers, buffer_callback=keep).dump(obj)
    except Exception as exc:
        raise SerializationError(_explain(obj, exc, named_roots, reducers)) from exc
    frames.insert(0, stream.getvalue())
    return frames


class _LeanPickler(pickle.Pickler):
    """C pickle plus the framework adapters, for payloads ``_plain`` vouched for (nothing cloudpickle would
    pickle differently from pickle)."""

    def __init__(self, file: io.BytesIO, reducers: dict[type, Reducer], **kwargs: Any) -> None:
        super().__init__(file, protocol=5, **kwargs)
        self._reducers = reducers

    def reducer_override(self, obj: Any) -> Any:
        reduce = self._reducers.get(type(obj))
        return NotImplemented if reduce is None else reduce(obj)


def _plain_call(payload: Any, reducers: dict[type, Reducer]) -> int:
    """How plain ``payload`` (``{"fn", "args", "kwargs"}``) is (see ``_plain``): ``_OTHER`` unless its
    function is a module-level function of an imported module that cloudpickle would pickle by reference."""
    if type(payload) is not dict:
        return _OTHER
    fn = payload.get("fn")
    if type(fn) not in _BY_NAME or _BY_VALUE is None:
        return _OTHER
    module = getattr(fn, "__module__", None)
    if module is None or module == "__main__" or module not in sys.modules:
        return _OTHER
    if _BY_VALUE and any(module == name or module.startswith(name + ".") for name in _BY_VALUE):
        return _OTHER  # cloudpickle.register_pickle_by_value
    args = _plain(payload.get("args"), 3, reducers)  # 3: a backward hop's {send: {slot: gradient}}
    kwargs = _plain(payload.get("kwargs"), 3, reducers) if args != _OTHER else _OTHER
    return _OTHER if kwargs == _OTHER else max(args, kwargs)


def _plain(value: Any, depth: int, reducers: dict[type, Reducer]) -> int:
    """``_BARE`` for scalars, strings and bytes in tuples, lists and dicts keyed by str or int, ``depth`` levels
    deep at most; ``_ADAPTED`` when objects of ``reducers``' exact types without instance attributes (arrays,
    tensors: the adapters pickle them, and nothing else of theirs) are among them too; else ``_OTHER``.

    One walk answers both questions (is C pickle enough, and does it need the adapters), with scalars
    checked inline: this runs for every call and result.
    """
    kind = type(value)
    if kind in _PLAIN or kind is bytes:
        return _BARE
    if kind in reducers:  # a tensor's attributes travel: they may be anything
        return _OTHER if getattr(value, "__dict__", None) else _ADAPTED
    if depth <= 0:
        return _OTHER
    if (kind is not tuple and kind is not list and kind is not dict) or len(value) > _PLAIN_ITEMS:
        return _OTHER
    items: Any = value
    if kind is dict:
        if value and not set(map(type, value)) <= _PLAIN_KEYS:  # (map: no Python-level call per key)
            return _OTHER
        items = value.values()
    found = _BARE
    for item in items:
        kind = type(item)
        if kind in _PLAIN or kind is bytes:
            continue
        inner = _plain(item, depth - 1, reducers)
        if inner == _OTHER:
            return _OTHER
        if inner > found:
            found = inner
    return found


def loads(frames: Sequence[bytes | memoryview]) -> object:
    """Inverse of :func:`dumps`; arrays and tensors alias ``frames[1:]`` where the framework allows."""
    if not frames:
        raise SerializationError("cannot deserialize an empty message (no pickle frame)")
    deadline, idle = 0.0, 0
    while True:
        try:
            return pickle.loads(frames[0], buffers=frames[1:])
        except Exception as exc:
            if _import_race(exc):
                deadline = deadline or time.monotonic() + _IMPORT_RACE_WAIT
                idle = 0 if _wait_for_imports() else idle + 1
                if idle <= 1 and time.monotonic() < deadline:  # a circle of our own fails at the second try
                    continue
            raise SerializationError(
                f"cannot deserialize the payload: {type(exc).__name__}: {exc}. Hint: {_RECV_HINT}."
            ) from exc


def _import_race(exc: Exception) -> bool:
    """Whether ``exc`` may be an import that another thread had under way (see ``_IMPORT_RACE``): also the
    KeyError of a module that the other thread's import took out of ``sys.modules`` as it failed."""
    if any(race in str(exc) for race in _IMPORT_RACE):
        return True
    name = exc.args[0] if isinstance(exc, KeyError) and len(exc.args) == 1 else None
    return isinstance(name, str) and all(part.isidentifier() for part in name.split("."))


def _wait_for_imports() -> bool:
    """Wait until the modules other threads are importing now are done (importing one waits for its lock),
    then a moment more for what they import next; whether there was anything to wait for. A module this
    thread itself is importing (an RPC made at import time) returns at once: nothing to wait for, then."""
    busy = [name for name, module in list(sys.modules.items())
            if getattr(getattr(module, "__spec__", None), "_initializing", False)]
    start = time.monotonic()
    for name in busy:
        with contextlib.suppress(Exception):  # theirs to report, if it fails
            importlib.import_module(name)
    waited = time.monotonic() - start > 0.001
    time.sleep(0.005)
    return waited


# --- finding what could not be pickled (error path only, so clarity over speed) ---------------------


def _explain(obj: object, exc: BaseException, named_roots: bool, reducers: dict[type, Reducer]) -> str:
    reason = f"{type(exc).__name__}: {exc}"
    roots: Iterator[tuple[str, Any]]
    if named_roots and isinstance(obj, dict):
        roots = ((str(key), value) for key, value in obj.items())
    else:
        roots = iter((("value", obj),))
    search = _Search(reducers)
    for path, root in roots:
        found = search.culprit(root, path, depth=0)
        if found is not None:
            where, culprit, error = found
            reason = f"{type(error).__name__}: {error}"
            return (
                f"cannot serialize {where}: it is a `{_type_name(culprit)}` ({reason}). Hint: {_SEND_HINT}."
            )
    return f"cannot serialize the payload ({reason}). Hint: {_SEND_HINT}."


class _Search:
    """Depth-first search for the innermost part of a payload that fails to pickle on its own."""

    _MAX_DEPTH = 50

    def __init__(self, reducers: dict[type, Reducer]) -> None:
        self._reducers = reducers
        self._budget = _SEARCH_BUDGET
        self._seen: set[int] = set()

    def culprit(self, obj: Any, path: str, depth: int) -> tuple[str, Any, BaseException] | None:
        """``(path, object, error)`` of the deepest failing part of ``obj``; ``None`` if ``obj`` pickles."""
        error = self._try(obj)
        if error is None:
            return None
        if depth < self._MAX_DEPTH and id(obj) not in self._seen:
            self._seen.add(id(obj))  # cycles: visit each object once
            for child_path, child in _children(obj, path):
                if self._budget <= 0:
                    break
                found = self.culprit(child, child_path, depth + 1)
                if found is not None:
                    return found
        return path, obj, error

    def _try(self, obj: Any) -> BaseException | None:
        self._budget -= 1
        try:
            # buffer_callback returning None keeps buffers out of band, i.e. never copied.
            _Pickler(io.BytesIO(), self._reducers, buffer_callback=lambda _buffer: None).dump(obj)
        except Exception as exc:
            return exc
        return None


def _children(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    """The parts of ``obj`` that pickle would pickle too, with their paths."""
    if isinstance(obj, (tuple, list)):
        for index, item in enumerate(obj):
            yield f"{path}[{index}]", item
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield f"{path}[{reprlib.repr(key)}]", value
            yield f"{path}<key {reprlib.repr(key)}>", key
    elif isinstance(obj, (set, frozenset)):
        for index, item in enumerate(obj):
            yield f"{path}<element {index}>", item
    elif isinstance(obj, types.FunctionType):
        # cloudpickle sends __main__ functions by value, with the globals and closure cells they use.
        for name in obj.__code__.co_names:
            if name in obj.__globals__:
                yield f"{path}.__globals__[{name!r}]", obj.__globals__[name]
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=True):
            try:
                yield f"{path}<closure {name}>", cell.cell_contents
            except ValueError:  # an empty cell
                continue
    elif _default_reduce(type(obj)):
        # Only objects pickled through their attributes: a custom __reduce__/__getstate__ may send
        # something else, and blaming an attribute it leaves out would mislead.
        for name, value in getattr(obj, "__dict__", {}).items():
            yield f"{path}.{name}", value
        for name in _slot_names(type(obj)):
            if hasattr(obj, name):
                yield f"{path}.{name}", getattr(obj, name)


def _default_reduce(cls: type) -> bool:
    """Whether instances of ``cls`` are pickled as their ``__dict__`` / slots (nothing overridden)."""
    return all(
        getattr(cls, name, None) is getattr(object, name, None)
        for name in ("__reduce_ex__", "__reduce__", "__getstate__")  # object.__getstate__: Python >= 3.11
    )


def _slot_names(cls: type) -> Iterator[str]:
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                yield name


def _type_name(obj: object) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
