"""Remote references and the owner-side table with distributed reference counting.

An RRef names a value living on its *owner*. Each user-side RRef object holds one *token*; the owner
counts tokens per value and frees the value when every token it has heard of was both added and
removed. A token is added when the owner creates the value (``remote``), or when an RRef is pickled
for another process (a *fork*: the sender tells the owner "add F" before the message carrying F
leaves); it is removed when the RRef object holding it is garbage collected ("rm F"). Messages about
one token may arrive in any order (they take different links), which is why counts are per token
and an "rm" before its "add" keeps the value alive rather than freeing it.

Each token also records its *holder*, the process whose RRef object carries it (the caller of a
``remote``; the destination of a fork). When a holder is gone for good -- a driver that died without
saying goodbye, past its lease (``_lease``) -- ``release_holder`` drops every token it held.

Messages about one value may also overtake its creation: the ``remote`` that creates it and a call that
uses it (from another process, or from another of the caller's sockets) take different routes. So
an owner asked for a value it has not heard of waits for it (up to the call timeout) instead of
failing, unless it knows the value was freed: the ids of freed values are remembered (a bounded
window) to tell the two apart.

Every member owns RRefs alike, the driver included: an RRef the driver owns is a real reference on the
workers (they call the driver back through its comm), and nothing travels by value unless
``to_here()`` asks for it.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from nbremote.errors import RRefError
from nbremote.rpc import _state
from nbremote.rpc._core.members import WorkerInfo
from nbremote.rpc._future import Future
from nbremote.rpc._wire.serialize import sending_to

if TYPE_CHECKING:
    from nbremote.rpc._agent import Agent

T = TypeVar("T")

_FREED_KEPT = 100_000  # ids of freed values remembered, to tell "freed" from "not created yet"


def new_id() -> str:
    return uuid.uuid4().hex


class _Entry:
    __slots__ = ("holders", "tokens", "value")

    def __init__(self) -> None:
        self.value: Future[Any] = Future()
        self.tokens: dict[str, int] = {}
        self.holders: dict[str, str] = {}  # token -> the process holding it (where known)


class OwnerTable:
    """Values this process owns, keyed by RRef id, with their token counts (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._freed: deque[str] = deque()
        self._freed_set: set[str] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def _bump(self, rref_id: str, token: str, delta: int) -> _Entry | None:
        entry = self._entries.get(rref_id)
        if entry is None:
            entry = self._entries[rref_id] = _Entry()
        count = entry.tokens.get(token, 0) + delta
        if count:
            entry.tokens[token] = count
        else:
            entry.tokens.pop(token, None)
            entry.holders.pop(token, None)
        if not entry.tokens:
            del self._entries[rref_id]
            self._freed.append(rref_id)
            self._freed_set.add(rref_id)
            if len(self._freed) > _FREED_KEPT:
                self._freed_set.discard(self._freed.popleft())
            return None
        return entry

    def add(self, rref_id: str, token: str, holder: str | None = None) -> None:
        with self._lock:
            entry = self._bump(rref_id, token, +1)
            if entry is not None and holder is not None and token in entry.tokens:
                entry.holders[token] = holder

    def remove(self, rref_id: str, token: str) -> None:
        with self._lock:
            self._bump(rref_id, token, -1)

    def try_remove(self, rref_id: str, token: str) -> bool:
        """``remove`` if the lock is free at once (a finalizer's way: it may run in the lock's holder)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._bump(rref_id, token, -1)
        finally:
            self._lock.release()
        return True

    def apply(self, add: list[list[str]], rm: list[list[str]]) -> None:
        """Counts from a peer: ``add`` items are ``[rref_id, token, holder]`` (holder optional)."""
        with self._lock:
            for item in add:
                rref_id, token = item[0], item[1]
                entry = self._bump(rref_id, token, +1)
                if entry is not None and len(item) > 2 and token in entry.tokens:
                    entry.holders[token] = item[2]
            for rref_id, token, *_ in rm:
                self._bump(rref_id, token, -1)

    def create(self, rref_id: str, token: str, holder: str | None = None) -> Future[Any]:
        """Register a value being created for ``remote`` (token counted) and return its future."""
        with self._lock:
            entry = self._bump(rref_id, token, +1)
            if entry is None:  # a +1 never empties an entry
                raise RuntimeError(f"RRef {rref_id[:8]} vanished while it was being created")
            if holder is not None:
                entry.holders[token] = holder
            return entry.value

    def release_holder(self, holder: str) -> int:
        """Drop every token ``holder`` held (it is gone for good); returns how many values were freed."""
        with self._lock:
            doomed = [(rref_id, token, entry.tokens[token])
                      for rref_id, entry in self._entries.items()
                      for token, who in entry.holders.items() if who == holder and token in entry.tokens]
            before = len(self._entries)
            for rref_id, token, count in doomed:
                self._bump(rref_id, token, -count)
            return before - len(self._entries)

    def value(self, rref_id: str, where: str, timeout: float | None) -> Any:
        """The value (waiting while it is being created, or not yet heard of: see the docstring)."""
        with self._lock:
            entry = self._entries.get(rref_id)
            if entry is None:
                if rref_id in self._freed_set:
                    raise RRefError(
                        f"RRef {rref_id[:8]} is not held on {where} any more: every reference to it was "
                        "dropped, so its owner freed the value")
                entry = self._entries[rref_id] = _Entry()  # its creation is on the way
        try:
            return entry.value.wait(timeout)
        except TimeoutError:
            with self._lock:
                if self._entries.get(rref_id) is entry and not entry.tokens:
                    del self._entries[rref_id]
            raise RRefError(f"RRef {rref_id[:8]} was never created on {where} (waited {timeout:.0f} s for "
                            "the remote() that makes it)") from None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._freed.clear()
            self._freed_set.clear()


def owned_value(rref_id: str) -> Any:
    """The value of an RRef this process owns, by id: for owner-side code whose caller holds the RRef
    for the whole call (so no reference count needs to travel with it)."""
    agent = _state.current()
    return agent.table.value(rref_id, agent.name, agent.default_timeout or None)


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
                return agent.remote(rref._owner.name, invoke_method, call_args, None, timeout)
            fut = agent.call(rref._owner.name, invoke_method, call_args, None, timeout)
            return fut if mode == "async" else fut.wait()

        invoke.__name__ = method
        return invoke


def invoke_method(rref: RRef[Any], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Runs on the owner: call ``method`` of the referenced value."""
    return getattr(rref.local_value(), method)(*args, **kwargs)


def fetch_value(rref: RRef[Any]) -> Any:
    """Runs on the owner for ``to_here``."""
    return rref.local_value()


class RRef(Generic[T]):
    """A reference to a value that lives on one worker (its owner); ``RRef(value)`` owns ``value`` here."""

    def __init__(self, value: T, type_hint: type | None = None) -> None:
        agent = _state.current()
        rref_id, token = new_id(), new_id()
        agent.table.create(rref_id, token, agent.name).set_result(value)
        self._init(agent, agent.info, rref_id, token, None)

    @classmethod
    def _make(cls, agent: Agent, owner: WorkerInfo, rref_id: str, token: str,
              created: Future[None] | None) -> RRef[Any]:
        self: RRef[Any] = cls.__new__(cls)
        self._init(agent, owner, rref_id, token, created)
        return self

    def _init(self, agent: Agent, owner: WorkerInfo, rref_id: str, token: str,
              created: Future[None] | None) -> None:
        self._agent = agent
        self._owner = owner
        self._id = rref_id
        self._token = token
        self._created = created
        weakref.finalize(self, agent.release_rref, owner.name, rref_id, token)

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
        return self._agent.call(self._owner.name, fetch_value, (self,), None, timeout).wait()

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
                "an RRef can only be pickled by nbremote's RPC (as an argument or result of a call); "
                "pickle.dumps cannot carry a remote reference")
        agent = self._agent
        token = new_id()
        agent.fork_rref(self._owner.name, self._id, token, dest)
        return (_rebuild, (self._owner.name, self._owner.id, self._id, token))

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}(owner={self._owner.name}, id={self._id[:8]})"


def _rebuild(owner: str, rank: int, rref_id: str, token: str) -> RRef[Any]:
    agent = _state.current()
    return RRef._make(agent, WorkerInfo(owner, rank), rref_id, token, None)
