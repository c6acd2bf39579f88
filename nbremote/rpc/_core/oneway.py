"""One-way messages: a call with no reply (``notify``), and the report that ends a backward hop.

A notification costs one message where a call costs two: no reply, nothing pending on the sender, no
future. It suits what nobody waits for in the sender's place: a backward hop and its report, a context's
release, and a chain of calls where each hop passes its result on (``RemoteSequential``: the stages'
outputs go from worker to worker, and only the caller at the end waits).

What a call would have returned is not lost:

- **Autograd.** ``grad=True`` sends inside the distributed autograd context of the sending thread, as
  a call does: tensors that require grad are recorded as the context's sends, and the receiver runs the
  function inside the context with the tensors it got recorded as received (``serving``), so a backward
  pass finds its way back along the hops.
- **Errors.** A call's error goes back with its reply; a notification's would only be logged where it ran.
  ``failed=(process, key, token)`` names who waits for the outcome instead: if the function cannot be
  loaded or raises, ``key``'s handler on ``process`` (registered in :data:`FAILED`) is called with
  ``token`` and the error -- its own type where it unpickles there, the remote traceback as its cause,
  like a call's error.

Output is the exception: what a notified function prints has no calling cell to go to, and stays in the
worker's own output.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

from nbremote.errors import SerializationError
from nbremote.frameworks import GradTrack, grad_tracking
from nbremote.rpc._core import gradctx, replies
from nbremote.rpc._core.calls import copied, fn_name
from nbremote.rpc._core.peers import Peers
from nbremote.rpc._core.serving import Server, with_error
from nbremote.rpc._transport.base import Link
from nbremote.rpc._wire import serialize
from nbremote.rpc._wire.envelope import Envelope
from nbremote.rpc._wire.serialize import sending_to

__all__ = ["FAILED", "Agent", "notify", "pickled", "report_hop", "tell_failure"]


class Agent(Protocol):
    """What these functions use of ``agent.Agent`` (which imports this module: its notify and report_hop are
    these)."""

    name: str
    grad: gradctx.Contexts
    server: Server
    peers: Peers

    def _export(self, dest: str, env: Envelope, frames: Sequence[Any]) -> tuple[Envelope, list[Any]]: ...

    def _notify_shm(self, peer: str, link: Link) -> None: ...

    def _self_reply(self, env: Envelope, frames: list[Any]) -> None: ...


#: key -> handler(token, error): who waits for the outcome of notifications sent with ``failed`` (their
#: sender's module registers it; the key travels in the envelope, the handler never does)
FAILED: dict[str, Callable[[Any, BaseException], None]] = {}


def notify(agent: Agent, to: str, fn: Callable[..., Any], args: Sequence[Any] = (), *, wake: bool = True,
           own: bool = False, grad: bool = False,
           failed: tuple[str, str, Any] | None = None) -> Callable[[float], None] | None:
    """``Agent.notify``: run ``fn(*args)`` on ``to``, no reply. ``wake=False`` queues it to leave with the next
    message to ``to`` (or the IO thread's next tick). ``own``: a root's backward hop, sent on this thread's own
    socket where it has one (its report comes back there if it is the pass's last): returns the pump (else
    None). ``grad``: in this thread's autograd context, as a call is. ``failed``: see the module's docstring.
    Arrays are not copied: the caller must leave them as they are (a call's ``snapshot`` copies them)."""
    env: Envelope = {"k": "call", "id": 0, "fn": fn_name(fn), "caller": agent.name, "to": 0.0, "nr": True}
    if failed is not None:
        env["fail"] = list(failed)
    frames = pickled(agent, to, env, fn, args, None, grad=grad)
    if to == agent.name:
        agent.server.serve([(env, copied(frames))], agent._self_reply, agent.name)
        return None
    link = agent.peers.link(agent.peers.peer(to))
    if link.same_host and len(frames) > 1:  # big frames go by shared memory (copied now)
        env, frames = agent._export(to, env, frames)
    agent._notify_shm(to, link)
    send_own = getattr(link, "send_own_reply", None) if own else None  # a zmq link to a kernel
    if send_own is not None and (pump := send_own({**env, "rb": True}, frames)) is not None:
        return cast(Callable[[float], None], pump)
    if wake:
        link.send(env, frames, now=True)
    else:
        link.post(env, frames)
    return None


def pickled(agent: Agent, to: str, env: Envelope, fn: Callable[..., Any], args: Sequence[Any],
            kwargs: dict[str, Any] | None, *, grad: bool = True) -> list[Any]:
    """The frames of a call (or notification) ``env`` of ``fn(*args, **kwargs)`` to ``to``: its RRefs pickled for
    ``to``, and, inside this thread's autograd context (``grad``), what it sends recorded in the context and in
    ``env``. A payload that cannot be pickled raises :class:`SerializationError` naming the call and ``to``."""
    active = gradctx.current.get() if grad else None
    ctx = None if active is None else agent.grad.get(active)
    track = None if ctx is None else GradTrack()
    token = sending_to.set(to)
    tracking = grad_tracking.set(track)
    try:
        frames = serialize.dumps({"fn": fn, "args": tuple(args), "kwargs": dict(kwargs or {})}, named_roots=True)
    except SerializationError as exc:
        raise SerializationError(f"cannot send the call {env['fn']} to {to!r}: {exc}") from exc.__cause__
    finally:
        grad_tracking.reset(tracking)
        sending_to.reset(token)
    if ctx is not None:
        _record_send(agent.grad, ctx, to, env, track)
    return frames


def _record_send(grad: gradctx.Contexts, ctx: gradctx.Context, dest: str, env: Envelope,
                 track: GradTrack | None) -> None:
    """Record a message sent in an autograd context in it, and say so in its envelope (see ``gradctx``)."""
    env["ag"] = ctx.id
    ctx.touch(dest)
    if track:
        env["ags"] = grad.record_send(ctx, dest, track.sent)
        forwarded = ctx.forwarded(track.sent)
        if forwarded:
            env["agf"] = forwarded


def report_hop(agent: Agent, root: str, ctx_id: int, run: int, hop: str, hops: list[tuple[str, str]],
               error: BaseException | None) -> None:
    """Tell the root of backward pass ``run`` that ``hop`` is over: the hops it started, or its error."""
    env: Envelope = {"k": "hop", "ctx": ctx_id, "run": run, "hop": hop, "hops": [list(h) for h in hops]}
    frames = [] if error is None else with_error(env, error, root)
    back = gradctx.report_back.get()
    if back is not None and back[0] == root and not hops:  # the last: to the socket the root waits on
        back[1](env, frames)
    elif root == agent.name:
        replies.hop_over(agent.grad, agent.name, env, frames)
    else:
        agent.peers.link(agent.peers.peer(root)).send(env, frames, now=True)


def tell_failure(agent: Agent, env: Envelope, exc: BaseException) -> None:
    """A notification sent with ``failed`` could not be loaded, or raised, here: tell whoever waits for it (the
    target's shape was checked on arrival, ``envelope.unpack``)."""
    process, key, token = env["fail"]
    fields: dict[str, Any] = {}
    frames = with_error(cast(Envelope, fields), exc, process)
    try:
        notify(agent, process, _failed, (key, token, agent.name, env.get("fn", "?"), fields,
                                         [bytes(f) for f in frames]))
    except Exception as lost:  # the waiting process is gone too (its own watch fails what it waited for)
        print(f"nbremote: could not tell {process!r} that {env.get('fn')} failed on {agent.name!r}: {lost}",
              file=sys.__stderr__, flush=True)


def _failed(key: str, token: Any, worker: str, fn: str, fields: dict[str, Any], frames: list[bytes]) -> None:
    """Runs where the outcome was waited for: hand the error, rebuilt, to ``key``'s handler."""
    handler = FAILED.get(key)
    error = replies.remote_error(worker, fn, cast(Envelope, fields), list(frames))
    if handler is None:
        print(f"nbremote: {fn} failed on {worker!r} and nothing here handles {key!r}: {error!r}",
              file=sys.__stderr__, flush=True)
        return
    handler(token, error)
