"""Running notebook cells in worker kernels: ``rpc.run_cell``, the engine behind ``%%remote``.

A cell is not an RPC. It runs in the worker's own namespace, on the kernel's *main* shell, as an
``execute_request`` sent by a client of ours (``_transport.cellclient.Client``): fresh shell/control/IOPub
sockets built from the connection info the driver holds for that worker (for a server-hosted worker, a
websocket of its own whose channels poll like sockets: ``_transport.wscells.CellClient``), separate from
the RPC link (which lives in a kernel subshell, so RPCs keep being served while a cell runs). The IOPub
messages whose parent is our request (stream, display_data, execute_result, error, ...) are handed, as
they arrive, to an output handler; the default one (``cell_output``) shows them in the calling cell,
labelled with the worker's name.

One loop polls every worker of a run. A blocking run polls in the calling thread, where the notebook's
interrupt button (SIGINT) lands: the run then interrupts the workers (a signal or an ``interrupt_request``,
as their kernelspec asks), shows what they print while stopping, and raises KeyboardInterrupt; a second
press stops waiting for them. While it polls in the main thread, the run counts presses with a SIGINT
handler of its own (:class:`_StopButton`) rather than waiting for a KeyboardInterrupt to reach its loop:
Python raises that exception wherever the thread happens to be, and one raised in a finalizer the garbage
collector runs there is dropped ("Exception ignored in ..."), which once left a stopped cell running on.
A background run polls on a thread of its own that runs in the calling cell's context, so its output
still lands in that cell; its :class:`CellRun` handle waits, interrupts and reports.

IOPub is a SUB socket: a subscription becomes live some time after ``connect``. Before executing,
each client repeats ``kernel_info_request`` on the control channel until IOPub delivers something,
so no early output of the cell is lost.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any, Literal, Protocol

import zmq

from nbremote.errors import RemoteCellError, WorkerError
from nbremote.rpc._transport.cellclient import Client

#: ``handler(worker, msg_type, content)`` for each output message of a running cell
OutputHandler = Callable[[str, str, dict[str, Any]], None]
OUTPUT_TYPES = frozenset({"stream", "display_data", "update_display_data", "execute_result", "error", "clear_output"})
INTERRUPT_GRACE = 10.0  # s to let interrupted cells report before giving up on them

Status = Literal["running", "ok", "error", "aborted", "lost"]


class CellHost(Protocol):
    """What a cell run needs of the driver's world (``world.World`` is one)."""

    def cell_client(self, name: str) -> Any:
        """A client of its own to ``name``'s kernel (``cellclient.Client``, or ``wscells.CellClient``)."""

    def lost(self, name: str) -> str | None:
        """Why ``name`` is gone, or None while it is a live member."""

    def interrupt(self, name: str) -> None:
        """Interrupt what runs on ``name``'s main shell."""

    def cell_started(self, name: str) -> None: ...

    def cell_finished(self, name: str) -> None: ...


@dataclass
class CellOutcome:
    """How a cell ended on one worker (``status`` is "running" until it has)."""

    worker: str
    status: Status = "running"
    execution_count: int | None = None
    ename: str = ""
    evalue: str = ""
    traceback: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.status == "error":
            return f"{self.worker}: {self.ename}" + (f": {self.evalue}" if self.evalue else "")
        return f"{self.worker}: {self.status}" + (f" ({self.evalue})" if self.evalue else "")


@dataclass(eq=False)
class _Execution:
    """One worker's part of a run."""

    client: Client
    msg_id: str
    outcome: CellOutcome
    idle: bool = False
    replied: bool = False

    @property
    def finished(self) -> bool:
        return (self.idle and self.replied) or self.outcome.status == "lost"


class _StopButton:
    """Counts SIGINTs (the notebook's interrupt button) while a blocking run waits in the main thread.

    The first press is only counted: the loop sees the count at its next poll (within 100 ms) and interrupts
    the workers. Raising KeyboardInterrupt for it instead would lose it wherever Python drops exceptions (a
    finalizer, a weakref callback, a gc callback running in this thread) and could land between reading a
    message and handling it. A second press also raises, as Python's own handler does, so it gets out of
    whatever holds the thread (an output handler that blocks, say). Only Python's default handler is
    replaced, and put back after: a handler installed by someone else, or an ignored SIGINT, stays as it is
    (the loop still treats a KeyboardInterrupt reaching it as a press). Signal handlers belong to the main
    thread; anywhere else there is nothing to install (and no SIGINT arrives there).
    """

    def __init__(self) -> None:
        self.presses = 0
        self._installed = False

    def __enter__(self) -> _StopButton:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, self._pressed)
            self._installed = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # a handler someone set while we waited is theirs to keep
        if self._installed and signal.getsignal(signal.SIGINT) == self._pressed:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _pressed(self, signum: int, frame: FrameType | None) -> None:
        self.presses += 1
        if self.presses > 1:
            signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt

    def caught(self) -> None:
        """A KeyboardInterrupt reached the loop: a press, unless this handler already counted it."""
        self.presses = max(self.presses, 1)


class CellRun:
    """A cell running (or run) on one or more workers; made by :func:`run`.

    ``wait()`` returns the outcomes per worker and raises :class:`RemoteCellError` if the cell failed on
    any of them; ``interrupt()`` interrupts the workers still running it; ``done()`` polls.
    """

    def __init__(self, world: CellHost, workers: Sequence[str], code: str, on_output: OutputHandler) -> None:
        self.workers = tuple(workers)
        self.code = code
        self._world = world
        self._on_output = on_output
        self._runs: dict[str, _Execution] = {}
        self._finished = threading.Event()
        self._interrupted = False
        self.started = time.monotonic()
        self.ended: float | None = None

    # -- the handle ------------------------------------------------------------------------------------
    @property
    def outcomes(self) -> dict[str, CellOutcome]:
        return {w: (self._runs[w].outcome if w in self._runs else CellOutcome(w)) for w in self.workers}

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> dict[str, CellOutcome]:
        """Wait for every worker to finish the cell; raise :class:`RemoteCellError` if it failed anywhere."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the cell is still running on {', '.join(self._running())} after {timeout} s; "
                               "interrupt it with .interrupt()")
        outcomes = self.outcomes
        if any(o.status != "ok" for o in outcomes.values()):
            raise RemoteCellError(outcomes)
        return outcomes

    def interrupt(self) -> None:
        """Interrupt the cell on every worker still running it (KeyboardInterrupt there)."""
        self._interrupted = True
        for worker in self._running():
            with contextlib.suppress(WorkerError):  # a worker that died meanwhile has nothing to interrupt
                self._world.interrupt(worker)

    def _running(self) -> list[str]:
        return [w for w in self.workers if w not in self._runs or not self._runs[w].finished]

    def __repr__(self) -> str:
        elapsed = (self.ended or time.monotonic()) - self.started
        if not self.done():
            return f"<CellRun on {', '.join(self.workers)}: running for {elapsed:.1f} s>"
        states = ", ".join(f"{o.worker} {o.status}" for o in self.outcomes.values())
        return f"<CellRun done in {elapsed:.1f} s: {states}>"

    # -- the loop --------------------------------------------------------------------------------------
    def _start(self) -> None:
        clients: list[Client] = []
        try:
            for worker in self.workers:
                client = self._world.cell_client(worker)  # a Client, or a CellClient through a server
                clients.append(client)
                client.sync(functools.partial(self._world.lost, worker))
            for client in clients:
                self._runs[client.worker] = _Execution(client, client.execute(self.code), CellOutcome(client.worker))
                self._world.cell_started(client.worker)
        except BaseException:
            for client in clients:
                client.close()
            self._close()
            raise

    def _loop(self) -> None:
        """Poll until every worker finished; the interrupt button (SIGINT) here interrupts the workers."""
        poller = zmq.Poller()
        for ex in self._runs.values():
            poller.register(ex.client.iopub, zmq.POLLIN)
            poller.register(ex.client.shell, zmq.POLLIN)
        give_up: float | None = None  # set when the button was pressed and the workers were interrupted
        button = _StopButton()
        try:
            with button:
                while not all(ex.finished for ex in self._runs.values()):
                    try:
                        self._pump(poller)
                    except KeyboardInterrupt:
                        if give_up is not None:  # pressed again: stop waiting for the workers
                            raise
                        button.caught()
                    if button.presses and give_up is None:
                        self.interrupt()
                        give_up = time.monotonic() + INTERRUPT_GRACE
                    if button.presses > 1:  # pressed again (its KeyboardInterrupt maybe lost on the way here)
                        raise KeyboardInterrupt
                    if give_up is not None and time.monotonic() > give_up:
                        break
        finally:
            self._close()
        if button.presses:  # read once Python's handler is back: a later press raises by itself
            raise KeyboardInterrupt

    def _pump(self, poller: zmq.Poller) -> None:
        by_socket = {}
        for ex in self._runs.values():
            by_socket[ex.client.iopub] = by_socket[ex.client.shell] = ex
        for sock, _ in poller.poll(100):
            ex = by_socket[sock]
            msg = ex.client.recv(sock)
            if msg["parent_header"].get("msg_id") != ex.msg_id:
                continue
            if sock is ex.client.shell:
                self._on_reply(ex, msg["content"])
            else:
                self._on_iopub(ex, msg["header"]["msg_type"], msg["content"])
        for worker, ex in self._runs.items():
            why = None if ex.finished else self._world.lost(worker)
            if why is not None:
                ex.outcome.status = "lost"
                ex.outcome.evalue = f"worker {worker!r} is gone: {why}"

    def _on_iopub(self, ex: _Execution, msg_type: str, content: dict[str, Any]) -> None:
        if msg_type == "status":
            ex.idle = content.get("execution_state") == "idle"
        elif msg_type == "execute_input":
            ex.outcome.execution_count = content.get("execution_count")
        elif msg_type in OUTPUT_TYPES:
            self._on_output(ex.client.worker, msg_type, content)

    def _on_reply(self, ex: _Execution, content: dict[str, Any]) -> None:
        ex.replied = True
        outcome = ex.outcome
        outcome.execution_count = content.get("execution_count", outcome.execution_count)
        status = content.get("status")
        if status == "ok":
            outcome.status = "ok"
        elif status == "error":
            outcome.status = "error"
            outcome.ename, outcome.evalue = str(content.get("ename", "")), str(content.get("evalue", ""))
            outcome.traceback = list(content.get("traceback", []))
        else:
            outcome.status = "aborted"
            outcome.evalue = "not run: an earlier cell on this worker failed"

    def _close(self) -> None:
        for worker, ex in self._runs.items():
            ex.client.close()
            if not ex.finished and ex.outcome.status == "running":
                ex.outcome.status = "lost"
                ex.outcome.evalue = "stopped waiting for it after an interrupt"
            self._world.cell_finished(worker)
        self.ended = time.monotonic()
        self._finished.set()

    def _run_in_background(self) -> None:
        ctx = contextvars.copy_context()  # output lands in the cell that started the run

        def main() -> None:
            try:
                ctx.run(self._loop)
            except Exception:  # the loop's failures end the run; wait() reports the outcomes
                if not self.done():
                    self._close()

        threading.Thread(target=main, name=f"nbremote-cell-{'-'.join(self.workers)}", daemon=True).start()


def run(world: CellHost, workers: Sequence[str], code: str, on_output: OutputHandler, background: bool) -> CellRun:
    """Start ``code`` on ``workers``; wait for it unless ``background`` (see :class:`CellRun`)."""
    cell = CellRun(world, workers, code, on_output)
    cell._start()
    if background:
        cell._run_in_background()
    else:
        cell._loop()
        cell.wait()
    return cell
