"""The owner side of distributed reference counting: the values this process owns, by RRef id.

An RRef names a value living on its *owner*. Each user-side RRef object holds one *token*; the owner
counts tokens per value and frees the value when every token it has heard of was both added and
removed. A token is added when the owner creates the value (``remote``), or when an RRef is pickled
for another process (a *fork*: the sender tells the owner "add F" before the message carrying F
leaves); it is removed when the RRef object holding it is garbage collected ("rm F"). Messages about
one token may arrive in any order (they take different links), which is why counts are per token
and an "rm" before its "add" keeps the value alive rather than freeing it. (The user side, the RRef
objects and their forks and releases, is ``rref``.)

Each token also records its *holder*, the process whose RRef object carries it (the caller of a
``remote``; the destination of a fork). When a holder is gone for good -- a driver that died without
saying goodbye, past its lease (``nbremote.rpc._wire.lease``) -- ``release_holder`` drops every token it
held.

Messages about one value may also overtake its creation: the ``remote`` that creates it and a call that
uses it (from another process, or from another of the caller's sockets) take different routes. So
an owner asked for a value it has not heard of waits for it (up to the call timeout) instead of
failing, unless it knows the value was freed: the ids of freed values are remembered (a bounded
window) to tell the two apart.

Unless the value is of an *earlier kernel* of this worker: a kernel replaced by ``rpc.restart_worker`` (or
one that died and came back) keeps its name and rank, so an RRef made before the restart reaches the new
kernel, which never heard of it -- and would wait the full call timeout for a creation that cannot come
(60 s, then "never created"). So every RRef id carries its owner's *incarnation* (``<uuid>@<incarnation>``,
a random tag each kernel's agent draws when it starts; callers learn it from the world's membership, see
``peers``): an id of another incarnation that is not here fails at once with ``RRefLostError``, and
reference counts about such ids are dropped (they would leave entries that nothing fills). Values put
back under their old ids (``adopt``: a module restored from its snapshot) are found as usual.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from typing import Any

from nbremote.errors import RRefError, RRefLostError
from nbremote.rpc._core.future import Future

__all__ = ["OwnerTable", "incarnation_of", "tagged_id"]

_FREED_KEPT = 100_000  # ids of freed values remembered, to tell "freed" from "not created yet"


def tagged_id(incarnation: str | None) -> str:
    """A new RRef id for a value owned by the kernel of ``incarnation`` (untagged where it is not known)."""
    base = uuid.uuid4().hex
    return f"{base}@{incarnation}" if incarnation else base


def incarnation_of(rref_id: str) -> str | None:
    """The incarnation an id was made for (None for an untagged id)."""
    _, at, incarnation = rref_id.partition("@")
    return incarnation if at else None


class _Entry:
    __slots__ = ("holders", "tokens", "value")

    def __init__(self) -> None:
        self.value: Future[Any] = Future()
        self.tokens: dict[str, int] = {}
        self.holders: dict[str, str] = {}  # token -> the process holding it (where known)


class OwnerTable:
    """Values this process owns, keyed by RRef id, with their token counts (thread-safe)."""

    def __init__(self, incarnation: str | None = None) -> None:
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        self._suffix = "@" + self.incarnation
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._freed: deque[str] = deque()
        self._freed_set: set[str] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def new_id(self) -> str:
        """An id for a value this process owns (tagged with its incarnation)."""
        return tagged_id(self.incarnation)

    def _foreign(self, rref_id: str) -> bool:
        """Whether ``rref_id`` was made for another incarnation of this worker (see the docstring)."""
        return "@" in rref_id and not rref_id.endswith(self._suffix)

    def _bump(self, rref_id: str, token: str, delta: int, created: bool = False) -> _Entry | None:
        entry = self._entries.get(rref_id)
        if entry is None:
            if not created and self._foreign(rref_id):
                return None  # a count about a value of an earlier kernel: nothing here to keep alive
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

    def lend(self, rref_id: str, token: str, holder: str) -> bool:
        """``add`` for the copy of an RRef that a blocking call lent us (``rref.lending``): its caller's
        reference holds the value for the call. False, counting nothing, if the value was freed all the
        same (the caller stopped waiting, a timeout, and dropped it)."""
        with self._lock:
            if rref_id not in self._entries and rref_id in self._freed_set:
                return False
            entry = self._bump(rref_id, token, +1)
            if entry is not None:
                entry.holders[token] = holder
        return True

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
            entry = self._bump(rref_id, token, +1, created=True)
            if entry is None:  # a +1 never empties an entry
                raise RuntimeError(f"RRef {rref_id[:8]} vanished while it was being created")
            if holder is not None:
                entry.holders[token] = holder
            return entry.value

    def adopt(self, rref_id: str, value: Any, tokens: list[tuple[str, str]]) -> None:
        """Own ``value`` under ``rref_id``, an id the references to it already carry (a value restored from a
        snapshot after its kernel was replaced), counted for each ``(token, holder)`` still held."""
        if not tokens:
            raise ValueError(f"RRef {rref_id[:8]}: a value is adopted for the references still holding it; none given")
        with self._lock:
            entry = None
            for token, holder in tokens:
                entry = self._bump(rref_id, token, +1, created=True)
                if entry is not None:
                    entry.holders[token] = holder
            if entry is None or entry.value.done():
                raise RRefError(f"RRef {rref_id[:8]} already has a value here: it cannot be adopted again")
            entry.value.set_result(value)

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
                if self._foreign(rref_id):
                    raise RRefLostError(
                        f"RRef {rref_id[:8]} names a value of an earlier kernel of {where!r} (incarnation "
                        f"{incarnation_of(rref_id)}; this one is {self.incarnation}): that kernel died or was "
                        f"replaced by rpc.restart_worker({where!r}), and the value went with it. Create it again "
                        "(a RemoteModule with a snapshot is restored by restart_worker itself)", where)
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
