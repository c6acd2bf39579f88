"""The measuring loop: cases of a group interleaved in rounds, every system one block per round.

For a group of cases (say the six echoes), every system first prepares every case it supports (warm-up and
checks, untimed). Then round ``r`` runs, for each case of the group, one block of each system, the systems
in an order rotated by ``r`` so that none always follows the same neighbour. Drift on a busy machine thus
hits every system and case of a round alike, which is what makes the paired ratios of ``_stats`` fair.

A world that keeps the cores busy while it idles (TensorPipe's default transport: its shared-memory
reactor polls, ~2 cores of this machine) would take them from whichever system is measured, which a user
running one of them never sees. Such a world is found when the systems start (:func:`spinners`: its
processes' CPU over ``IDLE_WINDOW_S`` of idling) and its processes are stopped (SIGSTOP) during the other
systems' blocks, then go on (SIGCONT) for its own: each system is measured on the machine it would have
alone, while still interleaved round by round.

A system that fails keeps the rounds it finished and the error; it is left out of the case's remaining
rounds, and the others go on. A system that did not start, or is not installed, gets the same error or
skip reason in every case it would have run.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import _env
from _cases import Case
from _stats import Outcome
from _system import System

Results = dict[str, dict[str, Outcome]]  # case id -> system name -> outcome


@dataclass
class Entry:
    """A system as the harness sees it: usable, or why not (``skipped`` when not installed)."""

    system: System
    problem: str | None = None
    skipped: bool = False
    idle_cores: float | None = None  # CPU its processes take while it idles (see spinners); None: not measured

    @property
    def spins(self) -> bool:
        return self.idle_cores is not None and self.idle_cores > SPIN_CORES


IDLE_WINDOW_S = 1.0  # how long the idle worlds' CPU is counted
SPIN_CORES = 0.25  # a world idling on more CPU than this polls busily


def idle_cores(pid_lists: Sequence[list[int]]) -> list[float]:
    """CPU (cores) each list of processes takes over ``IDLE_WINDOW_S`` of idling, all counted at once."""
    before = [_env.cpu_seconds(*pids) for pids in pid_lists]
    time.sleep(IDLE_WINDOW_S)
    return [(_env.cpu_seconds(*pids) - b) / IDLE_WINDOW_S for pids, b in zip(pid_lists, before, strict=True)]


def spinners(entries: Sequence[Entry]) -> list[Entry]:
    """Count every started system's idle CPU into its entry; the ones that poll busily."""
    started = [e for e in entries if e.problem is None]
    try:
        cores = idle_cores([e.system.pids() for e in started])
    except OSError:  # a process gone meanwhile: its system fails on its own; none is paused
        return []
    for entry, idle in zip(started, cores, strict=True):
        entry.idle_cores = idle
    return [e for e in entries if e.spins]


@contextlib.contextmanager
def stopped(pids: Sequence[int]) -> Iterator[None]:
    """Stop the processes ``pids`` (SIGSTOP) for the block, then let them go on (SIGCONT), even on error --
    and should this process be killed meanwhile (SIGKILL: no ``finally`` runs), a watchdog ends them
    (:class:`_Watchdog`) rather than leave stopped orphans that nothing would ever wake."""
    done = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                _Watchdog.get().watch(pid)
                os.kill(pid, signal.SIGSTOP)
                done.append(pid)
        yield
    finally:
        for pid in done:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


_WATCHDOG = """
import os, signal, sys
pids = set()
with os.fdopen(int(sys.argv[1]), "rb", buffering=0) as pipe:
    while line := pipe.readline():
        if line.strip() == b"done":  # this process ends normally: its worlds are closed (their pids may be reused)
            pids.clear()
        else:
            pids.add(int(line))
for pid in pids:  # the pipe's end: the benchmark is gone (SIGKILL ends a stopped process too)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""


class _Watchdog:
    """A small process that kills the processes it was told of once this one is killed: it reads their pids
    from a pipe whose other end only this process holds, and its end of file is the sign (a normal exit says
    ``done`` first: the worlds are closed by then). One per benchmark process, started the first time a world
    is stopped; it sleeps in a read meanwhile."""

    _instance: _Watchdog | None = None

    def __init__(self) -> None:
        import subprocess

        read, self._write = os.pipe()
        self._proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(read)], pass_fds=(read,),
                                      stdin=subprocess.DEVNULL)
        os.close(read)
        self._told: set[int] = set()
        atexit.register(self._done)  # not run when killed: then the watchdog acts

    def _done(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._write, b"done\n")

    @classmethod
    def get(cls) -> _Watchdog:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def watch(self, pid: int) -> None:
        if pid not in self._told:
            os.write(self._write, b"%d\n" % pid)
            self._told.add(pid)


def _others_stopped(system: System, entries: Sequence[Entry]) -> contextlib.AbstractContextManager[None]:
    """The busily polling worlds other than ``system``'s, stopped for its block."""
    return stopped([pid for e in entries if e.spins and e.system is not system for pid in e.system.pids()])


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _attempt(outcome: Outcome, what: str, fn: Callable[[], None]) -> bool:
    """Run ``fn``; on failure record it in ``outcome`` (traceback on stderr) and return False."""
    try:
        fn()
    except Exception as exc:
        print(f"  {outcome.system} failed in {what}: {_describe(exc)}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        outcome.error = f"{what}: {_describe(exc)}"
        return False
    return True


def _prepare(case: Case, entries: Sequence[Entry]) -> dict[str, Outcome]:
    outcomes = {}
    for entry in entries:
        system = entry.system
        if not system.supports(case):
            continue
        outcome = outcomes[system.name] = Outcome(system.name)
        if entry.problem is not None:
            if entry.skipped:
                outcome.skipped = entry.problem
            else:
                outcome.error = entry.problem
            continue
        _attempt(outcome, "prepare", functools.partial(_prepare_one, case, system, outcome))
    return outcomes


def _prepare_one(case: Case, system: System, outcome: Outcome) -> None:
    t0 = time.perf_counter()
    outcome.info = system.prepare(case)
    outcome.prepare_s = time.perf_counter() - t0


def _run_block(case: Case, system: System, outcome: Outcome, entries: Sequence[Entry]) -> None:
    with _others_stopped(system, entries):
        block = system.block(case)
    outcome.rounds.append(block.samples)
    for name, value in block.extra.items():
        outcome.extra.setdefault(name, []).append(value)


def rotated(items: Sequence[Entry], r: int) -> list[Entry]:
    k = r % len(items) if items else 0
    return [*items[k:], *items[:k]]


def run_group(cases: Sequence[Case], entries: Sequence[Entry], results: Results) -> None:
    """Measure ``cases`` (one group) on every entry, interleaved in rounds; fills ``results``."""
    t0 = time.perf_counter()
    print(f"{', '.join(c.id for c in cases)} ...", flush=True)
    for case in cases:
        results[case.id] = _prepare(case, entries)
    for r in range(max(c.rounds for c in cases)):
        for case in cases:
            if r >= case.rounds:
                continue
            for entry in rotated(entries, r):
                outcome = results[case.id].get(entry.system.name)
                if outcome is None or outcome.status != "ok":
                    continue
                _attempt(outcome, f"round {r + 1}", functools.partial(_run_block, case, entry.system, outcome, entries))
    for case in cases:
        for entry in entries:
            outcome = results[case.id].get(entry.system.name)
            if outcome is not None and outcome.status == "ok":
                _attempt(outcome, "finish", functools.partial(entry.system.finish, case))
    slow = sorted(((o.prepare_s, f"{c.id}/{o.system}") for c in cases for o in results[c.id].values()), reverse=True)
    print(f"  {time.perf_counter() - t0:.0f} s (slowest prepares: "
          + ", ".join(f"{what} {s:.1f} s" for s, what in slow[:3]) + ")", flush=True)


def groups(cases: Sequence[Case]) -> list[list[Case]]:
    """Consecutive cases of the same group, in order."""
    out: list[list[Case]] = []
    for case in cases:
        if out and out[-1][0].group == case.group:
            out[-1].append(case)
        else:
            out.append([case])
    return out
