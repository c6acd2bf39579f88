"""Workers in Slurm jobs: ``SlurmKernel(sbatch="-p gpu --gres=gpu:1 -t 2:00:00")``, a job per worker (or, packed, one).

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

**Liveness and loss** are the running job's handle's (``slurmjob``): alive while its job runs, lost with the
state the job ended in, stopped by cancelling the job (or, packed, its step).

**Packed** (``packed=True``): the workers one start gives the spec (``init_rpc(workers=...)``, ``add_workers``,
``%remote_workers start --slurm ... --packed``) share one job, ``sbatch -N <workers>``, a job step each, so that
Slurm gives the world all its nodes or none (``slurmpack``). The world says which workers form the pack before
their starts run (``expect``); a packed spec started alone (``add_worker``) is a pack of one. Each member is a
worker of its own (``SlurmStep``: ``job 123.0``, its own log); a pack still queued at ``start_timeout`` is
cancelled once and every member's ``WorkerStartError`` names the job; stopping a member cancels its step,
stopping the last one the job; ``restart_worker`` runs a member again in a new step of its job while the job
runs (its node is the job's until the job ends); a job that ends loses every member, naming it.

No Slurm command runs without a ``slurm.conf`` in sight (``slurmqueue.slurm``).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nbremote.errors import WorkerStartError
from nbremote.rpc._kernels.handle import log_tail
from nbremote.rpc._kernels.slurmjob import SlurmJob, SlurmStep
from nbremote.rpc._kernels.slurmpack import (
    MemberFiles,
    Pack,
    check_packable,
    member_files,
    read_step,
    script,
    step_name,
)
from nbremote.rpc._kernels.slurmqueue import JobInfo, cancel, driver_address, queue, slurm
from nbremote.rpc._kernels.slurmscript import (
    JOB_LOG,
    JOB_SCRIPT,
    KERNEL_FILE,
    file_name,
    opening,
    worker_command,
    write_private,
)

__all__ = ["SlurmJob", "SlurmKernel", "SlurmStep"]

FILE_POLL_S = 0.1  # s between looks for a starting worker's connection file
START_TIMEOUT = 60.0


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
    machine's filesystem and Python environment; ``packed=True``: the workers one start gives this spec share one
    job, a node and a job step each (all their nodes or none)."""

    def __init__(self, sbatch: str | list[str] = "", *, python: str = sys.executable, setup: str = "",
                 env: dict[str, str] | None = None, shared_dir: str | os.PathLike[str] | None = None,
                 driver_address: str | None = None, packed: bool = False) -> None:
        """``python``: the interpreter the job runs (with nbremote installed; by default this one, which the nodes
        must see at the same path); ``setup``: shell lines run first in the job (``module load cuda``);
        ``env``: variables set in the job, beside what ``sbatch`` exports; ``shared_dir``: where job scripts,
        logs and connection files go, on a filesystem the nodes share (default ``$NBREMOTE_SLURM_DIR``, else
        ``~/.nbremote/slurm``);
        ``driver_address``: this machine's address as the nodes reach it (default: its address on the route to
        the Slurm controller); ``packed``: the workers started with this spec in one call (``init_rpc``,
        ``add_workers``, the magic) share one job, ``sbatch -N <workers> --ntasks-per-node=1`` and a step each
        (``setup`` runs once, before the steps, and its environment reaches them), so the sbatch options must not
        say ``-N``, ``-n``, ``--ntasks-per-node`` or ``--array``."""
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
        if not isinstance(packed, bool):
            raise TypeError(f"SlurmKernel(packed=...) is True (the workers of a start share one job) or False (a job "
                            f"each), got {packed!r}")
        if packed:
            check_packable(args)
        self.packed = packed
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
        self._packs: dict[str, Pack] = {}  # worker -> the pack its coming start joins (``expect``)
        self._members: dict[str, Pack] = {}  # worker -> the pack it was last up in (a restart runs it there again)

    def __repr__(self) -> str:
        return f"SlurmKernel({shlex.join(self.sbatch)!r}{', packed=True' if self.packed else ''})"

    def expect(self, names: list[str]) -> None:
        """The workers that one start (the world's, in parallel) gives this spec: packed, they share one job."""
        if self.packed:
            pack = Pack(names)
            with self._lock:
                self._packs.update(dict.fromkeys(names, pack))

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
        """Submit worker ``name``'s job (or, packed, join its pack's) and wait (at most ``timeout`` s) until its
        kernel can be attached."""
        if self.packed:
            return self._start_member(name, timeout)
        deadline = time.monotonic() + timeout
        files = self._directory(name)
        conn_file, log, script = files / KERNEL_FILE, files / JOB_LOG, files / JOB_SCRIPT
        write_private(script, "\n".join([
            *opening(f"nbremote worker {name!r}", self.env, self.setup),
            f"exec {worker_command(self.python, conn_file, self.driver_address or driver_address())}", ""]))
        with self._starting_as(name):
            job: JobInfo | None = None
            try:
                job = self._submit(name, name, [], script, log)
                with self._lock:
                    self._starting[name] = job
                conn = self._wait(name, job, conn_file, log, deadline, timeout)
                job.up = True
                return SlurmJob(conn, job, files, str(log))
            except BaseException:
                if job is not None:
                    queue.forget(job.id)
                    with contextlib.suppress(Exception):  # the start's own error is what the user needs
                        cancel(job.id)
                with contextlib.suppress(OSError):
                    conn_file.unlink()
                raise

    @contextlib.contextmanager
    def _starting_as(self, name: str) -> Iterator[None]:
        """Worker ``name``'s start runs (``progress``, ``job_of`` and ``cancel`` see it) for the ``with`` block."""
        with self._lock:
            self._starting[name] = None
            self._cancelled.discard(name)
        try:
            yield
        finally:
            with self._lock:
                self._starting.pop(name, None)
                self._cancelled.discard(name)

    def _directory(self, name: str, prefix: str = "") -> Path:
        """A new private directory for a start's files (of worker ``name``, the first of a pack), in ``shared_dir``."""
        files = _private(self.shared_dir) / f"{prefix}{file_name(name)}-{os.getpid()}-{secrets.token_hex(4)}"
        files.mkdir(mode=0o700)
        return files

    def _start_member(self, name: str, timeout: float) -> SlurmStep:
        """Start worker ``name`` as a member of its pack (``expect``; a pack of one if none): the first member's
        start submits the job, and every member waits for its own step's kernel."""
        deadline = time.monotonic() + timeout
        with self._lock:
            pack = self._packs.pop(name, None)
            old = self._members.get(name) if pack is None else None
        with self._starting_as(name):
            running = old.relaunch(name) if old is not None else None
            if old is not None and running is not None:  # a restart while the job runs: a new step on its node
                return self._relaunch(name, old, *running, deadline, timeout)
            return self._join(name, pack or Pack([name]), deadline, timeout)

    def _join(self, name: str, pack: Pack, deadline: float, timeout: float) -> SlurmStep:
        """Member ``name``'s start in ``pack``: the job submitted if no member's start has yet, then its step's
        kernel waited for; a failure fails the pack's start (all or nothing)."""
        try:
            with pack.submitting:
                if pack.job is None and pack.failure is None:
                    self._submit_pack(name, pack)
            if pack.failure is not None or pack.job is None or pack.files is None:
                raise WorkerStartError(f"cannot start worker {name!r}: {pack.failure}", name)
            job, files = pack.job, pack.files
            with self._lock:
                self._starting[name] = job
            member = member_files(files, name)
            conn = self._wait(name, job, member.conn, member.log, deadline, timeout, pack)
            step, node = read_step(member.step)
            pack.up(name)
            with self._lock:
                self._members[name] = pack
            return SlurmStep(conn, job, files, pack, name, step, node, pack.launches[name])
        except BaseException as exc:
            prefix = f"cannot start worker {name!r}: "
            text = str(exc)
            pack.fail(text[len(prefix):] if text.startswith(prefix) else
                      f"worker {name!r} of its pack failed to start ({type(exc).__name__}: {text}); the pack's job was "
                      "cancelled")
            pack.release(name, None)
            raise

    def _relaunch(self, name: str, pack: Pack, job: JobInfo, files: Path, deadline: float,
                  timeout: float) -> SlurmStep:
        """Member ``name`` again, in a new step of its pack's running job (``Pack.relaunch`` asked for it); a failure
        withdraws the request, or cancels that step only."""
        member = member_files(files, name)
        launch = pack.launches[name]
        done: list[str] = []

        def withdraw() -> str:
            """Withdraw the request or cancel its step, once; what was done, as the error says it."""
            if not done:
                try:
                    done.append(_withdraw(name, pack, job, member, launch))
                except Exception as exc:  # the start's own error is what the user needs: say this in it
                    done.append(f"its new step could not be withdrawn or cancelled ({type(exc).__name__}: {exc}); "
                                f"`squeue -s -j {job.id}` lists it as {step_name(name, launch)}, and `scancel "
                                f"{job.id}.<step>` cancels it")
            return done[0]

        try:
            with self._lock:
                self._starting[name] = job
            conn = self._wait(name, job, member.conn, member.log, deadline, timeout, pack, stopped=withdraw,
                              completed=f"; no step of its pack was left running to keep the job (a packed job ends "
                                        f"with its last step), so worker {name!r} needs a job of its own: "
                                        f"rpc.restart_worker({name!r}) submits one")
            step, node = read_step(member.step)
            pack.up(name)
            return SlurmStep(conn, job, files, pack, name, step, node, launch)
        except BaseException:
            with contextlib.suppress(Exception):
                withdraw()
            raise

    def _submit_pack(self, name: str, pack: Pack) -> None:
        """Submit ``pack``'s job (by member ``name``'s start, the first to come): a node and a step per member."""
        files = self._directory(pack.names[0], "pack-")
        job_script = files / JOB_SCRIPT
        write_private(job_script, script(pack.names, files, self.python, self.driver_address or driver_address(),
                                         self.env, self.setup))
        pack.files = files
        label = "+".join(pack.names)
        label = label if len(label) <= 100 else f"{pack.names[0]}+{len(pack.names) - 1}-more"
        pack.job = self._submit(name, label, ["-N", str(len(pack.names)), "--ntasks-per-node=1"], job_script,
                                files / JOB_LOG)

    def _submit(self, name: str, label: str, ours: list[str], script: Path, log: Path) -> JobInfo:
        """Submit ``script`` as ``nbremote-<label>`` (by worker ``name``'s start), with ``ours`` after the user's
        options."""
        argv = ["sbatch", "--parsable", "--no-requeue", *self.sbatch, *ours, f"--job-name=nbremote-{label}",
                f"--output={log}", str(script)]
        done = slurm(*argv)
        job_id = done.stdout.strip().split(";")[0]
        if done.returncode != 0 or not job_id.isdigit():
            raise WorkerStartError(f"cannot start worker {name!r}: sbatch refused its job: "
                                   f"{done.stderr.strip() or done.stdout.strip()} (sbatch options: "
                                   f"{shlex.join([*self.sbatch, *ours])!r})", name)
        job = JobInfo(job_id, label)
        queue.watch(job)
        return job

    def _wait(self, name: str, job: JobInfo, conn_file: Path, log: Path, deadline: float, timeout: float,
              pack: Pack | None = None, stopped: Callable[[], str] | None = None,
              completed: str = "") -> dict[str, Any]:
        """The worker's connection file, once complete; a ``WorkerStartError`` if its job (or, ``pack``ed, its step)
        ends first, the start is cancelled, ``deadline`` passes, or (``pack``) a sibling's start failed.
        ``stopped``: stops what a failure here stops, if not the job (which the caller cancels), and says what it
        did; ``completed``: what an error adds when the job ended COMPLETED (its script's end)."""
        ended_at: float | None = None  # when the job was seen ending (COMPLETING, its final state to come)
        which = f"Slurm job {job.id}{pack.describe() if pack is not None else ''}"
        stopped = stopped or (lambda: f"the job was cancelled (scancel {job.id})")
        while True:
            if pack is not None and pack.failure is not None:
                raise WorkerStartError(f"cannot start worker {name!r}: {pack.failure}", name)
            # the file, not the poll, says first that the job runs: look at it often (a stat; once written, a read)
            conn = None if job.ended else _complete_connection_file(conn_file)
            if conn is not None:
                return conn
            status = pack.ended(name) if pack is not None and not job.ended else None
            if status is not None:  # its step ended, the job runs on (a packed member)
                raise WorkerStartError(
                    f"cannot start worker {name!r}: the step of worker {name!r} in {which} ended (exit status "
                    f"{status}) before its kernel was up{log_tail(str(log))} (step log: {log}); {stopped()}", name)
            if job.state == "COMPLETING":  # the state it ends in (FAILED, ...) is what the error should say: wait 2 s
                ended_at = ended_at or time.monotonic()
            if job.ended and (job.final or time.monotonic() - (ended_at or 0.0) > 2.0):
                raise WorkerStartError(
                    f"cannot start worker {name!r}: its {which} ended ({job.state}) before its kernel was "
                    f"up{completed if job.state == 'COMPLETED' else ''}{log_tail(str(log))} (job log: {log})", name)
            with self._lock:
                cancelled = name in self._cancelled
            if cancelled:
                raise WorkerStartError(f"the start of worker {name!r} was interrupted ({which}: {job.describe()}); "
                                       f"{stopped()}", name)
            left = deadline - time.monotonic()
            if left <= 0:
                where = (f"its {which} was still {job.state}" +
                         (f" ({job.reason})" if job.reason and job.reason != "None" else ""))
                what = "in the queue" if job.state in ("PENDING", "SUBMITTED") else "and its kernel not up"
                raise WorkerStartError(
                    f"cannot start worker {name!r}: {where} {what} after {timeout:.0f} s; {stopped()}. Give it longer "
                    f"(start_timeout=...) or ask for what is free (sinfo){_smaller(pack, job)}{log_tail(str(log))}",
                    name)
            with queue.changed:
                queue.changed.wait(min(left, FILE_POLL_S))


def _smaller(pack: Pack | None, job: JobInfo) -> str:
    """What else a pack still queued at its start's timeout can do: fewer nodes at once, or a job each."""
    if pack is None or len(pack.names) < 2:
        return ""
    limit = (" (PartitionNodeLimit: more nodes than its partition gives one job)"
             if job.reason == "PartitionNodeLimit" else "")
    return (f"; a pack needs all its {len(pack.names)} nodes at once{limit}: start fewer workers in it, or pass "
            "packed=False for a job each")


def _withdraw(name: str, pack: Pack, job: JobInfo, member: MemberFiles, launch: int) -> str:
    """A failed restart of packed member ``name``: its request withdrawn if the job script has not taken it, else its
    step of launch ``launch`` cancelled (the job if no other member is left); what was done, as an error says it."""
    try:
        member.again.unlink()  # the script claims it by a rename: here, it has not
        withdrawn = True
    except FileNotFoundError:
        withdrawn = False
    last, step = pack.release(name, None if withdrawn else read_step(member.step)[0])
    if last:
        return f"the job was cancelled (scancel {job.id}): no other worker of its pack was left"
    if withdrawn:
        return "its request for a new step was withdrawn before the job script took it; the job runs on for the others"
    if step is not None:
        return f"its new step {job.id}.{step} was cancelled; the job runs on for the others"
    return (f"no step of launch {launch} of it was found to cancel (its srun may still wait for the node: then it "
            "runs no one's kernel until the job ends); the job runs on for the others")


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
