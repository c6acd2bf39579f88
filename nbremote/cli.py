"""``nbremote demo`` (the main job: local workers doing real work, then a clean shutdown) and
``nbremote worker`` (start a kernel that a notebook can attach to with ``AttachedKernel``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence


def _where() -> str:
    from nbremote import rpc

    return f"{rpc.get_worker_info().name} (pid {os.getpid()})"


def _make_table(n: int) -> dict[int, int]:
    return {i: i * i for i in range(n)}


def _lookup(table_rref: object, key: int) -> str:
    table = table_rref.to_here()  # type: ignore[attr-defined]
    return f"{_where()} read {key}² = {table[key]} from an RRef owned by {table_rref.owner_name()}"  # type: ignore[attr-defined]


def _divide(a: float, b: float) -> float:
    return a / b


def demo(workers: int = 2) -> int:
    from nbremote import rpc

    t0 = time.perf_counter()
    names = [f"worker{i}" for i in range(1, workers + 1)]
    print(f"starting {workers} worker kernels ...", flush=True)
    rpc.init_rpc("driver", workers=names)
    pids: list[int] = []
    try:
        print(f"  ready in {time.perf_counter() - t0:.2f} s: "
              + ", ".join(f"{w.name} (rank {w.id})" for w in rpc.workers()))
        for name in names:
            print(f"  call -> {rpc.rpc_sync(name, _where)}")
            pids.append(rpc.rpc_sync(name, os.getpid))
        futs = [rpc.rpc_async(names[i % workers], pow, args=(i, 2)) for i in range(100)]
        total = sum(f.wait() for f in futs)
        print(f"  100 concurrent rpc_async calls: sum of squares 0..99 = {total}")
        table = rpc.remote(names[0], _make_table, args=(10,))
        print(f"  rpc.remote -> {table!r}")
        print(f"  RRef passed {names[0]} -> {names[-1]}: {rpc.rpc_sync(names[-1], _lookup, args=(table, 7))}")
        try:
            rpc.rpc_sync(names[-1], _divide, args=(1, 0))
        except ZeroDivisionError as exc:
            print(f"  remote error arrived as {type(exc).__name__}: {exc} "
                  f"(traceback from {exc.__cause__.worker})")  # type: ignore[union-attr]
        try:
            import torch
        except ImportError:
            print("  (torch not installed: skipping the tensor step)")
        else:
            x = torch.arange(6.0).reshape(2, 3)
            y = rpc.rpc_sync(names[0], torch.matmul, args=(x, x.t()))
            print(f"  torch.matmul on {names[0]}: {y.tolist()}")
    finally:
        rpc.shutdown()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    print(f"shut down in {time.perf_counter() - t0:.2f} s total; worker processes left: {left or 'none'}")
    return 1 if left else 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return True


def worker(connection_file: str, ip: str) -> int:
    """Run an ipykernel in the foreground, writing ``connection_file`` for ``AttachedKernel``."""
    print(f"starting a worker kernel; attach with nbremote.AttachedKernel({connection_file!r})", flush=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", f"--IPKernelApp.connection_file={connection_file}",
            f"--ip={ip}", "--HistoryManager.enabled=False"]
    os.execv(sys.executable, argv)
    return 0  # not reached


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nbremote", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="start local worker kernels, make them work, shut down cleanly")
    p_demo.add_argument("--workers", type=int, default=2)
    p_worker = sub.add_parser("worker", help="start a kernel others can attach to")
    p_worker.add_argument("--connection-file", default=os.path.abspath("nbremote-worker.json"))
    p_worker.add_argument("--ip", default="127.0.0.1")
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.workers < 1:
            parser.error("--workers must be at least 1")
        return demo(args.workers)
    return worker(args.connection_file, args.ip)


if __name__ == "__main__":
    sys.exit(main())
