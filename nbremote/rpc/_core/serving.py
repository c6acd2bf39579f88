"""Serving: what a process does with the envelopes a caller sends it.

Cheap bookkeeping (reference counts, membership, cancellation) happens at once, in order, on the
thread that received the message; calls run on the executor, so many run together and nested A→B→A
calls cannot deadlock. Each call's output is captured and sent, in order, before its reply. A call
made with ``remote`` stores its result in the owner table instead of sending it back. Self-calls take
this same path without a socket.

While a dashboard reads this process's task stream (``tasks``), calls go through ``_run_timed``, which
records each one; otherwise they pay one attribute test for it.

A torch builtin operator (``torch.add``) called with arguments none of its schemas takes raises torch's RPC
error, a ``RuntimeError`` "... failed to match any schema" that is still the ``TypeError`` Python raised
(``frameworks.operator_mismatch``).

A call made inside a distributed autograd context (``ag``) runs inside that context here too, so the
calls it makes stay in it; tensors that require grad arriving in its arguments, and leaving in its
result, are recorded in the context (see ``_core.gradctx``).
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
import traceback
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from nbremote.errors import SerializationError, also_runtime_error
from nbremote.frameworks import GradTrack, grad_tracking, operator_mismatch
from nbremote.rpc._core import capture, gradctx
from nbremote.rpc._core.future import Future
from nbremote.rpc._core.owners import OwnerTable
from nbremote.rpc._core.pool import Pool
from nbremote.rpc._core.tasks import TaskLog
from nbremote.rpc._wire import serialize
from nbremote.rpc._wire.envelope import Envelope
from nbremote.rpc._wire.serialize import sending_to

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "_nbremote_async_execution"

# Calls the task stream leaves out: the dashboard's own reads (see ``tasks``).
QUIET = frozenset({"dashboard_activity"})


def async_execution(fn: F) -> F:
    """Mark ``fn`` (which returns a Future) so RPC replies with the future's value, not the future
    (``nbremote.rpc.functions.async_execution``).

    A plain function is marked as a copy of itself (same code, globals, closure, defaults and attributes), not
    wrapped: a function defined in ``__main__`` travels by value with every call, and a wrapper made it travel
    twice (the wrapper and the function in its closure: ~40 us more per call here than the same function
    unmarked). The original is left as it was. Any other callable is wrapped, as torch wraps every one."""
    if isinstance(fn, types.FunctionType):
        marked = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        marked.__kwdefaults__ = fn.__kwdefaults__
        for attr in functools.WRAPPER_ASSIGNMENTS:  # what functools.wraps copies, __wrapped__ excepted
            if hasattr(fn, attr):
                setattr(marked, attr, getattr(fn, attr))
        marked.__dict__.update(fn.__dict__)
        setattr(marked, _MARK, True)
        return marked  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper  # type: ignore[return-value]


def is_async_execution(fn: object) -> bool:
    """Marked by ``async_execution`` -- or by torch's own (``torch.distributed.rpc.functions.async_execution``,
    which leaves ``_wrapped_async_rpc_function``), so a program that kept torch's decorator works too."""
    return bool(getattr(fn, _MARK, False)) or getattr(fn, "_wrapped_async_rpc_function", None) is not None


class AsyncResult:
    """What a function returns that ran an ``@async_execution`` callable for its caller (an RRef proxy's
    ``invoke_method``): the reply waits for ``future``, as if the function itself were marked."""

    __slots__ = ("future",)

    def __init__(self, future: Any) -> None:
        self.future = future


def _is_future(value: object) -> bool:
    """nbremote's Future, or one that behaves like it (a ``torch.futures.Future`` made by the user)."""
    return isinstance(value, Future) or all(hasattr(value, a) for a in ("add_done_callback", "done", "wait"))


def _outcome(fut: Any) -> tuple[Any, BaseException | None]:
    """(value, None) or (None, error) of a completed future of either kind."""
    try:
        return fut.wait(), None
    except BaseException as exc:
        return None, exc


def _qualified_type(exc: BaseException) -> str:
    t = type(exc)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


Handler = Callable[[Envelope, list[Any], str], None]  # (envelope, its frames, who sent it)


def with_error(env: Envelope, exc: BaseException, dest: str) -> list[Any]:
    """Put ``exc`` into ``env`` (its type's name, message and traceback) and return the frames that carry it
    pickled for ``dest`` (none when it cannot travel: the receiver rebuilds it by name then)."""
    env["type"], env["msg"] = _qualified_type(exc), str(exc)
    env["tb"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    token = sending_to.set(dest)
    try:
        frames = serialize.dumps(exc)
        serialize.loads(frames)  # an exception that pickles but cannot unpickle is sent by name
    except Exception:
        frames = []
    finally:
        sending_to.reset(token)
    return frames


class Server:
    """Runs calls for callers; ``name`` is this process's member name (for error messages)."""

    def __init__(self, name: str, table: OwnerTable, grad: gradctx.Contexts, executor: Pool,
                 bookkeeping: Mapping[str, Handler], failed: Callable[[Envelope, BaseException], None]) -> None:
        self.name = name
        self.table = table
        self.grad = grad
        self._executor = executor
        self._bookkeeping = bookkeeping  # the agent's handlers of kinds handled at once (world, ctx, hop)
        self._failed = failed  # tells whoever waits for a notification sent with ``failed`` (``oneway``)
        self._serving: dict[tuple[str, int], int] = {}  # (caller, call id) -> thread ident
        self._serving_lock = threading.Lock()
        self._here = threading.local()  # see take_one
        self.tasks = TaskLog()  # the task stream a dashboard reads (recorded while one does)

    def take_one(self, receive: Callable[[], None]) -> Callable[[], None] | None:
        """Run ``receive``, which serves what arrived; the first call it would have queued on the executor is
        returned instead, for this thread to run (the shell path's receiving thread, see ``_worker.shellpath``)."""
        claim: list[tuple[Any, ...]] = []
        self._here.claim = claim
        try:
            receive()
        finally:
            self._here.claim = None
        if not claim:
            return None
        # not a lambda: one Python frame less per call
        return functools.partial(self._run_timed if self.tasks.on else self._run_call, *claim[0])

    def busy(self) -> bool:
        """Whether calls wait for an executor thread now (their replies will follow soon)."""
        return self._executor.queued > 0

    def queue(self, run: Callable[[], None]) -> bool:
        """Queue a call ``take_one`` returned on the executor after all; False once it is shut down."""
        try:
            self._executor.submit(run)
        except RuntimeError:
            return False
        return True

    def relay(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn`` on another executor thread now (see ``Pool.relay``); False once it is shut down."""
        return self._executor.relay(fn, *args)

    def serve(self, items: Sequence[tuple[Envelope, list[Any]]], reply: capture.Reply, caller: str) -> None:
        """Handle what ``caller`` sent, in order: bookkeeping now, calls on the executor."""
        for env, frames in items:
            kind = env["k"]
            if kind == "call":
                created = None
                if "rref" in env:
                    rref_id, token = env["rref"]
                    created = self.table.create(rref_id, token, caller)
                claim = getattr(self._here, "claim", None)
                if claim is not None and not claim:  # take_one's thread runs this one itself
                    claim.append((env, frames, reply, caller, created))
                else:
                    run = self._run_timed if self.tasks.on else self._run_call  # the task stream is read
                    self._executor.submit(run, env, frames, reply, caller, created)
            elif kind == "cancel":
                self._cancel_serving(caller, env["id"])
            elif kind == "rref":
                self.table.apply(env.get("add", []), env.get("rm", []))
            else:
                handler = self._bookkeeping.get(kind)
                if handler is not None:
                    handler(env, frames, caller)

    def _run_timed(self, env: Envelope, frames: list[Any], reply: capture.Reply, caller: str,
                   created: Future[Any] | None) -> None:
        """``_run_call``, recorded in the task stream."""
        started = self.tasks.begin(caller)
        try:
            self._run_call(env, frames, reply, caller, created)
        finally:
            fn = env.get("fn", "?")
            self.tasks.end(started, fn, caller, quiet=fn in QUIET)

    def _run_call(self, env: Envelope, frames: list[Any], reply: capture.Reply, caller: str,
                  created: Future[Any] | None) -> None:
        if "nr" in env:
            self._run_notification(env, frames, caller, reply if "rb" in env else None)
            return
        key = (caller, env["id"])
        cap = capture.Capture(reply, env["id"])
        cap_token = capture.current.set(cap)
        grad_ctx = None if "ag" not in env else self.grad.join(env["ag"], caller)
        ctx_token = gradctx.current.set(None if grad_ctx is None else grad_ctx.id)
        result: Any = None
        error: BaseException | None = None
        try:
            with self._serving_lock:
                self._serving[key] = threading.get_ident()
            try:
                payload: Any = self._load_args(env, frames, caller, grad_ctx)
                try:
                    result = payload["fn"](*payload["args"], **payload["kwargs"])
                except TypeError as exc:  # a torch operator given arguments no schema of it takes: torch's error
                    mismatch = operator_mismatch(payload["fn"], payload["args"], payload["kwargs"])
                    if mismatch is None:
                        raise
                    raise also_runtime_error(TypeError(mismatch)) from exc
            finally:
                with self._serving_lock:
                    self._serving.pop(key, None)
            marked = is_async_execution(payload["fn"])
            if type(result) is AsyncResult:
                result, marked = result.future, True
            if marked:
                if not _is_future(result):
                    raise also_runtime_error(TypeError(
                        "Functions decorated with @rpc.async_function must return a torch.futures.Future object, "
                        f"and {env.get('fn')} is marked @async_execution but returned {type(result).__name__}: "
                        "return an nbremote.rpc.Future (or a torch.futures.Future) that completes with the result"))
                if not result.done():
                    cap.flush()
                    self._reply_when_done(result, env, caller, created, reply)
                    return
                result = result.wait()  # done already: replied to as a plain call is (raises its error)
        except BaseException as exc:  # everything the call raised goes back to the caller
            error = exc
        finally:
            gradctx.current.reset(ctx_token)
            capture.current.reset(cap_token)
        out = self._settle(env, caller, created, result, error)
        result = payload = None  # see _load_args: what the reply does not carry can go now
        cap.flush()  # what the call printed goes out before its reply
        reply(*out)

    def _reply_when_done(self, fut: Any, env: Envelope, caller: str, created: Future[Any] | None,
                         reply: capture.Reply) -> None:
        """Reply to an ``@async_execution`` call once the future it returned completes, from the thread that
        completes it -- as torch does, and as a plain call replies from the thread that ran it: a hop to another
        thread cost more than the rest of the call. Where nbremote completes an nbremote future on a thread of
        its own (its reply arrived on the IO thread, a timeout), a callback thread replies, as every reply did
        before: never the IO thread, and never more than the callback pool's threads however many complete at
        once (``Future._run_when_done``)."""

        def send(done: Any) -> None:
            try:
                reply(*self._settle(env, caller, created, *_outcome(done)))
            except Exception as exc:  # runs in whatever thread completed the future: never raise into it
                print(f"nbremote: the reply to {env.get('fn')} from {caller!r} could not be sent from {self.name!r}: "
                      f"{type(exc).__name__}: {exc}", file=sys.__stderr__, flush=True)

        if isinstance(fut, Future):
            fut._run_when_done(send)
        else:  # a torch.futures.Future of the user's: torch runs this inline where it completes
            fut.add_done_callback(send)

    def _run_notification(self, env: Envelope, frames: list[Any], caller: str, back: capture.Reply | None) -> None:
        """A call that wants no reply (``oneway.notify``): run it, inside the autograd context it was sent in
        (``ag``), as a call. What it raises goes to whoever waits for it where it names one (``fail``), else it is
        only logged here. ``back``: a backward hop the root sent on its waiting thread's own socket (``rb``),
        where its report goes (``gradctx.report_back``)."""
        token = None if back is None else gradctx.report_back.set((caller, back))
        grad_ctx = None if "ag" not in env else self.grad.join(env["ag"], caller)
        ctx_token = None if grad_ctx is None else gradctx.current.set(grad_ctx.id)
        try:
            payload: Any = self._load_args(env, frames, caller, grad_ctx)
            payload["fn"](*payload["args"], **payload["kwargs"])
        except Exception as exc:
            if "fail" in env:
                self._failed(env, exc)
            else:
                print(f"nbremote: {env.get('fn')} from {caller!r} failed on {self.name!r}: {type(exc).__name__}: "
                      f"{exc}", file=sys.__stderr__, flush=True)
        finally:
            if ctx_token is not None:
                gradctx.current.reset(ctx_token)
            if token is not None:
                gradctx.report_back.reset(token)

    def _load_args(self, env: Envelope, frames: list[Any], caller: str, grad_ctx: gradctx.Context | None) -> Any:
        """Unpickle a call; tensors sent from an autograd context become leaves recorded in it."""
        track = GradTrack() if grad_ctx is not None and "ags" in env else None
        tracking = grad_tracking.set(track)
        try:
            payload = serialize.loads(frames)
        except SerializationError as exc:  # say where and which call: the caller only sees this message
            raise SerializationError(f"worker {self.name!r} cannot load the call {env.get('fn')} that "
                                     f"{caller!r} sent: {exc}") from exc
        finally:
            grad_tracking.reset(tracking)
            # What was rebuilt holds the buffers it needs: drop ours, so that a buffer lent by shared
            # memory goes back as soon as the call is done with it, not when this work item is.
            frames.clear()
        if grad_ctx is not None and track:
            grad_ctx.record_recv(caller, env["ags"], track.received, env.get("agf", ()))
        return payload

    def _settle(self, env: Envelope, caller: str, created: Future[Any] | None, result: Any,
                error: BaseException | None) -> tuple[Envelope, list[Any]]:
        """The reply to a finished call; for ``remote``, also store its value (or error) on this owner."""
        if error is None:
            if created is not None:
                created.set_result(result)
                result = None
            grad_ctx = None if "ag" not in env else self.grad.get(env["ag"])
            track = None if grad_ctx is None else GradTrack()
            dest = sending_to.set(caller)
            tracking = grad_tracking.set(track)
            try:
                ok: Envelope = {"k": "ok", "id": env["id"]}
                frames = serialize.dumps(result)
                if grad_ctx is not None and track:  # the result's tensors are a send of this context
                    ok["ags"] = self.grad.record_send(grad_ctx, caller, track.sent)
                    forwarded = grad_ctx.forwarded(track.sent)
                    if forwarded:
                        ok["agf"] = forwarded
                return ok, frames
            except SerializationError as exc:
                error = SerializationError(f"the result of {env.get('fn')} on {self.name!r} cannot be sent back: {exc}")
            finally:
                grad_tracking.reset(tracking)
                sending_to.reset(dest)
        elif created is not None:
            created.set_exception(error)
        return self._error_reply(env["id"], error, caller)

    def _error_reply(self, call_id: int, exc: BaseException, caller: str) -> tuple[Envelope, list[Any]]:
        env: Envelope = {"k": "err", "id": call_id}
        return env, with_error(env, exc, caller)

    def _cancel_serving(self, caller: str, call_id: int) -> None:
        with self._serving_lock:
            ident = self._serving.pop((caller, call_id), None)
            if ident is not None:  # raise KeyboardInterrupt in that thread at its next bytecode
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt))
