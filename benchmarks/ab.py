"""Before and after: two checkouts of nbremote measured side by side, taking turns, against torch.

``python benchmarks/ab.py --base ../old-checkout [--new .] [--rounds 40] [--no-torch]``

Each checkout gets a driver process of its own with four local workers, as ``bench.py``'s world has,
all alive at once; with torch installed ``bench.py``'s own torch system joins them as a reference
(``TorchWorld``: rank 0 and four workers, TensorPipe's defaults). In every round each of them runs one
block of each case -- ``bench.py``'s ``small`` (``rpc_sync(worker, noop)``) and ``module`` (a
``RemoteModule`` forward of ``Linear(16, 16)`` on a batch of 32), made by its ``ApiRunner`` -- one after
the other, in an order rotated from round to round. The ratios are paired by round, so load that comes
and goes hits every side alike. Run the benchmark twice instead, once per checkout, and the machine's
speed drifts between the runs by more than a change of 10-20 % (here: up to 1.5x within minutes).

A checkout's driver and kernels must import that checkout's nbremote: a kernel puts its working directory
first on ``sys.path``, so each side runs in its checkout's folder with it on ``PYTHONPATH``, and the
first thing checked is where each side's driver and worker found nbremote (an error if not in its tree).
A checkout with a virtual environment of its own (``.venv``) runs in it: what an environment knows of
nbremote beyond its files -- the zygote provisioner's entry point, which names the module that holds it --
is its own checkout's, and two checkouts whose modules moved in between cannot share one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CASES = ("small", "module")  # the default; --cases adds e.g. bench.py's "train" (the split model's step)
BLOCK = 100  # calls per block
WARMUP = 300


def _where() -> str:
    import nbremote

    return str(nbremote.__file__)


def _ops(api: Any, workers: list[str], cases: tuple[str, ...]) -> dict[str, Callable[[], Any]]:
    """The cases' operations, made by the benchmark's own program (``ApiRunner``) as ``bench.py`` makes them."""
    from _apirunner import ApiRunner
    from _cases import catalogue

    runner = ApiRunner(api, workers)
    return {case.id: runner.make(case)[1] for case in catalogue(quick=False) if case.id in cases}


def serve_nbremote(cases: tuple[str, ...]) -> None:
    """A side: nbremote's world, answering ``case`` lines with a block's median (us) on stdout."""
    from _apirunner import nbremote_api

    from nbremote import rpc

    workers = ["worker1", "worker2", "worker3", "worker4"]  # as bench.py's world
    rpc.init_rpc("driver", workers=workers)
    try:
        ops = _ops(nbremote_api(), workers, cases)
        print("ready", _where(), rpc.rpc_sync("worker1", _where), flush=True)
        _answer(ops)
    finally:
        rpc.shutdown()


def _answer(ops: dict[str, Callable[[], Any]]) -> None:
    from _system import timed

    for op in ops.values():
        timed(op, WARMUP)
    print("warm", flush=True)
    for line in sys.stdin:
        case = line.strip()
        if case not in ops:
            return
        print(statistics.median(timed(ops[case], BLOCK)) * 1e6, flush=True)


def _python(tree: Path) -> str:
    """The checkout's own environment's interpreter (``.venv``), else this one."""
    own = tree / ".venv" / "bin" / "python"
    return str(own) if own.is_file() else sys.executable


def _start(tree: Path, cases: tuple[str, ...]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.Popen([_python(tree), str(Path(__file__).resolve()), "--serve", "--cases", ",".join(cases)],
                            env=env, cwd=str(tree),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


class _Torch:
    """bench.py's torch system itself (``TorchWorld``: rank 0 and four workers, TensorPipe's defaults), its
    blocks as long as the checkouts' and answered as their medians."""

    def __init__(self, log_dir: Path, cases: tuple[str, ...]) -> None:
        from _cases import catalogue
        from _torchworld import TorchWorld

        self.world = TorchWorld("default", log_dir)
        self.idle: float | None = None  # cores its world keeps busy while idle, once counted
        self.cases = {case.id: dataclasses.replace(case, block=BLOCK, warmup=WARMUP)
                      for case in catalogue(quick=False) if case.id in cases}

    def start(self) -> None:
        self.world.start()
        self.world.wait_ready()
        for case in self.cases.values():
            self.world.prepare(case)

    def block(self, case: str) -> float:
        return statistics.median(self.world.block(self.cases[case]).samples) * 1e6

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """While a checkout runs its block: the world stopped if it polls busily when idle (as bench.py does,
        see ``_harness``), so that its polling does not take the checkouts' cores."""
        from _harness import SPIN_CORES, idle_cores, stopped

        if self.idle is None:
            self.idle = idle_cores([self.world.pids()])[0]
        return stopped(self.world.pids()) if self.idle > SPIN_CORES else contextlib.nullcontext()

    def close(self) -> None:
        self.world.close()


def _read(proc: subprocess.Popen[str], name: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"ab: the {name} side exited (status {proc.wait()}); run it alone to see why")
    return line.strip()


def _ask(proc: subprocess.Popen[str], name: str, case: str) -> float:
    assert proc.stdin is not None
    proc.stdin.write(case + "\n")
    proc.stdin.flush()
    return float(_read(proc, name))


def compare(base: Path, new: Path, rounds: int, with_torch: bool,
            cases: tuple[str, ...] = CASES) -> dict[str, dict[str, list[float]]]:
    sides = {"base": _start(base, cases), "new": _start(new, cases)}
    torch = _Torch(Path(tempfile.mkdtemp(prefix="nbremote-ab-")), cases) if with_torch else None
    try:
        if torch is not None:
            torch.start()  # while the checkouts' worlds start
        for name, proc in sides.items():
            tree = (base if name == "base" else new).resolve()
            for where in _read(proc, name).split()[1:]:  # the driver's nbremote, then the worker's
                if not Path(where).resolve().is_relative_to(tree):
                    raise SystemExit(f"ab: the {name} side imported {where}, not the nbremote of {tree}")
        for name, proc in sides.items():
            _read(proc, name)  # warm
        names = [*sides, *(["torch"] if torch is not None else [])]
        medians: dict[str, dict[str, list[float]]] = {case: {n: [] for n in names} for case in cases}
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for case in cases:
                for name in order:
                    if torch is None:
                        medians[case][name].append(_ask(sides[name], name, case))
                    elif name == "torch":
                        medians[case][name].append(torch.block(case))
                    else:
                        with torch.paused():
                            medians[case][name].append(_ask(sides[name], name, case))
        return medians
    finally:
        if torch is not None:
            torch.close()
        for proc in sides.values():
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in sides.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios), q1, q3


def report(medians: dict[str, dict[str, list[float]]]) -> str:
    lines = [f"{'case':8s} {'side':6s} {'median us':>10s}   paired ratios (median, quartiles)"]
    for case, sides in medians.items():
        for name, values in sides.items():
            text = f"{case:8s} {name:6s} {statistics.median(values):10.0f}"
            if name == "new":
                text += "   base/new {:.2f} ({:.2f}-{:.2f})".format(*_paired(sides["base"], values))
            if "torch" in sides and name != "torch":
                text += "   {}/torch {:.2f} ({:.2f}-{:.2f})".format(name, *_paired(values, sides["torch"]))
            lines.append(text)
    lines.append("base/new > 1: the new checkout is faster; x/torch < 1: x is faster than torch.distributed.rpc")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="the checkout measured before (a git worktree, say)")
    parser.add_argument("--new", type=Path, default=HERE.parent, help="the checkout measured after (this one)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--no-torch", action="store_true", help="leave torch.distributed.rpc out")
    parser.add_argument("--cases", default=",".join(CASES),
                        help="bench.py's case ids to compare (default: %(default)s; 'train' is the training step)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cases = tuple(c for c in args.cases.split(",") if c)
    from _cases import catalogue

    known = {case.id for case in catalogue(quick=False) if case.kind not in ("burst", "start")}
    if not cases or set(cases) - known:
        parser.error(f"--cases takes bench.py's case ids among {sorted(known)}, got {args.cases!r}")
    if args.serve:
        serve_nbremote(cases)
        return 0
    if args.base is None:
        parser.error("--base is required: the checkout to compare this one with")
    for tree in (args.base, args.new):
        if not (tree / "nbremote" / "__init__.py").is_file():
            parser.error(f"{tree} is not an nbremote checkout (no nbremote/__init__.py)")
    with_torch = not args.no_torch
    if with_torch:
        try:
            import torch.distributed.rpc  # noqa: F401
        except ImportError:
            print("ab: torch.distributed.rpc is not importable here; comparing the checkouts alone")
            with_torch = False
    for name, tree in (("base", args.base), ("new", args.new)):
        print(f"ab: {name} = {tree.resolve()}, run by {_python(tree.resolve())}")
    print(report(compare(args.base, args.new, max(2, args.rounds), with_torch, cases)))
    return 0


if __name__ == "__main__":
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one compute thread per process, as bench.py has it
        os.environ.setdefault(var, "1")
    sys.exit(main(sys.argv[1:]))
