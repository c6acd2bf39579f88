"""A packed Slurm job: the workers one start gives ``SlurmKernel(packed=True)`` share one job, a job step each.

A world whose workers are useless apart (a pipeline across four GPU nodes) asks for its nodes in one job:
``sbatch -N <workers> --ntasks-per-node=1`` with the user's options, whose script (``script``) starts one
``srun --whole -N1 -n1 --relative=<i>`` step per worker in the background -- each its own ``nbremote worker``,
connection file and log, named ``nbremote-<worker>.<launch>`` -- and watches them (their pids, not setup's
background jobs). Slurm allocates all the nodes or none.
GRES asked per node (``--gres=gpu:1``) reach each step on its node: Slurm 22.05 gives a step the job's GRES on
the nodes it runs on (``CUDA_VISIBLE_DEVICES``, ``SLURM_STEP_GPUS``: that node's GPU, seen on the tests'
cluster), and ``--whole`` asks for all the job's CPUs and memory there (a step would otherwise get what it asks
for, one CPU: 22.05's ``srun`` does not take ``--cpus-per-task`` from the job). Each step
writes ``<step id> <node>`` beside its connection file before the kernel starts, so its handle names its step
(``job 123.0``) and node without asking Slurm, and the script writes ``<worker>.ended`` (``<exit status>
<launch>``) when its ``srun`` returns: a member whose step ends before its kernel is up fails its start at once,
with its log, while the job runs on (the launch number tells a stopped step's word from the new one's).

``Pack`` is what the members of one start share: the job (submitted once, by whichever member's start comes
first), the reason the pack's start failed (a pack is all or nothing: every member's ``WorkerStartError`` says
it), and which members are starting or up. A member stopped alone cancels its step (``cancel_step``); its node
stays the job's (Slurm does not shrink a running job) until the last member stops, or a failed start, cancels
the job, once. A member restarted while the job runs gets a new step on its node: the job script keeps
watching, every ``RELAUNCH_POLL_S``, for a ``<worker>.again`` file (``Pack.relaunch``; it claims it by a rename),
and launches its step again -- a new job of one would wait in the queue for a node while the pack's job holds that
member's idle (unless no other member's step runs: the script ends then, and the restart is a new job). The script
ends once no step runs; the driver's lease ends each worker, each step with it, and so the job.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import threading
from pathlib import Path
from typing import NamedTuple

from nbremote.rpc._kernels.slurmqueue import STOP_WAIT, JobInfo, cancel, queue, slurm, wait_gone
from nbremote.rpc._kernels.slurmscript import file_name, opening, worker_command, write_private

__all__ = ["RELAUNCH_POLL_S", "MemberFiles", "Pack", "cancel_step", "check_packable", "member_files", "read_step",
           "script", "step_name", "step_of"]

RELAUNCH_POLL_S = 0.5  # s between the job script's looks for a member to launch again (and for steps still running)

# sbatch options a pack sets itself (one node and one task per worker), or that make it more than one job
_CONFLICTS = {"-N": "--nodes", "-n": "--ntasks", "-a": "--array"}
_LONG_CONFLICTS = frozenset({"--nodes", "--ntasks", "--ntasks-per-node", "--array"})


def check_packable(args: list[str]) -> None:
    """A ``ValueError`` naming the first of ``args`` (sbatch options) that contradicts a packed job, if any."""
    for arg in args:
        long = arg.partition("=")[0]
        if long in _LONG_CONFLICTS or (not arg.startswith("--") and arg[:2] in _CONFLICTS):
            what = long if long in _LONG_CONFLICTS else _CONFLICTS[arg[:2]]
            one_job = " and is one job, not an array" if what == "--array" else ""
            raise ValueError(f"SlurmKernel(packed=True) cannot take the sbatch option {arg!r} ({what}): a packed job "
                             "asks for its nodes itself, one node and one task per worker of the start (sbatch -N "
                             f"<workers> --ntasks-per-node=1, a job step each){one_job}; leave {arg!r} out, or pass "
                             "packed=False for a job per worker")


class MemberFiles(NamedTuple):
    """A member's files in its pack's directory."""

    conn: Path  # its connection file (``nbremote worker`` writes it)
    log: Path  # its step's output
    step: Path  # ``<step id> <node>``, written by the step before its kernel starts
    again: Path  # a request to the job script: launch its step again (its launch number in it)
    ended: Path  # ``<exit status> <launch>``, written by the job script when its ``srun`` returns


def member_files(files: Path, name: str) -> MemberFiles:
    """Member ``name``'s files in its pack's directory ``files`` (``file_name``: one to one, ``a:b`` is not ``a_b``)."""
    base = files / file_name(name)
    return MemberFiles(*(Path(f"{base}.{ext}") for ext in ("json", "log", "step", "again", "ended")))


def step_name(name: str, launch: int | str) -> str:
    """The name of member ``name``'s step of launch ``launch``: ``nbremote-<name>.<launch>`` (a failed restart finds
    and cancels its own launch's step by it, never another's); ``launch=""``: the part before the number."""
    return f"nbremote-{name}.{launch}"


def script(names: list[str], files: Path, python: str, driver: str, env: dict[str, str], setup: str) -> str:
    """The pack's job script: ``setup`` once (its environment reaches the steps), a step per worker, each launched
    again when asked (``<worker>.again``), until none of the steps runs."""
    lines = [*opening(f"nbremote workers {', '.join(map(repr, names))}, a job step each (packed=True)", env, setup),
             # sbatch --export=NONE leaves SLURM_EXPORT_ENV=NONE in the job, and the steps' srun would then pass them
             # none of this shell's environment (setup's `module load`, env=): they are to inherit it
             "export SLURM_EXPORT_ENV=ALL",
             # each member's running step (its srun's subshell), by pid: what the script watches, not `jobs`, which
             # counts setup's background jobs too (a daemon there would keep the job running to its time limit)
             "pid=()"]
    watch = []
    for i, name in enumerate(names):
        member = member_files(files, name)
        log, step, again, ended = (shlex.quote(str(p)) for p in (member.log, member.step, member.again, member.ended))
        taken = shlex.quote(f"{member.again}.taken")
        inner = f'echo "$SLURM_STEP_ID $SLURMD_NODENAME" > {step} && exec {worker_command(python, member.conn, driver)}'
        lines.append(f"step{i}() {{ ( srun --whole -N1 -n1 --relative={i} --job-name={shlex.quote(step_name(name, ''))}"
                     f'"$1" --output={log} bash -c {shlex.quote(inner)}; echo "$? $1" > {ended} ) & pid[{i}]=$!; }}')
        # a restart's request, claimed whole by a rename (a failed restart deletes it: then there is none to read),
        # and a launch number or nothing
        watch.append(f"  if mv -f {again} {taken} 2>/dev/null; then launch=; read -r launch < {taken}; rm -f {taken}; "
                     f'case $launch in ""|*[!0-9]*) ;; *) step{i} "$launch" ;; esac; fi')
    lines += [f"step{i} 0" for i in range(len(names))]
    lines += ["while :; do", *watch,
              # a step's pid is dropped once it is gone (a pid reused later is not a step)
              '  running=; for i in "${!pid[@]}"; do if kill -0 "${pid[$i]}" 2>/dev/null; then running=1; '
              'else unset "pid[$i]"; fi; done',
              '  [ -n "$running" ] || break', f"  sleep {RELAUNCH_POLL_S}", "done",
              # no `wait`: every step has ended (and said so), and setup's background jobs are not ours to wait for
              # (Slurm ends them with the job)
              ""]
    return "\n".join(lines)


def read_step(step_file: Path) -> tuple[str | None, str | None]:
    """The step id and node a member's step wrote before its kernel started (None, None if it did not)."""
    with contextlib.suppress(OSError):
        words = step_file.read_text().split()
        if len(words) == 2 and words[0].isdigit():
            return words[0], words[1]
    return None, None


def step_of(job_id: str, name: str, launch: int) -> str | None:
    """The id of job ``job_id``'s step of member ``name``'s launch ``launch``, as ``squeue -s`` lists it, or None (not
    there, or not yet: an ``srun`` waiting for its node has no step)."""
    done = slurm("squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j")
    for line in done.stdout.splitlines():
        step, _, named = line.strip().partition("|")
        if named == step_name(name, launch) and step.startswith(f"{job_id}."):
            return step.partition(".")[2]
    return None


def cancel_step(job_id: str, step: str, wait: float = STOP_WAIT) -> None:
    """``scancel <job>.<step>``, then wait until ``squeue -s`` no longer lists the step."""
    slurm("scancel", f"{job_id}.{step}")
    wait_gone(f"{job_id}.{step}", ["-s", "-j", job_id], wait)


class Pack:
    """The workers of one start of a packed ``SlurmKernel``, sharing its job (see the module docstring)."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self.lock = threading.Lock()
        self.submitting = threading.Lock()  # held by the member whose start submits the job; the others wait
        self.job: JobInfo | None = None
        self.files: Path | None = None
        self.failure: str | None = None  # why the pack's start failed, said by every member's start
        self.starting = set(names)
        self.live: set[str] = set()
        self.cancelled = False
        self.launches = dict.fromkeys(names, 0)  # each member's launch number: 0 with the job, then 1, 2, ...

    def describe(self) -> str:
        """``(the pack of w1, w2)`` for errors, empty for a pack of one."""
        return f" (the pack of {', '.join(self.names)})" if len(self.names) > 1 else ""

    def relaunch(self, name: str) -> tuple[JobInfo, Path] | None:
        """Ask the running job to launch member ``name``'s step again (it was stopped, the others run on): the job
        and the pack's directory; None if the job is not there to ask (ended, cancelled, or no other member's step
        left running: the job script ends with its last step, so the request would find no one to read it)."""
        with self.lock:
            job, files = self.job, self.files
            if (job is None or files is None or self.cancelled or job.ended or name in self.live
                    or name in self.starting or name not in self.names):
                return None
            others = (self.live | self.starting) - {name}
        # a member lost but not removed (its kernel crashed, its step ended) is still live here: its step is not
        if not any(self.ended(other) is None for other in others):
            return None
        with self.lock:
            self.starting.add(name)
            self.launches[name] += 1
            launch = self.launches[name]
        member = member_files(files, name)
        asked = member.again.with_suffix(".asking")  # written whole, then renamed: the script never reads half
        try:
            write_private(asked, f"{launch}\n")
            os.replace(asked, member.again)
        except BaseException:
            with self.lock:  # not asked: as it was, so that the last member's release still cancels the job
                self.starting.discard(name)
                self.launches[name] -= 1
            raise
        return job, files

    def ended(self, name: str, launch: int | None = None) -> str | None:
        """The exit status of member ``name``'s step of launch ``launch`` (default: its latest) once it has ended (the
        job script says so in its ``.ended`` file), else None."""
        with self.lock:
            launch = self.launches.get(name) if launch is None else launch
            files = self.files
        if files is None:
            return None
        try:
            status, _, said = member_files(files, name).ended.read_text().strip().partition(" ")
        except OSError:
            return None
        return status or "?" if said == str(launch) else None

    def up(self, name: str) -> None:
        with self.lock:
            self.starting.discard(name)
            self.live.add(name)
            everyone = not self.starting
        if everyone and self.job is not None:
            self.job.up = True  # the poll slows down to its idle rate

    def fail(self, why: str) -> None:
        """The pack's start failed: every member's start says ``why``, and the job is cancelled (once)."""
        with self.lock:
            self.failure = self.failure or why
        self.cancel_job()

    def release(self, name: str, step: str | None) -> tuple[bool, str | None]:
        """Member ``name`` is stopped, or its start failed: cancel its step (``step``, else its latest launch's as
        Slurm names it), or the job if no member is left. Whether it was the last, and the step cancelled."""
        with self.lock:
            self.starting.discard(name)
            self.live.discard(name)
            last = not self.starting and not self.live
            job, launch = self.job, self.launches.get(name, 0)
        if last:
            self.cancel_job()
            return True, None
        if job is None or self.cancelled:
            return False, None
        step = step or step_of(job.id, name, launch)
        if step is not None:
            cancel_step(job.id, step)
        return False, step

    def cancel_job(self) -> None:
        with self.lock:
            job, first = self.job, not self.cancelled
            self.cancelled = self.cancelled or job is not None
        if job is not None and first:
            queue.forget(job.id)
            with contextlib.suppress(Exception):  # a start's own error, or a stop that never raises
                cancel(job.id)
