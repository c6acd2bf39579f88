"""The per-process RPC engine: peers, pending calls, timeouts, output routing, RRef bookkeeping.

One ``Agent`` runs in the driver and one in every worker kernel; every member calls every other.
Workers call each other over links of their own, and call the driver back through the comm the
driver opened on them (the driver is no kernel to connect to): ``_link`` picks the route.
Calling: the caller's thread pickles the call (so a bad argument fails at once, in the caller's cell),
registers a ``Pending`` entry and queues the envelope on the link. What arrives (``receive``, from the
IO thread or a worker's comm) is split: replies are delivered here -- output is replayed in the
calling cell's context (captured with ``contextvars.copy_context()`` at call time, which is how
ipykernel routes output to a cell), results and errors complete the future -- and requests are run by
this process's ``Server`` (_serving). A self-call takes that same path without a socket.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from nbremote.errors import (
    CallCancelledError,
    NotInitializedError,
    ProtocolError,
    RemoteError,
    RemoteTraceback,
    RPCTimeoutError,
    SerializationError,
    UnknownWorkerError,
    WorkerError,
    WorkerLostError,
)
from nbremote.frameworks import GradTrack, grad_tracking
from nbremote.rpc._core import capture, current, gradctx
from nbremote.rpc._core.future import Future
from nbremote.rpc._core.members import WorkerInfo
from nbremote.rpc._core.owners import OwnerTable
from nbremote.rpc._core.pool import Pool
from nbremote.rpc._core.rref import RRef, new_id
from nbremote.rpc._core.serving import Server
from nbremote.rpc._transport import open_link
from nbremote.rpc._transport.base import Connection, Link
from nbremote.rpc._transport.iothread import IOThread
from nbremote.rpc._transport.shm import SharedMemory
from nbremote.rpc._wire import batching, envelope, serialize
from nbremote.rpc._wire.envelope import REPLIES, Buffer, Envelope
from nbremote.rpc._wire.lease import LEASE_SECONDS, Leases
from nbremote.rpc._wire.serialize import sending_to

log = logging.getLogger("nbremote")

DEFAULT_TIMEOUT = 60.0
CONNECT_TIMEOUT = 30.0

# Calls made while this is set are nbremote looking at itself (a panel or dashboard refreshing): they do
# not count in the calls a status display reports.
_introspecting: contextvars.ContextVar[bool] = contextvars.ContextVar("nbremote_introspecting", default=False)


def current_agent() -> Agent:
    """This process's agent (``current``'s one member), or ``NotInitializedError`` saying what to do."""
    slot = current._current  # read here, not through current.current(): one Python frame less per call
    if slot and isinstance(slot[0], Agent):
        return slot[0]
    raise current._not_initialized()


def current_agent_or_none() -> Agent | None:
    member = current.current_or_none()
    return member if isinstance(member, Agent) else None


@contextlib.contextmanager
def introspection() -> Iterator[None]:
    """Calls made inside are not counted in ``call_counts`` (status displays must not count themselves)."""
    token = _introspecting.set(True)
    try:
        yield
    finally:
        _introspecting.reset(token)


@dataclass(eq=False)
class Peer:
    info: WorkerInfo
    conn: dict[str, Any] | None = None  # how to reach it (workers connect lazily)
    log_path: str | None = None  # where its kernel's log is, where the driver knows (named when it is lost)
    link: Connection | None = None  # a KernelLink, or a ServerLink for a server-hosted kernel
    lost: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return self.info.name


@dataclass(eq=False)
class Pending:
    fut: Future[Any]
    peer: str
    fn: str
    timeout: float
    deadline: float | None
    ctx: contextvars.Context
    autograd: int | None = None  # the distributed autograd context the call was made in
    counted: bool = True  # False for introspection (see ``introspection``)
    line_start: dict[str, bool] | None = None  # by stream: whether its text so far ended a line (made on first out)


def fn_name(fn: object) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return str(name) if name else type(fn).__name__


def _copied(frames: Sequence[Any]) -> list[Any]:
    """The frames with every out-of-band buffer copied (frames[0], the pickle stream, is bytes already)."""
    return [frames[0], *(bytearray(f) for f in frames[1:])] if frames else []  # writable, like received frames


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
        self.leases = Leases()  # on a worker: the callers holding state here (see _lease)
        self._parts = batching.Parts()  # messages arriving in pieces (see batching.split_parts)
        self._last_tick = time.monotonic()
        self.world_members: set[str] | None = None  # a worker's world, as the driver last told it
        self.on_expired: list[Callable[[str], None]] = []  # run when a caller's lease runs out
        self.on_peer_lost: list[Callable[[str, str], None]] = []  # (name, why): a peer's kernel is gone
        self.starting: Callable[[str], bool] = lambda name: False  # the driver: is ``name`` (re)starting?
        self.peers: dict[str, Peer] = {}
        self._callers: dict[str, Link] = {}  # comms callers opened on this kernel: the way to call them back
        self.state = "running"
        self._lock = threading.Lock()
        self._pending: dict[int, Pending] = {}
        self._ids = itertools.count(1)
        # RRefs garbage collected, to release: appended by finalizers (a deque: appends and pops need no lock)
        self._releases: collections.deque[tuple[str, str, str]] = collections.deque()
        self._calls_made: collections.Counter[str] = collections.Counter()  # per peer, for status displays
        self._executor = Pool(name)
        self.server = Server(name, self.table, self.grad, self._executor, self.update_world)
        self.world: object = None  # the driver's membership manager (_driver.World); None on workers
        self.io = IOThread(name, self._tick)
        capture.install()

    @property
    def running(self) -> bool:
        return self.state == "running"

    def _check_running(self) -> None:
        if self.state != "running":
            raise NotInitializedError(
                f"nbremote RPC on {self.name!r} is {self.state.replace('_', ' ')}: no more calls can be made; "
                "call rpc.init_rpc(...) to start a new world")

    # -- membership ---------------------------------------------------------------------------------------
    def add_peer(self, peer: Peer) -> None:
        with self._lock:
            self.peers[peer.name] = peer
        if peer.link is not None:
            self.io.adopt(peer.link, self._on_message, self._on_lost)

    def remove_peer(self, name: str, why: str) -> Peer | None:
        with self._lock:
            peer = self.peers.pop(name, None)
        if peer is None:
            return None
        peer.lost = peer.lost or why
        if peer.link is not None:
            self.io.drop(peer.link)
        self.shm.peer_lost(name)
        self._fail_pending(name, lambda p: WorkerLostError(
            f"worker {name!r} was removed ({why}) while {p.fn} was pending on it", name))
        return peer

    def admits(self, caller: str) -> bool:
        """Whether ``caller`` may open a link to this worker: anyone until the driver has told us the world
        (the first caller is the driver bootstrapping us), then its members only."""
        members = self.world_members
        return members is None or caller in members

    def attach_caller(self, link: Link) -> None:
        """A caller opened a comm on this kernel: calls to it can go back through that comm."""
        with self._lock:
            self._callers[link.name] = link
        self.leases.hold(link.name)

    def detach_caller(self, link: Link, why: str) -> None:
        """The comm ``link`` was closed; calls to its caller that could only take that route fail."""
        with self._lock:
            if self._callers.get(link.name) is not link:
                return
            del self._callers[link.name]
            peer = self.peers.get(link.name)
        if peer is None or (peer.link is None and peer.conn is None):
            self._fail_pending(link.name, lambda p: WorkerLostError(
                f"{link.name!r} is gone ({why}) while {p.fn} was pending on it", link.name))

    def call_counts(self, name: str) -> tuple[int, int]:
        """(calls in flight, calls made) from this process to ``name``, for status displays."""
        with self._lock:
            in_flight = sum(1 for p in self._pending.values() if p.peer == name and p.counted)
        return in_flight, self._calls_made[name]

    def known(self) -> list[str]:
        return [self.name, *sorted(self.peers, key=lambda n: self.peers[n].info.id)]

    def resolve(self, to: object) -> WorkerInfo:
        """A name, rank or WorkerInfo -> the member's WorkerInfo (clear error listing who exists)."""
        if isinstance(to, WorkerInfo):
            key: object = to.name
        elif isinstance(to, bool) or not isinstance(to, (str, int)):
            raise TypeError(f"an RPC destination is a worker name, rank or WorkerInfo, not {type(to).__name__}")
        else:
            key = to
        if key == self.name or key == self.rank:
            return self.info
        named = self.peers.get(key) if isinstance(key, str) else None  # the common case, without a scan
        if named is not None:
            return named.info
        with self._lock:
            for peer in self.peers.values():
                if key == peer.name or key == peer.info.id:
                    return peer.info
        if isinstance(key, str) and self.starting(key):  # not "unknown": add_worker would be the wrong fix
            raise WorkerLostError(
                f"worker {key!r} is being (re)started: its old kernel is gone and the new one is not ready; "
                "call it again once rpc.restart_worker / rpc.add_worker has returned", key)
        raise UnknownWorkerError(
            f"no worker {to!r} in this world (known: {', '.join(f'{n}' for n in self.known())}); "
            "start it with rpc.add_worker(name)", str(to))

    def _peer(self, name: str) -> Peer:
        with self._lock:
            peer = self.peers.get(name)
        if peer is None:
            raise UnknownWorkerError(f"worker {name!r} is not in this world any more", name)
        return peer

    def _link(self, peer: Peer) -> Link:
        """How to reach ``peer``: our own link to its kernel (opened on first use), else its comm on us."""
        if peer.lost is not None:
            raise WorkerLostError(
                f"worker {peer.name!r} is gone ({peer.lost}); rpc.restart_worker({peer.name!r}) starts a fresh "
                f"kernel in its place (one nbremote started), or remove it with rpc.remove_worker({peer.name!r}) "
                "and start a new one", peer.name)
        if peer.link is not None:
            return peer.link
        if peer.conn is None:
            # No kernel of its own to connect to (the driver), or one we cannot reach (behind the driver's
            # SSH tunnel): call it back through the comm it opened on us, if it did.
            with self._lock:
                channel = self._callers.get(peer.name)
            if channel is not None and not channel.closed:
                return channel
            if peer.info.id == 0:
                raise WorkerLostError(
                    f"{peer.name!r} cannot be called from {self.name!r}: its comm to this worker is closed "
                    "(the driver detached or shut down)", peer.name)
            raise WorkerError(
                f"{peer.name!r} cannot be called from {self.name!r}: it is reached through the driver's SSH "
                "tunnel, which other workers cannot use; call it from the driver", peer.name)
        with peer.lock:
            if peer.link is None:
                link = open_link(peer.name, peer.conn)  # zmq, or through the same server for a server-hosted peer
                try:
                    link.open(self.name, bootstrap=None, timeout=CONNECT_TIMEOUT, shm=self.shm)
                except BaseException:
                    link.close()
                    raise
                peer.link = link
                self.io.adopt(link, self._on_message, self._on_lost)
        return peer.link

    def _existing_link(self, peer: Peer) -> Link | None:
        """A route to ``peer`` that needs no connecting (for best-effort control messages), or None."""
        if peer.lost is not None:
            return None
        if peer.link is not None:
            return peer.link
        with self._lock:
            return self._callers.get(peer.name)

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
             rref: tuple[str, str] | None = None, snapshot: bool = True) -> Future[Any]:
        """Start ``fn(*args, **kwargs)`` on ``to``; the future completes with its result or error."""
        self._check_running()
        if not callable(fn):
            raise TypeError(f"the function to call must be callable, got {type(fn).__name__}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args of a call to {fn_name(fn)} is a tuple of positional arguments, e.g. args=(x,), "
                            f"not {type(args).__name__}")
        if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
            raise TypeError(f"kwargs of a call to {fn_name(fn)} is a dict of keyword arguments by name, "
                            f"not {type(kwargs).__name__}")
        dest = self.resolve(to)
        name = fn_name(fn)
        t = self.timeout(timeout)
        link = None if dest.name == self.name else self._link(self._peer(dest.name))  # before anything is pickled
        counted = not _introspecting.get()
        if counted:
            self._calls_made[dest.name] += 1
        call_id = next(self._ids)
        env: Envelope = {"k": "call", "id": call_id, "fn": name, "caller": self.name, "to": t}
        if rref is not None:
            env["rref"] = list(rref)
        autograd = gradctx.current.get()
        grad_ctx = None if autograd is None else self.grad.get(autograd)
        track = None if grad_ctx is None else GradTrack()
        token = sending_to.set(dest.name)
        tracking = grad_tracking.set(track)
        try:
            frames = serialize.dumps({"fn": fn, "args": tuple(args), "kwargs": dict(kwargs or {})},
                                      named_roots=True)
        except SerializationError as exc:
            raise SerializationError(f"cannot send the call {name} to {dest.name!r}: {exc}") from exc.__cause__
        finally:
            grad_tracking.reset(tracking)
            sending_to.reset(token)
        if grad_ctx is not None:  # record the call in its autograd context (see _gradctx)
            env["ag"] = grad_ctx.id
            grad_ctx.touch(dest.name)
            if track:
                env["ags"] = self.grad.record_send(grad_ctx, dest.name, track.sent)
        if link is not None and link.same_host and len(frames) > 1:  # big frames go by shared memory (copied
            env, frames = self._export(dest.name, env, frames)  # now); frames[0], a pickle stream, never does
        if snapshot or link is None:
            # The caller may change its arrays as soon as we return: send what it passed. A self-call
            # copies too, so that it shares no memory with the caller, exactly like a remote one.
            frames = _copied(frames)
        fut: Future[Any] = Future()
        fut.label = (dest.name, name)  # what a long wait on it is about (shown by the notebook layer)
        pending = Pending(fut, dest.name, name, t, time.monotonic() + t if t > 0 else None,
                          contextvars.copy_context(), None if grad_ctx is None else grad_ctx.id, counted)
        fut.on_interrupt = lambda: self._cancel(call_id, pending)
        with self._lock:
            self._pending[call_id] = pending
        if link is None:
            self.serve([(env, list(frames))], self._self_reply, self.name)
            return fut
        self._notify_shm(dest.name, link)
        pump = None if snapshot else link.send_own_reply(env, frames)
        if pump is not None:  # a blocking call: this thread receives its own reply
            fut.set_pump(pump)
        else:
            link.send(env, frames, now=not snapshot)
        if link.closed:  # the link was dropped between the lookup and the send: nothing will answer
            self._fail_pending(dest.name, lambda p: WorkerLostError(
                f"worker {dest.name!r} left the world while {p.fn} was being sent (it died, or was removed or "
                f"restarted); once rpc.restart_worker({dest.name!r}) or rpc.add_worker has run, call it again",
                dest.name), only=call_id)
        return fut

    def remote(self, to: object, fn: Callable[..., Any], args: Sequence[Any] = (),
               kwargs: dict[str, Any] | None = None, timeout: float | None = -1.0) -> RRef[Any]:
        """Create ``fn(*args, **kwargs)`` on ``to`` and return an RRef to it at once."""
        dest = self.resolve(to)
        rref_id, token = new_id(), new_id()
        fut = self.call(dest, fn, args, kwargs, timeout, rref=(rref_id, token))
        return RRef._make(self, dest, rref_id, token, fut)

    def _notify_shm(self, peer: str, link: Link) -> None:
        """Shared-memory news for ``peer`` rides ahead of our next message to it (see _shm)."""
        news = self.shm.pending_for(peer)
        if news:
            link.post({"k": "shm", **news})  # type: ignore[typeddict-item]

    def _export(self, dest: str, env: Envelope, frames: Sequence[Any]) -> tuple[Envelope, list[Any]]:
        exported, out = self.shm.export(dest, cast(dict[str, Any], env), list(frames))
        return cast(Envelope, exported), out

    def _self_reply(self, env: Envelope, frames: list[Any]) -> None:
        self._on_reply(self.name, env, _copied(frames))

    def _cancel(self, call_id: int, pending: Pending) -> None:
        with self._lock:
            self._pending.pop(call_id, None)
        pending.fut.set_exception(CallCancelledError(
            f"call {pending.fn} on {pending.peer!r} was cancelled by KeyboardInterrupt"))
        self._send_to(pending.peer, {"k": "cancel", "id": call_id})

    def _send_to(self, name: str, env: Envelope) -> None:
        """Best-effort control message (cancel, reference counts)."""
        if name == self.name:
            self.serve([(env, [])], self._self_reply, self.name)
            return
        with self._lock:
            peer = self.peers.get(name)
        link = None if peer is None else self._existing_link(peer)
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
                    self._unreadable(peer, env, reply, f"its shared-memory buffers cannot be mapped here: {exc}")
                    continue
            if kind == "part":  # a piece of a message too big for the channel (see batching.split_parts)
                whole = self._parts.add(peer, env, frames)
                if whole is not None:
                    self.receive(peer, envelope.unpack(whole[0], whole[1]), link)
            elif kind in REPLIES:
                self._on_reply(peer, env, frames)
            elif kind == "shm":
                self.shm.returned(peer, env.get("free", []))
                self.shm.dropped(env.get("drop", []))
            elif kind not in ("ack", "lease"):
                self.serve([(env, frames)], reply, peer)

    def _unreadable(self, peer: str, env: Envelope, reply: capture.Reply, why: str) -> None:
        """A message whose buffers could not be read: fail the call it belongs to, on whichever side."""
        if env["k"] == "call":
            reply({"k": "err", "id": env["id"], "type": "nbremote.errors.SerializationError",
                   "msg": f"the call {env.get('fn')} from {peer!r} reached {self.name!r}, but {why}", "tb": ""}, [])
        elif env["k"] in ("ok", "err"):
            with self._lock:
                pending = self._pending.pop(env["id"], None)
            if pending is not None:
                pending.fut.set_exception(SerializationError(f"the result of {pending.fn} on {peer!r}: {why}"))

    def _on_reply(self, worker: str, env: Envelope, frames: list[Any]) -> None:
        kind = env["k"]
        if kind == "out":
            with self._lock:
                pending = self._pending.get(env["id"])
            if pending is not None:
                stream = env.get("stream", "stdout")
                starts = pending.line_start
                if starts is None:
                    starts = pending.line_start = {"stdout": True, "stderr": True}
                starts[stream] = pending.ctx.run(capture.emit, worker, stream, env.get("text", ""), starts[stream])
            return
        if kind not in ("ok", "err"):
            return
        with self._lock:
            pending = self._pending.pop(env["id"], None)
        if pending is None:
            return  # timed out or cancelled already
        if kind == "ok":
            grad_ctx = None
            if pending.autograd is not None and "ags" in env:
                grad_ctx = self.grad.get(pending.autograd)
            track = None if grad_ctx is None else GradTrack()
            tracking = grad_tracking.set(track)
            try:
                value = serialize.loads(frames)
            except SerializationError as exc:
                pending.fut.set_exception(SerializationError(
                    f"the result of {pending.fn} on {worker!r} cannot be unpickled here: {exc}"))
                return
            finally:
                grad_tracking.reset(tracking)
            if grad_ctx is not None and track:
                grad_ctx.record_recv(worker, env["ags"], track.received)
            pending.fut.set_result(value)
        else:
            pending.fut.set_exception(self._remote_error(worker, pending.fn, env, frames))

    def _remote_error(self, worker: str, fn: str, env: Envelope, frames: list[Any]) -> BaseException:
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

    def _on_lost(self, link: Connection, why: str) -> None:
        with self._lock:
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
        for hook in list(self.on_peer_lost):
            hook(link.name, why)

    def _fail_pending(self, worker: str, make: Callable[[Pending], BaseException], only: int | None = None) -> None:
        with self._lock:
            dead = [(cid, p) for cid, p in self._pending.items()
                    if p.peer == worker and (only is None or cid == only)]
            for cid, _ in dead:
                del self._pending[cid]
        for _, p in dead:
            p.fut.set_exception(make(p))

    def _tick(self, now: float) -> None:
        self._executor.check(now)
        with self._lock:
            expired = [(cid, p) for cid, p in self._pending.items() if p.deadline is not None and now > p.deadline]
            for cid, _ in expired:
                del self._pending[cid]
        for cid, p in expired:
            p.fut.set_exception(RPCTimeoutError(
                f"RPC ran for more than {p.timeout * 1000:.0f} ms and timed out: {p.fn} on {p.peer!r}. "
                "Pass a larger timeout= (0 means none), or check what the call waits for. It was cancelled "
                "there: it stops at its next Python bytecode; if it is blocked in C code it runs on until that "
                f"call returns -- rpc.restart_worker({p.peer!r}) stops it for good"))
            self._send_to(p.peer, {"k": "cancel", "id": cid})
        if self._releases:
            self._flush_releases()
        for owner, news in self.shm.pending().items():
            with self._lock:
                peer = self.peers.get(owner)
            link = None if peer is None else self._existing_link(peer)
            if link is not None:
                link.send({"k": "shm", **news})  # type: ignore[typeddict-item]
        if self.role == "worker":
            stalled = now - self._last_tick - 0.5  # ticks come every 50 ms: a gap is a stall of ours
            if stalled > 0:
                self.leases.extend(stalled)
            self._last_tick = now
            for caller in self.leases.expired(now):
                self._expire(caller)

    def _expire(self, caller: str) -> None:
        """``caller``'s lease ran out (see _lease): free what it held here and close its links."""
        freed = self.table.release_holder(caller)
        with self._lock:
            peer = self.peers.get(caller)
            link = self._callers.get(caller)
        contexts = self.grad.release_touched_by(caller)
        self.shm.peer_lost(caller)
        self._parts.forget(caller)
        if link is not None:
            self.detach_caller(link, f"its lease ran out: nothing heard from it for {LEASE_SECONDS:.0f} s")
        if peer is not None and peer.info.id == 0:
            self.world_members = None  # the driver is gone: the next one to bootstrap us makes a new world
        for hook in list(self.on_expired):
            with contextlib.suppress(Exception):
                hook(caller)
        print(f"nbremote: {caller!r} was not heard from for {LEASE_SECONDS:.0f} s: released what it held here "
              f"({freed} value(s), {contexts} autograd context(s))", file=sys.__stderr__, flush=True)

    # -- serving (see _serving) ---------------------------------------------------------------------------
    def serve(self, items: Sequence[tuple[Envelope, list[Any]]], reply: capture.Reply, caller: str) -> None:
        self.server.serve(items, reply, caller)

    def update_world(self, peers: list[dict[str, Any]]) -> None:
        """A worker learns who its peers are (sent by the driver whenever membership changes)."""
        if self.role == "driver":  # the driver makes the world; no worker tells it who is in it
            return
        self.world_members = {str(p["name"]) for p in peers}
        names = set()
        for p in peers:
            name, rank, conn = p["name"], int(p["rank"]), p.get("conn")
            names.add(name)
            if name == self.name:
                continue
            with self._lock:
                known = self.peers.get(name)
            if known is None or known.info.id != rank:
                self.add_peer(Peer(WorkerInfo(name, rank), conn=conn))
            elif p.get("lost") and known.lost is None:
                # The driver saw it die (it polls the process); our own heartbeat would take ~2 s more.
                why = f"the driver saw it go: {p['lost']}"
                if known.link is not None:
                    self.io.lose(known.link, why)
                else:
                    known.lost = why
        for name in [n for n in self.peers if n not in names]:
            self.remove_peer(name, "it left the world")

    # -- RRef reference counts ------------------------------------------------------------------------------
    def fork_rref(self, owner: str, rref_id: str, token: str, holder: str) -> None:
        """Count a new reference, held by ``holder``, before the message carrying it leaves (see _rref)."""
        if owner == self.name:
            self.table.add(rref_id, token, holder)
            return
        # Queued without waking the IO thread: the message being pickled drains the outbox (in order)
        # when it is sent, so the count usually rides in the same comm message; the IO thread's tick
        # sends it otherwise.
        self._link(self._peer(owner)).post({"k": "rref", "add": [[rref_id, token, holder]]})

    def release_rref(self, owner: str, rref_id: str, token: str) -> None:
        """Called when an RRef object is garbage collected: never blocks, never raises.

        A collection can run in any thread at any allocation -- also in one that holds the owner table's
        lock (allocating a new entry) -- so a value of ours is released here only if its lock is free at
        once; otherwise, like a value owned elsewhere, on the IO thread's next tick.
        """
        if self.state != "running":
            return
        if owner == self.name and self.table.try_remove(rref_id, token):
            return
        self._releases.append((owner, rref_id, token))

    def _flush_releases(self) -> None:
        by_owner: dict[str, list[list[str]]] = {}
        while True:
            try:
                owner, rref_id, token = self._releases.popleft()
            except IndexError:
                break
            if owner == self.name:
                self.table.remove(rref_id, token)
            else:
                by_owner.setdefault(owner, []).append([rref_id, token])
        for owner, rm in by_owner.items():
            with self._lock:
                peer = self.peers.get(owner)
            if peer is None or peer.lost is not None:
                continue
            link = self._existing_link(peer)
            if link is not None:
                link.send({"k": "rref", "rm": rm})
            else:  # connecting blocks: not on the IO thread
                self._executor.submit(self._send_release, peer, rm)

    def _send_release(self, peer: Peer, rm: list[list[str]]) -> None:
        try:
            self._link(peer).send({"k": "rref", "rm": rm})
        except Exception:
            log.debug("could not release RRefs on %r", peer.name, exc_info=True)

    # -- lifecycle --------------------------------------------------------------------------------------
    def wait_idle(self, timeout: float | None) -> None:
        """Wait for this process's pending calls (graceful shutdown)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = [p.fut for p in self._pending.values()]
            if not pending:
                return
            for fut in pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                with contextlib.suppress(Exception):  # failures belong to whoever made the call
                    fut.wait(left)
            if deadline is not None and time.monotonic() >= deadline:
                return

    def close(self) -> None:
        self.state = "shut_down"
        with self._lock:
            peers = list(self.peers.values())
            self.peers.clear()
            self._callers.clear()
            pending = list(self._pending.values())
            self._pending.clear()
        for p in pending:
            p.fut.set_exception(NotInitializedError(f"nbremote RPC was shut down while {p.fn} was pending"))
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
