"""A running Slurm worker's kernel, as the driver holds it: ``SlurmJob`` (a job of its own), ``SlurmStep`` (a step
of a packed job).

**Liveness and loss.** A running job's kernel is a ``SlurmJob``: alive while its job runs (the poll), and its
link gives up on the kernel's heartbeat after 1.5 s, as for any kernel beyond this machine. A lost worker's
reason names its job and the job's state as Slurm has it (``CANCELLED``, ``TIMEOUT``, ``NODE_FAIL``,
``PREEMPTED``): a job is alive until it has one (not while ``COMPLETING``: its kernel may still be exiting),
and it is asked afresh when the heartbeat stops first. Like a provisioned kernel, the worker is told at
bootstrap to exit when the driver's lease runs out (``_worker.install(exit_with=...)``), and the job ends with
it: a driver killed with -9 leaves no job behind for long. ``stop`` (``rpc.shutdown``, ``remove_worker``,
``restart_worker``) cancels the job and waits, bounded, until it has left the queue.

A packed member (``SlurmStep``, see ``slurmpack``) shares its job's state with its siblings, so a job that ends
loses all of them, each naming the job and its own node; ``stop`` cancels its step only, or the job when it is
the last member of its pack still there.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from nbremote.rpc._kernels.handle import StartedKernel
from nbremote.rpc._kernels.slurmpack import Pack, member_files
from nbremote.rpc._kernels.slurmqueue import JobInfo, cancel, queue
from nbremote.rpc._kernels.slurmscript import JOB_SCRIPT, KERNEL_FILE
from nbremote.rpc._transport.base import Connection
from nbremote.rpc._transport.heartbeat import HEARTBEAT_TIMEOUT
from nbremote.rpc._transport.zmqlink import KernelLink

__all__ = ["FRESH_STATE_WAIT", "SlurmJob", "SlurmStep"]

FRESH_STATE_WAIT = 1.0  # s a lost worker's reason waits for a fresh state of its job


class _SlurmLink(KernelLink):
    """The driver's link to a job's kernel: the poll says at once when the job ends (``alive``), the heartbeat gives
    up after ``HEARTBEAT_TIMEOUT``, and the reason names the job and the state Slurm has for it."""

    job: SlurmJob
    _asked: float | None = None  # when the heartbeat stopped and the job's state was not yet final
    _poked = 0.0  # when the poll thread was last asked for a fresh state

    def heartbeat(self, now: float) -> str | None:
        why = super().heartbeat(now) or self.heart.check(now, HEARTBEAT_TIMEOUT)
        if why is None:
            return None
        info = self.job.info
        # The state a job ends in (not COMPLETING, which it shows until its processes are gone), asked afresh if
        # the heartbeat stopped first -- by the poll thread, never blocking this IO thread; at most
        # FRESH_STATE_WAIT s, then the loss is reported with what is known.
        if not info.final:
            if self._asked is None:
                self._asked = now
            if now - self._asked < FRESH_STATE_WAIT:
                if info.polled >= self._poked:  # the last ask was answered: ask again
                    self._poked = now
                    queue.poke()
                return None
        node = self.job.where()
        if info.ended:
            return f"its Slurm job {info.id} ended: {info.state}{f' on {node}' if node else ''}"
        # a packed member's step alone (scancel 123.0, or its kernel exited): its heartbeat said so, and the job
        # script (one read of a file, only now: the job's poll, not this IO thread, watches the job)
        status = self.job.step_ended()
        if status is not None:
            return (f"its Slurm job step {info.id}.{self.job.step or '?'} ended (exit status {status})"
                    f"{f' on {node}' if node else ''}; the job runs on for the other workers in it, and "
                    f"rpc.restart_worker({self.name!r}) runs it again in a new step (a new job if no step of "
                    "the pack runs)")
        return f"{why}; its Slurm job {info.id} is {info.describe(now, named=False)}"


class SlurmJob(StartedKernel):
    """A worker's kernel in a Slurm job: alive while the job runs, stopped by cancelling the job."""

    owned = True
    provisioned = True  # it does not follow its driver as a child does: it exits when the driver's lease ends
    kind = "slurm"
    step: str | None = None  # a packed member's step id in its job

    def __init__(self, conn: dict[str, Any], info: JobInfo, files: Path, log_path: str) -> None:
        super().__init__(conn)
        self.info = info
        self.files = files
        self.log_path = log_path
        self.log_start = 0
        self.host = info.node or None
        self.job_id = info.id

    def alive(self) -> bool:
        # not while COMPLETING: its kernel may still be exiting, and the state the job ends in comes only then
        # (at most ENDING_POLL_S later); a kernel that is gone meanwhile is found by its heartbeat
        return not self.info.final

    def where(self) -> str:
        """The node its kernel runs on, as far as known."""
        return self.info.node

    def step_ended(self) -> str | None:
        """A packed member's step's exit status once it has ended while the job runs on (None for a job of its
        own: its job's state says it all)."""
        return None

    def detail(self, lost: str | None) -> str:
        """What status displays say of the worker: ``job 123 (RUNNING on node1 with gpu:1, 1:52:10 left)``, and
        why it is gone if it is."""
        return f"job {self.job_id} ({self.info.describe(named=False)})" + (f": {lost}" if lost else "")

    def link(self, name: str) -> Connection:
        link = _SlurmLink(name, self.conn, alive=self.alive)
        link.job = self
        return link

    def stop(self, timeout: float = 2.0) -> None:
        """Cancel the job and wait (at most ``STOP_WAIT`` s) until it has left the queue; never raise."""
        del timeout
        with contextlib.suppress(Exception):
            cancel(self.info.id)
        queue.forget(self.info.id)
        for path in (self.files / KERNEL_FILE, self.files / JOB_SCRIPT):
            with contextlib.suppress(OSError):
                path.unlink()


class SlurmStep(SlurmJob):
    """A packed worker's kernel: one step of its pack's job (``job 123.0``), alive while the job runs, stopped by
    cancelling its step -- or the job, when it is the last member of its pack still there."""

    def __init__(self, conn: dict[str, Any], info: JobInfo, files: Path, pack: Pack, name: str, step: str | None,
                 node: str | None, launch: int) -> None:
        self.pack, self.name, self.step, self.launch = pack, name, step, launch
        self.member = member_files(files, name)
        super().__init__(conn, info, files, str(self.member.log))
        self.host = node or None

    def where(self) -> str:
        return self.host or self.info.node

    def step_ended(self) -> str | None:
        return self.pack.ended(self.name, self.launch)

    def detail(self, lost: str | None) -> str:
        """``job 123.0 (RUNNING on node1 with gpu:1, 1:52:10 left)``, and why it is gone if it is."""
        step = f"job {self.job_id}.{self.step}" if self.step is not None else f"job {self.job_id}"
        return f"{step} ({self.info.describe(node=self.host, named=False)})" + (f": {lost}" if lost else "")

    def stop(self, timeout: float = 2.0) -> None:
        """Cancel this step (the job if no other member is left) and wait, bounded, until it is gone; never raise."""
        del timeout
        last = True
        with contextlib.suppress(Exception):
            last, _ = self.pack.release(self.name, self.step)
        for path in (self.member.conn, self.member.step, *([self.files / JOB_SCRIPT] if last else [])):
            with contextlib.suppress(OSError):
                path.unlink()
