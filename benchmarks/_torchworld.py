"""torch.distributed.rpc as a system: worlds of spawned processes, driven over a pipe.

:class:`TorchWorld` spawns a world of ``driver`` (rank 0) + ``worker1..4`` and keeps it for the whole run.
Rank 0 runs :class:`ApiRunner` -- the program nbremote's driver runs -- on commands received over a
``multiprocessing`` pipe (prepare / block / finish a case) and sends back what it measured: timing happens
in rank 0, as nbremote's happens in its driver, and the pipe is never inside a timed region.

Two transports: TensorPipe's default (shared memory between processes of one host, plus uv TCP and the
cma channel), and uv only (``_transports=["uv"], _channels=["basic"]``): what torch does between hosts,
measured on loopback.

:class:`TorchStart` (world start) spawns a fresh world per sample. All ranks import torch, meet at a
barrier, then rank 0 times ``init_rpc`` until a call to every worker has returned (the side figure
"init_rpc alone": torch's own bring-up). The sample is the wall time from spawning the processes to that
point, Python's start and torch's import included: what a user waits for, as nbremote's ``init_rpc``
(which starts its kernels) is.

Children ignore SIGINT (the parent ends them), send their output to a log file, and silence torch's
deprecation warnings (forced with ``simplefilter("always")``, not ours to fix). They are daemon processes,
and rank 0 ends when the parent's end of the pipe closes, so no path leaves a world behind.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
import traceback
import warnings
from multiprocessing.context import ForkServerContext, SpawnContext
from pathlib import Path
from typing import Any

import _fns
from _cases import Case
from _system import CALL_TIMEOUT, Block, System

TRANSPORTS = ("default", "uv")
FORKSERVER_PRELOAD = ("torch.distributed.autograd", "torch.distributed.nn", "torch.distributed.rpc", "_apirunner",
                      "_torchworld")
READY_TIMEOUT = 300.0  # spawn + torch import of 4-5 processes on 2 busy cores took up to ~15 s
ASK_TIMEOUT = 600.0  # one prepare or block; the slowest, a prepare with its warm-up, takes seconds


def _free_port() -> int:
    """A port the OS picked (torch's TCP rendezvous needs it before any process binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _quiet(log_path: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    warnings.showwarning = lambda *args, **kwargs: None


def _rank_name(rank: int) -> str:
    return "driver" if rank == 0 else f"worker{rank}"


def _init(rank: int, size: int, port: int, transport: str) -> None:
    import torch.distributed.rpc as trpc

    options: dict[str, Any] = {"init_method": f"tcp://127.0.0.1:{port}", "rpc_timeout": CALL_TIMEOUT}
    if transport == "uv":
        options.update(_transports=["uv"], _channels=["basic"])
    trpc.init_rpc(_rank_name(rank), rank=rank, world_size=size,
                  rpc_backend_options=trpc.TensorPipeRpcBackendOptions(**options))


def _serve(conn: multiprocessing.connection.Connection, size: int) -> None:
    """Rank 0 of a kept world: answer (command, case) until told to close or the parent is gone."""
    from _apirunner import ApiRunner, torch_api

    runner = ApiRunner(torch_api(), [_rank_name(r) for r in range(1, size)])
    conn.send(("ready", None))
    while True:
        try:
            command, case = conn.recv()
        except EOFError:
            return
        if command == "close":
            return
        try:
            conn.send(("ok", getattr(runner, command)(case)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _world_rank(rank: int, size: int, port: int, transport: str, conn: Any, log_path: str) -> None:
    _quiet(log_path)
    # Every rank imports what RemoteModule and distributed autograd need, as torch's own examples do: the
    # calls a RemoteModule makes refer to a module torch generates when torch.distributed.nn is imported.
    import torch.distributed.autograd
    import torch.distributed.nn  # noqa: F401
    import torch.distributed.rpc as trpc

    try:
        _init(rank, size, port, transport)
    except Exception:
        if rank == 0:
            conn.send(("error", traceback.format_exc()))
        raise
    try:
        if rank == 0:
            _serve(conn, size)
    finally:
        trpc.shutdown()  # graceful: workers serve until rank 0 is done too


def _start_rank(rank: int, size: int, port: int, transport: str, barrier: Any, conn: Any, log_path: str) -> None:
    parent = os.getppid()
    _quiet(log_path)
    import torch.distributed.rpc as trpc  # in the sample (spawn to ready), not in init_rpc's side figure

    barrier.wait(READY_TIMEOUT)
    t0 = time.perf_counter()
    try:
        _init(rank, size, port, transport)
        if rank == 0:
            for future in [trpc.rpc_async(_rank_name(r), _fns.noop) for r in range(1, size)]:
                future.wait()
            conn.send(("ok", time.perf_counter() - t0))
    except Exception:
        if rank == 0:
            conn.send(("error", traceback.format_exc()))
        raise
    # The parent kills the world once rank 0 reported (its shutdown is not timed); should the parent die
    # first, this process is reparented and ends by itself.
    while os.getppid() == parent:
        time.sleep(0.5)


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty log)"


class _Processes:
    """Spawned daemon processes that end on ``stop`` whatever state they are in."""

    def __init__(self) -> None:
        self.procs: list[multiprocessing.process.BaseProcess] = []

    def spawn(self, targets: list[tuple[Any, tuple[Any, ...]]], name: str,
              mp: SpawnContext | ForkServerContext) -> None:
        for i, (target, args) in enumerate(targets):
            proc = mp.Process(target=target, args=args, name=f"{name}-{i}", daemon=True)
            proc.start()
            self.procs.append(proc)

    def stop(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.procs = []


class TorchWorld(System):
    def __init__(self, transport: str, log_dir: Path, workers: int = 4) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport is one of {TRANSPORTS}, not {transport!r}")
        self.name = "torch" if transport == "default" else f"torch-{transport}"
        self.transport = transport
        self.size = workers + 1
        self.log = log_dir / f"{self.name}.log"
        self._procs = _Processes()
        self._conn: multiprocessing.connection.Connection | None = None
        self._gone: str | None = None  # why the world can no longer answer
        self._closing = False

    def start(self) -> None:
        """Start the world; :meth:`wait_ready` waits for it, so several worlds can start at once.

        Its processes fork from a server that imported torch once (``forkserver``), rather than each
        importing it (~3 s of CPU apiece): a kept world's start is not measured, and it spares 2 busy cores
        some 20 s. World start (:class:`TorchStart`) spawns fresh interpreters, as a user's launch does.
        """
        mp = multiprocessing.get_context("forkserver")
        mp.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        receive, send = mp.Pipe()
        port = _free_port()
        self._procs.spawn([(_world_rank, (r, self.size, port, self.transport, send if r == 0 else None,
                                          str(self.log))) for r in range(self.size)], f"bench-{self.name}", mp)
        send.close()
        self._conn = receive

    def wait_ready(self) -> None:
        self._receive(READY_TIMEOUT, "start")

    def supports(self, case: Case) -> bool:
        return case.kind in ("call", "echo", "burst", "module", "train", "fused", "train4", "pipe4", "pipe4rref",
                             "ps")

    def prepare(self, case: Case) -> dict[str, Any]:
        info: dict[str, Any] = self._ask("prepare", case)
        return info

    def block(self, case: Case) -> Block:
        block: Block = self._ask("block", case)
        return block

    def finish(self, case: Case) -> None:
        self._ask("finish", case)

    def _ask(self, command: str, case: Case) -> Any:
        if self._gone or self._closing or self._conn is None:
            raise RuntimeError(f"the {self.name} world is gone: {self._gone or 'closing or not started'}")
        self._conn.send((command, case))
        return self._receive(ASK_TIMEOUT, f"{command} {case.id}")

    def _receive(self, timeout: float, what: str) -> Any:
        if self._conn is None:
            raise RuntimeError(f"the {self.name} world was not started")
        try:
            if not self._conn.poll(timeout):
                self._gone = f"rank 0 did not answer {what} within {timeout:.0f} s"
            else:
                status, value = self._conn.recv()
                if status == "error":  # the traceback's last line first: it is what the table shows
                    raise RuntimeError(f"{self.name} rank 0 failed in {what}: {value.strip().splitlines()[-1]}\n"
                                       f"{value}")
                return value
        except (EOFError, OSError) as exc:
            self._gone = f"rank 0 ended during {what} ({type(exc).__name__})"
        raise RuntimeError(f"{self._gone}; log {self.log}:\n{_log_tail(self.log)}")

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.procs if p.pid is not None and p.is_alive()]

    def begin_close(self) -> None:
        """Tell rank 0 to shut the world down, without waiting: several worlds then close at once."""
        if self._conn is not None and not self._gone and not self._closing:
            with contextlib.suppress(OSError):  # rank 0 may be gone already
                self._conn.send(("close", None))
            self._closing = True

    def close(self) -> None:
        self.begin_close()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        # torch's graceful shutdown takes 2-10 s on 2 busy cores, and measures nothing: a world still up after
        # a few seconds is killed, as is at once one that lost its rank 0 (it would never shut down)
        self._procs.stop(grace=0 if self._gone else 5)


class TorchStart(System):
    """World start: a fresh world of ``driver`` + N workers per sample."""

    def __init__(self, transport: str, log_dir: Path) -> None:
        self.name = "torch" if transport == "default" else f"torch-{transport}"
        self.transport = transport
        self.log = log_dir / f"{self.name}-start.log"

    def supports(self, case: Case) -> bool:
        return case.kind == "start"

    def block(self, case: Case) -> Block:
        mp = multiprocessing.get_context("spawn")
        size = case.workers + 1
        barrier = mp.Barrier(size)
        receive, send = mp.Pipe(duplex=False)
        port = _free_port()
        procs = _Processes()
        t0 = time.perf_counter()
        try:
            procs.spawn([(_start_rank, (r, size, port, self.transport, barrier, send if r == 0 else None,
                                        str(self.log))) for r in range(size)], f"bench-{self.name}-start", mp)
            if not receive.poll(READY_TIMEOUT):
                raise RuntimeError(f"{self.name}: no world ready within {READY_TIMEOUT:.0f} s; log {self.log}:\n"
                                   f"{_log_tail(self.log)}")
            status, value = receive.recv()
            t_ready = time.perf_counter()
        finally:
            procs.stop(grace=0)
            receive.close()
            send.close()
        if status == "error":
            raise RuntimeError(f"{self.name} world start failed: {value.strip().splitlines()[-1]}\n{value}")
        return Block([t_ready - t0], {"init_rpc alone": value})
