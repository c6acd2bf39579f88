"""Benchmark RemoteModule's forward overhead: ``Linear(16, 16)`` on a batch of 32.

``python benchmarks/bench_remote_module.py [--quick] [--framework torch|tensorplay|both]``

Measured in one run on one worker kernel, in alternating blocks so that drift on a busy machine hits
every case alike:

1. **local**: ``module(x)`` in this process (the floor of the work itself);
2. **small call**: ``rpc_sync(worker, noop)``, the raw round trip of the RPC layer;
3. **RemoteModule**: ``rm(x)`` (blocking), and ``rm.forward_async(x).wait()``;
4. **rref proxy**: ``module_rref.rpc_sync().forward(x)``, the same work without RemoteModule, to show
   what the handle itself adds on top of the RPC layer.

Ratios printed: RemoteModule / local forward, and RemoteModule / small call (1.0 would mean the forward
costs nothing beyond one empty round trip). nbremote's RemoteModule against torch.distributed.rpc's, in
the same run, is ``bench.py``'s ``module`` case (``python benchmarks/bench.py --only module``).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

from nbremote import rpc
from nbremote.nn import RemoteModule


def noop() -> None:
    return None


def _block_times(fn: Callable[[], Any], calls: int) -> list[float]:
    """Per-call wall times (seconds) of ``calls`` back-to-back calls."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def run(framework: str, blocks: int, calls: int) -> None:
    lib = importlib.import_module(framework)
    lib.manual_seed(0)
    local = lib.nn.Linear(16, 16)
    x = lib.randn(32, 16)
    rm = RemoteModule("worker1/cpu", lib.nn.Linear, args=(16, 16))
    rref = rm.get_module_rref()
    cases: dict[str, Callable[[], Any]] = {
        "local forward": lambda: local(x),
        "small call (rpc_sync noop)": lambda: rpc.rpc_sync("worker1", noop),
        "RemoteModule rm(x)": lambda: rm(x),
        "RemoteModule forward_async(x).wait()": lambda: rm.forward_async(x).wait(),
        "rref.rpc_sync().forward(x)": lambda: rref.rpc_sync().forward(x),
    }
    for fn in cases.values():  # warm up: imports on the worker, first pickles, caches
        _block_times(fn, 50)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(blocks):
        for name, fn in cases.items():
            samples[name].extend(_block_times(fn, calls))

    print(f"\n{framework}: Linear(16, 16), batch 32, {blocks} blocks x {calls} calls per case")
    print(f"  {'case':40s} {'p50 ms':>8s} {'p90 ms':>8s} {'mean ms':>8s}")
    p50 = {}
    for name, values in samples.items():
        p50[name] = statistics.median(values)
        p90, mean = _p(values, 0.9), statistics.fmean(values)
        print(f"  {name:40s} {p50[name] * 1e3:8.3f} {p90 * 1e3:8.3f} {mean * 1e3:8.3f}")
    remote, small, proxy = (
        p50["RemoteModule rm(x)"],
        p50["small call (rpc_sync noop)"],
        p50["rref.rpc_sync().forward(x)"],
    )
    print("  ratios (p50):")
    print(f"    RemoteModule / local forward      {remote / p50['local forward']:8.1f}x")
    print(f"    RemoteModule / small call         {remote / small:8.2f}x")
    print(f"    RemoteModule / rref proxy forward {remote / proxy:8.2f}x")
    print(f"    RemoteModule - small call         {(remote - small) * 1e3:8.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--framework", choices=["torch", "tensorplay", "both"], default="both")
    options = parser.parse_args()
    blocks, calls = (3, 50) if options.quick else (10, 200)
    frameworks = ["torch", "tensorplay"] if options.framework == "both" else [options.framework]
    rpc.init_rpc("driver", workers=["worker1"])
    try:
        for framework in frameworks:
            run(framework, blocks, calls)
    finally:
        rpc.shutdown()


if __name__ == "__main__":
    main()
