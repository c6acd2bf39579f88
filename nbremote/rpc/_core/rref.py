"""Remote references, the user side: ``RRef`` objects, their proxies, and the reference counts they send.

An RRef names a value living on its *owner* (``owners.OwnerTable`` counts the references to it there).
Each RRef object holds one *token*. Pickling an RRef for another process *forks* it: a new token, counted
at the owner (``add``) before the message carrying it leaves; an RRef object that is garbage collected
releases its token (``rm``), never blocking and never raising, from whatever thread the collector runs in.
An RRef that a blocking call (``rpc_sync``) brings to its owner is *lent* instead: the caller's arguments
live until the reply, so its RRef keeps the value alive for the whole call, and the owner counts the token
of the copy it unpickles itself -- no ``add`` travels (a message of its own, ahead of the call, that the
owner had to wake for: it made such a call 1.5x as slow as one without the RRef).

Every member owns RRefs alike, the driver included: an RRef the driver owns is a real reference on the
workers (they call the driver back through its comm), and nothing travels by value unless
``to_here()`` asks for it. What this module needs of the process's agent is ``current.Member`` (the agent,
which imports this module, is one).
"""

from __future__ import annotations

import collections
import contextvars
import logging
import uuid
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from nbremote.errors import RRefError
from nbremote.rpc._core import current, gradctx
from nbremote.rpc._core.current import Member
from nbremote.rpc._core.future import Future
from nbremote.rpc._core.members import WorkerInfo
from nbremote.rpc._core.owners import OwnerTable
from nbremote.rpc._core.peers import Peer, Peers
from nbremote.rpc._core.serving import AsyncResult, is_async_execution
from nbremote.rpc._wire.serialize import sending_to

__all__ = ["RRef", "RefCounts", "adopt", "fetch_value", "held_reference", "invoke_method", "new_id", "owned_value"]

log = logging.getLogger("nbremote")

T = TypeVar("T")

#: set by the agent while it pickles a blocking call to another process: its RRefs are lent (see above)
lending: contextvars.ContextVar[bool] = contextvars.ContextVar("nbremote_lending", default=False)


def new_id() -> str:
    return uuid.uuid4().hex


def owned_value(rref_id: str) -> Any:
    """The value of an RRef this process owns, by id: for owner-side code whose caller holds the RRef
    for the whole call (so no reference count needs to travel with it)."""
    agent = current.current()
    return agent.table.value(rref_id, agent.name, agent.default_timeout or None)


def held_reference(rref: RRef[Any]) -> tuple[str, str, str]:
    """``(id, token, holder)`` of the reference ``rref`` holds: what its owner counts for it. For putting a
    value back under its id on a replaced kernel (:func:`adopt`), so that the RRefs naming it work again."""
    return rref._id, rref._token, rref._agent.name


def adopt(rref_id: str, value: Any, tokens: list[tuple[str, str]]) -> None:
    """Own ``value`` here under ``rref_id``, counted for the ``(token, holder)`` references still held
    (``owners.OwnerTable.adopt``): a value restored after its kernel was replaced."""
    current.current().table.adopt(rref_id, value, tokens)


class _Proxy:
    """``rref.rpc_sync()`` & co.: attribute access returns a function calling that method on the owner."""

    def __init__(self, rref: RRef[Any], mode: str, timeout: float) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, method: str) -> Callable[..., Any]:
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def invoke(*args: Any, **kwargs: Any) -> Any:
            agent = rref._agent
            call_args = (rref, method, args, kwargs)
            if mode == "remote":
                # As torch's proxy: a method the value's type lacks fails here, not at the RRef's first use.
                value_type = rref._get_type(timeout)
                if not hasattr(value_type, method) and not hasattr(value_type, "__getattr__"):
                    raise AttributeError(f"{value_type.__name__!r} object (the value of {rref!r}) has no "
                                         f"attribute {method!r}")
                return agent.remote(rref._owner.name, invoke_method, call_args, None, timeout)
            if mode == "async":
                return agent.call(rref._owner.name, invoke_method, call_args, None, timeout)
            # A blocking call, as rpc_sync's: its reply comes to this thread, and the RRef is lent
            return agent.call(rref._owner.name, invoke_method, call_args, None, timeout, snapshot=False).wait()

        invoke.__name__ = method
        return invoke


def invoke_method(rref: RRef[Any], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Runs on the owner: call ``method`` of the referenced value (an ``@async_execution`` one's reply
    waits for the future it returns, as torch's proxies do)."""
    bound = getattr(rref.local_value(), method)
    result = bound(*args, **kwargs)
    return AsyncResult(result) if is_async_execution(bound) else result


def fetch_value(rref: RRef[Any]) -> Any:
    """Runs on the owner for ``to_here``."""
    return rref.local_value()


def type_of_value(rref: RRef[Any]) -> type:
    """Runs on the owner for ``_get_type``."""
    return type(rref.local_value())


def local_backward(rref: RRef[Any], retain_graph: bool) -> None:
    """Runs on the owner for ``RRef.backward()`` without a context: the framework's own backward."""
    value = rref.local_value()
    if not (hasattr(value, "requires_grad") and callable(getattr(value, "backward", None))):
        raise RRefError(f"RRef should contain a tensor for .backward(): {rref!r} holds a {type(value).__name__}")
    value.backward(retain_graph=retain_graph)


class RRef(Generic[T]):
    """A reference to a value that lives on one worker (its owner); ``RRef(value)`` owns ``value`` here."""

    def __init__(self, value: T, type_hint: type | None = None) -> None:
        agent = current.current()
        rref_id, token = agent.table.new_id(), new_id()
        agent.table.create(rref_id, token, agent.name).set_result(value)
        self._init(agent, agent.info, rref_id, token, None)

    @classmethod
    def _make(cls, agent: Member, owner: WorkerInfo, rref_id: str, token: str,
              created: Future[None] | None) -> RRef[Any]:
        self: RRef[Any] = cls.__new__(cls)
        self._init(agent, owner, rref_id, token, created)
        return self

    def _init(self, agent: Member, owner: WorkerInfo, rref_id: str, token: str,
              created: Future[None] | None) -> None:
        self._agent = agent
        self._owner = owner
        self._id = rref_id
        self._token = token
        self._created = created
        self._type: Future[type] | None = None  # the value's type, once asked (``_get_type``)
        weakref.finalize(self, agent.refs.release, owner.name, rref_id, token)

    # -- where it lives -------------------------------------------------------------------------------
    def owner(self) -> WorkerInfo:
        return self._owner

    def owner_name(self) -> str:
        return self._owner.name

    def is_owner(self) -> bool:
        return self._owner.name == self._agent.name

    def confirmed_by_owner(self) -> bool:
        """True once the owner has the value (created without error), or for an RRef we received."""
        if self._created is None:
            return True
        return self._created.done() and self._created.exception() is None

    # -- the value ---------------------------------------------------------------------------------------
    def local_value(self) -> T:
        """The value itself; only on the owner."""
        if not self.is_owner():
            raise RRefError(
                f"local_value() is only available on the RRef's owner {self._owner.name!r}, not on "
                f"{self._agent.name!r}; use to_here() to fetch a copy")
        agent = self._agent
        return agent.table.value(self._id, agent.name, agent.default_timeout or None)

    def to_here(self, timeout: float = -1.0) -> T:
        """A copy of the value, fetched from the owner (the value itself on the owner)."""
        if self._created is not None and self._created.done() and self._created.exception() is not None:
            self._created.wait()  # raises the creation error, with its own type
        if self.is_owner():
            return self._agent.table.value(self._id, self._agent.name, self._agent.timeout(timeout) or None)
        # A blocking call: its reply comes to this thread, and this RRef is lent to the owner (see above)
        value = self._agent.call(self._owner.name, fetch_value, (self,), None, timeout, snapshot=False).wait()
        self._created = None  # the owner has it: confirmed, even if remote()'s own reply is still on its way
        return value

    def _get_type(self, timeout: float = -1.0, blocking: bool = True) -> Any:
        """The value's type, asked of the owner once and then kept (torch's ``RRef._get_type``); with
        ``blocking=False`` a Future of it (the same one every time)."""
        fut = self._type
        if fut is None:
            if self.is_owner():
                fut = Future()
                try:
                    fut.set_result(type(self.local_value()))
                except Exception as exc:
                    fut.set_exception(exc)
            else:
                fut = self._agent.call(self._owner.name, type_of_value, (self,), None, timeout)
            self._type = fut
        return fut.wait() if blocking else fut

    def _get_future(self) -> Future[None]:
        """The future of the value's creation on the owner (done at once for an RRef made by its owner)."""
        if self._created is None:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        return self._created

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Back-propagate from the value (a scalar tensor) on its owner, as torch's ``RRef.backward``.

        With a distributed autograd context id, a distributed backward pass in that context (gradients in
        ``get_gradients``); with ``-1`` (only on the owner), the framework's local backward (into ``.grad``).
        """
        if dist_autograd_ctx_id == -1:
            if not self.is_owner():
                raise RRefError(
                    f"User RRefs require 'dist_autograd_ctx_id' to be specified: {self!r} lives on "
                    f"{self._owner.name!r}; call backward(context_id) inside `with dist_autograd.context() "
                    "as context_id:`")
            local_backward(self, retain_graph)
            return
        run = gradctx.rref_backward()
        if self.is_owner():
            run(self, dist_autograd_ctx_id, retain_graph)
        else:
            self._agent.call(self._owner.name, run, (self, dist_autograd_ctx_id, retain_graph)).wait()

    def rpc_sync(self, timeout: float = -1.0) -> Any:
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        return _Proxy(self, "remote", timeout)

    # -- travelling ------------------------------------------------------------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        dest = sending_to.get()
        if dest is None:
            raise RRefError(
                "Can not pickle rref in python pickler: an RRef can only be pickled by nbremote's RPC (as an "
                "argument or result of a call); pickle.dumps cannot carry a remote reference")
        if dest == self._owner.name and lending.get():
            return (_lent, (self._owner.name, self._owner.id, self._id))
        agent = self._agent
        token = new_id()
        agent.refs.fork(self._owner.name, self._id, token, dest)
        return (_rebuild, (self._owner.name, self._owner.id, self._id, token))

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}(owner={self._owner.name}, id={self._id[:8]})"


def _rebuild(owner: str, rank: int, rref_id: str, token: str) -> RRef[Any]:
    agent = current.current()
    return RRef._make(agent, WorkerInfo(owner, rank), rref_id, token, None)


def _lent(owner: str, rank: int, rref_id: str) -> RRef[Any]:
    """On the owner: an RRef a blocking call brought, with a token counted here."""
    agent = current.current()
    token = new_id()
    if not agent.table.lend(rref_id, token, agent.name):
        raise RRefError(f"RRef {rref_id[:8]} is not held on {agent.name} any more: the call that brought it "
                        "outlived its caller's wait (a timeout), and every reference to it was dropped meanwhile")
    return RRef._make(agent, WorkerInfo(owner, rank), rref_id, token, None)


class RefCounts:
    """This process's side of the counting: the adds and removes its RRef objects send to their owners.

    A fork's ``add`` is queued on the link to the owner before the message carrying the fork is pickled
    to the end (so it leaves first, usually in the same message); releases collect here and leave in
    batches, per owner, on the IO thread's tick (``flush``).
    """

    def __init__(self, me: str, table: OwnerTable, peers: Peers, submit: Callable[..., None],
                 running: Callable[[], bool]) -> None:
        self._me = me
        self._table = table  # our own values are counted here directly
        self._peers = peers
        self._submit = submit  # runs a function on an executor thread (connecting blocks)
        self._running = running
        # RRefs garbage collected, to release: appended by finalizers (a deque: appends and pops need no lock)
        self._releases: collections.deque[tuple[str, str, str]] = collections.deque()

    def fork(self, owner: str, rref_id: str, token: str, holder: str) -> None:
        """Count a new reference, held by ``holder``, before the message carrying it leaves."""
        if owner == self._me:
            self._table.add(rref_id, token, holder)
            return
        # Queued without waking the IO thread: the message being pickled drains the outbox (in order)
        # when it is sent, so the count usually rides in the same comm message; the IO thread's tick
        # sends it otherwise.
        self._peers.link(self._peers.peer(owner)).post({"k": "rref", "add": [[rref_id, token, holder]]})

    def release(self, owner: str, rref_id: str, token: str) -> None:
        """Called when an RRef object is garbage collected: never blocks, never raises.

        A collection can run in any thread at any allocation -- also in one that holds the owner table's
        lock (allocating a new entry) -- so a value of ours is released here only if its lock is free at
        once; otherwise, like a value owned elsewhere, on the IO thread's next tick.
        """
        if not self._running():
            return
        if owner == self._me and self._table.try_remove(rref_id, token):
            return
        self._releases.append((owner, rref_id, token))

    def flush(self) -> None:
        """Send the releases collected since the last flush, one message per owner (the IO thread's tick)."""
        if not self._releases:
            return
        by_owner: dict[str, list[list[str]]] = {}
        while True:
            try:
                owner, rref_id, token = self._releases.popleft()
            except IndexError:
                break
            if owner == self._me:
                self._table.remove(rref_id, token)
            else:
                by_owner.setdefault(owner, []).append([rref_id, token])
        for owner, rm in by_owner.items():
            peer = self._peers.get(owner)
            if peer is None or peer.lost is not None:
                continue
            link = self._peers.existing_link(peer)
            if link is not None:
                link.send({"k": "rref", "rm": rm})
            else:  # connecting blocks: not on the IO thread
                self._submit(self._send_release, peer, rm)

    def _send_release(self, peer: Peer, rm: list[list[str]]) -> None:
        try:
            self._peers.link(peer).send({"k": "rref", "rm": rm})
        except Exception:
            log.debug("could not release RRefs on %r", peer.name, exc_info=True)
