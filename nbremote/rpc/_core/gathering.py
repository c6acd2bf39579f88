"""torch's graceful shutdown inside a running world: the barrier the driver holds for members that joined.

A torch program's ``run_worker(rank, world_size)`` calls ``init_rpc`` and, at its end, ``shutdown()``, which in
torch returns once every rank has reached it and the outstanding work is done. In nbremote the processes are
members of a world that goes on, so such a program *joins* it (``joining``) and its ``shutdown`` is this
barrier, without the ending. The driver holds one :class:`Gathering`; members arrive by RPC.

A *round* opens with the first member that joins and ends when its barrier releases (or is abandoned). Who it
waits for: every member of rank < ``world_size`` when the joiners gave one (torch's static start-up: every rank
takes part, so a rank that is quick to shut down waits for one that has not joined yet, as torch's would),
else the members that joined. With a ``world_size``, ``init_rpc`` is collective too, as torch's static
``init_rpc`` is a rendezvous (:meth:`Gathering.wait_joined`): a rank's join returns once every other rank of
the program has joined -- the host (the driver) excepted, whose world's start-up was its ``init_rpc``. So a
master's call reaches a trainer only after the trainer's ``run_worker`` has done what comes before its
``init_rpc`` (seeding, ``init_process_group``), as under torch. A rank whose ``init_rpc`` was refused (a wrong
name, rank or size) fails the rendezvous for the ranks waiting for it, and for those that join within
``REFUSAL_HOLD`` seconds -- the driver's own, which the others do not wait for, may come last -- unless they
were told of it already, or it joins: then theirs is a new run.

The barrier has ``STEPS`` steps, each member waiting for its own calls before each: a call a handler made
while the others waited is answered before anyone leaves. A step releases when every awaited member has
arrived at it. The round is abandoned at once, with an error naming the member, when an awaited member is
lost, leaves the world or fails (:meth:`Gathering.fail`); a waiter's own deadline ends its wait with an error
naming who did not arrive, and whether they joined at all.

Pure bookkeeping under one condition variable; what members exist is asked of ``members`` (name -> rank, live
and lost) and ``lost`` (why a member is gone, or None).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["JOIN_PREFIX", "PREFIX", "STEPS", "Gathering", "Joined"]

STEPS = 2
PREFIX = "rpc.shutdown() in"  # how every barrier error begins (the conformance runner tells them apart by it)
JOIN_PREFIX = "rpc.init_rpc in"  # how every error of a collective join begins
_POLL = 0.25  # s between checks while waiting: a cancelled call stops at its next bytecode, not at the deadline
REFUSAL_HOLD = 60.0  # s a refused init_rpc fails the other ranks' rendezvous: later joins are taken as another run's


@dataclass
class Joined:
    """This process's part in a round: it called ``init_rpc`` in the running world and not yet ``shutdown``."""

    name: str
    rank: int
    world_size: int | None
    driver: str  # who holds the barrier
    round: int  # the driver's round it joined
    before: set[int] = field(default_factory=set)  # ids of the calls pending at the join: not this program's
    call: Callable[[], object] | None = None  # a weak reference to the served call that joined (its capture)


@dataclass
class _Refusal:
    """A rank's collective ``init_rpc`` that was refused: why, when, and who has been told (failed with it)."""

    why: str
    when: float
    told: set[str] = field(default_factory=set)


class Gathering:
    """The driver's barrier for the members that joined (see the module docstring)."""

    def __init__(self, members: Callable[[], dict[str, int]], lost: Callable[[str], str | None],
                 host: str | None = None) -> None:
        self._members = members
        self._lost = lost
        self._host = host  # the driver: it never joins to take part (its world's start-up was its init_rpc)
        self._cond = threading.Condition()
        self.round = 0
        self._joined: dict[str, int] = {}  # name -> rank, this round
        self._size: int | None = None  # the world_size the joiners gave
        self._left: set[str] = set()  # shut down with graceful=False: not waited for
        self._refused: dict[str, _Refusal] = {}  # name -> why and when its collective init_rpc was refused
        self._met: set[int] = set()  # the rounds whose rendezvous completed (every awaited rank joined)
        self._arrived: list[set[str]] = [set() for _ in range(STEPS)]
        self._released = -1  # the last step released in this round
        self._ended: dict[int, str | None] = {}  # round -> None (released) or why it was abandoned

    def open(self) -> bool:
        """Whether a round is under way (someone joined)."""
        with self._cond:
            return bool(self._joined)

    def join(self, name: str, rank: int, world_size: int | None) -> int:
        """``name`` (rank ``rank``) called ``init_rpc``; returns the round it joined."""
        with self._cond:
            if world_size is not None and self._size is not None and world_size != self._size:
                raise RuntimeError(
                    f"init_rpc in {name!r}: world_size={world_size}, but the members that joined before it gave "
                    f"world_size={self._size} ({', '.join(sorted(self._joined))}); every rank of a program gives the "
                    "same world_size")
            self._joined[name] = rank
            self._left.discard(name)
            self._refused.pop(name, None)
            for n in [n for n, r in self._refused.items() if name in r.told]:  # it comes again: another run
                del self._refused[n]
            if world_size is not None:
                self._size = world_size
                self._rendezvous()
            self._cond.notify_all()
            return self.round

    def refuse(self, name: str, why: str) -> None:
        """``name``'s collective ``init_rpc`` was refused (a wrong name, rank or size): the rendezvous of the ranks
        that wait for it fails with ``why``, as torch's fails on every rank -- theirs now, and for ``REFUSAL_HOLD``
        seconds the joins still to come (unless ``name`` joins meanwhile), so that none waits for it in vain."""
        with self._cond:
            self._refused[name] = _Refusal(why, time.monotonic())
            self._cond.notify_all()

    def wait_joined(self, name: str, rnd: int, timeout: float | None) -> None:
        """``name``, which joined round ``rnd`` with a ``world_size``, waits for the program's other ranks (every
        member of rank < ``world_size`` but the host) to join it; ``RuntimeError`` naming them when one cannot
        come (lost, gone, no such rank), when one's join was refused, when the round is abandoned, or at
        ``timeout`` seconds (None: none)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if rnd != self.round:  # a round that failed after its rendezvous completed failed after the join
                    why = self._ended.get(rnd, "its round ended long ago")
                    if why is None or rnd in self._met:
                        return
                    raise RuntimeError(f"{JOIN_PREFIX} {name!r} gave up waiting for the other ranks to join: {why}")
                missing, problem = self._rendezvous()
                if problem is not None:
                    self._end(problem)
                    continue
                if not missing:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:  # the round fails for all, as torch's rendezvous would
                    why = (f"{name!r} waited {timeout:.0f} s for the other ranks of world_size={self._size}, and "
                           f"{self._describe(missing)} did not join; every rank of a program calls "
                           "rpc.init_rpc(name, rank=, world_size=) at its start")
                    self._end(why)
                    raise RuntimeError(f"{JOIN_PREFIX} {why}")
                self._cond.wait(_POLL if left is None else min(_POLL, left))

    def leave(self, name: str, rnd: int) -> None:
        """``name``, which joined round ``rnd``, shut down without waiting (``graceful=False``): nobody waits for it
        in that round; a round nobody is joined in any more is over."""
        with self._cond:
            if rnd != self.round or name not in self._joined:
                return
            del self._joined[name]
            self._left.add(name)
            if not self._joined:
                self._end(None)
            self._cond.notify_all()

    def fail(self, name: str, why: str, rnd: int | None = None) -> None:
        """``name`` failed in round ``rnd`` (None: the current one): whoever waits in it is released with an error
        naming it. A round that is over already is left alone (the current one may be waiting for ``name``)."""
        with self._cond:
            if (rnd is None or rnd == self.round) and (self._joined or any(self._arrived)):
                self._end(f"{name!r} failed: {why}")

    def changed(self) -> None:
        """Membership changed (a member was lost, removed or restarted): waiters look again."""
        with self._cond:
            self._cond.notify_all()

    def reset(self) -> None:
        """Abandon the round under way, if any (its waiters are told), and start afresh."""
        with self._cond:
            self._refused.clear()
            if self._joined or any(self._arrived):
                self._end("the round was reset")

    def arrive(self, name: str, step: int, timeout: float | None, rnd: int | None = None) -> None:
        """``name`` arrives at ``step`` of round ``rnd`` (the one it joined; None: the current one); returns once
        every awaited member has, raises ``RuntimeError`` (naming them) when one cannot come or at ``timeout``
        seconds (None: no deadline). A round that ended meanwhile answers at once, as it ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            rnd = self.round if rnd is None else rnd
            if rnd == self.round:
                self._arrived[step].add(name)
            self._cond.notify_all()
            while True:
                if rnd != self.round or self._released >= step:
                    why = self._ended.get(rnd, "its round ended long ago") if rnd != self.round else None
                    if why is None:
                        return
                    raise RuntimeError(f"{PREFIX} {name!r} gave up waiting for the world's other members: {why}")
                missing, problem = self._missing(self._arrived[step])
                if problem is not None:
                    self._end(problem)
                    continue
                if not missing:
                    self._release(step)
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:  # the round fails for all: its program's shutdown did
                    why = (f"{name!r} waited {timeout:.0f} s for the world's other members, and "
                           f"{self._describe(missing)} did not get there; every member that calls init_rpc must call "
                           "rpc.shutdown() too (give rpc.shutdown(timeout=...) or rpc_timeout in the backend options "
                           "to wait longer, 0 for no limit)")
                    self._end(why)
                    raise RuntimeError(f"{PREFIX} {why}")
                self._cond.wait(_POLL if left is None else min(_POLL, left))

    # -- under the condition's lock ------------------------------------------------------------------------
    def _awaited(self, members: dict[str, int]) -> set[str]:
        if self._size is None:
            return set(self._joined) - self._left
        return {n for n, r in members.items() if r < self._size} - self._left

    def _missing(self, there: set[str], exempt: str | None = None) -> tuple[set[str], str | None]:
        """Who of the awaited (but ``exempt``) is not ``there`` (joined, or arrived at a step), and why one of
        them can never come (or None)."""
        members = self._members()
        gone = [n for n in self._joined if n not in members]
        if gone:
            return set(), f"{gone[0]!r} left the world (removed or restarted) after it joined"
        if self._size is not None:
            holes = sorted(set(range(self._size)) - {r for r in members.values() if r < self._size})
            if holes:
                return set(), (f"the members joined with world_size={self._size}, but the world has no rank "
                               f"{', '.join(map(str, holes))}")
        awaited = self._awaited(members) - {exempt}
        for n in sorted(awaited):
            why = self._lost(n)
            if why is not None:
                return set(), f"{n!r} (rank {members[n]}) is gone: {why}"
        return awaited - there, None

    def _rendezvous(self) -> tuple[set[str], str | None]:
        """Who the rendezvous of this round still waits for, and why it fails (or None); a complete one is
        recorded as met, so that its waiters return even when the round fails before they wake."""
        refused = self._refusals()
        if refused:
            first = min(refused)
            refused[first].told.update(self._joined)  # each of them fails with it (the round ends)
            return set(), f"{first!r} failed: {refused[first].why}"
        missing, problem = self._missing(set(self._joined), self._host)
        if problem is None and not missing:
            self._met.add(self.round)
            self._met.discard(self.round - 8)
        return missing, problem

    def _refusals(self) -> dict[str, _Refusal]:
        """The refusals that fail this round's rendezvous: those of the ranks it waits for, made in the last
        ``REFUSAL_HOLD`` seconds (an older one was an earlier run's, as is one a joiner was told of before)."""
        since = time.monotonic() - REFUSAL_HOLD
        members = self._members()
        size = self._size if self._size is not None else 0
        return {n: r for n, r in self._refused.items()
                if r.when >= since and n != self._host and members.get(n, size) < size}

    def _describe(self, missing: set[str]) -> str:
        members = self._members()
        parts = []
        for n in sorted(missing, key=lambda n: members.get(n, -1)):
            did = "joined, has not called rpc.shutdown()" if n in self._joined else "has not called rpc.init_rpc"
            parts.append(f"{n!r} (rank {members.get(n, '?')}: {did})")
        return ", ".join(parts)

    def _release(self, step: int) -> None:
        self._released = step
        if step == STEPS - 1:
            self._end(None)
        self._cond.notify_all()

    def _end(self, why: str | None) -> None:
        """The round is over (released, or abandoned for ``why``); the next one starts empty."""
        self._ended[self.round] = why
        self._ended.pop(self.round - 8, None)  # waiters of an old round are long gone
        self.round += 1
        self._joined.clear()
        self._left.clear()
        self._size = None
        self._arrived = [set() for _ in range(STEPS)]
        self._released = -1
        self._cond.notify_all()
