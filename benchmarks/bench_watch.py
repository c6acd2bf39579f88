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
(paired, as ``bench.py`` does, so load elsewhere on the machine hits both alike). On a machine shared with
other work wall times swing by 2x from block to block whatever is paired, so the CPU time each step costs
(the driver's process, refresh threads included, plus both workers' processes, per step) is reported
beside them: what watching adds to the work, which load elsewhere does not change. Widgets are made outside a
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


def recording_cost(module_rref: Any, steps: int) -> tuple[float, float]:
    """Runs on a stage's worker: CPU microseconds (this thread's) of a local SGD step of the stage, not watched
    and watched (history rings and layer hooks), alternating blocks; the medians of 3 blocks each."""
    import torch

    from nbremote import history

    module = module_rref.local_value()
    opt = torch.optim.SGD(module.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(32, module.fc.in_features)
    blocks: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(3):
        for watched in (False, True):
            history.recorder.renew(module, 600 if watched else 0)
            start = time.thread_time()
            for _ in range(steps):
                opt.zero_grad()
                module(x).sum().backward()
                opt.step()
            blocks[watched].append((time.thread_time() - start) / steps * 1e6)
    history.recorder.renew(module, 0)
    return statistics.median(blocks[False]), statistics.median(blocks[True])


def cpu_seconds() -> float:
    """This process's CPU time so far, every thread (runs on the workers too)."""
    times = os.times()
    return times.user + times.system


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

        def cpu_now() -> float:
            return cpu_seconds() + sum(rpc.rpc_sync(w, cpu_seconds) for w in ("worker1", "worker2"))

        _block(step, 1.0)  # warm up: imports, first pickles, caches
        samples: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
        cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}  # CPU seconds per step, one per block
        for r in range(rounds):
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
            for name in order:
                with variant(name):
                    before = cpu_now()
                    samples[name].append(_block(step, seconds))
                    cpu[name].append((cpu_now() - before) / len(samples[name][-1]))
            print(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{v} {statistics.median(samples[v][-1]) * 1e3:.2f} ms ({cpu[v][-1] * 1e3:.2f} ms CPU)"
                for v in VARIANTS), flush=True)
        pieces = _pieces(rpc, step, stage1, stage2, ModulePanel, WorkerDashboard, cpu_now, quick=options.quick)
    finally:
        rpc.shutdown()

    print(f"\ntraining step (split model, 2 workers), {rounds} rounds x {seconds:g} s per variant, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"  {'variant':14s} {'steps':>7s} {'p50 ms':>8s} {'p90 ms':>8s} {'/ off (paired)':>15s} "
          f"{'CPU ms/step':>12s} {'/ off (paired)':>15s}")
    ratios: dict[str, float] = {}
    cpu_ratios: dict[str, float] = {}
    for name in VARIANTS:
        flat = sorted(t for block in samples[name] for t in block)
        ratios[name] = statistics.median(statistics.median(a) / statistics.median(b)
                                         for a, b in zip(samples[name], samples["off"], strict=True))
        cpu_ratios[name] = statistics.median(a / b for a, b in zip(cpu[name], cpu["off"], strict=True))
        print(f"  {name:14s} {len(flat):7d} {statistics.median(flat) * 1e3:8.3f} "
              f"{flat[int(0.9 * (len(flat) - 1))] * 1e3:8.3f} {ratios[name]:14.3f}x "
              f"{statistics.median(cpu[name]) * 1e3:12.3f} {cpu_ratios[name]:14.3f}x")
    live, live_cpu = ratios["live"], cpu_ratios["live"]
    print(f"\ntarget (issue 23): the live panels and dashboard slow the step by <= 5 %: step time "
          f"{(live - 1) * 100:+.1f} % -> {'met' if live <= 1.05 else 'NOT met'}; "
          f"CPU per step {(live_cpu - 1) * 100:+.1f} % (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: "
          "above the core count, the step times are noise)")
    print("\nthe pieces, in CPU time (steadier than step times under load):")
    for line in pieces["lines"]:
        print(f"  {line}")
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"samples": samples, "cpu_per_step": cpu, "ratios": ratios, "cpu_ratios": cpu_ratios,
                       "rounds": rounds, "seconds": seconds, "pieces": pieces}, f)
    return 0


def _pieces(rpc: Any, step: Callable[[], float], stage1: Any, stage2: Any, panel_class: Any, board_class: Any,
            cpu_now: Callable[[], float], quick: bool) -> dict[str, Any]:
    """What each piece costs: recording per step on a worker; a panel's and the dashboard's refresh (driver and
    workers), the dashboard with 10 s of the training's task stream in view."""
    steps = 20 if quick else 300
    off1, on1 = rpc.rpc_sync("worker1", recording_cost, args=(stage1.module_rref, steps), timeout=300)
    off2, on2 = rpc.rpc_sync("worker2", recording_cost, args=(stage2.module_rref, steps), timeout=300)
    refreshes = 3 if quick else 10
    panel = panel_class(stage1)
    board = board_class(auto_refresh=False)
    end = time.perf_counter() + (1 if quick else 10)
    while time.perf_counter() < end:  # 10 s of training in the dashboard's view
        step()
    measured = {}
    for name, refresh in (("panel", panel.refresh), ("dashboard", board.refresh)):
        driver, total = time.thread_time(), cpu_now()
        for _ in range(refreshes):
            refresh()
        driver = (time.thread_time() - driver) / refreshes
        measured[name] = (driver, (cpu_now() - total) / refreshes - driver)
    panel.close()
    board.close()
    per_second = 2 * sum(measured["panel"]) + sum(measured["dashboard"])
    lines = [f"recording, per step of a stage: stage1 {off1:.0f} -> {on1:.0f} us CPU (+{on1 - off1:.0f} us), "
             f"stage2 {off2:.0f} -> {on2:.0f} us (+{on2 - off2:.0f} us)",
             f"a panel refresh: {measured['panel'][0] * 1e3:.2f} ms CPU in the driver, "
             f"{measured['panel'][1] * 1e3:.2f} ms in the workers",
             f"a dashboard refresh, 10 s of training in view: {measured['dashboard'][0] * 1e3:.2f} ms CPU in the "
             f"driver, {measured['dashboard'][1] * 1e3:.2f} ms in the workers",
             f"two panels and the dashboard at their default 1 s refresh: {per_second * 1e3:.1f} ms CPU a second "
             f"({per_second * 100:.1f} % of one core)"]
    return {"recording_us": {"stage1": (off1, on1), "stage2": (off2, on2)}, "refresh_s": measured,
            "lines": lines}


if __name__ == "__main__":
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    sys.exit(main(sys.argv[1:]))
