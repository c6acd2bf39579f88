"""Before and after: two checkouts of nbremote measured side by side, taking turns, against torch.

``python benchmarks/ab.py --base ../old-checkout [--new .] [--rounds 40] [--no-torch]``

Each checkout gets a driver process of its own with three local workers, as ``bench.py``'s world has,
all alive at once; with torch installed a torch.distributed.rpc pair (rank 0 here, rank 1 spawned) joins
them as a reference (``bench.py``, with torch's full world, judges the targets). In every round each of
them runs one block of each case (a small call ``rpc_sync(worker, noop)``; a ``RemoteModule`` forward of
``Linear(16, 16)`` on a batch of 32), one after the other, in an order rotated from round to round. The
ratios are paired by round, so load that comes and goes hits every side alike. Run the benchmark twice
instead, once per checkout, and the machine's speed drifts between the runs by more than a change of
10-20 % (here: up to 1.5x within minutes).

A checkout's driver and kernels must import that checkout's nbremote: a kernel puts its working directory
first on ``sys.path``, so each side runs in its checkout's folder with it on ``PYTHONPATH``, and the
first thing checked is where each side's driver and worker found nbremote (an error if not in its tree).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CASES = ("small", "module")
BLOCK = 100  # calls per block
WARMUP = 300


def _where() -> str:
    import nbremote

    return str(nbremote.__file__)


def serve_nbremote() -> None:
    """A side: nbremote's world, answering ``case`` lines with a block's median (us) on stdout."""
    import _fns
    from _models import SeededLinear, linear_input

    from nbremote import rpc
    from nbremote.nn import RemoteModule

    rpc.init_rpc("driver", workers=["worker1", "worker2", "worker3"])
    try:
        module = RemoteModule("worker1/cpu", SeededLinear)
        x = linear_input()
        ops = {"small": lambda: rpc.rpc_sync("worker1", _fns.noop, timeout=30.0), "module": lambda: module(x)}
        print("ready", _where(), rpc.rpc_sync("worker1", _where), flush=True)
        _answer(ops)
    finally:
        rpc.shutdown()


def _torch_rank1(port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed.rpc as rpc

    rpc.init_rpc("worker1", rank=1, world_size=2)
    rpc.shutdown()


def serve_torch() -> None:
    """The torch side: rank 0 here, rank 1 spawned; the same cases through torch.distributed.rpc."""
    import socket

    import _fns
    import torch.distributed.rpc as rpc
    import torch.multiprocessing as mp
    from _models import SeededLinear, linear_input
    from torch.distributed.nn import RemoteModule

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank1 = mp.get_context("spawn").Process(target=_torch_rank1, args=(port,))
    rank1.start()
    rpc.init_rpc("driver", rank=0, world_size=2)
    try:
        module = RemoteModule("worker1/cpu", SeededLinear)
        x = linear_input()
        ops = {"small": lambda: rpc.rpc_sync("worker1", _fns.noop, timeout=30.0), "module": lambda: module(x)}
        print("ready torch", flush=True)
        _answer(ops)
    finally:
        rpc.shutdown()
        rank1.join(30)


def _answer(ops: dict[str, Any]) -> None:
    for op in ops.values():
        for _ in range(WARMUP):
            op()
    print("warm", flush=True)
    for line in sys.stdin:
        case = line.strip()
        if case not in ops:
            return
        times = []
        for _ in range(BLOCK):
            start = time.perf_counter()
            ops[case]()
            times.append(time.perf_counter() - start)
        print(statistics.median(times) * 1e6, flush=True)


def _start(role: str, tree: Path | None) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # as bench.py runs every process
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", role], env=env,
                            cwd=str(tree or HERE), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _read(proc: subprocess.Popen[str], name: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"ab: the {name} side exited (status {proc.wait()}); run it alone to see why")
    return line.strip()


def compare(base: Path, new: Path, rounds: int, with_torch: bool) -> dict[str, dict[str, list[float]]]:
    sides = {"base": _start("nbremote", base), "new": _start("nbremote", new)}
    if with_torch:
        sides["torch"] = _start("torch", None)
    try:
        for name, proc in sides.items():
            ready = _read(proc, name).split()
            if name != "torch":
                tree = (base if name == "base" else new).resolve()
                for where in ready[1:]:  # the driver's nbremote, then the worker's
                    if not Path(where).resolve().is_relative_to(tree):
                        raise SystemExit(f"ab: the {name} side imported {where}, not the nbremote of {tree}")
        for name, proc in sides.items():
            _read(proc, name)  # warm
        names = list(sides)
        medians: dict[str, dict[str, list[float]]] = {case: {n: [] for n in names} for case in CASES}
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for case in CASES:
                for name in order:
                    proc = sides[name]
                    assert proc.stdin is not None
                    proc.stdin.write(case + "\n")
                    proc.stdin.flush()
                    medians[case][name].append(float(_read(proc, name)))
        return medians
    finally:
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
    parser.add_argument("--serve", choices=["nbremote", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve == "nbremote":
        serve_nbremote()
        return 0
    if args.serve == "torch":
        serve_torch()
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
    print(report(compare(args.base, args.new, max(2, args.rounds), with_torch)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
