"""torch's start-up line inside a running world: ``init_rpc`` joins it, ``shutdown`` waits without ending it.

A ported program's ``run_worker(rank, world_size)`` runs as written on a member (``rpc.rpc_async("trainer0",
run_worker, args=(0, 4))``, or in the driver): its ``init_rpc(name, rank=, world_size=, ...)`` finds the process
already a member, so it *joins* (:func:`join`): name, rank and world size must be this member's in the running
world (``RuntimeError`` naming what differs and the world's actual values, as torch's rendezvous would fail);
the options' ``rpc_timeout`` becomes the default timeout; the driver records the join (``gathering``). With a
``world_size`` the join is collective, as torch's rendezvous is: it returns once every other rank of the program
(the driver excepted) has joined, within ``JOIN_TIMEOUT`` (torch's rendezvous default), or raises naming the
rank that did not come. Before it was, a master's first call could reach a trainer whose ``run_worker`` had not
yet seeded or made its process group: torch's DDP+RPC program then failed ("Default process group has not been
initialized") or, where one trainer had its group and the other not, hung in DDP's first broadcast. Its
``shutdown()`` (:func:`leave`) is torch's graceful shutdown without the ending: this process waits for the
calls it made since the join, then arrives at the driver's barrier, twice (see ``gathering``), and returns once
every awaited member has; ``graceful=False`` returns at once. The process stays a member, serving and calling.

A program run by RPC that raised (or was cancelled) before its ``shutdown`` leaves no join behind: the next
``init_rpc`` there sees that the call which joined has ended, tells the driver (whoever waits for it at the
barrier is released, naming it) and joins afresh, as a new process of torch's would.

The barrier's wait is bounded by ``shutdown(timeout=...)`` when given (a member that never comes is then named);
without it there is no limit, as in torch, whose graceful shutdown waits for every rank however long the
others train (a parameter server waits out its trainers' 100 epochs). A member that dies or is removed
releases the others at once all the same, naming it.

The functions at the bottom run on the driver, called by the members.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections.abc import Callable
from typing import Any

from nbremote.rpc._core import capture
from nbremote.rpc._core.agent import Agent, current_agent
from nbremote.rpc._core.gathering import PREFIX, STEPS, Gathering, Joined

__all__ = ["arrived", "check", "failed", "gather", "hold", "join", "joined", "leave", "left", "members", "refused",
           "reset"]

_MARGIN = 5.0  # s the RPC to the barrier waits beyond the barrier's own deadline (which answers first)
JOIN_TIMEOUT = 1800.0  # s a collective init_rpc waits for the program's other ranks: torch's rendezvous default


def members(agent: Agent) -> dict[str, int]:
    """Every member this process knows, lost ones too, by name -> rank (itself included)."""
    return {agent.name: agent.rank, **{p.name: p.info.id for p in agent.peers.values()}}


def hold(agent: Agent) -> Gathering:
    """Make ``agent`` (the driver) the holder of the world's shutdown barrier, told of every member it loses."""

    def gone(name: str) -> str | None:  # why ``name`` cannot come to the barrier any more, or None
        if name == agent.name:
            return None
        peer = agent.peers.get(name)
        return "it left the world" if peer is None else peer.lost

    gathering = agent.gathering = Gathering(lambda: members(agent), gone, host=agent.name)
    agent.on_peer_lost.append(lambda name, why: gathering.changed())
    return gathering


def check(agent: Agent, name: str, rank: int | None, world_size: int | None, size: int | None = None) -> None:
    """``init_rpc(name, rank, world_size)`` fits this process in the running world (``size``: the world size a
    program must give, by default the world's), else ``RuntimeError`` naming what differs."""
    world = {n: r for n, r in members(agent).items() if n == agent.name or agent.peers[n].lost is None}
    size = len(world) if size is None else size
    call = f"init_rpc(name={name!r}, rank={rank}, world_size={world_size})"
    listing = ", ".join(f"{n!r}: {r}" for n, r in sorted(world.items(), key=lambda kv: kv[1]))
    actual = (f"this process is {agent.name!r}, rank {agent.rank}, of a running world of {size} ({listing}): a "
              f"process of a running world joins it under its own name and rank -- rpc.init_rpc({agent.name!r}, "
              f"rank={agent.rank}, world_size={size})")
    differs = None
    if name != agent.name:
        taken = f"; {name!r} is not unique: it is rank {world[name]}'s name" if name in world else ""
        differs = f"the name differs{taken}"
    elif rank not in (None, -1) and rank != agent.rank:
        differs = "the rank differs"
    elif world_size is not None and world_size != size:
        differs = "the world size differs"
    if differs is not None:
        error = f"{call}: {differs}; {actual}"
        if world_size is not None and agent.joined is None:  # the program's other ranks wait for this one: tell them
            _refuse(agent, error)
        raise RuntimeError(error)
    if agent.joined is not None and _ended(agent.joined):  # its program failed (or was cancelled) before shutdown
        stale, agent.joined = agent.joined, None
        with contextlib.suppress(Exception):  # whoever waits for it at the barrier is told at once
            _at_driver(agent, stale.driver, failed, stale.name, "its program ended without calling rpc.shutdown()",
                       stale.round)
    if agent.joined is not None:
        raise RuntimeError(f"{call}: RPC is already initialized in {agent.name!r} (joined with init_rpc and not shut "
                           "down since); call rpc.shutdown() first (rpc.shutdown(graceful=False) ends a program that "
                           "failed before its own)")


def join(agent: Agent, world_size: int | None, timeout: float | None) -> None:
    """This process's program joins the running world (checked by :func:`check` first); ``timeout``: the
    options' ``rpc_timeout``, the default timeout from now on."""
    driver = agent.peers.driver
    if driver is None:
        raise RuntimeError(f"init_rpc in {agent.name!r}: this worker has not been told who its driver is yet; call "
                           "it once rpc.init_rpc / rpc.add_worker has returned in the driver")
    before = set(agent.calls.snapshot())  # not this program's: the calls that launched it, among others
    rnd = _at_driver(agent, driver, joined, agent.name, agent.rank, world_size, JOIN_TIMEOUT,
                     timeout=JOIN_TIMEOUT + _MARGIN)
    call = capture.current.get()  # the served call running this program, if it is one (run_worker by RPC)
    agent.joined = Joined(agent.name, agent.rank, world_size, driver, rnd, before,
                          None if call is None else weakref.ref(call))
    if timeout is not None:
        agent.default_timeout = timeout


def _refuse(agent: Agent, error: str) -> None:
    """This process's collective ``init_rpc`` was refused (``error``): the driver records it, and the program's
    other ranks -- those waiting for this one, and those that join soon after -- fail with it, as torch's
    rendezvous fails on every rank (best effort)."""
    driver = agent.peers.driver
    if driver is not None:
        with contextlib.suppress(Exception):
            _at_driver(agent, driver, refused, agent.name, error, timeout=5.0)


def leave(agent: Agent, graceful: bool, timeout: float | None) -> None:
    """torch's ``shutdown`` of the program that joined: see the module docstring. The process is no longer
    joined afterwards, whether the barrier released or failed."""
    me = agent.joined
    if me is None:
        raise RuntimeError(f"{agent.name!r} has not joined with rpc.init_rpc")
    try:
        if not graceful:
            with contextlib.suppress(Exception):  # nobody is to wait for us: best effort
                _at_driver(agent, me.driver, left, me.name, me.round)
            return
        limit = _limit(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        for step in range(STEPS):
            _wait_idle(agent, me, deadline)
            _arrive(agent, me.driver, me.name, step, deadline, me.round)
    finally:
        agent.joined = None


def gather(agent: Agent, timeout: float | None) -> None:
    """The driver's final ``shutdown`` while members have joined: it arrives at their barrier as one of them
    (it is a rank of their program too), and returns once they all have."""
    gathering = _gathering(agent)
    rnd = gathering.round
    limit = _limit(timeout)
    deadline = None if limit is None else time.monotonic() + limit
    for step in range(STEPS):
        _arrive(agent, agent.name, agent.name, step, deadline, rnd)


def reset(agent: Agent) -> None:
    """Forget this process's join and, on the driver, abandon the round under way (a harness between programs)."""
    agent.joined = None
    if agent.gathering is not None:
        agent.gathering.reset()


def _ended(me: Joined) -> bool:
    """Whether the served call that joined has ended (its output capture is gone): a program run by RPC that
    raised, or was cancelled at its timeout, before its shutdown. Then a new init_rpc there may join again, as a
    fresh process of torch's would. (A join made outside a served call -- a cell, a thread -- never ends so.)"""
    if me.call is None:
        return False
    if me.call() is not None:
        gc.collect()  # a call that raised holds its capture in a cycle (frame -> error -> traceback -> frame)
    return me.call() is None


def _limit(timeout: float | None) -> float | None:
    """The barrier's bound: ``shutdown``'s ``timeout`` when given and positive, else none (torch's default)."""
    return float(timeout) if timeout is not None and timeout > 0 else None


def _wait_idle(agent: Agent, me: Joined, deadline: float | None) -> None:
    """Wait until the calls this process made since it joined are answered (their failures are their callers')."""
    while True:
        pending = [p for cid, p in agent.calls.snapshot().items() if cid not in me.before]
        if not pending:
            return
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            p = pending[0]
            raise RuntimeError(f"{PREFIX} {me.name!r}: its call {p.fn} to {p.peer!r} was still pending when the "
                               "shutdown's time ran out; give rpc.shutdown(timeout=...) or wait for it first")
        with contextlib.suppress(Exception):
            pending[0].fut.wait(left)


def _arrive(agent: Agent, driver: str, name: str, step: int, deadline: float | None, rnd: int) -> None:
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    _at_driver(agent, driver, arrived, name, step, left, rnd, timeout=0.0 if left is None else left + _MARGIN)


def _at_driver(agent: Agent, driver: str, fn: Callable[..., Any], *args: object, timeout: float = -1.0) -> Any:
    if driver == agent.name:  # the driver's own program: no call to itself
        return fn(*args)
    return agent.call(driver, fn, args, timeout=timeout, snapshot=False).wait()


def _gathering(agent: Agent) -> Gathering:
    if agent.gathering is None:
        raise RuntimeError(f"{agent.name!r} holds no shutdown barrier: the driver does")
    return agent.gathering


# -- on the driver, called by the members --------------------------------------------------------------------


def joined(name: str, rank: int, world_size: int | None, timeout: float | None = None) -> int:
    """``name`` joined; the round it joined, once the program's other ranks have joined it too when it gave a
    ``world_size`` (at most ``timeout`` seconds)."""
    gathering = _gathering(current_agent())
    rnd = gathering.join(name, rank, world_size)
    if world_size is not None:
        gathering.wait_joined(name, rnd, timeout)
    return rnd


def refused(name: str, why: str) -> None:
    """``name``'s collective ``init_rpc`` was refused for ``why``."""
    _gathering(current_agent()).refuse(name, why)


def arrived(name: str, step: int, timeout: float | None, rnd: int) -> None:
    """``name`` arrived at the barrier's ``step``; returns when it may go on."""
    _gathering(current_agent()).arrive(name, step, timeout, rnd)


def left(name: str, rnd: int) -> None:
    """``name`` shut down without waiting: nobody waits for it in round ``rnd``."""
    _gathering(current_agent()).leave(name, rnd)


def failed(name: str, why: str, rnd: int | None = None) -> None:
    """``name``'s program failed (in round ``rnd``; None: the current one): the others' waits at the barrier end
    with an error naming it."""
    _gathering(current_agent()).fail(name, why, rnd)
