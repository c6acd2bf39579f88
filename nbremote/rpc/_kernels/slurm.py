"""Workers in Slurm jobs: ``SlurmKernel(sbatch="-p gpu --gres=gpu:1 -t 2:00:00")``, one job per worker.

**Submit.** Each start writes a job script (0600) into a directory of its own (0700) under a private
directory on the filesystem the nodes share (``shared_dir``, default ``~/.nbremote/slurm``), and submits it
with ``sbatch`` -- the user's options, then ours: a job name naming the worker (``nbremote-<name>``), the log
beside the script, ``--no-requeue`` (a requeued job would start a kernel no one attaches). The job runs
``nbremote worker --ip auto --driver <this machine's address>``: the node listens on its own address on its
route back here (what a user typing ``$(hostname -i)`` into ``--wrap`` gets wrong: it expands on the login
node, and Debian-style nodes map their name to 127.0.1.1), with CurveZMQ keys in the connection file it
writes beside the script, as any attached worker beyond loopback. Workers start in parallel (the world's
threads), so their ``sbatch`` calls do too.

**Wait visibly.** One thread of this process polls ``squeue`` once for all its jobs (``slurmqueue``). A start
waits for its connection file to be complete (looked at every ``FILE_POLL_S``: it says before the poll that
the job runs), then the world attaches it. ``progress`` says where a start is
(``PENDING (Resources), job 123, 0:42 in queue``) for status displays. A job that ends before its worker is
up fails the start at once with the tail of its log; a start that runs out of time (``start_timeout``) or is
interrupted (Ctrl-C, ``SlurmKernel.cancel``) cancels its job (``scancel``) and raises ``WorkerStartError``
with Slurm's reason. Every failure after ``sbatch`` cancels the job: no start leaves one behind.

**Liveness and loss.** A running job's kernel is a ``SlurmJob``: alive while its job runs (the poll), and its
link gives up on the kernel's heartbeat after 1.5 s, as for any kernel beyond this machine. A lost worker's
reason names its job and the job's state as Slurm has it (``CANCELLED``, ``TIMEOUT``, ``NODE_FAIL``,
``PREEMPTED``): a job is alive until it has one (not while ``COMPLETING``: its kernel may still be exiting),
and it is asked afresh when the heartbeat stops first. Like a provisioned kernel, the worker is told at
bootstrap to exit when the driver's lease runs out (``_worker.install(exit_with=...)``), and the job ends with
it: a driver killed with -9 leaves no job behind for long. ``stop`` (``rpc.shutdown``, ``remove_worker``,
``restart_worker``) cancels the job and waits, bounded, until it has left the queue.

No Slurm command runs without a ``slurm.conf`` in sight (``slurmqueue.slurm``).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import secrets
import shlex
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from nbremote.errors import WorkerStartError
from nbremote.rpc._kernels.handle import StartedKernel, log_tail
from nbremote.rpc._kernels.slurmqueue import JobInfo, cancel, driver_address, queue, slurm
from nbremote.rpc._transport.base import Connection
from nbremote.rpc._transport.heartbeat import HEARTBEAT_TIMEOUT
from nbremote.rpc._transport.zmqlink import KernelLink

__all__ = ["SlurmJob", "SlurmKernel"]

FILE_POLL_S = 0.1  # s between looks for a starting worker's connection file
FRESH_STATE_WAIT = 1.0  # s a lost worker's reason waits for a fresh state of its job
START_TIMEOUT = 60.0


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
        if info.ended:
            return f"its Slurm job {info.id} ended: {info.state}{f' on {info.node}' if info.node else ''}"
        return f"{why}; its Slurm job is {info.describe(now)}"


class SlurmJob(StartedKernel):
    """A worker's kernel in a Slurm job: alive while the job runs, stopped by cancelling the job."""

    owned = True
    provisioned = True  # it does not follow its driver as a child does: it exits when the driver's lease ends
    kind = "slurm"

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

    def detail(self, lost: str | None) -> str:
        """What status displays say of the worker: ``job 123 (RUNNING on node1, 1:52:10 left)``, and why it is
        gone if it is."""
        return f"job {self.job_id} ({self.info.describe()})" + (f": {lost}" if lost else "")

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
        for path in (self.files / "kernel.json", self.files / "job.sh"):
            with contextlib.suppress(OSError):
                path.unlink()


def _private(path: Path) -> Path:
    """``path`` made if missing (0700); an error if others can read it (connection files hold kernels' keys)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise WorkerStartError(f"SlurmKernel(shared_dir={str(path)!r}) is not private to this user (mode "
                               f"{st.st_mode & 0o777:o}, owner uid {st.st_uid}): the workers' connection files, which "
                               f"hold their keys, go there; `chmod 700 {path}` or pass another shared_dir")
    return path


class SlurmKernel:
    """Start a worker in a Slurm job of its own: ``sbatch`` options (a string or a list), on nodes that share this
    machine's filesystem and Python environment."""

    def __init__(self, sbatch: str | list[str] = "", *, python: str = sys.executable, setup: str = "",
                 env: dict[str, str] | None = None, shared_dir: str | os.PathLike[str] | None = None,
                 driver_address: str | None = None) -> None:
        """``python``: the interpreter the job runs (with nbremote installed; by default this one, which the nodes
        must see at the same path); ``setup``: shell lines run first in the job (``module load cuda``);
        ``env``: variables set in the job, beside what ``sbatch`` exports; ``shared_dir``: where job scripts,
        logs and connection files go, on a filesystem the nodes share (default ``$NBREMOTE_SLURM_DIR``, else
        ``~/.nbremote/slurm``);
        ``driver_address``: this machine's address as the nodes reach it (default: its address on the route to
        the Slurm controller)."""
        if isinstance(sbatch, str):
            args = shlex.split(sbatch)
        elif isinstance(sbatch, (list, tuple)) and all(isinstance(a, str) for a in sbatch):
            args = list(sbatch)
        else:
            raise TypeError(f"SlurmKernel(sbatch=...) is a str of sbatch options or a list of them, got {sbatch!r}")
        for what, value in (("python", python), ("setup", setup)):
            if not isinstance(value, str):
                raise TypeError(f"SlurmKernel({what}=...) is a str, got {type(value).__name__}")
        if env is not None and not (isinstance(env, dict) and all(
                isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) and isinstance(v, str)
                for k, v in env.items())):
            raise TypeError("SlurmKernel(env=...) is a dict of variable names to str values")
        self.sbatch = args
        self.python = python
        self.setup = setup
        self.env = dict(env or {})
        self.shared_dir = Path(shared_dir if shared_dir is not None else
                               os.environ.get("NBREMOTE_SLURM_DIR") or Path.home() / ".nbremote" / "slurm")
        self.driver_address = driver_address
        self._lock = threading.Lock()
        self._starting: dict[str, JobInfo | None] = {}  # worker -> its job, while its start runs
        self._cancelled: set[str] = set()

    def __repr__(self) -> str:
        return f"SlurmKernel({shlex.join(self.sbatch)!r})"

    # -- what status displays and Ctrl-C need --------------------------------------------------------------------
    def progress(self, name: str) -> str:
        """Where the start of worker ``name`` is: ``PENDING (Resources), job 123, 0:42 in queue``."""
        with self._lock:
            job = self._starting.get(name)
        if job is None:
            return "submitting its Slurm job"
        if job.state == "RUNNING":
            return f"{job.describe()}: its kernel is starting"
        return job.describe()

    def job_of(self, name: str) -> JobInfo | None:
        with self._lock:
            return self._starting.get(name)

    def cancel(self, name: str | None = None) -> None:
        """Give up the start of worker ``name`` (every start of this spec if None): its job is cancelled."""
        with self._lock:
            self._cancelled.update([name] if name is not None else list(self._starting))
        with queue.changed:  # the starts wait on it
            queue.changed.notify_all()

    # -- start -----------------------------------------------------------------------------------------------------
    def start(self, name: str, timeout: float = START_TIMEOUT) -> SlurmJob:
        """Submit worker ``name``'s job and wait (at most ``timeout`` s) until its kernel can be attached."""
        deadline = time.monotonic() + timeout
        base = _private(self.shared_dir)
        files = base / f"{name.replace(':', '_').replace('/', '_')}-{os.getpid()}-{secrets.token_hex(4)}"
        files.mkdir(mode=0o700)
        conn_file, log = files / "kernel.json", files / "job.log"
        script = files / "job.sh"
        with open(script, "w", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
            f.write(self._script(name, conn_file, self.driver_address or driver_address()))
        with self._lock:
            self._starting[name] = None
            self._cancelled.discard(name)
        job: JobInfo | None = None
        try:
            job = self._submit(name, script, log)
            return self._wait(name, job, conn_file, log, files, deadline, timeout)
        except BaseException:
            if job is not None:
                queue.forget(job.id)
                with contextlib.suppress(Exception):  # the start's own error is what the user needs
                    cancel(job.id)
            with contextlib.suppress(OSError):
                conn_file.unlink()
            raise
        finally:
            with self._lock:
                self._starting.pop(name, None)
                self._cancelled.discard(name)

    def _script(self, name: str, conn_file: Path, driver: str) -> str:
        lines = ["#!/bin/bash",
                 f"# nbremote worker {name!r} for {getpass.getuser()}@{socket.gethostname()} (pid {os.getpid()}), "
                 "written by nbremote.SlurmKernel",
                 # a notebook kernel's own: ipykernel in the job would watch a pid of the login node and exit
                 "unset JPY_PARENT_PID",
                 *(f"export {k}={shlex.quote(v)}" for k, v in self.env.items()),
                 self.setup,
                 f"exec {shlex.quote(self.python)} -m nbremote.cli worker --connection-file "
                 f"{shlex.quote(str(conn_file))} --ip auto --driver {shlex.quote(driver)}", ""]
        return "\n".join(lines)

    def _submit(self, name: str, script: Path, log: Path) -> JobInfo:
        argv = ["sbatch", "--parsable", "--no-requeue", *self.sbatch, f"--job-name=nbremote-{name}",
                f"--output={log}", str(script)]
        done = slurm(*argv)
        job_id = done.stdout.strip().split(";")[0]
        if done.returncode != 0 or not job_id.isdigit():
            raise WorkerStartError(f"cannot start worker {name!r}: sbatch refused its job: "
                                   f"{done.stderr.strip() or done.stdout.strip()} (sbatch options: "
                                   f"{shlex.join(self.sbatch)!r})", name)
        job = JobInfo(job_id, name)
        with self._lock:
            self._starting[name] = job
        queue.watch(job)
        return job

    def _wait(self, name: str, job: JobInfo, conn_file: Path, log: Path, files: Path, deadline: float,
              timeout: float) -> SlurmJob:
        ended_at: float | None = None  # when the job was seen ending (COMPLETING, its final state to come)
        while True:
            # the file, not the poll, says first that the job runs: look at it often (a stat; once written, a read)
            conn = None if job.ended else _complete_connection_file(conn_file)
            if conn is not None:
                job.up = True
                return SlurmJob(conn, job, files, str(log))
            if job.state == "COMPLETING":  # the state it ends in (FAILED, ...) is what the error should say: wait 2 s
                ended_at = ended_at or time.monotonic()
            if job.ended and (job.final or time.monotonic() - (ended_at or 0.0) > 2.0):
                raise WorkerStartError(
                    f"cannot start worker {name!r}: its Slurm job {job.id} ended ({job.state}) before its kernel was "
                    f"up{log_tail(str(log))} (job log: {log})", name)
            with self._lock:
                cancelled = name in self._cancelled
            if cancelled:
                raise WorkerStartError(f"the start of worker {name!r} was interrupted; its Slurm job {job.id} "
                                       f"({job.describe()}) was cancelled", name)
            left = deadline - time.monotonic()
            if left <= 0:
                where = (f"its Slurm job {job.id} was still {job.state}" +
                         (f" ({job.reason})" if job.reason and job.reason != "None" else ""))
                what = "in the queue" if job.state in ("PENDING", "SUBMITTED") else "and its kernel not up"
                raise WorkerStartError(
                    f"cannot start worker {name!r}: {where} {what} after {timeout:.0f} s; the job was cancelled "
                    f"(scancel {job.id}). Give it longer (start_timeout=...) or ask for what is free (sinfo)"
                    f"{log_tail(str(log))}", name)
            with queue.changed:
                queue.changed.wait(min(left, FILE_POLL_S))


def _complete_connection_file(path: Path) -> dict[str, Any] | None:
    """The connection file's contents once it names every port and key, else None (not yet written, or being
    written: ``nbremote worker`` writes it, then the kernel writes it again once bound)."""
    import json

    if not path.exists():
        return None
    try:
        conn = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    needed = ("shell_port", "iopub_port", "control_port", "hb_port", "stdin_port", "key", "ip")
    if not isinstance(conn, dict) or not all(conn.get(k) for k in needed):
        return None
    return conn
