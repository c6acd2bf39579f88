"""Batch reinforce in both worlds, and what ``@async_execution`` costs a call (issue 40).

    python benchmarks/bench_reinforce.py [--rounds 3] [--steps 200] [--episodes 3] [--max-world-size 4]
                                         [--calls 300] [--no-program] [--no-calls]

**The program.** pytorch/examples' ``distributed/rpc/batch/reinforce.py`` as the tests run it
(``tests/examples/reinforce``): for each world size (one agent, ``world size - 1`` observers) it trains in batch
mode -- every observer's step answered through one ``@async_execution`` function that replies to them all once
the last state has arrived -- and in non-batch mode (one plain call per observer step), under torch's RPC
(``mp.spawn``-ed ranks, TensorPipe's defaults) and under nbremote (the agent's process starts the observers'
kernels). The figure is the episodes' time alone (the program prints it; the worlds' start is not in it), per
observer step. Each round runs the program once in each world, one after the other; ratios are paired by round
(batch / non-batch in each world, nbremote / torch in each mode), medians over rounds.

**The call.** Blocking calls, one at a time, in both worlds alive at once (torch: rank 0 and two workers, spawned
here; nbremote: this process and two kernels), driver -> worker and worker -> worker, rounds alternating between
the worlds: ``plain`` (returns None), ``ae_done`` (``@async_execution``, returns a completed
``torch.futures.Future``), ``ae_thread`` (its future completed by another thread of the user's), ``hop`` (a plain
call that waits for that same thread: what ``ae_thread`` must pay anyway), and an RRef proxy's plain and
``@async_execution`` methods (``rref.rpc_sync().m()``); nbremote alone also with its own Future (``*_nb``).
The figures are medians (us) of one call; ``ae - plain`` is the cost of ``@async_execution``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLE = ROOT / "tests" / "examples" / "reinforce"
WORLDS = ("torch", "nbremote")
READY_TIMEOUT = 300.0
RUN_TIMEOUT = 900.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _paired(a: list[float], b: list[float]) -> float:
    """Median over rounds of a / b."""
    return _median([x / y for x, y in zip(a, b, strict=False) if y > 0])


# -- the program ----------------------------------------------------------------------------------------------
def run_program(world: str, steps: int, episodes: int, max_world_size: int) -> dict[tuple[int, bool], float]:
    """One run of the example in ``world``: seconds per observer step, per (world size, batch)."""
    env = {**os.environ, "EXAMPLE_BACKEND": world, "EXAMPLE_STEPS": str(steps),
           "EXAMPLE_RPC_PORT": str(_free_port()), "PYTHONUNBUFFERED": "1"}
    run = subprocess.run([sys.executable, "main.py", "--num-episode", str(episodes), "--max-world-size",
                          str(max_world_size)], cwd=EXAMPLE, env=env, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT)
    if run.returncode != 0:
        raise RuntimeError(f"the reinforce example failed under {world}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    out = {}
    for line in run.stdout.splitlines():
        if line.startswith("episodes "):
            _, size, batch, seconds = line.split()
            out[(int(size), batch == "True")] = float(seconds) / (episodes * steps)
    return out


def bench_program(args: argparse.Namespace) -> None:
    per_step: dict[tuple[str, int, bool], list[float]] = {}
    for r in range(args.rounds):
        for world in (WORLDS if r % 2 == 0 else WORLDS[::-1]):
            for (size, batch), seconds in run_program(world, args.steps, args.episodes, args.max_world_size).items():
                per_step.setdefault((world, size, batch), []).append(seconds)
        print(f"program: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"\nbatch reinforce: time per observer step, ms (episodes only; {args.episodes} episodes of {args.steps} "
          f"steps, medians of {args.rounds} rounds)")
    print(f"{'world size':>10} {'world':>9} {'batch':>8} {'non-batch':>10} {'batch/non-batch':>16} "
          f"{'x/torch batch':>14} {'x/torch non-batch':>18}")
    sizes = sorted({size for _, size, _ in per_step})
    for size in sizes:
        for world in WORLDS:
            b, n = per_step.get((world, size, True), []), per_step.get((world, size, False), [])
            tb, tn = per_step.get(("torch", size, True), []), per_step.get(("torch", size, False), [])
            print(f"{size:>10} {world:>9} {_median(b) * 1e3:8.3f} {_median(n) * 1e3:10.3f} {_paired(b, n):16.2f} "
                  f"{_paired(b, tb):14.2f} {_paired(n, tn):18.2f}")


# -- the call -------------------------------------------------------------------------------------------------
def _torch_rank(rank: int, size: int, port: int, conn: Any, log: str) -> None:
    """A rank of the torch world; rank 0 answers ``(peer, case, calls)`` with a block's median (us)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.path.insert(0, str(HERE))
    import _aefns
    import torch.distributed.rpc as rpc

    name = "driver" if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=size, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120))
    try:
        if rank == 0:
            conn.send("ready")
            while True:
                try:
                    command = conn.recv()
                except EOFError:
                    break
                if command is None:
                    break
                try:
                    conn.send(("ok", _block("torch", *command)))
                except Exception:
                    conn.send(("error", traceback.format_exc()))
            _aefns.forget()
    finally:
        rpc.shutdown()


def _block(world: str, source: str, peer: str, case: str, calls: int) -> float:
    """A block of ``case`` from ``source`` (this process, or a worker it asks) to ``peer``."""
    import _aefns

    if world == "torch":
        import torch.distributed.rpc as rpc
    else:
        from nbremote import rpc  # type: ignore[no-redef]
    if source == "driver":
        return _aefns.block(world, peer, case, calls)
    value: float = rpc.rpc_sync(source, _aefns.block, args=(world, peer, case, calls), timeout=0)
    return value


class TorchCalls:
    def __init__(self, log: Path) -> None:
        mp = multiprocessing.get_context("spawn")
        port = _free_port()
        self.conn, child = mp.Pipe()
        self.procs = [mp.Process(target=_torch_rank, args=(r, 3, port, child if r == 0 else None, str(log)),
                                 daemon=True) for r in range(3)]
        for proc in self.procs:
            proc.start()
        if not self.conn.poll(READY_TIMEOUT) or self.conn.recv() != "ready":
            raise RuntimeError(f"the torch world did not start; see {log}")

    def block(self, source: str, peer: str, case: str, calls: int) -> float:
        self.conn.send((source, peer, case, calls))
        if not self.conn.poll(RUN_TIMEOUT):
            raise RuntimeError("the torch world did not answer")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"torch rank 0 failed:\n{value}")
        return float(value)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        deadline = time.monotonic() + 20
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()


def bench_calls(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    import _aefns

    from nbremote import rpc

    log = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_reinforce_torch.log"
    torch_world = TorchCalls(log)
    rpc.init_rpc("driver", workers=["worker1", "worker2"])
    routes = (("driver", "worker1"), ("worker1", "worker2"))
    cases = {"torch": _aefns.CASES, "nbremote": _aefns.CASES + _aefns.NBREMOTE_ONLY}
    results: dict[tuple[str, str, str], list[float]] = {}
    try:
        for r in range(args.rounds):
            for world in (WORLDS if r % 2 == 0 else WORLDS[::-1]):
                for source, peer in routes:
                    for case in cases[world]:
                        value = (torch_world.block(source, peer, case, args.calls) if world == "torch"
                                 else _block("nbremote", source, peer, case, args.calls))
                        results.setdefault((world, f"{source}->{peer}", case), []).append(value)
            print(f"calls: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        _aefns.forget()
        for source in ("worker1",):
            with contextlib.suppress(Exception):
                rpc.rpc_sync(source, _aefns.forget)
        rpc.shutdown()
        torch_world.close()
    print(f"\none call, us (medians of {args.rounds} rounds of {args.calls} calls); "
          "'- plain': the case's cost above a plain call, paired by round")
    print(f"{'route':>18} {'case':>13} {'torch':>8} {'nbremote':>9} {'nbr/torch':>10} "
          f"{'torch - plain':>14} {'nbr - plain':>12}")
    for source, peer in routes:
        route = f"{source}->{peer}"
        for case in cases["nbremote"]:
            t, n = results.get(("torch", route, case), []), results.get(("nbremote", route, case), [])
            base = "proxy_plain" if case.startswith("proxy_") else "hop" if "thread" in case else "plain"
            tp, np_ = results.get(("torch", route, base), []), results.get(("nbremote", route, base), [])
            t_extra = _median([x - y for x, y in zip(t, tp, strict=False)]) if t else float("nan")
            n_extra = _median([x - y for x, y in zip(n, np_, strict=False)])
            print(f"{route:>18} {case:>13} {_median(t):8.1f} {_median(n):9.1f} {_paired(n, t):10.2f} "
                  f"{t_extra:14.1f} {n_extra:12.1f}" + (f"   (vs {base})" if case != base else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="steps per episode (the example's NUM_STEPS)")
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--max-world-size", type=int, default=4, help="world sizes 2 .. this - 1, as the example")
    parser.add_argument("--calls", type=int, default=300, help="calls per block")
    parser.add_argument("--no-program", action="store_true")
    parser.add_argument("--no-calls", action="store_true")
    args = parser.parse_args()
    if not args.no_program:
        bench_program(args)
    if not args.no_calls:
        bench_calls(args)


if __name__ == "__main__":
    main()
