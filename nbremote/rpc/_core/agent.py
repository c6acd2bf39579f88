"""The per-process RPC engine: one call's life, from the caller's thread to its reply.

One ``Agent`` runs in the driver and one in every worker kernel; every member calls every other.
Calling (``call``): the caller's thread pickles the call (so a bad argument fails at once, in the caller's
cell), registers it with the pending calls (``calls``) and queues the envelope on the route to the callee
(``peers``: our own link to its kernel, or the comm it opened on us). What arrives (``receive``, from the
IO thread, a worker's comm or a calling thread's own socket) is split: replies are delivered here --
output is replayed in the calling cell's context (captured with ``contextvars.copy_context()`` at call
time, which is how ipykernel routes output to a cell), results and errors complete the future -- and
requests are run by this process's ``serving.Server``. A self-call takes that same path without a
socket. A lost peer fails what was pending on it (``_on_lost``); the IO thread's tick expires deadlines,
sends what waits (reference counts, shared-memory news), lets go of idle receive memory and runs the
``on_tick`` hooks (a worker's leases).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from nbremote.errors import (
    CallCancelledError,
    NotInitializedError,
    ProtocolError,
    RPCTimeoutError,
    WorkerLostError,
    WorkerStartError,
)
from nbremote.rpc._core import capture, current, gradctx, oneway, replies
from nbremote.rpc._core.calls import Pending, PendingCalls, copied, fn_name, introspecting
from nbremote.rpc._core.future import Future
from nbremote.rpc._core.gathering import Gathering, Joined
from nbremote.rpc._core.members import WorkerInfo
from nbremote.rpc._core.owners import OwnerTable
from nbremote.rpc._core.peers import Peer, Peers
from nbremote.rpc._core.pool import Pool
from nbremote.rpc._core.rref import RefCounts, RRef, new_id
from nbremote.rpc._core.rref import lending as rref_lending
from nbremote.rpc._core.serving import Server
from nbremote.rpc._transport.base import Connection, Link
from nbremote.rpc._transport.iothread import IOThread
from nbremote.rpc._transport.shm import SharedMemory
from nbremote.rpc._wire import batching, bufpool, envelope
from nbremote.rpc._wire.envelope import REPLIES, Buffer, Envelope
from nbremote.rpc._wire.lease import Leases

__all__ = ["DEFAULT_TIMEOUT", "Agent", "current_agent", "current_agent_or_none"]

log = logging.getLogger("nbremote")

DEFAULT_TIMEOUT = 60.0

def current_agent() -> Agent:
    """This process's agent (``current``'s one member), or ``NotInitializedError`` saying what to do."""
    slot = current._current  # read here, not through current.current(): one Python frame less per call
    if slot and isinstance(slot[0], Agent):
        return slot[0]
    raise current._not_initialized()


def current_agent_or_none() -> Agent | None:
    member = current.current_or_none()
    return member if isinstance(member, Agent) else None


def known_names() -> list[str]:
    """On any member: the names it can call now (its own and its peers')."""
    agent = current_agent()
    return [agent.name, *agent.peers]


def until_known_by_all(agent: Agent, timeout: float) -> None:
    """Return once every member of ``agent``'s world can name every other, as torch's ``init_rpc`` does.

    The membership broadcast and a user's first call after ``init_rpc`` may travel by different connections of
    one link (its own, a thread's) and be served in either order: a worker calling the driver by name right
    away once found only itself (issue 40). So ask each member, again until it names them all; a member that
    cannot answer (lost meanwhile) is the liveness checks' to report. Raises ``WorkerStartError`` at ``timeout``."""
    members = {agent.name, *(p.name for p in agent.peers.values() if p.lost is None)}
    deadline = time.monotonic() + timeout
    waiting = sorted(members - {agent.name})
    while waiting:
        futs = [(w, agent.call(w, known_names, timeout=max(1.0, deadline - time.monotonic()))) for w in waiting]
        waiting = []
        for w, fut in futs:
            with contextlib.suppress(Exception):
                if not members <= set(fut.wait()):
                    waiting.append(w)
        if waiting and time.monotonic() > deadline:
            raise WorkerStartError(f"worker {waiting[0]!r} did not learn who else is in the world ({sorted(members)}) "
                                   f"within {timeout:.0f} s; it stays a member: its log may say why", waiting[0])
        if waiting:
            time.sleep(0.01)


class Agent:
    """This process's member of the world. ``role`` is "driver" or "worker"."""

    def __init__(self, name: str, rank: int, role: str, default_timeout: float = DEFAULT_TIMEOUT) -> None:
        self.name = name
        self.rank = rank
        self.role = role
        self.default_timeout = default_timeout
        self.info = WorkerInfo(name, rank)
        self.table = OwnerTable()
        self.grad = gradctx.Contexts(rank)
        self.shm = SharedMemory()
        self.leases = Leases()  # on a worker: the callers holding state here (see the worker's install)
        self._parts = batching.Parts()  # messages arriving in pieces (see batching.split_parts)
        self.on_tick: list[Callable[[float], None]] = []  # run on the IO thread's tick (a worker's lease expiry)
        self.on_expired: list[Callable[[str], None]] = []  # run when a caller's lease runs out (set by the worker)
        self.on_peer_lost: list[Callable[[str, str], None]] = []  # (name, why): a peer's kernel is gone
        self.state = "running"
        self.calls = PendingCalls()
        self._executor = Pool(name)
        self.server = Server(name, self.table, self.grad, self._executor, {
            "world": lambda env, frames, caller: self.update_world(env.get("peers", [])),
            "ctx": lambda env, frames, caller: self.release_context(env["ctx"], caller),
            "hop": lambda env, frames, caller: replies.hop_over(self.grad, caller, env, frames)},
            failed=lambda env, exc: oneway.tell_failure(self, env, exc))
        self.world: object = None  # the driver's membership manager (_driver.World); None on workers
        self.gathering: Gathering | None = None  # on the driver: torch's shutdown barrier (see ``joining``)
        self.joined: Joined | None = None  # this process's torch-style program, between init_rpc and shutdown
        self.io = IOThread(name, self._tick)
        self.peers = Peers(self.info, self.io, self.shm, self._adopt)
        if role == "driver":
            self.peers.driver = name
        self.refs = RefCounts(name, self.table, self.peers, self._executor.submit, lambda: self.running)
        capture.install()
        self.io.start()  # last: its tick uses all of the above

    @property
    def running(self) -> bool:
        return self.state == "running"

    def _check_running(self) -> None:
        if self.state != "running":
            raise NotInitializedError(
                f"nbremote RPC on {self.name!r} is {self.state.replace('_', ' ')}: no more calls can be made; "
                "call rpc.init_rpc(...) to start a new world")

    # -- membership (see peers) ----------------------------------------------------------------------------
    def _adopt(self, link: Connection) -> None:
        self.io.adopt(link, self._on_message, self._on_lost)

    def remove_peer(self, name: str, why: str) -> Peer | None:
        """Take ``name`` out of the world: its link dropped, what was pending on it failed."""
        peer = self.peers.remove(name, why)
        if peer is None:
            return None
        self.shm.peer_lost(name)
        self._fail_pending(name, lambda p: WorkerLostError(
            f"worker {name!r} was removed ({why}) while {p.fn} was pending on it", name))
        self.grad.peer_lost(name, why)
        return peer

    def attach_caller(self, link: Link) -> None:
        """A caller opened a comm on this kernel: calls to it can go back through that comm, and it holds a
        lease here from now on."""
        self.peers.attach_caller(link)
        self.leases.hold(link.name)

    def detach_caller(self, link: Link, why: str) -> None:
        """The comm ``link`` was closed; calls to its caller that could only take that route fail."""
        if self.peers.detach_caller(link):
            self._fail_pending(link.name, lambda p: WorkerLostError(
                f"{link.name!r} is gone ({why}) while {p.fn} was pending on it", link.name))

    def update_world(self, members: list[dict[str, Any]]) -> None:
        """A worker learns who its peers are (sent by the driver whenever membership changes)."""
        if self.role == "driver":  # the driver makes the world; no worker tells it who is in it
            return
        for member in members:
            if member.get("driver"):  # whichever rank it has (it may take any, as torch's master does)
                self.peers.driver = str(member["name"])
        for name in self.peers.update(members):
            self.remove_peer(name, "it left the world")
        for member in members:
            if member.get("lost"):
                self.grad.peer_lost(str(member["name"]), f"the driver saw it go: {member['lost']}")

    def release_context(self, ctx_id: int, origin: str | None) -> None:
        """Forget autograd context ``ctx_id``; tell the others it touched (not ``origin``), who tell theirs: at once
        where it was left (``origin`` None), not on the next step's path; passed on, with the next message."""
        ctx = self.grad.release(ctx_id)
        if ctx is None or not self.running:
            return
        for peer in ctx.peers - {self.name, origin}:
            link = self.peers.route(peer)
            if link is not None:
                env: Envelope = {"k": "ctx", "ctx": ctx_id}
                link.send(env, now=True) if origin is None else link.post(env)

    # -- calling ------------------------------------------------------------------------------------------
    def timeout(self, timeout: float | None) -> float:
        """A call's timeout in seconds: negative (or None) means the world's default, 0 means none."""
        if timeout is None:
            return self.default_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout != timeout:
            raise TypeError(f"timeout is a number of seconds (-1: the default, 0: none), got {timeout!r}")
        return self.default_timeout if timeout < 0 else float(timeout)

    def call(self, to: object, fn: Callable[..., Any], args: Sequence[Any] = (),
             kwargs: dict[str, Any] | None = None, timeout: float | None = -1.0, *,
             rref: tuple[str, str] | None = None, snapshot: bool = True, now: bool = False) -> Future[Any]:
        """Start ``fn(*args, **kwargs)`` on ``to``; the future completes with its result or error.

        ``snapshot=False``: a blocking call (the caller's arrays cannot change meanwhile; this thread sends
        it and receives its reply). ``now``: send it from this thread at once, not from the IO thread."""
        self._check_running()
        _check_call(fn, args, kwargs)
        peers = self.peers
        dest = peers.resolve(to)
        name = fn_name(fn)
        t = self.timeout(timeout)
        peer = None if dest.name == self.name else peers.peer(dest.name)
        link = None if peer is None else peers.link(peer)  # before anything is pickled
        env: Envelope = {"k": "call", "fn": name, "caller": self.name, "to": t}  # its id once it is pending
        if rref is not None:
            env["rref"] = list(rref)
        lent = rref_lending.set(not snapshot and link is not None)  # its RRefs live until the reply
        try:
            frames = oneway.pickled(self, dest.name, env, fn, args, kwargs)
        finally:
            rref_lending.reset(lent)
        if link is not None and link.same_host and len(frames) > 1:  # big frames go by shared memory (copied
            env, frames = self._export(dest.name, env, frames)  # now); frames[0], a pickle stream, never does
        if snapshot or link is None:
            # The caller may change its arrays as soon as we return: send what it passed. A self-call
            # copies too, so that it shares no memory with the caller, exactly like a remote one.
            frames = copied(frames)
        fut: Future[Any] = Future()
        fut.label = (dest.name, name)  # what a long wait on it is about (shown by the notebook layer)
        pending = Pending(fut, dest.name, name, t, time.monotonic() + t if t > 0 else None,
                          contextvars.copy_context(), env.get("ag"),
                          not introspecting.get())
        call_id = env["id"] = self.calls.add(pending)
        fut.on_interrupt = lambda: self._cancel(call_id, pending)
        if link is None:
            self.server.serve([(env, list(frames))], self._self_reply, self.name)
            return fut
        self._notify_shm(dest.name, link)
        pump = None if snapshot else link.send_own_reply(env, frames)
        if pump is not None:  # a blocking call: this thread receives its own reply
            fut.set_pump(pump)
        else:
            link.send(env, frames, now=now or not snapshot)
        # The worker was lost (or removed, or restarted) between the lookup and now: its pending calls were
        # failed before this one was added, and its link is dropped by the IO thread, later. Its loss is
        # marked before each of those sweeps, so a call that one missed sees it here.
        if link.closed or (peer is not None and peer.lost is not None):
            self._fail_pending(dest.name, lambda p: WorkerLostError(
                f"worker {dest.name!r} left the world while {p.fn} was being sent (it died, or was removed or "
                f"restarted); once rpc.restart_worker({dest.name!r}) or rpc.add_worker has run, call it again",
                dest.name), only=call_id)
        return fut

    def notify(self, to: str, fn: Callable[..., Any], args: Sequence[Any] = (),
               **how: Any) -> Callable[[float], None] | None:
        """Run ``fn(*args)`` on ``to`` with no reply and nothing pending here (``oneway.notify``: ``wake``, ``own``,
        ``grad``, ``failed``)."""
        return oneway.notify(self, to, fn, args, **how)

    def report_hop(self, root: str, ctx_id: int, run: int, hop: str, hops: list[tuple[str, str]],
                   error: BaseException | None) -> None:
        """Tell the root of backward pass ``run`` that ``hop`` is over (``oneway.report_hop``)."""
        oneway.report_hop(self, root, ctx_id, run, hop, hops, error)

    def remote(self, to: object, fn: Callable[..., Any], args: Sequence[Any] = (),
               kwargs: dict[str, Any] | None = None, timeout: float | None = -1.0) -> RRef[Any]:
        """Create ``fn(*args, **kwargs)`` on ``to`` and return an RRef to it at once."""
        dest = self.peers.resolve(to)
        rref_id, token = self.peers.new_id_for(dest.name, self.table), new_id()
        fut = self.call(dest, fn, args, kwargs, timeout, rref=(rref_id, token))
        return RRef._make(self, dest, rref_id, token, fut)

    def _notify_shm(self, peer: str, link: Link) -> None:
        """Shared-memory news for ``peer`` rides ahead of our next message to it (see ``shm``)."""
        news = self.shm.pending_for(peer)
        if news:
            link.post({"k": "shm", **news})  # type: ignore[typeddict-item]

    def _export(self, dest: str, env: Envelope, frames: Sequence[Any]) -> tuple[Envelope, list[Any]]:
        exported, out = self.shm.export(dest, cast(dict[str, Any], env), list(frames))
        return cast(Envelope, exported), out

    def _self_reply(self, env: Envelope, frames: list[Any]) -> None:
        replies.deliver(self.calls, self.grad, self.name, env, copied(frames))

    def _cancel(self, call_id: int, pending: Pending) -> None:
        self.calls.take(call_id)
        pending.fut._fail(CallCancelledError(
            f"call {pending.fn} on {pending.peer!r} was cancelled by KeyboardInterrupt"))
        self._send_to(pending.peer, {"k": "cancel", "id": call_id})

    def _send_to(self, name: str, env: Envelope) -> None:
        """Best-effort control message (a cancellation)."""
        if name == self.name:
            self.server.serve([(env, [])], self._self_reply, self.name)
            return
        link = self.peers.route(name)
        if link is not None:
            link.send(env)

    # -- what arrives (IO thread, a worker's comm, or the executor for self-calls) -----------------------------
    def _on_message(self, link: Connection, items: list[tuple[Envelope, list[Buffer]]]) -> None:
        self.receive(link.name, items, link)

    def receive(self, peer: str, items: Sequence[tuple[Envelope, list[Any]]], link: Link) -> None:
        """What ``peer`` sent on ``link``, in order: replies complete our calls, requests are served."""

        self.leases.heard(peer)

        def reply(env: Envelope, frames: list[Any]) -> None:
            if link.same_host and len(frames) > 1:  # frames[0], a pickle stream, never goes by shared memory
                exported_env, exported = self._export(peer, env, frames)
                if exported is not frames:  # copied into shared memory: let the originals go before we
                    frames.clear()  # tell the peer which of its segments we no longer need
                env, frames = exported_env, exported
            self._notify_shm(peer, link)
            link.send(env, frames, now=True)

        for env, frames in items:
            kind = env["k"]
            if "shm" in env:  # frames that came by shared memory
                try:
                    frames = self.shm.attach(peer, env["shm"], frames)
                except (OSError, ProtocolError) as exc:
                    replies.unreadable(self.calls, self.name, peer, env, reply,
                                       f"its shared-memory buffers cannot be mapped here: {exc}")
                    continue
            if kind == "part":  # a piece of a message too big for the channel (see batching.split_parts)
                whole = self._parts.add(peer, env, frames)
                if whole is not None:
                    self.receive(peer, envelope.unpack(whole[0], whole[1]), link)
            elif kind in REPLIES:
                replies.deliver(self.calls, self.grad, peer, env, frames)
            elif kind == "shm":
                self.shm.returned(peer, env.get("free", []))
                self.shm.dropped(env.get("drop", []))
            elif kind not in ("ack", "lease"):
                self.server.serve([(env, frames)], reply, peer)

    def _on_lost(self, link: Connection, why: str) -> None:
        peer = self.peers.get(link.name)
        if peer is None or peer.link is not link:
            return
        peer.lost = why
        self.shm.peer_lost(link.name)
        log_hint = f" (its log: {peer.log_path})" if peer.log_path else ""
        self._fail_pending(link.name, lambda p: WorkerLostError(
            f"worker {link.name!r} is gone: {why}; {p.fn} failed{log_hint}. "
            f"Replace it with rpc.restart_worker({link.name!r}) (a kernel nbremote started), or with "
            f"rpc.remove_worker({link.name!r}) and rpc.add_worker(...)", link.name))
        self.grad.peer_lost(link.name, why)
        for hook in list(self.on_peer_lost):
            hook(link.name, why)

    def _fail_pending(self, worker: str, make: Callable[[Pending], BaseException], only: int | None = None) -> None:
        for p in self.calls.for_peer(worker, only):
            p.fut._fail(make(p))

    def _tick(self, now: float) -> None:
        """The IO thread's timer (every 50 ms): deadlines, what waits to be sent, the ``on_tick`` hooks."""
        self._executor.check(now)
        for cid, p in self.calls.expired(now):
            p.fut._fail(RPCTimeoutError(
                f"RPC ran for more than {p.timeout * 1000:.0f} ms and timed out: {p.fn} on {p.peer!r}. "
                "Pass a larger timeout= (0 means none), or check what the call waits for. It was cancelled "
                "there: it stops at its next Python bytecode; if it is blocked in C code it runs on until that "
                f"call returns -- rpc.restart_worker({p.peer!r}) stops it for good"))
            self._send_to(p.peer, {"k": "cancel", "id": cid})
        bufpool.POOL.trim()  # receive memory unused for a while is let go
        self.refs.flush()
        for owner, news in self.shm.pending().items():
            link = self.peers.route(owner)
            if link is not None:
                link.send({"k": "shm", **news})  # type: ignore[typeddict-item]
        for hook in self.on_tick:
            hook(now)

    def forget_caller(self, caller: str, why: str) -> tuple[int, int]:
        """``caller`` is gone for good (its lease ran out): free what it held here and close its routes;
        returns how many values and autograd contexts were released."""
        freed = self.table.release_holder(caller)
        peer = self.peers.get(caller)
        link = self.peers.caller(caller)
        contexts = self.grad.release_touched_by(caller)
        self.shm.peer_lost(caller)
        self._parts.forget(caller)
        if link is not None:
            self.detach_caller(link, why)
        if peer is not None and caller == self.peers.driver:
            self.peers.world_members = None  # the driver is gone: the next one to bootstrap us makes a new world
        return freed, contexts

    # -- lifecycle --------------------------------------------------------------------------------------
    def close(self) -> None:
        self.state = "shut_down"
        peers = self.peers.clear()
        for p in self.calls.clear():
            p.fut._fail(NotInitializedError(f"nbremote RPC was shut down while {p.fn} was pending"))
        for peer in peers:
            if peer.link is not None:
                self.io.drop(peer.link)
        self.io.stop()
        self._executor.shutdown()
        self.table.clear()
        self.grad.clear()
        self.shm.close()
        capture.uninstall()
        current.clear(self)


def _check_call(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None) -> None:
    if not callable(fn):
        raise TypeError(f"the function to call must be callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args of a call to {fn_name(fn)} is a tuple of positional arguments, e.g. args=(x,), "
                        f"not {type(args).__name__}")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise TypeError(f"kwargs of a call to {fn_name(fn)} is a dict of keyword arguments by name, "
                        f"not {type(kwargs).__name__}")
