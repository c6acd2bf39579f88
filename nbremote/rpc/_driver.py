"""The driver's side of the world: starting and attaching worker kernels, membership, shutdown.

Workers start in parallel (a thread each: jupyter_client's ``start_kernel`` is quick, the handshake is
the wait). After every membership change the driver tells each worker who its peers are and how to
reach them (connection info, key included), so workers call each other directly.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from nbremote.errors import WorkerStartError
from nbremote.rpc._agent import Agent, Peer
from nbremote.rpc._transport import KernelLink
from nbremote.rpc._world import (
    AttachedKernel,
    LocalKernel,
    StartedKernel,
    WorkerInfo,
    check_name,
    thread_event_loop_closed,
)

START_TIMEOUT = 60.0

WorkersArg = Sequence[str] | Mapping[str, LocalKernel | AttachedKernel | None] | int | None


def normalize_workers(workers: WorkersArg) -> list[tuple[str, LocalKernel | AttachedKernel]]:
    if workers is None:
        return []
    if isinstance(workers, int) and not isinstance(workers, bool):
        return [(f"worker{i}", LocalKernel()) for i in range(1, workers + 1)]
    if isinstance(workers, Mapping):
        items = [(check_name(n), spec or LocalKernel()) for n, spec in workers.items()]
    elif isinstance(workers, (list, tuple)):
        items = [(check_name(n), LocalKernel()) for n in workers]
    else:
        raise TypeError("workers= is a list of names, a dict of name -> LocalKernel/AttachedKernel, or a count")
    for name, spec in items:
        if not isinstance(spec, (LocalKernel, AttachedKernel)):
            raise TypeError(f"worker {name!r}: expected LocalKernel or AttachedKernel, got {type(spec).__name__}")
    names = [n for n, _ in items]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"worker names must be unique; repeated: {dupes}")
    return items


def _bootstrap(name: str, rank: int, timeout: float) -> str:
    return (f"import nbremote.rpc._worker as _nbremote_worker\n"
            f"_nbremote_worker.install({name!r}, {rank}, {sys.path!r}, {timeout!r})\n"
            f"del _nbremote_worker\n")


class World:
    """Membership as the driver manages it."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._next_rank = 1

    def start(self, workers: list[tuple[str, LocalKernel | AttachedKernel]], timeout: float = START_TIMEOUT) -> None:
        """Start/attach workers in parallel; on any failure stop the ones that did start and raise."""
        for name, _ in workers:
            if name == self.agent.name or name in self.agent.peers:
                raise ValueError(f"a worker called {name!r} is already in the world")
        ranks = list(range(self._next_rank, self._next_rank + len(workers)))
        self._next_rank += len(workers)
        with concurrent.futures.ThreadPoolExecutor(max(1, len(workers))) as pool:
            futs = [pool.submit(self._start_one, name, spec, rank, timeout)
                    for (name, spec), rank in zip(workers, ranks, strict=True)]
            results: list[Peer] = []
            errors: list[BaseException] = []
            for f in futs:
                try:
                    results.append(f.result())
                except BaseException as exc:
                    errors.append(exc)
        if errors:
            for peer in results:
                if peer.link is not None:
                    peer.link.close()
                if peer.kernel is not None:
                    peer.kernel.stop()
            raise errors[0]
        for peer in results:
            self.agent.add_peer(peer)
        self.broadcast()

    def _start_one(self, name: str, spec: LocalKernel | AttachedKernel, rank: int, timeout: float) -> Peer:
        with thread_event_loop_closed():
            return self._start_kernel(name, spec, rank, timeout)

    def _start_kernel(self, name: str, spec: LocalKernel | AttachedKernel, rank: int, timeout: float,
                      retry: bool = True) -> Peer:
        kernel = spec.start(name)
        log_start = _log_size(kernel.log_path)
        link = KernelLink(name, kernel.conn, alive=kernel.alive if kernel.owned else None)
        try:
            link.open(self.agent.name, bootstrap=_bootstrap(name, rank, self.agent.default_timeout),
                      timeout=timeout)
        except BaseException as exc:
            link.close()
            died = kernel.owned and not kernel.alive()
            kernel.stop()
            # jupyter_client picks free ports and the kernel binds them a moment later; another process
            # can take one in between. That start is lost, not the worker: start it again on new ports.
            if retry and died and _log_says(kernel.log_path, log_start, "Address already in use"):
                return self._start_kernel(name, spec, rank, timeout, retry=False)
            if isinstance(exc, WorkerStartError) and kernel.log_path:
                raise WorkerStartError(f"{exc} (worker log: {kernel.log_path})", name) from exc
            raise
        return Peer(WorkerInfo(name, rank), conn=_shareable(kernel), kernel=kernel, link=link)

    def broadcast(self) -> None:
        """Tell every worker the current membership."""
        peers = [{"name": self.agent.name, "rank": 0, "conn": None}]
        peers += [{"name": p.name, "rank": p.info.id, "conn": p.conn} for p in self.agent.peers.values()]
        for p in list(self.agent.peers.values()):
            if p.link is not None and p.lost is None:
                self.agent.io.send(p.link, {"k": "world", "peers": peers})

    def remove(self, name: str) -> None:
        peer = self.agent.remove_peer(name, "rpc.remove_worker")
        if peer is None:
            raise self._unknown(name)
        if peer.kernel is not None:
            peer.kernel.stop()
        self.broadcast()

    def _unknown(self, name: str) -> Exception:
        from nbremote.errors import UnknownWorkerError

        return UnknownWorkerError(f"no worker {name!r} to remove (known: {', '.join(self.agent.known())})", name)

    def stop_all(self) -> None:
        kernels = [p.kernel for p in self.agent.peers.values() if p.kernel is not None]
        self.agent.close()
        with concurrent.futures.ThreadPoolExecutor(max(1, len(kernels))) as pool:
            list(pool.map(_stop, kernels))


def _log_size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def _log_says(path: str | None, offset: int, text: str) -> bool:
    """Whether ``text`` was written to the log at ``path`` after ``offset``."""
    if not path:
        return False
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return text.encode() in f.read()
    except OSError:
        return False


def _stop(kernel: StartedKernel) -> None:
    with thread_event_loop_closed():
        kernel.stop()


def _shareable(kernel: StartedKernel) -> dict[str, Any] | None:
    if not kernel.shareable:
        return None
    conn = dict(kernel.conn)
    if isinstance(conn.get("key"), bytes):
        conn["key"] = conn["key"].decode()
    return {k: v for k, v in conn.items() if isinstance(v, (str, int, float, bool)) or v is None}
