"""What ``nbremote demo`` runs: a model split across worker kernels, trained from this process.

:func:`train` is the main demo (what nbremote is for): it starts local worker kernels, builds a small
regression model whose first layer stays here (the *head*) and whose stages live one per worker, trains it
with distributed autograd and ``DistributedOptimizer``, prints the loss as it falls and each worker's
parameter table (``RemoteModule.remote_summary()``, the text of the notebook's module panel), then shuts
down and checks that no worker process is left. :func:`tour` is the RPC layer's tour (calls, RRefs, a
remote error). Both return a process exit status: 0 when everything they check holds.

The model is built here first, from a fixed seed, and the remote stages start from copies of its weights,
so a run prints the same losses every time. Its classes are made inside a function: they are not
importable by name, so they travel to the workers by value, like classes defined in a notebook.
"""

from __future__ import annotations

import importlib
import os
import time
from types import ModuleType
from typing import Any

FRAMEWORKS = ("torch", "tensorplay")
SAMPLES, FEATURES, HIDDEN, LR = 512, 8, 32, 0.01


def _framework(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise SystemExit(f"nbremote demo: {name} is not installed; pip install 'nbremote[{name}]' "
                         "(or pick the other one with --framework)") from None


def _stage_class(lib: ModuleType) -> type:
    """``Stage(n_in, n_out, last)``: a Linear layer, followed by tanh unless it is the model's last."""

    class Stage(lib.nn.Module):  # type: ignore[name-defined]
        def __init__(self, n_in: int, n_out: int, last: bool = False) -> None:
            super().__init__()
            self.fc = lib.nn.Linear(n_in, n_out)
            self.last = last

        def forward(self, h: Any) -> Any:
            out = self.fc(h)
            return out if self.last else lib.tanh(out)

    return Stage


def _warm_up(framework: str) -> None:
    """Runs on a worker: import the framework and build one optimizer (torch's first one loads its compiler,
    ``torch._dynamo``); done on every worker at once, it saves seconds of one-after-the-other loading later."""
    lib = importlib.import_module(framework)
    lib.optim.SGD([lib.zeros(1, requires_grad=True)], lr=0.1)


def _elapsed(start: float) -> str:
    return f"{time.perf_counter() - start:.1f} s"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def _left_after(pids: list[int], seconds: float = 5.0) -> list[int]:
    """The pids still running after at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _shutdown_and_check(pids: list[int], start: float) -> list[int]:
    from nbremote import rpc

    rpc.shutdown()  # first: nothing (not even a closed stdout) may keep the workers alive
    left = _left_after(pids)
    print(f"shut down; {_elapsed(start)} in all; worker processes left: {left or 'none'}")
    return left


def _log_every(steps: int) -> int:
    return 1 if steps <= 20 else steps // 10


def train(workers: int = 2, steps: int = 30, framework: str = "torch") -> int:
    """Train a model split over ``workers`` local worker kernels for ``steps`` steps; 0 if the loss fell
    and no worker process is left."""
    import nbremote.autograd as dist_autograd
    from nbremote import rpc
    from nbremote.nn import RemoteModule
    from nbremote.optim import DistributedOptimizer

    lib = _framework(framework)
    start = time.perf_counter()
    names = [f"worker{i}" for i in range(1, workers + 1)]
    print(f"nbremote demo: a model split across {workers} worker kernel(s) and this process, "
          f"trained from here ({framework})\n")
    print(f"starting {', '.join(names)} ...", flush=True)
    rpc.init_rpc("driver", workers=names)
    pids = [s.pid for s in rpc.worker_status() if s.pid is not None]
    fell = False
    try:
        print(f"  ready in {_elapsed(start)}: " + ", ".join(f"{s.name} (pid {s.pid})" for s in rpc.worker_status()))
        loading = time.perf_counter()
        warm = [rpc.rpc_async(name, _warm_up, args=(framework,)) for name in names]  # all workers at once

        # The whole model is built here from a fixed seed; the stages then move to their workers.
        lib.manual_seed(0)
        stage_cls = _stage_class(lib)
        head = lib.nn.Linear(FEATURES, HIDDEN)
        shapes = [(HIDDEN, HIDDEN, False)] * (workers - 1) + [(HIDDEN, 1, True)]
        local_stages = [stage_cls(n_in, n_out, last) for n_in, n_out, last in shapes]
        x = lib.randn(SAMPLES, FEATURES)
        y = lib.sin(2 * (x @ lib.randn(FEATURES, 1)) / FEATURES**0.5) + 0.05 * lib.randn(SAMPLES, 1)

        for fut in warm:
            fut.wait()
        print(f"  {framework} loaded in every worker (in parallel) in {_elapsed(loading)}")
        stages = []
        for name, (n_in, n_out, last), local in zip(names, shapes, local_stages, strict=True):
            stage = RemoteModule(f"{name}/cpu", stage_cls, args=(n_in, n_out), kwargs={"last": last})
            stage.remote_load_state_dict(local.state_dict())
            stages.append(stage)
        path = " -> ".join(f"Stage {n_in}->{n_out} on {s.remote_device}" for s, (n_in, n_out, _) in
                           zip(stages, shapes, strict=True))
        print(f"  model: head Linear {FEATURES}->{HIDDEN} (here, in the driver) -> tanh -> {path}")

        def model(inputs: Any) -> Any:
            h = lib.tanh(head(inputs))
            for stage in stages:
                h = stage(h)
            return h

        params = [rpc.RRef(p) for p in head.parameters()]
        for stage in stages:
            params += stage.remote_parameters()
        opt = DistributedOptimizer(lib.optim.Adam, params, lr=LR)

        plural = "s" if steps > 1 else ""
        print(f"\ntraining {steps} step{plural} on {SAMPLES} samples: each step one distributed autograd context, "
              "a forward and a backward pass\nthrough every worker, and an Adam step on each owner of parameters "
              f"({len(params)} parameter tensors on {workers + 1} processes)", flush=True)
        losses: list[float] = []
        train_start = time.perf_counter()
        for step in range(1, steps + 1):
            with dist_autograd.context() as context_id:
                loss = ((model(x) - y) ** 2).mean()
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            losses.append(float(loss.item()))
            if step % _log_every(steps) == 0 or step in (1, steps):
                print(f"  step {step:{len(str(steps))}d}  loss {losses[-1]:.4f}", flush=True)
        final = float(((model(x) - y) ** 2).mean().item())  # the loss after the last step
        fell = final < losses[0]
        print(f"loss {'fell' if fell else 'did NOT fall'} from {losses[0]:.4f} to {final:.4f} after {steps} "
              f"step(s) ({losses[0] / max(final, 1e-12):.1f}x lower) in {_elapsed(train_start)}")

        print("\nparameters on each worker after training (what the notebook's module panel shows):")
        for stage in stages:
            print("\n" + stage.remote_summary().to_text())
        print("(grad norm: distributed gradients live in the autograd context, not in .grad)\n")
    finally:
        left = _shutdown_and_check(pids, start)
    return 0 if fell and not left else 1


def _where() -> str:
    from nbremote import rpc

    return f"{rpc.get_worker_info().name} (pid {os.getpid()})"


def _make_table(n: int) -> dict[int, int]:
    return {i: i * i for i in range(n)}


def _lookup(table_rref: Any, key: int) -> str:
    table = table_rref.to_here()
    return f"{_where()} read {key}² = {table[key]} from an RRef owned by {table_rref.owner_name()}"


def _divide(a: float, b: float) -> float:
    return a / b


def tour(workers: int = 2) -> int:
    """The RPC layer's tour: calls, many calls in flight, an RRef passed between workers, a remote error."""
    from nbremote import rpc

    start = time.perf_counter()
    names = [f"worker{i}" for i in range(1, workers + 1)]
    print(f"starting {workers} worker kernels ...", flush=True)
    rpc.init_rpc("driver", workers=names)
    pids = [s.pid for s in rpc.worker_status() if s.pid is not None]
    try:
        print(f"  ready in {_elapsed(start)}: " + ", ".join(f"{w.name} (rank {w.id})" for w in rpc.workers()))
        for name in names:
            print(f"  call -> {rpc.rpc_sync(name, _where)}")
        futs = [rpc.rpc_async(names[i % workers], pow, args=(i, 2)) for i in range(100)]
        total = sum(f.wait() for f in futs)
        print(f"  100 concurrent rpc_async calls: sum of squares 0..99 = {total}")
        table = rpc.remote(names[0], _make_table, args=(10,))
        print(f"  rpc.remote -> {table!r}")
        print(f"  RRef passed {names[0]} -> {names[-1]}: {rpc.rpc_sync(names[-1], _lookup, args=(table, 7))}")
        try:
            rpc.rpc_sync(names[-1], _divide, args=(1, 0))
        except ZeroDivisionError as exc:
            cause: Any = exc.__cause__
            print(f"  remote error arrived as {type(exc).__name__}: {exc} (traceback from {cause.worker})")
        try:
            import torch
        except ImportError:
            print("  (torch not installed: skipping the tensor step)")
        else:
            m = torch.arange(6.0).reshape(2, 3)
            print(f"  torch.matmul on {names[0]}: {rpc.rpc_sync(names[0], torch.matmul, args=(m, m.t())).tolist()}")
    finally:
        left = _shutdown_and_check(pids, start)
    return 1 if left else 0
