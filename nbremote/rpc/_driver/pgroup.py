"""Forming a c10d process group among named workers, from the driver: ``rpc.init_process_group``.

One call does what a torch program's launcher and its ``init_process_group`` lines do, for kernels that are
already running: worker ``names[i]`` becomes rank ``i`` of ``len(names)`` in torch.distributed's default
group. The driver asks every member what it has (torch.distributed, CUDA, a group already: ``_core.pgroup.probe``),
picks the backend (nccl where every member has CUDA, else gloo, unless named) and the rendezvous: the first
member serves a ``TCPStore`` on a port its system picks, at an address every member reaches -- loopback where
they share one (same machine, same network namespace), else the address the driver reaches that kernel at,
else the one that kernel routes the others by -- and all members join at once (``init_process_group`` is a
collective: each waits for the others). Any failure undoes what did form, so a corrected call can follow.

The group ends with the world: each member destroys it when the driver is gone or a member leaves, dies or
is restarted (``_core.pgroup``'s watch), so nothing is needed in ``rpc.shutdown``.
"""

from __future__ import annotations

import datetime
import ipaddress
import time
from collections.abc import Sequence
from typing import Any

from nbremote.errors import NotInitializedError, UnknownWorkerError, WorkerError
from nbremote.rpc._core import pgroup
from nbremote.rpc._core.agent import current_agent
from nbremote.rpc._core.future import Future
from nbremote.rpc._driver.world import World

__all__ = ["destroy_process_group", "init_process_group"]

RENDEZVOUS_TIMEOUT = 60.0


def init_process_group(workers: Sequence[str], backend: str | None = None, *,
                       timeout: float | datetime.timedelta | None = None, master_addr: str | None = None,
                       rendezvous_timeout: float = RENDEZVOUS_TIMEOUT) -> None:
    """Form a c10d process group among ``workers``: in each, ``torch.distributed``'s default group is initialized
    with rank = its index in ``workers`` and world_size = ``len(workers)``, so DDP and collectives work there.

    ``backend``: ``"nccl"`` where every member has CUDA, else ``"gloo"`` (None, the default), or the one named.
    ``timeout``: the group's own, as torch's ``init_process_group(timeout=)`` (seconds or a timedelta; None:
    torch's default). ``master_addr``: the address the members reach the first one's store at, where the
    chosen one (see ``nbremote.rpc._driver.pgroup``) does not work; ``rendezvous_timeout``: seconds for each
    member to reach the store and meet the others. Undo with :func:`destroy_process_group`; the group also
    ends with the world, or when one of its members is removed or restarted.
    """
    world = _driver_world("forms process groups")
    names = _members(world, workers)
    timeout_s = _seconds(timeout, "timeout")
    if not (isinstance(rendezvous_timeout, (int, float)) and rendezvous_timeout > 0):
        raise ValueError(f"rpc.init_process_group: rendezvous_timeout is in seconds, > 0; got {rendezvous_timeout!r}")
    probes = _gather(names, pgroup.probe, lambda name: (), -1, "could not be asked about torch.distributed")
    for name in names:
        _check_member(name, probes[name])
    backend = _backend(names, probes, backend)
    addr = _rendezvous_addr(world, names, probes, master_addr)
    port: int = world.agent.call(names[0], pgroup.serve_store, (float(rendezvous_timeout),)).wait()
    specs = {name: pgroup.JoinSpec(backend, rank, len(names), addr, port, float(rendezvous_timeout), timeout_s,
                                   world.agent.name, tuple(names)) for rank, name in enumerate(names)}
    joined = _gather(names, pgroup.join, lambda name: (specs[name],), 2 * rendezvous_timeout + 30,
                     "could not join the process group", raise_first=False)
    failed = {n: r for n, r in joined.items() if isinstance(r, BaseException) or "error" in r}
    if failed:
        _undo(names)
        raise _join_error(names, failed, specs[names[0]])


def destroy_process_group(workers: Sequence[str] | None = None) -> None:
    """Destroy the default process group of each of ``workers`` (every worker: None), whoever formed it:
    ``torch.distributed.destroy_process_group()`` there. A worker without one is left as it is."""
    world = _driver_world("destroys process groups")
    names = [p.name for p in world.agent.peers.values() if p.lost is None] if workers is None \
        else _members(world, workers)
    _gather(names, pgroup.leave, lambda name: (), -1, "could not destroy its process group")


def _driver_world(what: str) -> World:
    agent = current_agent()
    if not isinstance(agent.world, World):
        raise NotInitializedError(
            f"{agent.name!r} is a worker: only the driver {what} (rpc.init_process_group forms one among "
            "workers; in a worker's own code, torch.distributed.init_process_group works as in torch)")
    return agent.world


def _members(world: World, workers: Sequence[str]) -> list[str]:
    if isinstance(workers, str) or not isinstance(workers, Sequence) or not all(isinstance(w, str) for w in workers):
        raise TypeError(f"rpc.init_process_group takes a list of worker names, e.g. ['trainer0', 'trainer1'], "
                        f"not {workers!r}")
    names = list(workers)
    if not names:
        raise ValueError("rpc.init_process_group needs at least one worker name")
    if len(set(names)) != len(names):
        raise ValueError(f"a worker is named twice in {names}: each worker is one rank")
    agent = world.agent
    for name in names:
        if name == agent.name:
            raise ValueError(f"{name!r} is the driver: a process group is formed among workers; call "
                             "torch.distributed.init_process_group here yourself if the driver must be a rank")
        peer = agent.peers.get(name)
        if peer is None:
            known = ", ".join(p.name for p in agent.peers.values()) or "none"
            raise UnknownWorkerError(f"no worker {name!r} to put in a process group (workers: {known}); start "
                                     f"it first with rpc.add_worker({name!r})", name)
        if peer.lost is not None:
            raise WorkerError(f"worker {name!r} is gone ({peer.lost}), so it cannot be in a process group; "
                              f"rpc.restart_worker({name!r}) gives it a fresh kernel", name)
    return names


def _seconds(value: float | datetime.timedelta | None, what: str) -> float | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"rpc.init_process_group: {what} is in seconds (or a timedelta), > 0; got {value!r}")
    return float(seconds)


def _gather(names: list[str], fn: Any, args: Any, timeout: float, failing: str,
            raise_first: bool = True) -> dict[str, Any]:
    """``fn(*args(name))`` on every worker at once; their results by name (an error raised, or kept)."""
    agent = current_agent()
    futs: dict[str, Future[Any]] = {name: agent.call(name, fn, args(name), timeout=timeout) for name in names}
    results: dict[str, Any] = {}
    for name, fut in futs.items():
        try:
            results[name] = fut.wait()
        except Exception as exc:
            if raise_first:
                raise WorkerError(f"worker {name!r} {failing}: {exc}", name) from exc
            results[name] = exc
    return results


def _check_member(name: str, info: dict[str, Any]) -> None:
    if info["torch"] is None:
        raise WorkerError(f"worker {name!r} cannot join a process group: torch is not installed in its kernel's "
                          "environment; install torch there (pip install torch), or leave it out", name)
    if not info["dist"]:
        raise WorkerError(f"worker {name!r} cannot join a process group: its torch {info['torch']} has no "
                          "torch.distributed (torch.distributed.is_available() is False there); install a torch "
                          "build with distributed support", name)
    group = info["group"]
    if group is not None:
        who = "rpc.init_process_group" if group["ours"] else "its own code"
        raise WorkerError(
            f"worker {name!r} already has a default process group (backend {group['backend']}, rank {group['rank']} "
            f"of {group['world_size']}, made by {who}); destroy it first with rpc.destroy_process_group([{name!r}]) "
            "(torch.distributed.destroy_process_group() there)", name)


def _backend(names: list[str], probes: dict[str, dict[str, Any]], backend: str | None) -> str:
    if backend is None:
        return "nccl" if all(probes[n]["cuda"] and probes[n]["nccl"] for n in names) else "gloo"
    if not isinstance(backend, str):
        raise TypeError(f"rpc.init_process_group: backend is a name such as 'gloo' or 'nccl', not {backend!r}")
    backend = backend.lower()
    for name in names:
        if backend == "gloo" and not probes[name]["gloo"]:
            raise WorkerError(f"worker {name!r} has no gloo backend (torch.distributed.is_gloo_available() is False "
                              "there); name another backend, or leave backend=None", name)
        if backend == "nccl" and not (probes[name]["cuda"] and probes[name]["nccl"]):
            why = "no CUDA device" if not probes[name]["cuda"] else "a torch without NCCL"
            raise WorkerError(f"worker {name!r} has {why}, so it cannot be in an nccl group; use backend='gloo' "
                              "(or None: nccl only where every member has CUDA)", name)
    return backend


def _rendezvous_addr(world: World, names: list[str], probes: dict[str, dict[str, Any]],
                     master_addr: str | None) -> str:
    """Where the members reach the store that ``names[0]`` serves (see the module docstring)."""
    if master_addr is not None:
        return master_addr
    if len({probes[n]["machine"] for n in names}) == 1:
        return pgroup.LOOPBACK
    master = names[0]
    own = _reached_at(world, master)
    if own is not None:
        return own
    for other in names[1:]:  # ask the first member which of its addresses leads to another member
        dest = _reached_at(world, other)
        if dest is not None:
            local = world.agent.call(master, pgroup.source_address, (dest,)).wait()
            if local is not None and _routable(local):
                return str(local)
    raise WorkerError(
        f"cannot tell at which address the other members reach worker {master!r}, which serves the process "
        f"group's store (the driver reaches it through loopback or a tunnel); pass master_addr= an address of "
        f"{master!r}'s host that every member reaches", master)


def _reached_at(world: World, name: str) -> str | None:
    """The address the driver reaches ``name``'s kernel at, where others could use it too."""
    kernel = world.kernels.get(name)
    if kernel is None:
        return None
    ip = kernel.conn.get("ip")  # an ipc kernel's (a local one's) is a path
    if kernel.shareable and kernel.conn.get("transport", "tcp") == "tcp" and isinstance(ip, str) and _routable(ip):
        return ip
    return kernel.host if kernel.host and _routable(kernel.host) else None


def _routable(addr: str) -> bool:
    """Not loopback and not a wildcard: an address another host may reach (a host name counts)."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return addr not in ("localhost", "") and "/" not in addr
    return not (ip.is_loopback or ip.is_unspecified)


def _undo(names: list[str]) -> None:
    """Destroy what formed of a group that failed (a member that did join would refuse the next one)."""
    agent = current_agent()
    futs = [agent.call(name, pgroup.leave, (True,), timeout=10.0) for name in names]
    deadline = time.monotonic() + 15
    for fut in futs:
        try:
            fut.wait(max(0.1, deadline - time.monotonic()))
        except Exception:  # a member we cannot reach has no group of ours left to worry about
            continue


def _join_error(names: list[str], failed: dict[str, Any], spec: pgroup.JoinSpec) -> WorkerError:
    """One error for a failed join: a member that could not reach the store first (the others only waited)."""
    def message(result: Any) -> str:
        return f"{type(result).__name__}: {result}" if isinstance(result, BaseException) else str(result["message"])

    store = [n for n in names if n in failed and isinstance(failed[n], dict) and failed[n]["error"] == "store"]
    name = store[0] if store else next(n for n in names if n in failed)
    others = [n for n in names if n in failed and n != name]
    also = f" (also failed: {', '.join(others)})" if others else ""
    if store:
        return WorkerError(
            f"worker {name!r} could not reach the process group's store at {spec.addr}:{spec.port}, served by "
            f"{names[0]!r}, within {spec.rendezvous_s:.0f} s: {message(failed[name])}{also}. Check that {name!r} "
            f"can reach {spec.addr} (another network, a firewall), or pass master_addr= an address of "
            f"{names[0]!r}'s host that every member reaches; nothing of the group was kept", name)
    return WorkerError(
        f"worker {name!r} could not join the process group (rank {names.index(name)} of {len(names)}, backend "
        f"{spec.backend}, store {spec.addr}:{spec.port}): {message(failed[name])}{also}; nothing of the group "
        "was kept", name)
