"""The measuring loop: cases of a group interleaved in rounds, every system one block per round.

For a group of cases (say the six echoes), every system first prepares every case it supports (warm-up and
checks, untimed). Then round ``r`` runs, for each case of the group, one block of each system, the systems
in an order rotated by ``r`` so that none always follows the same neighbour. Drift on a busy machine thus
hits every system and case of a round alike, which is what makes the paired ratios of ``_stats`` fair.

A system that fails keeps the rounds it finished and the error; it is left out of the case's remaining
rounds, and the others go on. A system that did not start, or is not installed, gets the same error or
skip reason in every case it would have run.
"""

from __future__ import annotations

import functools
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


def _run_block(case: Case, system: System, outcome: Outcome) -> None:
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
                _attempt(outcome, f"round {r + 1}", functools.partial(_run_block, case, entry.system, outcome))
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
