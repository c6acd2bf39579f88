"""Who is in the world as this process knows it, and by which route each member is reached.

:class:`Peers` holds one :class:`Peer` per other member, by name: its rank, how to reach its kernel
(connection info, or none for the driver and for kernels behind the driver's SSH tunnel), the link once
one is open, and why it is gone once it is. Routes: our own link to a peer's kernel, opened on first use
(``link``; workers call each other this way), else the comm the peer opened on us (``attach_caller``: how
a worker calls the driver back, which is no kernel to connect to). A worker learns the world from the
driver (``update``); the driver makes it.

It opens links and hands them to the IO thread (``adopt``), and says which calls a lost route strands;
failing those calls is the agent's (``agent.Agent``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nbremote.errors import UnknownWorkerError, WorkerError, WorkerLostError
from nbremote.rpc._core.members import WorkerInfo
from nbremote.rpc._core.owners import OwnerTable, tagged_id
from nbremote.rpc._transport import open_link
from nbremote.rpc._transport.base import Connection, Link
from nbremote.rpc._transport.iothread import IOThread
from nbremote.rpc._transport.shm import SharedMemory

__all__ = ["CONNECT_TIMEOUT", "Peer", "Peers"]

CONNECT_TIMEOUT = 30.0  # s to open a link of our own to a peer's kernel


@dataclass(eq=False)
class Peer:
    info: WorkerInfo
    conn: dict[str, Any] | None = None  # how to reach it (workers connect lazily)
    log_path: str | None = None  # where its kernel's log is, where the driver knows (named when it is lost)
    link: Connection | None = None  # a KernelLink, or a ServerLink for a server-hosted kernel
    lost: str | None = None
    incarnation: str | None = None  # its kernel's (see ``owners``): the tag of the RRef ids it owns
    watched: bool = False  # the driver polls its kernel's process and says at once when it dies
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return self.info.name


class Peers:
    """The other members, by name (thread-safe), and the routes to them."""

    def __init__(self, me: WorkerInfo, io: IOThread, shm: SharedMemory,
                 adopt: Callable[[Connection], None]) -> None:
        self.me = me
        self._io = io
        self._shm = shm
        self._adopt = adopt  # hands an open link to the IO thread, with the agent's handlers
        self._lock = threading.Lock()
        self._by_name: dict[str, Peer] = {}
        self._callers: dict[str, Link] = {}  # comms callers opened on this kernel: the way to call them back
        self.world_members: set[str] | None = None  # a worker's world, as the driver last told it
        self.world_token: str | None = None  # on a worker: which world it joined (its driver's ``World.token``)
        self.starting: Callable[[str], bool] = lambda name: False  # the driver: is ``name`` (re)starting?
        self.driver: str | None = None  # the driver's name: its own on the driver, else as the world broadcast says

    # -- the table ---------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Peer:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._by_name))

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> Peer | None:
        return self._by_name.get(name)

    def values(self) -> list[Peer]:
        with self._lock:
            return list(self._by_name.values())

    def add(self, peer: Peer) -> None:
        with self._lock:
            self._by_name[peer.name] = peer
        if peer.link is not None:
            self._adopt(peer.link)

    def remove(self, name: str, why: str) -> Peer | None:
        """Take ``name`` out (its link dropped, the peer marked lost); None if it was not a member."""
        with self._lock:
            peer = self._by_name.pop(name, None)
        if peer is None:
            return None
        peer.lost = peer.lost or why
        if peer.link is not None:
            self._io.drop(peer.link)
        return peer

    def known(self) -> list[str]:
        """Every member's name, this process first, then by rank."""
        with self._lock:
            others = sorted(self._by_name.values(), key=lambda p: p.info.id)
        return [self.me.name, *(p.name for p in others)]

    def peer(self, name: str) -> Peer:
        peer = self._by_name.get(name)
        if peer is None:
            raise UnknownWorkerError(f"worker {name!r} is not in this world any more", name)
        return peer

    def resolve(self, to: object) -> WorkerInfo:
        """A name, rank or WorkerInfo -> the member's WorkerInfo (clear error listing who exists)."""
        if isinstance(to, WorkerInfo):
            key: object = to.name
        elif isinstance(to, float):  # a rank that is no int: torch's ValueError
            raise ValueError(f"an RPC destination is a worker name, rank or WorkerInfo; a rank is an int, not the "
                             f"float {to!r}")
        elif isinstance(to, bool) or not isinstance(to, (str, int)):
            raise TypeError(f"an RPC destination is a worker name, rank or WorkerInfo, not {type(to).__name__}")
        else:
            key = to
        me = self.me
        if key == me.name or key == me.id:
            return me
        named = self._by_name.get(key) if isinstance(key, str) else None  # the common case, without a scan
        if named is not None:
            return named.info
        for peer in self.values():
            if key == peer.name or key == peer.info.id:
                return peer.info
        if isinstance(key, str) and self.starting(key):  # not "unknown": add_worker would be the wrong fix
            raise WorkerLostError(
                f"worker {key!r} is being (re)started: its old kernel is gone and the new one is not ready; "
                "call it again once rpc.restart_worker / rpc.add_worker has returned", key)
        raise UnknownWorkerError(
            f"could not find destination {to!r}: no such worker in this world (known: {', '.join(self.known())}); "
            "start it with rpc.add_worker(name)", str(to))

    def new_id_for(self, owner: str, table: OwnerTable) -> str:
        """A new id for an RRef that ``owner`` will own, tagged with its kernel's incarnation as we know it."""
        if owner == self.me.name:
            return table.new_id()
        peer = self._by_name.get(owner)
        return tagged_id(None if peer is None else peer.incarnation)

    # -- routes ------------------------------------------------------------------------------------------
    def link(self, peer: Peer) -> Link:
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
            if peer.name == self.driver:
                raise WorkerLostError(
                    f"{peer.name!r} cannot be called from {self.me.name!r}: its comm to this worker is closed "
                    "(the driver detached or shut down)", peer.name)
            raise WorkerError(
                f"{peer.name!r} cannot be called from {self.me.name!r}: it is reached through the driver's SSH "
                "tunnel, which other workers cannot use; call it from the driver", peer.name)
        with peer.lock:
            if peer.link is None:
                # zmq, or through the same server for a server-hosted peer
                link = open_link(peer.name, peer.conn, watched=peer.watched)
                try:
                    link.open(self.me.name, bootstrap=None, timeout=CONNECT_TIMEOUT, shm=self._shm)
                except BaseException:
                    link.close()
                    raise
                peer.link = link
                self._adopt(link)
        return peer.link

    def existing_link(self, peer: Peer) -> Link | None:
        """A route to ``peer`` that needs no connecting (for best-effort control messages), or None."""
        if peer.lost is not None:
            return None
        if peer.link is not None:
            return peer.link
        with self._lock:
            return self._callers.get(peer.name)

    def route(self, name: str) -> Link | None:
        """``existing_link`` by name: None for a name that is no member."""
        peer = self._by_name.get(name)
        return None if peer is None else self.existing_link(peer)

    def caller(self, name: str) -> Link | None:
        """The comm (or shell link) ``name`` opened on this kernel, if it is open."""
        with self._lock:
            return self._callers.get(name)

    def attach_caller(self, link: Link) -> None:
        """A caller opened a comm on this kernel: calls to it can go back through that comm."""
        with self._lock:
            self._callers[link.name] = link

    def detach_caller(self, link: Link) -> bool:
        """The comm ``link`` was closed. True when its caller can no longer be reached at all (no other
        route: calls pending on it are stranded); False when ``link`` was not its route, or another is."""
        with self._lock:
            if self._callers.get(link.name) is not link:
                return False
            del self._callers[link.name]
            peer = self._by_name.get(link.name)
        return peer is None or (peer.link is None and peer.conn is None)

    def admits(self, caller: str) -> bool:
        """Whether ``caller`` may open a link to this worker: anyone until the driver has told us the world
        (the first caller is the driver bootstrapping us), then its members only."""
        members = self.world_members
        return members is None or caller in members

    # -- a worker's view of the world -------------------------------------------------------------------------
    def update(self, members: list[dict[str, Any]]) -> list[str]:
        """What the driver says the world is (``world`` envelopes): new members are added, those it saw die
        are lost at once; returns the names that left, for the caller to remove."""
        self.world_members = {str(p["name"]) for p in members}
        for p in members:
            name, rank, conn = p["name"], int(p["rank"]), p.get("conn")
            if name == self.me.name:
                continue
            known = self._by_name.get(name)
            if known is None or known.info.id != rank:
                self.add(Peer(WorkerInfo(name, rank), conn=conn, incarnation=p.get("inc"),
                              watched=bool(p.get("watched"))))
            elif p.get("lost") and known.lost is None:
                # The driver saw it die (it polls the process); our own heartbeat would take ~2 s more.
                why = f"the driver saw it go: {p['lost']}"
                if known.link is not None:
                    self._io.lose(known.link, why)
                else:
                    known.lost = why
        return [n for n in self if n not in self.world_members]

    def clear(self) -> list[Peer]:
        """Forget everyone (the agent closes); returns who was known."""
        with self._lock:
            peers = list(self._by_name.values())
            self._by_name.clear()
            self._callers.clear()
        return peers
