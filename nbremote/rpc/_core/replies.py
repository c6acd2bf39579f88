"""Replies, the end of a call's life: what ``ok``, ``err`` and ``out`` envelopes do to the call they answer.

A result is unpickled here, in the receiving thread; inside a distributed autograd context the tensors that
require grad in it become leaves recorded in the context (``gradctx``). An error is rebuilt with its own
type where it unpickles (else as a :class:`~nbremote.errors.RemoteError`), the remote traceback attached as
its cause. Output is replayed in the context of the cell that made the call (``capture.emit``).
"""

from __future__ import annotations

from typing import Any

from nbremote.errors import RemoteError, RemoteTraceback, SerializationError
from nbremote.frameworks import GradTrack, grad_tracking
from nbremote.rpc._core import capture, gradctx
from nbremote.rpc._core.calls import PendingCalls
from nbremote.rpc._wire import serialize
from nbremote.rpc._wire.envelope import Envelope

__all__ = ["deliver", "hop_over", "remote_error", "unreadable"]


def deliver(calls: PendingCalls, grad: gradctx.Contexts, worker: str, env: Envelope, frames: list[Any]) -> None:
    """What ``worker`` answered one of our calls: output replayed in the calling cell, a result or an error
    settling the call's future (``ok`` / ``err``); a reply to no pending call (timed out, cancelled) is dropped."""
    kind = env["k"]
    if kind == "out":
        pending = calls.get(env["id"])
        if pending is not None:
            stream = env.get("stream", "stdout")
            starts = pending.line_start
            if starts is None:
                starts = pending.line_start = {"stdout": True, "stderr": True}
            starts[stream] = pending.ctx.run(capture.emit, worker, stream, env.get("text", ""), starts[stream])
        return
    if kind not in ("ok", "err"):
        return
    pending = calls.take(env["id"])
    if pending is None:
        return  # timed out or cancelled already
    if kind == "ok":
        grad_ctx = None
        if pending.autograd is not None and "ags" in env:
            grad_ctx = grad.get(pending.autograd)
        track = None if grad_ctx is None else GradTrack()
        tracking = grad_tracking.set(track)
        try:
            value = serialize.loads(frames)
        except SerializationError as exc:
            pending.fut._fail(SerializationError(
                f"the result of {pending.fn} on {worker!r} cannot be unpickled here: {exc}"))
            return
        finally:
            grad_tracking.reset(tracking)
        if grad_ctx is not None and track:
            grad_ctx.record_recv(worker, env["ags"], track.received, env.get("agf", ()))
        pending.fut._complete(value, None)
    else:
        pending.fut._fail(remote_error(worker, pending.fn, env, frames))


def hop_over(grad: gradctx.Contexts, worker: str, env: Envelope, frames: list[Any]) -> None:
    """A hop of a backward pass rooted here is over (``hop`` envelope, from ``worker``); a report for a pass
    that is over already (failed, timed out) is dropped."""
    ctx = grad.get(env["ctx"])
    run = None if ctx is None else ctx.passes.get(env["run"])
    if run is None:
        return
    error = None if "type" not in env else remote_error(worker, "dist_autograd.backward", env, frames)
    run.report(env["hop"], [(str(h), str(p)) for h, p in env["hops"]], error)


def remote_error(worker: str, fn: str, env: Envelope, frames: list[Any]) -> BaseException:
    """The error a call raised on ``worker``, as its own type where it unpickles, with the remote traceback."""
    exc: BaseException | None = None
    if frames:
        try:
            loaded = serialize.loads(frames)
            exc = loaded if isinstance(loaded, BaseException) else None
        except Exception:
            exc = None
    if exc is None:
        exc = RemoteError(worker, env.get("type", "Exception"), env.get("msg", ""))
    exc.__cause__ = RemoteTraceback(worker, env.get("tb", ""))
    if hasattr(exc, "add_note") and not isinstance(exc, RemoteError):
        exc.add_note(f"(raised on worker {worker!r} in {fn})")
    return exc


def unreadable(calls: PendingCalls, name: str, peer: str, env: Envelope, reply: capture.Reply, why: str) -> None:
    """A message from ``peer`` whose buffers could not be read here (on ``name``): fail the call it belongs to,
    on whichever side."""
    if env["k"] == "call":
        reply({"k": "err", "id": env["id"], "type": "nbremote.errors.SerializationError",
               "msg": f"the call {env.get('fn')} from {peer!r} reached {name!r}, but {why}", "tb": ""}, [])
    elif env["k"] in ("ok", "err"):
        pending = calls.take(env["id"])
        if pending is not None:
            pending.fut._fail(SerializationError(f"the result of {pending.fn} on {peer!r}: {why}"))
