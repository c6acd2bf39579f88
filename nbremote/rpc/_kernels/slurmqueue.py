"""Slurm's side of ``SlurmKernel`` (``slurm``): running its commands, and one thread that polls ``squeue``.

``slurm`` runs a Slurm command, never without a ``slurm.conf`` in sight (``SLURM_CONF``, ``/etc/slurm``, or
the cache of a configless node): Slurm's clients would otherwise look the controller up in DNS. ``Queue``
(one per process, ``queue``) keeps each job of this process as its last poll saw it (``JobInfo``) and polls
``squeue`` once for all of them: every ``POLL_S`` while a job waits or its worker starts, every
``IDLE_POLL_S`` once all are up, at once when asked (``poke``: a heartbeat stopped). A job that ends shows
``COMPLETING`` (``squeue`` and ``scontrol`` alike, Slurm 22.05) until its processes are gone -- a kernel with
torch loaded takes a second or two to exit -- and only then the state it ended in (``CANCELLED``, ``TIMEOUT``,
``NODE_FAIL``, ``PREEMPTED``): it is polled every ``ENDING_POLL_S`` meanwhile. ``cancel`` ends a job and
waits, bounded, until it has left the queue. ``driver_address`` is this machine's address as the nodes reach it.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field

from nbremote._netaddr import is_loopback, source_address
from nbremote.errors import WorkerStartError

__all__ = ["COMMAND_TIMEOUT", "ENDING_POLL_S", "IDLE_POLL_S", "POLL_S", "RUNNING", "STOP_WAIT", "JobInfo", "Queue",
           "cancel", "driver_address", "gres", "queue", "seconds_left", "slurm",
           "slurm_conf", "wait_gone"]

POLL_S = 0.5  # s between squeue polls while a job waits in the queue or its kernel starts
IDLE_POLL_S = 2.0  # s between squeue polls once every job's worker is up
ENDING_POLL_S = 0.2  # s between squeue polls while a job is COMPLETING
COMMAND_TIMEOUT = 30.0  # s an sbatch / squeue / scancel may take (a busy controller answers in seconds)
WARN_LEFT_S = 600  # a running job with less time left than this is said to be near its limit
STOP_WAIT = 15.0  # s a cancel waits for the job to leave the queue (slurm.conf's KillWait is 30 s by default)
RUNNING = frozenset({"PENDING", "CONFIGURING", "RUNNING", "RESIZING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                     "REQUEUE_FED", "SIGNALING", "STAGE_OUT"})  # states of a job that has not ended
_CONF_PATHS = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf", "/run/slurm/conf/slurm.conf")


def slurm_conf() -> str | None:
    """The slurm.conf Slurm's commands would read (``SLURM_CONF`` or a standard place), or None."""
    candidates = [os.environ["SLURM_CONF"]] if os.environ.get("SLURM_CONF") else list(_CONF_PATHS)
    return next((p for p in candidates if os.path.isfile(p)), None)


def slurm(*argv: str, timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run a Slurm command (never without a slurm.conf: its clients would look the controller up in DNS)."""
    if slurm_conf() is None:
        raise WorkerStartError(f"cannot run {argv[0]}: no slurm.conf here (SLURM_CONF is unset and none is in "
                               f"{', '.join(_CONF_PATHS)}); start Slurm workers from a machine of the cluster (a "
                               "login node), or set SLURM_CONF")
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise WorkerStartError(f"cannot run {argv[0]}: it is not on PATH (is this a Slurm login node?)") from None
    except subprocess.TimeoutExpired:
        raise WorkerStartError(f"{' '.join(argv[:2])} did not answer in {timeout:.0f} s: Slurm's controller is busy "
                               "or unreachable (scontrol ping)") from None


@dataclass
class JobInfo:
    """One job as the last poll saw it."""

    id: str
    worker: str
    submitted: float = field(default_factory=time.monotonic)
    state: str = "SUBMITTED"
    reason: str = ""
    node: str = ""
    time_left: str = ""
    gres: str = ""  # what it holds on each node: ``gpu:1`` (squeue's ``%b``, its ``gres:`` or ``gres/`` left out)
    polled: float = 0.0  # when a poll last told us about it (monotonic)
    up: bool = False  # its worker is attached: poll it at the idle rate

    @property
    def ended(self) -> bool:
        """It ends or has ended (COMPLETING included)."""
        return self.state not in RUNNING and self.state != "SUBMITTED"

    @property
    def final(self) -> bool:
        """It has ended, and its state says how (not COMPLETING: Slurm 22.05 says that, and nothing more, until the
        job's processes are gone -- a kernel with torch loaded takes a second or two to exit)."""
        return self.ended and self.state != "COMPLETING"

    def describe(self, now: float | None = None, node: str | None = None, named: bool = True) -> str:
        """``PENDING (Resources), job 123, 0:42 in queue`` / ``RUNNING on node1 with gpu:1, job 123, 1:52:10 left``;
        ``node``: the one node to name (a packed job's step's) instead of the job's; ``named=False`` leaves out
        ``job 123`` (for a text that names the job already)."""
        ident = f", job {self.id}" if named else ""
        if self.state in ("PENDING", "SUBMITTED"):
            waited = int((now or time.monotonic()) - self.submitted)
            why = f" ({self.reason})" if self.reason and self.reason != "None" else ""
            return f"{self.state}{why}{ident}, {waited // 60}:{waited % 60:02d} in queue"
        where = f" on {node or self.node}" if node or self.node else ""
        where += f" with {self.gres}" if self.gres and self.state == "RUNNING" else ""
        left = f", {self.time_left} left" if self.time_left and self.state == "RUNNING" else ""
        seconds = seconds_left(self.time_left) if self.state == "RUNNING" else None
        if seconds is not None and seconds < WARN_LEFT_S:  # Slurm ends the job, and the worker, at its limit
            left += " -- its time limit is near: save what you need from it"
        return f"{self.state}{where}{ident}{left}"


def gres(text: str) -> str:
    """squeue's ``%b`` as a person reads it: ``gres:gpu:1`` (22.05) or ``gres/gpu:1`` (later) is ``gpu:1``; ``N/A``
    is nothing."""
    items = [item.strip() for item in text.split(",") if item.strip() and item.strip() != "N/A"]
    return ",".join(item.removeprefix("gres:").removeprefix("gres/") for item in items)


def seconds_left(text: str) -> int | None:
    """Slurm's ``%L`` (``[days-][hours:]minutes:seconds``) in seconds; None for ``UNLIMITED`` and the like."""
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.strip())
    if match is None:
        return None
    days, hours, minutes, secs = (int(g) if g else 0 for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + secs


class Queue:
    """The jobs of this process and one thread polling ``squeue`` for all of them at once."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobInfo] = {}
        self.changed = threading.Condition()
        self._poke = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, job: JobInfo) -> None:
        with self.changed:
            self.jobs[job.id] = job
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="nbremote-squeue", daemon=True)
                self._thread.start()
        self._poke.set()

    def forget(self, job_id: str) -> None:
        with self.changed:
            self.jobs.pop(job_id, None)

    def poke(self) -> None:
        """Poll now (a heartbeat stopped: what does Slurm say?)."""
        self._poke.set()

    def _run(self) -> None:
        while True:
            with self.changed:
                jobs = dict(self.jobs)
                if not jobs:
                    self._thread = None
                    return
            with contextlib.suppress(Exception):  # a failed poll (a busy controller) proves nothing: keep the states
                self._poll(jobs)
            busy = any(not j.up for j in jobs.values())
            ending = any(j.state == "COMPLETING" for j in jobs.values())  # its final state is what a loss says
            self._poke.wait(ENDING_POLL_S if ending else POLL_S if busy else IDLE_POLL_S)
            self._poke.clear()

    def _poll(self, jobs: dict[str, JobInfo]) -> None:
        done = slurm("squeue", "-h", "-t", "all", "-j", ",".join(jobs), "-o", "%i|%T|%r|%N|%L|%b")
        if done.returncode != 0 and "Invalid job id" not in done.stderr:
            return
        now = time.monotonic()
        seen: dict[str, list[str]] = {}
        for line in done.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 6:
                seen[parts[0]] = parts
        for job_id, job in jobs.items():
            row = seen.get(job_id)
            if row is not None:
                job.state, job.reason, job.node, job.time_left = row[1], row[2], row[3] or job.node, row[4]
                job.gres = gres(row[5])
            elif now - job.submitted > 5.0:  # not even pending: it left the queue (MinJobAge) long ago
                job.state = job.state if job.ended else "GONE"
            job.polled = now
        with self.changed:
            self.changed.notify_all()


queue = Queue()


_driver_address: str | None = None


def driver_address() -> str:
    """This machine's address as the cluster's nodes reach it: its address on the route to the Slurm controller
    (``SlurmctldHost``), or, where that is this machine's loopback (a controller on this machine, named by a
    name that resolves to 127.0.x.x here), on the route to a compute node (its ``NodeAddr``); asked once per
    process."""
    global _driver_address
    if _driver_address is None:
        done = slurm("scontrol", "show", "config")
        match = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", done.stdout, re.M)
        found = None
        with contextlib.suppress(OSError):
            found = source_address(match.group(2) or match.group(1)) if match else None
        if found is None or is_loopback(found):
            nodes = slurm("sinfo", "-h", "-N", "-o", "%o").stdout.split()
            with contextlib.suppress(OSError, IndexError):
                found = source_address(nodes[0])
        if found is None or is_loopback(found):
            raise WorkerStartError("cannot tell this machine's address on the cluster's network (its routes to the "
                                   "Slurm controller and to the nodes are loopback or none); pass "
                                   "SlurmKernel(driver_address='<an address of this machine the nodes reach>')")
        _driver_address = found
    return _driver_address


def cancel(job_id: str, wait: float = STOP_WAIT) -> None:
    """``scancel`` the job, then wait until ``squeue`` no longer lists it (pending, running or completing)."""
    slurm("scancel", job_id)
    wait_gone(job_id, ["-j", job_id], wait)


def wait_gone(what: str, squeue: list[str], wait: float = STOP_WAIT) -> None:
    """Wait, at most ``wait`` s, until ``squeue -h <squeue> -o %i`` no longer lists ``what`` (a job ``123``, or a
    step ``123.0`` with ``-s``), or the controller does not answer (nothing more to learn from here)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        done = slurm("squeue", "-h", *squeue, "-o", "%i")
        if done.returncode != 0 and "Invalid job id" not in done.stderr:
            return
        if what not in done.stdout.split():
            return
        time.sleep(0.2)
