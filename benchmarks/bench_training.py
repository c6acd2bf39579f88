"""Benchmark one training step of a split model: nbremote vs torch.distributed.rpc vs one process.

``python benchmarks/bench_training.py [--quick] [--steps N]``

The model: ``stage1`` (Linear 64->256, tanh) on worker1, ``stage2`` (Linear 256->64, tanh) on worker2,
and a local ``head`` (Linear 64->1) in the trainer, batch 32, MSE loss, SGD with momentum. One *step* is
what a training loop does per batch::

    with dist_autograd.context() as context_id:
        loss = mse(head(stage2(stage1(x))), y)
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)

measured in the same run, on the same machine, three ways:

1. **local**: the same three layers trained in this process (``loss.backward(); opt.step()``): the
   floor of the arithmetic itself.
2. **nbremote**: the driver (this process) with two local worker kernels; ``nbremote.nn.RemoteModule``,
   ``nbremote.autograd`` and ``nbremote.optim.DistributedOptimizer``.
3. **torch.distributed.rpc**: three processes (trainer + two workers, TensorPipe backend on loopback),
   ``torch.distributed.nn.RemoteModule``, ``torch.distributed.autograd`` and
   ``torch.distributed.optim.DistributedOptimizer`` -- the identical program, run by torch.

Every path first checks that it computes the same loss from the same weights (so all three do the same
work), then times ``--steps`` steps after a warm-up; p50 and p90 of per-step times are printed with the
ratios nbremote/torch and nbremote/local. Each step makes 2 forward RPCs, 2 backward hops and a step on 3
owners; on a 2-core machine the three processes of torch's world and the kernels share the cores.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

# benchmarks/ is sys.path[0] when this runs as a script; the workers import the model by this name too
from _split_model import BATCH, Head, Stage, data
from torch import nn

LR, MOMENTUM = 0.01, 0.9


def _stats(times: Sequence[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _time_steps(step: Callable[[], float], warmup: int, steps: int) -> tuple[list[float], float]:
    first = step()
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times, first


# -- 1. local ---------------------------------------------------------------------------------------------
def bench_local(warmup: int, steps: int) -> tuple[list[float], float]:
    model = nn.Sequential(Stage(64, 256, 1), Stage(256, 64, 2), Head())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = data()

    def step() -> float:
        opt.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return _time_steps(step, warmup, steps)


# -- 2. nbremote --------------------------------------------------------------------------------------------
def bench_nbremote(warmup: int, steps: int) -> tuple[list[float], float]:
    import nbremote.autograd as dist_autograd
    from nbremote import rpc
    from nbremote.nn import RemoteModule
    from nbremote.optim import DistributedOptimizer

    rpc.init_rpc("trainer", workers=["worker1", "worker2"])
    try:
        stage1 = RemoteModule("worker1/cpu", Stage, args=(64, 256, 1))
        stage2 = RemoteModule("worker2/cpu", Stage, args=(256, 64, 2))
        head = Head()
        params = stage1.remote_parameters() + stage2.remote_parameters() + [rpc.RRef(p) for p in head.parameters()]
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=LR, momentum=MOMENTUM)
        x, y = data()

        def step() -> float:
            with dist_autograd.context() as context_id:
                loss = _loss(head(stage2(stage1(x))), y)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            return float(loss.detach())

        return _time_steps(step, warmup, steps)
    finally:
        rpc.shutdown()


# -- 3. torch.distributed.rpc (three processes) --------------------------------------------------------------
def _torch_rank(rank: int, port: int, warmup: int, steps: int, out: Any) -> None:
    import warnings

    # torch's own deprecation notices (TorchScript optimizers, forced with simplefilter("always")) are not
    # ours to fix, and would bury the table
    warnings.showwarning = lambda *args, **kwargs: None
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as trpc
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer

    names = ["trainer", "worker1", "worker2"]
    options = trpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=16)
    trpc.init_rpc(names[rank], rank=rank, world_size=3, rpc_backend_options=options)
    if rank == 0:
        stage1 = RemoteModule("worker1/cpu", Stage, args=(64, 256, 1))
        stage2 = RemoteModule("worker2/cpu", Stage, args=(256, 64, 2))
        head = Head()
        params = stage1.remote_parameters() + stage2.remote_parameters() + [trpc.RRef(p) for p in head.parameters()]
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=LR, momentum=MOMENTUM)
        x, y = data()

        def step() -> float:
            with dist_autograd.context() as context_id:
                loss = _loss(head(stage2(stage1(x))), y)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            return float(loss.detach())

        out.send(_time_steps(step, warmup, steps))
    trpc.shutdown()


def bench_torch(warmup: int, steps: int) -> tuple[list[float], float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp = multiprocessing.get_context("spawn")
    receive, send = mp.Pipe(duplex=False)
    procs = [mp.Process(target=_torch_rank, args=(rank, port, warmup, steps, send), daemon=True) for rank in range(3)]
    for p in procs:
        p.start()
    try:
        if not receive.poll(300):
            raise RuntimeError("torch.distributed.rpc's trainer did not report within 300 s")
        result: tuple[list[float], float] = receive.recv()
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="a few steps: checks that it works, times nothing")
    args = parser.parse_args(argv)
    steps, warmup = (5, 2) if args.quick else (args.steps, 20)
    print(f"one training step of a split model (Linear 64->256->64 on two workers + local head, batch {BATCH}); "
          f"{steps} steps after {warmup} warm-up; torch {torch.__version__}, {os.cpu_count()} cores")
    results = {}
    for name, bench in (("local", bench_local), ("nbremote", bench_nbremote), ("torch.rpc", bench_torch)):
        results[name] = bench(warmup, steps)
        p50, p90 = _stats(results[name][0])
        print(f"  {name:<10} p50 {p50 * 1000:8.2f} ms   p90 {p90 * 1000:8.2f} ms   first loss {results[name][1]:.6f}")
    losses = {name: first for name, (_, first) in results.items()}
    if max(losses.values()) - min(losses.values()) > 1e-5:
        print(f"MISMATCH: the three paths start from different losses {losses}")
        return 1
    nbr, trch, local = (_stats(results[n][0])[0] for n in ("nbremote", "torch.rpc", "local"))
    print(f"  ratios (p50): nbremote / torch.rpc = {nbr / trch:.2f}   nbremote / local = {nbr / local:.1f}   "
          f"torch.rpc / local = {trch / local:.1f}")
    if args.quick:
        print("  (--quick: a smoke run; the figures mean nothing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
