"""``python benchmarks/bench.py``: start every system, run the cases, print the table, write the JSON."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import _env
import _report
from _cases import NBREMOTE_MAIN, Case, catalogue, select
from _harness import Entry, Results, groups, run_group, spinners
from _ipp import IpyParallel, unavailable
from _local import Local
from _nbr import NbremoteAlias, NbremoteStart, NbremoteWorld
from _stats import verdicts
from _system import System
from _torchworld import TRANSPORTS, TorchStart, TorchWorld
from _zmq import RawZmq


def parse(argv: Sequence[str] | None, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny samples and sizes, every path once; figures mean nothing")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write every figure, check and verdict here")
    parser.add_argument("--only", metavar="CASE,...", help="case ids or groups (small, echo, burst, module, "
                        "train, start; or e.g. echo-64MB-numpy)")
    parser.add_argument("--rounds", type=int, metavar="N", help="rounds of every case (default: per case)")
    return parser.parse_args(argv)


def _try(entry: Entry, step: Callable[[], None]) -> None:
    """Run a start step of ``entry``'s system; a failure becomes the reason it takes no part."""
    if entry.problem is not None:
        return
    try:
        step()
    except Exception as exc:
        entry.problem = f"did not start: {type(exc).__name__}: {str(exc).strip()[:300]}"
        print(f"  {entry.system.name} {entry.problem}", file=sys.stderr)


def _close(system: System, notes: list[str]) -> None:
    """Close one system; a failure is noted (and its traceback printed), and the others still close."""
    t0 = time.perf_counter()
    try:
        system.close()
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        notes.append(f"closing {system.name} failed: {type(exc).__name__}: {exc}")
    print(f"  closed {system.name} in {time.perf_counter() - t0:.1f} s", flush=True)


def kept_systems(cases: Sequence[Case], stack: contextlib.ExitStack, log_dir: Path,
                 main_noop: Callable[[], None], notes: list[str]) -> list[Entry]:
    """Every system kept alive for ``cases``, started; slow starts (torch's worlds) overlap the others."""
    world = NbremoteWorld()
    ipp = IpyParallel()
    candidates: list[System] = [world, NbremoteAlias(world, NBREMOTE_MAIN, main_noop),
                                *(TorchWorld(t, log_dir) for t in TRANSPORTS), RawZmq(), ipp, Local()]
    entries = [Entry(s) for s in candidates if any(s.supports(c) for c in cases)]
    print("starting: " + ", ".join(e.system.name for e in entries), flush=True)
    t0 = time.perf_counter()
    for entry in entries:
        if entry.system is ipp and (reason := unavailable()):
            entry.problem, entry.skipped = reason, True
            continue
        stack.callback(_close, entry.system, notes)  # registered first: a half-started system is cleaned up too
        _try(entry, entry.system.start)
    for entry in entries:
        _try(entry, entry.system.wait_ready)
    # Registered last, so it runs first at exit: every torch world starts its slow shutdown at once.
    for entry in entries:
        if isinstance(entry.system, TorchWorld):
            stack.callback(entry.system.begin_close)
    print(f"  started in {time.perf_counter() - t0:.0f} s", flush=True)
    for entry in spinners(entries):
        notes.append(f"{entry.system.name}: its world kept {entry.idle_cores:.2f} cores busy while idle (it polls); "
                     "its processes were stopped (SIGSTOP) while the other systems ran their blocks, so that its "
                     "polling did not take their cores")
        print(f"  {notes[-1]}", flush=True)
    if ipp.start_seconds is not None:
        notes.append(f"ipyparallel: a cluster of {ipp.engines} engines started in {ipp.start_seconds:.1f} s "
                     "(one sample, while the other systems started too)")
    return entries


def start_systems(log_dir: Path, quick: bool) -> list[Entry]:
    """World start's systems. A quick run leaves torch-uv out: the same code as torch's, and the
    slowest sample of all (every process imports torch), while its kept world already proved uv works."""
    transports = TRANSPORTS[:1] if quick else TRANSPORTS
    return [Entry(NbremoteStart()), *(Entry(TorchStart(t, log_dir)) for t in transports)]


def measure(cases: Sequence[Case], log_dir: Path, main_noop: Callable[[], None], notes: list[str],
            quick: bool) -> Results:
    results: Results = {}
    kept = [c for c in cases if c.kind != "start"]
    if kept:
        with contextlib.ExitStack() as stack:
            entries = kept_systems(kept, stack, log_dir, main_noop, notes)
            for group in groups(kept):
                run_group(group, entries, results)
            print("closing the kept systems ...", flush=True)
            t0 = time.perf_counter()
        print(f"  {time.perf_counter() - t0:.0f} s", flush=True)
    starts = [c for c in cases if c.kind == "start"]
    if starts:  # after the kept worlds are gone: nbremote holds one world per process
        for group in groups(starts):
            run_group(group, start_systems(log_dir, quick), results)
    return results


def main(argv: Sequence[str] | None, main_noop: Callable[[], None], description: str) -> int:
    args = parse(argv, description)
    try:
        cases = select(catalogue(args.quick), args.only, args.rounds)
    except ValueError as exc:
        print(f"bench.py: {exc}", file=sys.stderr)
        return 2
    env = _env.environment()
    print(f"nbremote comparison ({'quick' if args.quick else 'full'}): "
          + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
          + f"; {env['cores']} cores, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    load_before = _env.load("before")
    print(_env.load_note(load_before), flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="nbremote-compare-logs-"))
    notes: list[str] = []
    t0 = time.perf_counter()
    results = measure(cases, log_dir, main_noop, notes, args.quick)
    duration = time.perf_counter() - t0
    load_after = _env.load("after")
    judged = [] if args.quick else verdicts(cases, results)
    print()
    print(_report.table(cases, results, judged))
    print()
    print(_report.LEGEND)
    for note in notes:
        print(note)
    if args.quick:
        print("smoke run: figures mean nothing (tiny samples and sizes); no verdicts")
    print(f"total {duration:.0f} s; {_env.load_note(load_before)}")
    print(_env.load_note(load_after))
    failures = _report.failures(cases, results)
    if args.json:
        meta = {"quick": args.quick, "argv": list(sys.argv[1:] if argv is None else argv), "environment": env,
                "load": [load_before, load_after], "duration_s": duration, "notes": notes, "failures": failures}
        _report.write_json(args.json, _report.to_json(cases, results, judged, meta))
        print(f"JSON: {args.json}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures) + f"\n(tracebacks above; logs of torch's worlds in {log_dir})")
        return 1
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0
