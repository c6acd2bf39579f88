"""What watching training costs: the training step with the module panels and the dashboard live, and without.

``python benchmarks/bench_watch.py [--quick] [--rounds N] [--seconds S] [--json out.json]``

The step is ``bench.py``'s ``train`` case (two ``Stage`` modules on two worker kernels, a local ``Head``,
distributed autograd, ``DistributedOptimizer`` with SGD + momentum; ``_models``). Variants, in one world:

- **off**: nothing watches (the baseline);
- **recording**: each stage's history recorded on its owner and both workers' task streams, leases held
  without any panel (the recording alone: norms, copies and task records per step);
- **live**: a :class:`~nbremote.jupyter.ModulePanel` per stage with auto-refresh at its default interval
  (1 s) and a :class:`~nbremote.jupyter.WorkerDashboard` at its default (1 s): recording plus every
  refresh's calls, the driver's refresh threads and the HTML they render (the issue's target: <= 5 %);
- **live + log**: the same, the loop also calling ``stage2.log(loss=...)`` every step (a notification).

Each round runs one block of each variant (``--seconds`` of steps), in an order rotated from round to round;
the ratio of a variant to ``off`` is the median over rounds of the ratio of the two blocks' median step times
(paired, as ``bench.py`` does, so load elsewhere on the machine hits both alike). Widgets are made outside a
kernel, as in the tests (ipywidgets uses a no-op comm): what a frontend receives is rendered, not sent.
One compute thread per process (``OMP_NUM_THREADS=1``), as ``bench.py`` has it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

VARIANTS = ("off", "recording", "live", "live + log")


def _block(step: Callable[[], float], seconds: float) -> list[float]:
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds of 0.5 s blocks")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one block of steps")
    parser.add_argument("--json", help="write the samples and ratios here")
    options = parser.parse_args(argv)
    rounds, seconds = (2, 0.5) if options.quick else (options.rounds, options.seconds)

    import torch
    from _models import LR, MOMENTUM, Head, Stage, data, mse

    import nbremote.autograd as dist_autograd
    from nbremote import rpc
    from nbremote.jupyter import ModulePanel, WorkerDashboard
    from nbremote.nn import RemoteModule
    from nbremote.optim import DistributedOptimizer

    rpc.init_rpc("driver", workers=["worker1", "worker2"])
    try:
        stage1 = RemoteModule("worker1/cpu", Stage, args=(64, 256, 1))
        stage2 = RemoteModule("worker2/cpu", Stage, args=(256, 64, 2))
        head = Head()
        params = stage1.remote_parameters() + stage2.remote_parameters() + [rpc.RRef(p) for p in head.parameters()]
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=LR, momentum=MOMENTUM)
        x, y = data()
        logging = [False]

        def step() -> float:
            with dist_autograd.context() as context_id:
                loss = mse(head(stage2(stage1(x))), y)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            value = float(loss.detach())
            if logging[0]:
                stage2.log(loss=value)
            return value

        @contextlib.contextmanager
        def variant(name: str) -> Iterator[None]:
            widgets: list[Any] = []
            logging[0] = name == "live + log"
            if name == "recording":
                for stage in (stage1, stage2):
                    stage.remote_history(lease=3600)
                for worker in ("worker1", "worker2"):
                    rpc.worker_activity(worker, lease=3600)
            elif name.startswith("live"):
                widgets = [ModulePanel(stage1, auto_refresh=True), ModulePanel(stage2, auto_refresh=True),
                           WorkerDashboard()]
            try:
                yield
            finally:
                for widget in widgets:
                    widget.close()
                for stage in (stage1, stage2):
                    stage.remote_history(lease=0)
                for worker in ("worker1", "worker2"):
                    rpc.worker_activity(worker, lease=0)

        _block(step, 1.0)  # warm up: imports, first pickles, caches
        samples: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
            for name in order:
                with variant(name):
                    samples[name].append(_block(step, seconds))
            print(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{v} {statistics.median(samples[v][-1]) * 1e3:.2f} ms" for v in VARIANTS), flush=True)
    finally:
        rpc.shutdown()

    print(f"\ntraining step (split model, 2 workers), {rounds} rounds x {seconds:g} s per variant, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"  {'variant':14s} {'steps':>7s} {'p50 ms':>8s} {'p90 ms':>8s} {'/ off (paired)':>15s}")
    ratios: dict[str, float] = {}
    for name in VARIANTS:
        flat = sorted(t for block in samples[name] for t in block)
        ratios[name] = statistics.median(statistics.median(a) / statistics.median(b)
                                         for a, b in zip(samples[name], samples["off"], strict=True))
        print(f"  {name:14s} {len(flat):7d} {statistics.median(flat) * 1e3:8.3f} "
              f"{flat[int(0.9 * (len(flat) - 1))] * 1e3:8.3f} {ratios[name]:14.3f}x")
    live = ratios["live"]
    print(f"\ntarget (issue 23): the live panels and dashboard slow the step by <= 5 %: "
          f"{(live - 1) * 100:+.1f} % -> {'met' if live <= 1.05 else 'NOT met'}")
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"samples": samples, "ratios": ratios, "rounds": rounds, "seconds": seconds}, f)
    return 0


if __name__ == "__main__":
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    sys.exit(main(sys.argv[1:]))
