"""The driver's side of the world: starting and attaching worker kernels, membership, shutdown.

Workers start in parallel (a thread each: jupyter_client's ``start_kernel`` is quick, the handshake is
the wait). Each joins as soon as its kernel answers, under the driver's lease from then on, so one that is
up early is not lost to a sibling that starts a lease later (issue 38); it shows as starting until the call
returns, which checks that every worker it started is still alive. After every membership change the
driver tells each worker who its peers are and how to reach them (connection info, key included), so
workers call each other directly.

A restart (``rpc.restart_worker``) is a new kernel process under the same name and rank: the old
member is removed first (its pending calls fail with ``WorkerLostError``, here and, through the
membership broadcast, on every peer, which also drops its link to the old kernel), then the worker is
started from the spec it was started with, bootstrapped and announced again. Only kernels nbremote
started can be restarted. The world also keeps what status displays need and only the driver knows:
which workers are starting, how many ``%%remote`` cells run on each (see ``_driver.cells``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import socket
import threading
import urllib.parse
import uuid
from typing import Any

from nbremote.errors import UnknownWorkerError, WorkerError, WorkerStartError
from nbremote.rpc._core import joining
from nbremote.rpc._core.agent import Agent, Peer, until_known_by_all
from nbremote.rpc._core.members import WorkerInfo
from nbremote.rpc._driver.bootstrap import bootstrap
from nbremote.rpc._driver.specs import Spec
from nbremote.rpc._driver.status import WorkerKind, WorkerState, WorkerStatus
from nbremote.rpc._kernels import zygote
from nbremote.rpc._kernels.attached import AttachedKernel
from nbremote.rpc._kernels.handle import StartedKernel, log_says, log_size, log_tail, thread_event_loop_closed
from nbremote.rpc._kernels.hosted import ServerHostedKernel, ServerKernel
from nbremote.rpc._kernels.local import LocalKernel
from nbremote.rpc._kernels.paths import sweep_connection_files
from nbremote.rpc._kernels.slurm import SlurmKernel
from nbremote.rpc._kernels.slurmjob import SlurmJob
from nbremote.rpc._transport.cellclient import Client, interrupt_request
from nbremote.rpc._transport.shm import sweep_dead

START_TIMEOUT = 60.0
class World:
    """Membership as the driver manages it."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        # Names this world to its workers: a kernel that is a member already (attached twice, by another name)
        # refuses to become a second one instead of leaving the first without a kernel.
        self.token = uuid.uuid4().hex
        self._next_rank = 0  # the next worker's rank, the driver's own skipped (it may take any, as torch's master)
        sweep_dead()  # shared-memory segments left behind by processes that died (see _transport.shm)
        sweep_connection_files()  # and the connection files (keys) of their kernels
        self._lock = threading.Lock()
        self._specs: dict[str, Spec] = {}  # how each worker was started
        self.kernels: dict[str, StartedKernel] = {}  # each member's kernel: how to stop, signal and reach it
        self._starting: dict[str, tuple[int, Spec]] = {}  # name -> (rank, spec)
        self._cells: collections.Counter[str] = collections.Counter()  # %%remote cells running, per worker
        # A dead worker is seen here at once (we poll the processes we started); tell the others, whose
        # own links to it would wait for their heartbeat, so their calls to it fail as fast as ours.
        agent.on_peer_lost.append(lambda name, why: self.broadcast())
        self.gathering = joining.hold(agent)  # torch's shutdown barrier, for programs that join the world
        agent.peers.starting = lambda name: name in self._starting

    def start(self, workers: list[tuple[str, Spec]], timeout: float = START_TIMEOUT) -> None:
        """Start/attach workers in parallel; on any failure stop the ones that did start and raise.

        Each worker joins the world the moment its kernel has answered (``_join``): its link goes to the IO
        thread, whose heartbeat renews the driver's lease there, so a kernel that is up does not release the
        driver (or exit) while a sibling takes longer than a lease to start. It stays "starting" for status
        readers until the call returns. Before returning, every worker started is checked to be alive: the
        call never returns with a dead member (``WorkerStartError`` naming it)."""
        with self._lock:
            for name, _ in workers:
                if name == self.agent.name or name in self.agent.peers or name in self._starting:
                    raise ValueError(f"a worker called {name!r} is already in the world")
            ranks, self._next_rank = _next_ranks(self._next_rank, len(workers), self.agent.rank)
            for (name, spec), rank in zip(workers, ranks, strict=True):
                self._starting[name] = (rank, spec)
        joined: list[tuple[Peer, StartedKernel]] = []
        try:
            errors = self._start_all(workers, ranks, timeout, joined)
            if not errors:
                errors = [exc for exc in (self._check_alive(p, k, len(workers)) for p, k in joined) if exc]
            if errors:
                for peer, kernel in joined:
                    self.agent.remove_peer(peer.name, "its start failed")
                    self.kernels.pop(peer.name, None)
                    _stop(kernel)
                if joined:
                    sweep_dead()  # the shared memory the stopped kernels held
                    self.broadcast()  # a broadcast meanwhile (a loss) may have named them to the other workers
                raise errors[0]
            self._specs.update(workers)
        finally:  # only now: a status read in between must see each worker as starting or as a member
            with self._lock:
                for name, _ in workers:
                    self._starting.pop(name, None)
        self.broadcast()
        until_known_by_all(self.agent, timeout)

    def _start_all(self, workers: list[tuple[str, Spec]], ranks: list[int], timeout: float,
                   joined: list[tuple[Peer, StartedKernel]]) -> list[BaseException]:
        """Start ``workers`` in parallel, each joining the world as soon as it is up (appended to ``joined``);
        returns the errors, an interruption of this thread first, then the starts' failures in order. The workers
        given one packed ``SlurmKernel`` are told to it first (``expect``): they share one job."""
        errors: dict[int, BaseException] = {}
        interrupted: list[BaseException] = []
        packs: dict[int, tuple[SlurmKernel, list[str]]] = {}  # the workers given one packed spec share its job
        for name, spec in workers:
            if isinstance(spec, SlurmKernel) and spec.packed:
                packs.setdefault(id(spec), (spec, []))[1].append(name)
        for spec, names in packs.values():
            spec.expect(names)
        with concurrent.futures.ThreadPoolExecutor(max(1, len(workers))) as pool:
            futs = {pool.submit(self._start_one, name, spec, rank, timeout): i
                    for i, ((name, spec), rank) in enumerate(zip(workers, ranks, strict=True))}
            waiting = set(futs)
            while waiting:
                try:  # (a Ctrl-C here: the starts still finish, to be stopped, before it is raised)
                    done, waiting = concurrent.futures.wait(waiting, return_when=concurrent.futures.FIRST_COMPLETED)
                except BaseException as exc:
                    interrupted.append(exc)
                    for _, spec in workers:  # a job waiting in a queue would wait out its timeout: cancel it now
                        if isinstance(spec, SlurmKernel):
                            spec.cancel()
                    continue
                for f in done:
                    try:
                        peer, kernel = f.result()
                    except BaseException as exc:
                        errors[futs[f]] = exc
                        continue
                    self._join(peer, kernel)
                    joined.append((peer, kernel))
        return interrupted[:1] + [errors[i] for i in sorted(errors)]

    def _join(self, peer: Peer, kernel: StartedKernel) -> None:
        """``peer`` is up: a member from now on, its link on the IO thread (heartbeat, lease renewal)."""
        self.kernels[peer.name] = kernel
        self.agent.peers.add(peer)

    def _check_alive(self, peer: Peer, kernel: StartedKernel, started: int) -> WorkerStartError | None:
        """A ``WorkerStartError`` if ``peer``, up earlier in this start, is dead by its end, else None."""
        why = peer.lost
        if why is None and self.agent.peers.get(peer.name) is not peer:
            why = "it left the world"
        if why is None and not kernel.alive():  # before the IO thread's poll has seen it
            why = "its kernel process has exited"
        if why is None:
            return None
        together = " and the workers started with it were stopped" if started > 1 else ""
        tail = log_tail(kernel.log_path, kernel.log_start or 0)
        where = f" (worker log: {kernel.log_path})" if kernel.log_path else ""
        return WorkerStartError(
            f"worker {peer.name!r} started, then died before the start returned: {why}{tail}{where}; it was "
            f"removed{together}. Start it again (rpc.add_worker / rpc.add_workers) once its log says why it "
            "died", peer.name)

    def _threads(self) -> int:
        """The intra-op threads of a local kernel that starts now: this machine's cores shared among the world's
        local kernels (running, starting, this one), at least 1 -- as torchrun gives each of several processes
        on one node. Each kernel's torch would otherwise run as many threads as there are cores, and kernels
        that compute at once (a pipeline's stages, the owners of an optimizer step) spin those threads against
        each other: on 2 cores a 4-stage training step took 5-10% longer with 2 threads a kernel than with 1
        (paired runs, this project's VM). Kernels that run already keep what they have."""
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        with self._lock:
            local = sum(isinstance(self._specs.get(n), LocalKernel) for n in list(self.kernels))  # (a snapshot)
            local += sum(isinstance(spec, LocalKernel) for _, spec in self._starting.values())
        return max(1, cores // max(1, local))

    def _start_one(self, name: str, spec: Spec, rank: int, timeout: float) -> tuple[Peer, StartedKernel]:
        with thread_event_loop_closed():
            return self._start_kernel(name, spec, rank, timeout)

    def _start_kernel(self, name: str, spec: Spec, rank: int, timeout: float,
                      retry: bool = True) -> tuple[Peer, StartedKernel]:
        if isinstance(spec, LocalKernel):
            kernel: StartedKernel = spec.start(name, self._threads())
        elif isinstance(spec, SlurmKernel):  # the time a job waits in the queue counts against the start's
            kernel = spec.start(name, timeout)
        else:
            kernel = spec.start(name)
        if kernel.log_start is None:  # where its part of the log begins, to quote if it dies (see _check_alive)
            kernel.log_start = log_size(kernel.log_path)
        log_start = kernel.log_start
        link = kernel.link(name)
        try:
            plan = kernel.after_driver()
            exit_with = self.agent.name if plan is not None else None
            with self._lock:
                members = sorted({*self.agent.peers, *self._starting} - {name})
            link.open(self.agent.name, bootstrap=bootstrap(name, rank, self.agent.default_timeout,
                                                            (self.token, members), exit_with, plan),
                      timeout=timeout, shm=self.agent.shm)
        except BaseException as exc:
            link.close()
            died = kernel.owned and not kernel.alive()
            kernel.stop()
            # jupyter_client picks free ports and the kernel binds them a moment later; another process
            # can take one in between. That start is lost, not the worker: start it again on new ports.
            if retry and died and log_says(kernel.log_path, log_start, "Address already in use"):
                return self._start_kernel(name, spec, rank, timeout, retry=False)
            if isinstance(exc, WorkerStartError) and kernel.log_path:
                raise WorkerStartError(f"{exc}{log_tail(kernel.log_path, log_start)} (worker log: {kernel.log_path})",
                                       name) from exc
            raise
        peer = Peer(WorkerInfo(name, rank), conn=_shareable(kernel), log_path=kernel.log_path, link=link,
                    incarnation=link.info.get("inc"))
        return peer, kernel

    def broadcast(self) -> None:
        """Tell every worker the current membership."""
        peers = [{"name": self.agent.name, "rank": self.agent.rank, "conn": None, "inc": self.agent.table.incarnation,
                  "driver": True}]
        peers += [{"name": p.name, "rank": p.info.id, "conn": p.conn, "inc": p.incarnation, "watched": self._watched(p),
                   **({"lost": p.lost} if p.lost else {})} for p in self.agent.peers.values()]
        for p in list(self.agent.peers.values()):
            if p.link is not None and p.lost is None:
                self.agent.io.send(p.link, {"k": "world", "peers": peers})

    @staticmethod
    def _watched(peer: Peer) -> bool:
        """Whether our link to the worker polls its kernel's process (``KernelLink.alive``): then we see it die
        at once and tell the others (``lost`` in this broadcast), who can wait longer for its heartbeat."""
        return getattr(peer.link, "alive", None) is not None

    def remove(self, name: str) -> None:
        self._not_starting(name, "remove")
        peer = self.agent.remove_peer(name, "rpc.remove_worker")
        if peer is None:
            raise self._unknown(name, "remove")
        self._specs.pop(name, None)
        kernel = self.kernels.pop(name, None)
        if kernel is not None:
            kernel.stop()
            sweep_dead()  # the shared memory a stopped kernel held (it had no chance to unlink it)
        self.broadcast()
        self.gathering.changed()  # a shutdown barrier that waits for it fails now, naming it

    def _unknown(self, name: str, what: str) -> Exception:
        return UnknownWorkerError(f"no worker {name!r} to {what} (known: {', '.join(self.agent.peers.known())})", name)

    def _not_starting(self, name: str, what: str) -> None:
        """A worker that is up while its siblings still start is a member, but the start owns it until it returns
        (it stops it if a sibling fails)."""
        with self._lock:
            starting = name in self._starting
        if starting:
            raise WorkerError(f"cannot {what} worker {name!r}: it is still starting; {what} it once the "
                              "rpc.init_rpc / add_worker(s) / restart_worker call that starts it has returned", name)

    def _member(self, name: str, what: str) -> Peer:
        peer = self.agent.peers.get(name)
        if peer is None:
            raise self._unknown(name, what)
        return peer

    # -- restart, interrupt ------------------------------------------------------------------------------
    def restart(self, name: str, timeout: float = START_TIMEOUT) -> None:
        """Replace ``name``'s kernel by a fresh one with the same name, rank and spec (see the docstring)."""
        self._not_starting(name, "restart")
        peer = self._member(name, "restart")
        spec = self._specs.get(name)
        old = self.kernels.get(name)
        if old is None or not old.owned or not isinstance(spec, (LocalKernel, ServerKernel, SlurmKernel)):
            raise WorkerError(
                f"cannot restart worker {name!r}: it is an attached kernel (a connection file, or a server's "
                f"kernel_id), which nbremote did not start and "
                f"cannot start again; restart it where it runs, then re-attach it with "
                f"rpc.remove_worker({name!r}) and rpc.add_worker({name!r}, nbremote.AttachedKernel(...))", name)
        rank = peer.info.id
        with self._lock:
            self._starting[name] = (rank, spec)
        try:
            self.agent.remove_peer(name, "rpc.restart_worker")
            self.broadcast()  # peers forget the old kernel (and fail what they had pending on it)
            self.gathering.changed()
            del self.kernels[name]
            _stop(old)
            sweep_dead()  # the shared memory the old kernel held (killed, it had no chance to unlink it)
            try:
                new, kernel = self._start_one(name, spec, rank, timeout)
            except BaseException as exc:
                self._specs.pop(name, None)
                raise WorkerStartError(
                    f"restarting worker {name!r} failed, so it is no longer in the world: {exc}; start it again "
                    f"with rpc.add_worker({name!r})", name) from exc
            self.kernels[name] = kernel
            self.agent.peers.add(new)
        finally:
            with self._lock:
                self._starting.pop(name, None)
        self.broadcast()

    def interrupt(self, name: str) -> None:
        """Interrupt what runs on ``name``'s main shell (a ``%%remote`` cell); RPCs are not affected."""
        peer = self._member(name, "interrupt")
        if peer.lost is not None:
            raise WorkerError(f"cannot interrupt worker {name!r}: it is gone ({peer.lost})", name)
        kernel = self.kernels.get(name)
        if kernel is None:
            raise WorkerError(f"cannot interrupt worker {name!r}: the driver holds no connection to it", name)
        if not kernel.interrupt():  # not ours to signal: ask the kernel itself
            interrupt_request(name, kernel.conn)

    # -- what status displays and %%remote need -----------------------------------------------------------
    def connection_info(self, name: str) -> dict[str, Any]:
        """How the driver reaches ``name``'s kernel (for a client of its own, e.g. to run cells)."""
        return dict(self.kernel(name).conn)

    def kernel(self, name: str) -> StartedKernel:
        """The driver's handle on ``name``'s kernel (every member's: the world started or attached it)."""
        self._member(name, "reach")
        kernel = self.kernels.get(name)
        if kernel is None:
            raise WorkerError(f"the driver holds no connection to worker {name!r}", name)
        return kernel

    def cell_client(self, name: str) -> Any:
        """A client of its own to ``name``'s kernel for running cells: zmq sockets from its connection info,
        or, for a server-hosted kernel, a websocket of its own (``_transport.wscells.CellClient``)."""
        kernel = self.kernel(name)
        if isinstance(kernel, ServerHostedKernel):
            return kernel.cell_client(name)
        return Client(name, dict(kernel.conn))

    def lost(self, name: str) -> str | None:
        """Why ``name`` is gone (dead, removed or being restarted), or None while it is a live member."""
        peer = self.agent.peers.get(name)
        if peer is None:
            return "it left the world (removed or restarted)"
        return peer.lost

    def cell_started(self, name: str) -> None:
        with self._lock:
            self._cells[name] += 1

    def cell_finished(self, name: str) -> None:
        with self._lock:
            self._cells[name] -= 1
            if self._cells[name] <= 0:
                del self._cells[name]

    def status(self) -> list[WorkerStatus]:
        """One record per worker, by rank, from what the driver knows (no call to the workers)."""
        peers = list(self.agent.peers.values())
        with self._lock:
            starting = dict(self._starting)
            cells = dict(self._cells)
        rows = [self._status_of(p, cells.get(p.name, 0)) for p in peers if p.name not in starting]
        for name, (rank, spec) in starting.items():
            doing = spec.progress(name) if isinstance(spec, SlurmKernel) else "starting its kernel"
            rows.append(WorkerStatus(name, rank, _kind(spec, None), _spec_host(spec), None, "starting", 0, 0, None,
                                     doing))
        return sorted(rows, key=lambda r: r.rank)

    def _status_of(self, peer: Peer, cells: int) -> WorkerStatus:
        kernel = self.kernels.get(peer.name)
        info = peer.link.info if peer.link is not None else {}
        in_flight, total = self.agent.calls.counts(peer.name)
        state: WorkerState = "dead" if peer.lost is not None else ("busy" if in_flight or cells else "idle")
        spec = self._specs.get(peer.name)
        if kernel is not None and kernel.host:  # the provisioner's word: the worker only knows its own name
            host = kernel.host
        else:
            host = str(info.get("host") or (_spec_host(spec) if spec is not None else "?"))
        pid = info.get("pid", kernel.pid if kernel is not None else None)
        detail = kernel.detail(peer.lost) if isinstance(kernel, SlurmJob) else peer.lost or ""
        return WorkerStatus(peer.name, peer.info.id, _kind(spec, kernel), host, pid, state, in_flight, total,
                            kernel.log_path if kernel is not None else None, detail)

    def stop_all(self) -> None:
        kernels = list(self.kernels.values())
        self.kernels.clear()
        self.agent.close()
        with concurrent.futures.ThreadPoolExecutor(max(1, len(kernels))) as pool:
            list(pool.map(_stop, kernels))
        zygote.stop()
        sweep_dead()  # the shared memory the stopped kernels held


def _next_ranks(start: int, n: int, driver: int) -> tuple[list[int], int]:
    """The ``n`` ranks from ``start`` on, in order, skipping the driver's; and the one after them."""
    ranks = [r for r in range(start, start + n + 1) if r != driver][:n]
    return ranks, ranks[-1] + 1 if ranks else start


def _kind(spec: Spec | None, kernel: StartedKernel | None) -> WorkerKind:
    if isinstance(spec, ServerKernel) or (kernel is not None and kernel.kind == "server"):
        return "server"
    if isinstance(spec, SlurmKernel) or isinstance(kernel, SlurmJob):
        return "slurm"
    if isinstance(spec, LocalKernel):
        return "local" if spec.kernel_name is None else "kernelspec"
    if spec is None and kernel is not None and kernel.owned:
        return "local" if kernel.kind == "local" else "kernelspec"
    return "attached"


def _spec_host(spec: Spec | None) -> str:
    if isinstance(spec, AttachedKernel) and spec.ssh:
        return spec.ssh.rpartition("@")[2]
    if isinstance(spec, ServerKernel):
        return urllib.parse.urlparse(spec.url).hostname or "?"
    if isinstance(spec, SlurmKernel):
        return "?"  # a node Slurm has not picked yet (a running worker's host is the name it reports)
    return socket.gethostname()


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
