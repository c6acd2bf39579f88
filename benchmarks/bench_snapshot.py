"""What snapshots and recovery cost for a 10M-parameter model trained with Adam, against baselines in the same run.

    python benchmarks/bench_snapshot.py [--width 1024] [--layers 10] [--rounds 5]

One worker holds ``layers`` Linear(width, width) layers (10.5 M parameters by default, 42 MB of weights and
84 MB of Adam moments); the driver trains it with a ``DistributedOptimizer(Adam)``. Measured, as medians
over ``rounds``:

* ``train step``: forward, backward and step of a batch of 32 -- the unit the snapshot cost is set against;
* ``snapshot -> memory``: ``net.snapshot()`` (copied on the owner under the step lock, sent to the driver);
* ``snapshot -> directory``: the same, written to a temporary directory as well;
* ``local copy``: the baseline, in this process: ``clone()`` of a local model's state dict and of its Adam
  state (what a snapshot must at least do), and ``torch.save`` of both to the same directory;
* ``restart + restore``: ``rpc.restart_worker`` after a kill -9 (a new kernel, the model rebuilt, loaded,
  Adam rebuilt), and the restore part alone (``last_report().seconds``); the baseline is a restart of a
  worker with nothing to restore.

Prints each figure and its ratio to its baseline (snapshot / train step, snapshot / local copy, restore /
plain restart).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

import nbremote.autograd as dist_autograd
from nbremote import rpc
from nbremote.nn import RemoteModule, last_report
from nbremote.optim import DistributedOptimizer


def model(width: int, layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def median_time(fn: Callable[[], object], rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def kill_and_restart(worker: str) -> float:
    os.kill(rpc.rpc_sync(worker, os.getpid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not any(s.name == worker and s.state == "dead" for s in rpc.worker_status()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{worker} was not seen dead")
        time.sleep(0.01)
    t0 = time.perf_counter()
    rpc.restart_worker(worker)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args()
    rpc.init_rpc("driver", workers=["holder", "plain"])
    try:
        net = RemoteModule("holder/cpu", model, args=(opts.width, opts.layers))
        opt = DistributedOptimizer(torch.optim.Adam, net.remote_parameters(), lr=1e-4)
        x = torch.randn(32, opts.width)
        n_params = sum(v.numel() for v in net.remote_state_dict().values())

        def step() -> None:
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [net(x).pow(2).mean()])
                opt.step(ctx)

        step()  # Adam's moments exist from here on
        snap = net.snapshot()
        local = model(opts.width, opts.layers)
        local_opt = torch.optim.Adam(local.parameters(), lr=1e-4)
        local(x).pow(2).mean().backward()
        local_opt.step()

        def local_copy() -> object:
            return ({k: v.clone() for k, v in local.state_dict().items()},
                    {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(local_opt.state.values())})

        # Rounds interleave the cases, so the load of this shared machine hits them alike.
        times: dict[str, list[float]] = {}
        with tempfile.TemporaryDirectory() as where:
            cases: dict[str, Callable[[], object]] = {
                "train": step, "memory": net.snapshot, "copy": local_copy,
                "dir": lambda: net.snapshot(to=os.path.join(where, "net")),
                "save": lambda: torch.save(local_copy(), os.path.join(where, "local.pt"))}
            for _ in range(opts.rounds):
                for name, fn in cases.items():
                    times.setdefault(name, []).append(median_time(fn, 1))
        train, to_memory, copy, to_dir, save = (statistics.median(times[k])
                                                for k in ("train", "memory", "copy", "dir", "save"))
        plains, restarts, restores = [], [], []
        for _ in range(max(2, opts.rounds // 2)):
            plains.append(kill_and_restart("plain"))
            restarts.append(kill_and_restart("holder"))
            report = last_report("holder")
            assert report is not None and not report.lost, report
            restores.append(report.seconds)
        plain, restart, restore = (statistics.median(v) for v in (plains, restarts, restores))
        step()  # the restored model and optimizer train on
        print(f"model: {opts.layers} x Linear({opts.width}, {opts.width}) = {n_params / 1e6:.1f} M parameters; "
              f"a snapshot holds {snap.nbytes / 1e6:.0f} MB (weights and Adam's moments)")
        rows = [("train step (baseline)", train, None, ""),
                ("snapshot -> memory", to_memory, train, "x a train step"),
                ("local copy, clone() (baseline)", copy, None, ""),
                ("snapshot -> memory vs local copy", to_memory, copy, "x the local copy"),
                ("snapshot -> directory", to_dir, None, ""),
                ("torch.save of the local copy (baseline)", save, None, ""),
                ("snapshot -> directory vs torch.save", to_dir, save, "x torch.save"),
                ("restart, nothing to restore (baseline)", plain, None, ""),
                ("restart + restore", restart, plain, "x a plain restart"),
                ("  of which the restore", restore, None, "")]
        for label, seconds, base, unit in rows:
            ratio = f"  {seconds / base:6.2f} {unit}" if base else ""
            print(f"{label:42s} {seconds * 1000:9.1f} ms{ratio}")
    finally:
        rpc.shutdown()


if __name__ == "__main__":
    main()
