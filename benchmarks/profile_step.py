"""A training step's time, hop by hop: the split model of ``bench.py``'s ``train`` case, profiled.

``python benchmarks/profile_step.py [--model split|train4] [--steps 300] [--no-torch] [--json out.json]``

The step is ``bench.py``'s (two ``Stage`` RemoteModules on worker1 and worker2, a local ``Head``, SGD with
momentum through ``DistributedOptimizer``); ``--model train4`` profiles its ``train4`` case instead (an
``MLPStage`` on each of worker1..4, each activation coming back to the driver). Functions of nbremote on the
step's path are wrapped, in the driver and in the workers on the path, to stamp their entry and exit with
``perf_counter_ns`` -- CLOCK_MONOTONIC, one clock for every process of the machine -- and so are the codec's
``encode_items`` (a message leaves) and ``decode`` (one arrives), and a context's release. Each step's
stamps, from all these processes, are laid end to end; an event is named by its process, its stamp and how
many of its kind came before it in the step (``driver encode#3``), so the same event is found in every
step and its median offset from the step's start, and the gap since the event before it, tell where the
time goes. The phases (forward, backward, optimizer step, leaving the context) are also timed in the
driver alone, and the same phases of the same step under torch.distributed.rpc (TensorPipe, a world of
spawned processes as ``bench.py``'s) are timed in its rank 0, which is what torch lets one see without its
profiler.

Both worlds' CPU is counted too (every process's, from ``/proc``): per step over the timed steps, and
while the world sits idle for ``IDLE_S`` seconds. TensorPipe's default transport polls busily (its
shared-memory reactor): a world of torch processes takes both cores of this machine doing nothing, and
part of its lead in a step's latency is bought with that CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

STAMPED = [  # (module, attribute): stamped on entry and exit wherever nbremote runs
    ("nbremote.nn._remote_module", "RemoteModule._forward_sync"),
    ("nbremote.nn._owner", "forward"),
    ("nbremote.autograd", "backward"),
    ("nbremote.autograd", "_local_pass"),
    ("nbremote.autograd", "_backward_hop"),
    ("nbremote.optim", "DistributedOptimizer.step"),
    ("nbremote.optim", "_local_step"),
    ("nbremote.rpc._wire.serialize", "dumps"),
    ("nbremote.rpc._wire.serialize", "loads"),
    ("nbremote.rpc._wire.codec", "Codec.encode_items"),
    ("nbremote.rpc._wire.codec", "Codec.decode"),
    ("nbremote.rpc._core.agent", "Agent.release_context"),
]
PHASES = ("forward", "backward", "optimizer step", "leave the context")
WHOLE = "whole step"  # timed with the phases, unstamped in both worlds (nbremote's stamped steps: step_us)
IDLE_S = 3.0  # how long each world sits idle while its CPU is counted


def _cpu_figures(pids: list[int], step: Callable[[], float], n: int) -> dict[str, float]:
    """CPU of ``pids`` per step over ``n`` steps (and those steps' wall time), and idle for ``IDLE_S``."""
    from _env import cpu_seconds

    c0, t0 = cpu_seconds(*pids), time.perf_counter()
    for _ in range(n):
        step()
    c1, t1 = cpu_seconds(*pids), time.perf_counter()
    time.sleep(IDLE_S)
    c2 = cpu_seconds(*pids)
    return {"cpu_per_step_us": (c1 - c0) / n * 1e6, "wall_per_step_us": (t1 - t0) / n * 1e6,
            "idle_cores": (c2 - c1) / IDLE_S}


def stamp_functions(log: list[tuple[str, int]]) -> None:
    """Wrap every STAMPED function to append ``(label, ns)`` on entry (``name>``) and exit (``name<``)."""
    import functools
    import importlib

    now = time.perf_counter_ns
    for module, attr in STAMPED:
        owner: Any = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        if getattr(original, "_stamped", False):
            continue
        label = attr.rpartition(".")[2]

        def stamped(*args: Any, _f: Any = original, _label: str = label, **kwargs: Any) -> Any:
            log.append((_label + ">", now()))
            try:
                return _f(*args, **kwargs)
            finally:
                log.append((_label + "<", now()))

        wrapped = functools.wraps(original)(stamped)
        wrapped._stamped = True  # type: ignore[attr-defined]
        setattr(owner, name, wrapped)


def _install_in_worker() -> None:
    import builtins

    log: list[tuple[str, int]] = []
    builtins._nbremote_step_log = log  # type: ignore[attr-defined]
    stamp_functions(log)


def _worker_log(clear: bool) -> list[tuple[str, int]]:
    import builtins

    log: list[tuple[str, int]] = builtins._nbremote_step_log  # type: ignore[attr-defined]
    out = list(log)
    if clear:
        log.clear()
    return out


MODELS = {"split": 3, "train4": 4}  # model -> workers of its world (the split model's third is idle)


def _make_step(api: Any, workers: list[str],
               model: str) -> tuple[Callable[[], float], Callable[[dict[str, list[float]]], None]]:
    """bench.py's training step (as ``_apirunner`` makes it), and the same step timed phase by phase."""
    from _models import mlp4_model, mse, split_model

    forward, opt, y = (split_model if model == "split" else mlp4_model)(api, workers)

    def step() -> float:
        with api.dist_autograd.context() as context_id:
            loss = mse(forward(), y)
            api.dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        return float(loss.detach())

    def phases(into: dict[str, list[float]]) -> None:
        now = time.perf_counter
        ctx = api.dist_autograd.context()
        t0 = now()
        context_id = ctx.__enter__()
        loss = mse(forward(), y)
        t1 = now()
        api.dist_autograd.backward(context_id, [loss])
        t2 = now()
        opt.step(context_id)
        t3 = now()
        ctx.__exit__(None, None, None)
        t4 = now()
        for name, a, b in zip(PHASES, (t0, t1, t2, t3), (t1, t2, t3, t4), strict=True):
            into[name].append((b - a) * 1e6)
        into[WHOLE].append((t4 - t0) * 1e6)

    return step, phases


def _warm_and_time_phases(step: Callable[[], float], phases: Callable[[dict[str, list[float]]], None],
                          n: int) -> tuple[float, dict[str, list[float]]]:
    """The first step's loss, 50 steps of warm-up, then ``n`` steps timed phase by phase."""
    first = step()
    for _ in range(50):
        step()
    timed: dict[str, list[float]] = {p: [] for p in (*PHASES, WHOLE)}
    for _ in range(n):
        phases(timed)
    return first, timed


def _timeline(steps: list[list[tuple[str, str, int]]]) -> list[tuple[str, float, float]]:
    """Events named by (process, label, occurrence in the step) -> (name, median offset us, median gap us)."""
    offsets: dict[str, list[float]] = {}
    order: dict[str, list[int]] = {}
    for events in steps:
        seen: dict[tuple[str, str], int] = {}
        t0 = events[0][2]
        for position, (proc, label, t) in enumerate(events):
            k = seen.get((proc, label), 0)
            seen[proc, label] = k + 1
            name = f"{proc} {label}#{k}"
            offsets.setdefault(name, []).append((t - t0) / 1000)
            order.setdefault(name, []).append(position)
    common = [n for n, v in offsets.items() if len(v) >= len(steps) * 0.9]  # in (nearly) every step
    common.sort(key=lambda n: statistics.median(offsets[n]))
    out, previous = [], 0.0
    for name in common:
        median = statistics.median(offsets[name])
        out.append((name, median, median - previous))
        previous = median
    return out


def profile_nbremote(n: int, model: str) -> dict[str, Any]:
    import _apirunner
    from _nbr import _names

    from nbremote import rpc

    workers = _names(MODELS[model])
    stamped = workers[:2] if model == "split" else workers  # the workers on the step's path
    rpc.init_rpc("driver", workers=workers)
    try:
        step, phases = _make_step(_apirunner.nbremote_api(), workers, model)
        first, timed = _warm_and_time_phases(step, phases, n)
        cpu = _cpu_figures([os.getpid(), *(rpc.rpc_sync(w, os.getpid) for w in workers)], step, n)
        for w in stamped:
            rpc.rpc_sync(w, _install_in_worker)
        driver_log: list[tuple[str, int]] = []
        stamp_functions(driver_log)
        for _ in range(20):
            step()
        for w in stamped:
            rpc.rpc_sync(w, _worker_log, args=(True,))
        driver_log.clear()
        spans = []
        now = time.perf_counter_ns
        for _ in range(n):
            start = now()
            step()
            spans.append((start, now()))
        logs = {"driver": list(driver_log)}
        for w in stamped:
            logs[w] = rpc.rpc_sync(w, _worker_log, args=(False,))
    finally:
        rpc.shutdown()
    merged = sorted((t, proc, label) for proc, log in logs.items() for label, t in log)
    steps, i = [], 0
    for start, end in spans:
        events = [("driver", "STEP>", start)]
        while i < len(merged) and merged[i][0] < start:
            i += 1
        while i < len(merged) and merged[i][0] <= end:
            t, proc, label = merged[i]
            events.append((proc, label, t))
            i += 1
        events.append(("driver", "STEP<", end))
        steps.append(events)
    durations = [(b - a) / 1000 for a, b in spans]
    ranked = sorted(range(len(steps)), key=lambda k: durations[k])

    def events(k: int) -> list[tuple[str, str, float]]:
        return [(proc, label, (t - steps[k][0][2]) / 1000) for proc, label, t in steps[k]]

    return {"first_loss": first, "phases_us": timed, "step_us": durations, "timeline": _timeline(steps), "cpu": cpu,
            "median_step": events(ranked[len(steps) // 2]), "slow_step": events(ranked[int(len(steps) * 0.98)])}


def _torch_rank(rank: int, port: int, size: int, n: int, model: str, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed.rpc as trpc
    from _nbr import _names

    torch.set_num_threads(1)
    names = ["driver", *_names(size - 1)]
    trpc.init_rpc(names[rank], rank=rank, world_size=size, rpc_backend_options=trpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60))
    if rank == 0:
        import _apirunner

        step, phases = _make_step(_apirunner.torch_api(), names[1:], model)
        first, timed = _warm_and_time_phases(step, phases, n)
        cpu = _cpu_figures([os.getpid(), *(trpc.rpc_sync(w, os.getpid) for w in names[1:])], step, n)
        spans = []
        for _ in range(n):
            start = time.perf_counter()
            step()
            spans.append((time.perf_counter() - start) * 1e6)
        out.send({"first_loss": first, "phases_us": timed, "step_us": spans, "cpu": cpu})
    trpc.shutdown()


def profile_torch(n: int, model: str) -> dict[str, Any]:
    size = MODELS[model] + 1
    return spawn_torch_world(_torch_rank, size, (size, n, model))


def spawn_torch_world(target: Callable[..., None], size: int, args: tuple[Any, ...]) -> dict[str, Any]:
    """Spawn ``size`` processes running ``target(rank, port, *args, out)``, rank 0 sending its figures on ``out``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=target, args=(r, port, *args, send), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    try:
        if not receive.poll(600):
            raise SystemExit("torch's world did not report within 600 s")
        result: dict[str, Any] = receive.recv()
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return result


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(nbr: dict[str, Any], torch: dict[str, Any] | None) -> str:
    lines = [f"{'phase':22s} {'nbremote us':>12s}" + (f" {'torch us':>10s} {'ratio':>6s}" if torch else "")]
    for phase in (*PHASES, WHOLE):
        a = _median(nbr["phases_us"][phase])
        text = f"{phase:22s} {a:12.0f}"
        if torch:
            b = _median(torch["phases_us"][phase])
            text += f" {b:10.0f} {a / b:6.2f}"
        lines.append(text)
    for label, key, unit in (("wall per step", "wall_per_step_us", "us"), ("CPU per step", "cpu_per_step_us", "us"),
                             ("CPU while idle", "idle_cores", "cores")):
        a = nbr["cpu"][key]
        text = f"{label:22s} {a:9.{2 if unit == 'cores' else 0}f} {unit:>2s}"
        if torch:
            b = torch["cpu"][key]
            text += f" {b:7.{2 if unit == 'cores' else 0}f} {unit:>2s}" + (f" {a / b:6.2f}" if b else "")
        lines.append(text)
    lines.append("(CPU: every process of the world, from /proc, in 10 ms clock ticks; idle: "
                 f"{IDLE_S:.0f} s after the steps, in cores kept busy)")
    losses = f"first loss: nbremote {nbr['first_loss']:.6f}"
    lines.append(losses + (f", torch {torch['first_loss']:.6f}" if torch else ""))
    lines.append("")
    steps = sorted(nbr["step_us"])
    lines.append("nbremote's stamped steps (the timeline's: the stamps slow them), us: "
                 + ", ".join(f"p{q} {steps[int(len(steps) * q / 100)]:.0f}" for q in (10, 50, 90, 98)))
    for title, key in (("the median step", "median_step"), ("a slow step (p98)", "slow_step")):
        lines.append(f"{title}, event by event (process, stamp; > entry, < exit; gaps over 300 us marked):")
        previous = 0.0
        for proc, label, at in nbr[key]:
            mark = "  <--" if at - previous > 300 else ""
            lines.append(f"  {proc:8s} {label:22s} {at:8.0f} us  {at - previous:+6.0f}{mark}")
            previous = at
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="split", help="bench.py's case profiled")
    parser.add_argument("--steps", type=int, default=300, help="steps profiled (after a warm-up)")
    parser.add_argument("--no-torch", action="store_true", help="leave torch.distributed.rpc out")
    parser.add_argument("--json", help="also write every figure here")
    args = parser.parse_args(argv)
    return run_both(lambda: profile_nbremote(args.steps, args.model),
                    None if args.no_torch else lambda: profile_torch(args.steps, args.model), report, args.json)


def run_both(nbremote: Callable[[], dict[str, Any]], torch: Callable[[], dict[str, Any]] | None,
             table: Callable[[dict[str, Any], dict[str, Any] | None], str], json_path: str | None) -> int:
    """Profile nbremote's world, then torch's (unless None), print their table, and write both to ``json_path``."""
    nbr = nbremote()
    theirs = None if torch is None else torch()
    print(table(nbr, theirs))
    if json_path:
        with open(json_path, "w") as out:
            json.dump({"nbremote": nbr, "torch": theirs}, out)
    return 0


if __name__ == "__main__":
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one compute thread per process, as bench.py has it
        os.environ.setdefault(var, "1")
    sys.exit(main(sys.argv[1:]))
