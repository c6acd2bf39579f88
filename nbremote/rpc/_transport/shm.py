"""Same-host transfers through shared memory: big buffers skip the socket.

Between processes of one machine, a large frame (an array's or a tensor's out-of-band buffer,
``THRESHOLD`` bytes or more) is copied once into a *segment* -- a file in ``/dev/shm`` that both sides
map -- and the message carries ``[frame index, segment, offset, size]`` instead of the bytes. The
receiver's array or tensor aliases its mapping: one memcpy in all, where a socket costs two copies and
a fresh allocation on the receiving side. On this kind of machine fresh memory is the expensive part
(first touch of new pages), so segments are *pooled* and their mappings kept: a segment is lent for one
message and comes back to its owner's pool when the receiver's last alias of it is garbage collected
(the receiver sends ``{"k": "shm", "free": [...]}``, batched with its other bookkeeping).

Who may use it: both ends must see each other's segments. Each process makes a tiny *probe* segment
and names it in its handshake (``comm_open`` one way, the ``ack`` the other); a link uses shared memory
once each side found the other's probe (``sees``) -- one machine, one ``/dev/shm``. Everything else
keeps the socket path, as does a process with ``NBREMOTE_SHM=0`` (one side off is enough). Pool memory
is capped (``POOL_CAP``); past the cap, free segments are evicted
(receivers are told to drop their mappings) or, with none free, the frame goes by the socket.

Safety: segments are created ``0600`` under a name that embeds the creator's pid; a segment lent to a
peer that is lost comes back to the pool; everything a process created is unlinked when its agent
closes, when the process exits, and when SIGTERM, SIGHUP or (where it would kill) SIGINT ends it
(``reap_on_exit``: a kernel stopped by its manager gets SIGTERM, whose default kills without atexit, and
left a 16 MB segment and its probe behind until a later driver swept them). Only SIGKILL leaves them, for
the driver to sweep (``sweep_dead``). Received descriptors are checked (name pattern, bounds) before
anything is mapped.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import mmap
import os
import re
import secrets
import signal
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nbremote.errors import ProtocolError
from nbremote.rpc._transport.switches import switched_on

__all__ = ["POOL_CAP", "SHM_DIR", "SOCKET_NAME", "THRESHOLD", "SharedMemory", "available", "reap_on_exit",
           "sweep_dead"]

THRESHOLD = 1 << 20  # bytes: below, a socket copy is cheaper than a segment round
POOL_CAP = 2 << 30  # bytes of segments one process may hold
SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^nbr-(\d+)-[0-9a-f]{8}-(\d+|probe)$")
# A kernel's listening Unix-domain socket (``unixlink``) lives here too, named by its pid, so that the same exit
# paths unlink it and the same sweep finds it after a SIGKILL; it is never a segment (``_NAME`` refuses it).
SOCKET_NAME = re.compile(r"^nbr-(\d+)-[0-9a-f]{8}-sock$")


def available() -> bool:
    """``/dev/shm`` is usable here, and ``NBREMOTE_SHM`` (read in each process) does not turn it off."""
    if not switched_on("NBREMOTE_SHM"):
        return False
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) and hasattr(mmap, "MAP_POPULATE")


def _unlink_own() -> None:
    """Unlink every segment and probe this process made, found by the pid in their names: no lock taken
    (it runs in a signal handler, which may interrupt a thread holding ``SharedMemory._lock``)."""
    prefix = f"nbr-{os.getpid()}-"
    with contextlib.suppress(OSError):
        for path in SHM_DIR.iterdir():
            if path.name.startswith(prefix):
                with contextlib.suppress(OSError):
                    path.unlink()


def _reap_and_die(signum: int, frame: object) -> None:
    """A deadly signal at its default disposition: unlink our segments, then die of it as we would have."""
    del frame
    _unlink_own()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_reaping: list[int] = []  # the pid whose exit paths unlink its segments (a fork child installs its own)


def reap_on_exit() -> None:
    """Once per process: unlink this process's segments at exit and at SIGTERM / SIGHUP / SIGINT.

    Only signals left at their default (deadly) disposition are taken: a handler someone installed keeps
    the decision (and runs atexit if it exits), an ignored signal stays ignored, and a kernel's SIGINT --
    its interrupt, not its end -- is ipykernel's. Signal handlers can be set from the main thread only;
    from another, atexit alone covers the process.
    """
    if _reaping == [os.getpid()]:
        return
    _reaping[:] = [os.getpid()]
    atexit.register(_unlink_own)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _reap_and_die)


def _size_class(size: int) -> int:
    return max(THRESHOLD, 1 << (size - 1).bit_length())


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


@dataclass(eq=False)
class _Segment:
    name: str
    size: int
    mapping: mmap.mmap
    lent_to: str | None = None  # the peer holding it now (None: in the pool)
    mapped_by: set[str] = field(default_factory=set)  # peers that have mapped it (told on eviction)


class SharedMemory:
    """One process's segments (the ones it lends) and mappings (the ones it borrowed); thread-safe."""

    def __init__(self) -> None:
        self.enabled = available()
        if self.enabled:
            reap_on_exit()
        self._tag = f"nbr-{os.getpid()}-{secrets.token_hex(4)}"
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._own: dict[str, _Segment] = {}
        self._free: dict[int, list[_Segment]] = {}  # size class -> segments in the pool
        self._bytes = 0
        self._mapped: dict[str, mmap.mmap] = {}  # segments of other processes we have mapped
        self._to_free: dict[str, list[str]] = {}  # peer -> its segments we are done with (see ``pending``)
        self._finished: deque[tuple[str, str]] = deque()  # (peer, segment) from finalizers (see ``_done``)
        self._dropped: dict[str, list[str]] = {}  # peer -> our segments it may unmap (we unlinked them)
        self._probe: str | None = None

    @property
    def probe(self) -> str | None:
        """The name of this process's probe segment (made on first use), or None without shared memory."""
        if not self.enabled:
            return None
        with self._lock:
            if self._probe is None:
                name = f"{self._tag}-probe"
                try:
                    os.close(os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600))
                    self._probe = name
                except OSError:
                    self.enabled = False
        return self._probe

    def sees(self, probe: object) -> bool:
        """Whether the peer that named ``probe`` shares our ``/dev/shm`` (then links to it may use it)."""
        return (self.enabled and isinstance(probe, str) and _NAME.match(probe) is not None
                and (SHM_DIR / probe).exists())

    # -- lending (sending side) ----------------------------------------------------------------------------
    def export(self, dest: str, env: dict[str, Any], frames: list[Any]) -> tuple[dict[str, Any], list[Any]]:
        """Move the big frames of a message for ``dest`` into segments; the others stay as they are."""
        if len(frames) < 2 or not self.enabled or "shm" in env:  # frames[0] is a pickle stream, never exported
            return env, frames
        descriptors = []
        out = list(frames)
        for index in range(1, len(out)):  # frames[0] is a pickle stream: small, and not worth a round
            view = memoryview(out[index])
            if view.nbytes < THRESHOLD:
                continue
            segment = self._lend(dest, view.nbytes)
            if segment is None:
                continue  # the pool is full: this frame takes the socket
            segment.mapping[: view.nbytes] = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            descriptors.append([index, segment.name, 0, view.nbytes])
            out[index] = b""
        if not descriptors:
            return env, frames
        return {**env, "shm": descriptors}, out

    def _lend(self, dest: str, size: int) -> _Segment | None:
        size_class = _size_class(size)
        with self._lock:
            pool = self._free.get(size_class)
            segment = pool.pop() if pool else None
            if segment is None:
                if self._bytes + size_class > POOL_CAP:
                    self._evict(self._bytes + size_class - POOL_CAP)
                if self._bytes + size_class > POOL_CAP:
                    return None
                segment = self._create(size_class)
            segment.lent_to = dest
            segment.mapped_by.add(dest)
            return segment

    def _create(self, size: int) -> _Segment:
        name = f"{self._tag}-{next(self._ids)}"
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = _map(fd, size)
        finally:
            os.close(fd)
        segment = self._own[name] = _Segment(name, size, mapping)
        self._bytes += size
        return segment

    def _evict(self, needed: int) -> None:
        """Unlink free segments (largest first) until ``needed`` bytes are gone; the caller holds the lock."""
        for size_class in sorted(self._free, reverse=True):
            pool = self._free[size_class]
            while pool and needed > 0:
                segment = pool.pop()
                self._destroy(segment)
                needed -= segment.size
                for peer in segment.mapped_by:  # let them unmap it
                    self._dropped.setdefault(peer, []).append(segment.name)

    def _destroy(self, segment: _Segment) -> None:
        self._own.pop(segment.name, None)
        self._bytes -= segment.size
        with contextlib.suppress(OSError):
            (SHM_DIR / segment.name).unlink()
        with contextlib.suppress(BufferError):  # an alias in this process (a self-call) keeps it mapped
            segment.mapping.close()

    def returned(self, peer: str, names: Sequence[str]) -> None:
        """``peer`` is done with these segments of ours: back to the pool."""
        with self._lock:
            for name in names:
                segment = self._own.get(name)
                if segment is not None and segment.lent_to == peer:
                    segment.lent_to = None
                    self._free.setdefault(segment.size, []).append(segment)

    def peer_lost(self, peer: str) -> None:
        """Segments lent to a peer that is gone come back; its mappings of ours are gone with it."""
        with self._lock:
            for segment in self._own.values():
                segment.mapped_by.discard(peer)
                if segment.lent_to == peer:
                    segment.lent_to = None
                    self._free.setdefault(segment.size, []).append(segment)
            self._to_free.pop(peer, None)
            self._dropped.pop(peer, None)

    # -- borrowing (receiving side) -------------------------------------------------------------------------
    def attach(self, sender: str, descriptors: object, frames: list[Any]) -> list[Any]:
        """Replace the placeholders of a received message by arrays aliasing the sender's segments."""
        if not isinstance(descriptors, list):
            raise ProtocolError("malformed shared-memory descriptors")
        out = list(frames)
        for item in descriptors:
            if not (isinstance(item, list) and len(item) == 4 and isinstance(item[1], str)
                    and all(isinstance(v, int) and v >= 0 for v in (item[0], item[2], item[3]))):
                raise ProtocolError(f"malformed shared-memory descriptor {item!r:.100}")
            index, name, offset, size = item
            if not _NAME.match(name) or name.endswith("probe") or index >= len(out) or index == 0:
                raise ProtocolError(f"bad shared-memory descriptor {item!r:.100}")
            mapping = self._mapping(name)
            if offset + size > len(mapping):
                raise ProtocolError(f"shared-memory descriptor {item!r:.100} runs past its segment")
            alias = np.frombuffer(mapping, dtype=np.uint8, count=size, offset=offset)
            weakref.finalize(alias, self._done, sender, name)
            out[index] = alias
        return out

    def _mapping(self, name: str) -> mmap.mmap:
        with self._lock:
            own = self._own.get(name)
            if own is not None:  # our own segment, sent back to us
                return own.mapping
            mapping = self._mapped.get(name)
            if mapping is None:
                fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CLOEXEC)
                try:
                    mapping = self._mapped[name] = _map(fd, os.fstat(fd).st_size)
                finally:
                    os.close(fd)
            return mapping

    def _done(self, sender: str, name: str) -> None:
        """The last alias of a borrowed segment is gone (a finalizer: never blocks, never raises).

        No lock here: a collection may run in a thread that holds ``_lock``. ``_collect`` moves these
        into ``_to_free`` later, under the lock.
        """
        self._finished.append((sender, name))

    def _collect(self) -> None:
        """Move what finalizers reported into ``_to_free`` (the caller holds ``_lock``)."""
        while True:
            try:
                sender, name = self._finished.popleft()
            except IndexError:
                return
            self._to_free.setdefault(sender, []).append(name)

    def dropped(self, names: Sequence[str]) -> None:
        """Their owner unlinked these segments: forget our mappings (aliases still alive keep theirs)."""
        with self._lock:
            for name in names:
                self._mapped.pop(name, None)

    def pending(self) -> dict[str, dict[str, list[str]]]:
        """What to tell each peer now (``free``: done with its segments; ``drop``: ours it may unmap)."""
        with self._lock:
            self._collect()
            peers = {*self._to_free, *self._dropped}
        return {peer: news for peer in peers if (news := self.pending_for(peer))}

    def pending_for(self, peer: str) -> dict[str, list[str]]:
        """What to tell ``peer`` now; sent ahead of a message to it, so its segments come back at once."""
        if not self._to_free and not self._dropped and not self._finished:  # the common case, without the lock
            return {}
        with self._lock:
            self._collect()
            news = {}
            free, drop = self._to_free.pop(peer, None), self._dropped.pop(peer, None)
            if free:
                news["free"] = free
            if drop:
                news["drop"] = drop
            return news

    def close(self) -> None:
        """Unlink every segment this process created (on agent close)."""
        with self._lock:
            for segment in list(self._own.values()):
                self._destroy(segment)
            self._free.clear()
            self._mapped.clear()
            if self._probe is not None:
                with contextlib.suppress(OSError):
                    (SHM_DIR / self._probe).unlink()
                self._probe = None


def sweep_dead() -> int:
    """Unlink segments left by processes that died (their creator pid is gone); returns how many."""
    removed = 0
    with contextlib.suppress(OSError):
        for path in SHM_DIR.iterdir():
            match = _NAME.match(path.name) or SOCKET_NAME.match(path.name)
            if match is None:
                continue
            pid = int(match.group(1))
            try:
                os.kill(pid, 0)
                continue  # alive (or not ours to signal: leave it)
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    return removed
