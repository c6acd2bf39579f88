"""A member's side of a c10d process group formed by the driver (``rpc.init_process_group``).

The driver asks each named worker, by RPC, what it has (:func:`probe`), has the first one open a
``TCPStore`` on a free port (:func:`serve_store`), then runs :func:`join` on all of them at once: each
connects to that store and calls ``torch.distributed.init_process_group`` with its rank. :func:`leave`
destroys the group (``rpc.destroy_process_group``).

torch's default group is one per process, so the group this process joined is kept in one slot here
(``_SLOT``), beside torch's own global. It ends with the world: the :class:`_Watch` that :func:`join`
puts on the agent's tick (every 50 ms, on the IO thread; one dict lookup per member) destroys it once the
driver that formed it is gone (its comm closed, its lease ran out, a new world bootstrapped this kernel)
or a member left the world, died or was replaced (restarted) -- a group with a missing rank can only
hang or fail, and a group left behind would refuse the next ``init_process_group``. The destroy runs
on a thread of its own, never on the IO thread. A group the user made without nbremote is left alone.

gloo picks its network interface from the host name, which may resolve to an address the other members
cannot reach (``127.0.1.1`` on Debian, or nothing in a container). Unless the user set
``GLOO_SOCKET_IFNAME``, :func:`join` names the interface that routes to the store's address (loopback
when the group is on one host), only while the group is made.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from nbremote import _netaddr
from nbremote.rpc._core.agent import Agent, current_agent_or_none

__all__ = ["LOOPBACK", "JoinSpec", "join", "leave", "probe", "serve_store", "source_address", "stale_reason"]

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class JoinSpec:
    """What one member needs to join: sent by the driver with :func:`join`."""

    backend: str
    rank: int
    world_size: int
    addr: str  # the store's address as this member reaches it
    port: int
    rendezvous_s: float  # reaching the store and meeting every rank
    timeout_s: float | None  # the group's own (torch's ``timeout=``); None: torch's default
    driver: str
    members: tuple[str, ...]


@dataclass
class _Joined:
    """The group this process is in because the driver formed it."""

    spec: JoinSpec
    agent: Agent
    token: str | None  # the world's, as this worker knew it at the join
    incarnations: dict[str, str | None] = field(default_factory=dict)  # each other member's kernel then
    driver_route: bool = True  # whether the driver's comm was open at the join (then its close ends the group)
    group: Any = None  # torch's default group we made: one the user made after destroying ours is theirs


_LOCK = threading.Lock()  # joins, leaves and the watch's destroy, one at a time
_SLOT: dict[str, Any] = {"joined": None, "store": None}  # the group we joined; the store we serve as rank 0


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def probe() -> dict[str, Any]:
    """What the driver must know of this member before forming a group: torch.distributed, devices, a group."""
    stale_reason()  # a group of a world that has ended goes first: it must not refuse the new one
    info: dict[str, Any] = {"machine": _machine(), "host": socket.gethostname(), "torch": None, "dist": False,
                            "gloo": False, "nccl": False, "cuda": 0, "group": None}
    try:
        import torch
    except ImportError:
        return info
    info["torch"] = torch.__version__
    dist = _dist()
    info["dist"] = bool(dist.is_available())
    if not info["dist"]:
        return info
    info["gloo"], info["nccl"] = bool(dist.is_gloo_available()), bool(dist.is_nccl_available())
    info["cuda"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dist.is_initialized():
        info["group"] = {"backend": str(dist.get_backend()), "rank": dist.get_rank(),
                         "world_size": dist.get_world_size(), "ours": _ours(dist)}
    return info


def serve_store(rendezvous_s: float) -> int:
    """Open the group's ``TCPStore`` here (rank 0) on a port the system picks; returns that port.

    The store's server listens on every interface (torch binds it so); this process's own client reaches it
    on loopback, which always works, while the others use the address the driver chose.
    """
    dist = _dist()
    with _LOCK:
        _release_store()
        store = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=rendezvous_s))
        _SLOT["store"] = store
        return int(store.port)


def join(spec: JoinSpec) -> dict[str, Any]:
    """Join the group: connect to its store and ``init_process_group`` with this member's rank.

    Returns what torch then says (backend, rank, world size), or ``{"error": stage, "message": ...}`` where
    reaching the store (``"store"``) or meeting the other ranks (``"init"``) failed: torch's own errors
    carry pages of C++ frames, and the driver words the error for the user.
    """
    dist = _dist()
    agent = current_agent_or_none()
    if agent is None:
        return {"error": "init", "message": "this kernel is no member of a world"}
    with _LOCK:
        if spec.rank == 0:
            store = _SLOT["store"]
            if store is None:
                return {"error": "store", "message": "the store rank 0 served is gone (destroyed meanwhile)"}
        else:
            try:
                store = dist.TCPStore(spec.addr, spec.port, is_master=False,
                                      timeout=datetime.timedelta(seconds=spec.rendezvous_s))
            except Exception as exc:
                return {"error": "store", "message": _first_line(exc)}
        timeout, meeting = _timeouts(dist, spec)
        names_made = getattr(dist.distributed_c10d._world, "group_count", None)
        try:
            with _gloo_interface(spec):
                dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size,
                                        timeout=meeting or timeout)
            if meeting is not None:
                dist.distributed_c10d._set_pg_timeout(timeout)
        except Exception as exc:
            if spec.rank == 0:
                _release_store()
            if names_made is not None and not dist.is_initialized():
                # torch counted the failed group: its next default group would look for keys under another
                # name than the members that never got this far (the store's keys are prefixed with it)
                dist.distributed_c10d._world.group_count = names_made
            return {"error": "init", "message": _first_line(exc)}
        joined = _Joined(spec, agent, agent.peers.world_token,
                         driver_route=agent.peers.caller(spec.driver) is not None)
        for name in spec.members:
            peer = agent.peers.get(name)
            if name != agent.name and peer is not None:
                joined.incarnations[name] = peer.incarnation
        joined.group = dist.group.WORLD
        _SLOT["joined"] = joined
        _watch(agent)
        return {"backend": str(dist.get_backend()), "rank": dist.get_rank(), "world_size": dist.get_world_size()}


def _timeouts(dist: Any, spec: JoinSpec) -> tuple[datetime.timedelta | None, datetime.timedelta | None]:
    """The group's timeout, and the shorter one its making waits under where torch can change it afterwards.

    Making a gloo group waits for every rank's address under the *group's* timeout (torch's default: 30 min),
    so a member that never arrives would hold the others that long; the meeting waits ``rendezvous_s``
    instead, and the group gets its own timeout once made (torch's ``_set_pg_timeout``, since 2.3).
    """
    timeout: datetime.timedelta | None = None
    if spec.timeout_s is not None:
        timeout = datetime.timedelta(seconds=spec.timeout_s)
    else:
        from torch.distributed import constants

        timeout = constants.default_pg_nccl_timeout if spec.backend == "nccl" else constants.default_pg_timeout
    known = spec.backend in ("gloo", "nccl") and hasattr(dist.distributed_c10d, "_set_pg_timeout")
    meeting = datetime.timedelta(seconds=spec.rendezvous_s) if known and timeout is not None else None
    return timeout, meeting


def leave(only_ours: bool = False) -> bool:
    """Destroy this process's default group (``only_ours``: only one nbremote formed); True if there was one."""
    with _LOCK:
        return _destroy(only_ours)


def _ours(dist: Any) -> bool:
    joined = _SLOT["joined"]
    return joined is not None and joined.group is dist.group.WORLD


def _destroy(only_ours: bool) -> bool:
    destroyed = False
    if "torch.distributed" in sys.modules:  # never import torch to find nothing to destroy
        dist = _dist()
        if dist.is_available() and dist.is_initialized() and (not only_ours or _ours(dist)):
            dist.destroy_process_group()
            destroyed = True
    _SLOT["joined"] = None
    _release_store()
    return destroyed


def _release_store() -> None:
    _SLOT["store"] = None  # the last reference: the server stops with it


def stale_reason() -> str | None:
    """Why the group this process joined has outlived its world (and destroy it then), or None."""
    joined = _SLOT["joined"]
    why = None if joined is None else _outlived(joined)
    if why is not None:
        with _LOCK:
            if _SLOT["joined"] is joined:
                _destroy(only_ours=True)
                print(f"nbremote: destroyed the process group {joined.agent.name!r} was rank {joined.spec.rank} of: "
                      f"{why}", file=sys.__stderr__, flush=True)
    return why


def _outlived(joined: _Joined) -> str | None:
    agent = joined.agent
    if current_agent_or_none() is not agent or not agent.running:
        return "this kernel left its world"
    if agent.peers.world_token != joined.token:
        return "a new world bootstrapped this kernel"
    if joined.driver_route and agent.peers.caller(joined.spec.driver) is None:
        return f"the world ended ({joined.spec.driver!r}, which formed the group, is gone)"
    for name, inc in joined.incarnations.items():
        peer = agent.peers.get(name)
        if peer is None:
            return f"member {name!r} left the world"
        if peer.lost is not None:
            return f"member {name!r} is gone ({peer.lost})"
        if peer.incarnation != inc:
            return f"member {name!r} was restarted"
    return None


class _Watch:
    """The agent's tick hook (see the module docstring): cheap while nothing changed, a thread when it did."""

    def __init__(self) -> None:
        self.busy = False

    def __call__(self, now: float) -> None:
        del now
        joined = _SLOT["joined"]
        if joined is None or self.busy or _outlived(joined) is None:
            return
        self.busy = True
        threading.Thread(target=self._destroy, name="nbremote-pgroup-end", daemon=True).start()

    def _destroy(self) -> None:
        try:
            stale_reason()
        finally:
            self.busy = False


def _watch(agent: Agent) -> None:
    if not any(isinstance(hook, _Watch) for hook in agent.on_tick):  # once per agent; idle without a group
        agent.on_tick.append(_Watch())


@contextlib.contextmanager
def _gloo_interface(spec: JoinSpec) -> Any:
    """``GLOO_SOCKET_IFNAME`` = the interface that routes to the store, while gloo makes its device."""
    name = None if spec.backend != "gloo" or os.environ.get("GLOO_SOCKET_IFNAME") else interface_towards(spec.addr)
    if name is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def interface_towards(addr: str) -> str | None:
    """The name of this host's network interface whose address the system would send to ``addr`` from."""
    import psutil

    local = source_address(addr)
    if local is None:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == local for a in addrs):
            return name
    return None


def source_address(addr: str) -> str | None:
    """This host's address that packets to ``addr`` leave from (``_netaddr.source_address``), None if none does."""
    try:
        return _netaddr.source_address(addr)
    except OSError:
        return None


def _machine() -> str:
    """Where loopback leads: the host name, the boot id and the network namespace (Linux). Members that agree
    reach each other on ``127.0.0.1``; a container or namespace of the same machine has a loopback of its own."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        parts.append(f.read().strip())
    with contextlib.suppress(OSError):
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    return "/".join(parts)


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()
