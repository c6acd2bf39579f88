"""The parameter server's step, phase by phase: ``bench.py``'s ``ps`` case, profiled in both worlds.

``python benchmarks/profile_ps.py [--steps 300] [--no-torch] [--json out.json]``

The world is ``bench.py``'s (``_models.PSModel`` on worker1, a ``PSTrainer`` on worker2 and worker3, both
running their loops at once), under nbremote and under torch.distributed.rpc (TensorPipe, spawned
processes). Each trainer times its own step, phase by phase, with ``perf_counter``: waiting for its turn,
the forward call, the backward pass, the optimizer step, leaving the context, and ending its turn. The
server stamps when a turn is taken and when it is given back: the *turn* (the lock held, from taking it
to giving it back) is what the step rate is made of, since the trainers take turns on the model, and the
*hand-over* (from one trainer giving the turn back to the other's taking it) is what a turn costs on top.
Steps per second count both trainers over the timed steps.

The phases are medians over both trainers' steps. Both worlds are measured one after the other, so the
ratios are unpaired: on this project's 2-core VM the load moves them by 10-20 % within minutes (paired
figures: ``bench.py --only ps``, ``ab.py --cases ps``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from typing import Any

PHASES = ("wait for the turn", "forward", "backward", "optimizer step", "leave the context", "end the turn")
TRAINERS = ("worker2", "worker3")
SERVER = "worker1"
WARMUP = 50  # steps each trainer runs before the timed ones

_turns: list[tuple[str, float]] = []  # on the server: ("take" | "give", perf_counter)


def take_turn(model_rref: Any) -> None:
    """``_models.ps_take_turn``, stamped when the turn is taken."""
    model_rref.local_value().turn.acquire()
    _turns.append(("take", time.perf_counter()))


def end_turn(model_rref: Any) -> None:
    """``_models.ps_end_turn``, stamped as the turn is given back."""
    _turns.append(("give", time.perf_counter()))
    model_rref.local_value().turn.release()


def turns(clear: bool) -> list[tuple[str, float]]:
    out = list(_turns)
    if clear:
        _turns.clear()
    return out


def _trainer_class() -> type:
    from _models import PSTrainer, mse, ps_forward

    class TimedTrainer(PSTrainer):
        """``PSTrainer``'s step, with the stamped turn and a clock between its phases."""

        def timed_steps(self, n: int) -> list[list[float]]:
            rpc, server, model, autograd = self.rpc, self.server, self.model_rref, self.dist_autograd
            now, out = time.perf_counter, []
            for _ in range(n):
                t0 = now()
                rpc.rpc_sync(server, take_turn, args=(model,))
                t1 = now()
                ctx = autograd.context()
                context_id = ctx.__enter__()
                loss = mse(rpc.rpc_sync(server, ps_forward, args=(model, self.x)), self.y)
                t2 = now()
                autograd.backward(context_id, [loss])
                t3 = now()
                self.opt.step(context_id)
                t4 = now()
                ctx.__exit__(None, None, None)
                t5 = now()
                rpc.rpc_sync(server, end_turn, args=(model,))
                t6 = now()
                out.append([(b - a) * 1e6 for a, b in itertools.pairwise((t0, t1, t2, t3, t4, t5, t6))])
            return out

    return TimedTrainer


def timed_steps(trainer_rref: Any, n: int) -> list[list[float]]:
    return trainer_rref.local_value().timed_steps(n)  # type: ignore[no-any-return]


def new_trainer(server: str, model_rref: Any, library: str) -> Any:
    return _trainer_class()(server, model_rref, library)


def run(rpc: Any, library: str, n: int) -> dict[str, Any]:
    """Build the world's parameter server and trainers, warm up, time ``n`` steps of each trainer at once."""
    from _models import PSModel

    model = rpc.remote(SERVER, PSModel)
    trainers = [rpc.remote(t, new_trainer, args=(SERVER, model, library)) for t in TRAINERS]

    def steps(k: int) -> tuple[float, list[list[float]]]:
        start = time.perf_counter()
        futures = [rpc.rpc_async(t, timed_steps, args=(h, k), timeout=600)
                   for t, h in zip(TRAINERS, trainers, strict=True)]
        phases = [row for f in futures for row in f.wait()]
        return time.perf_counter() - start, phases

    steps(WARMUP)
    rpc.rpc_sync(SERVER, turns, args=(True,))
    wall, phases = steps(n)
    stamps = rpc.rpc_sync(SERVER, turns, args=(True,))
    held = [b - a for (k1, a), (k2, b) in itertools.pairwise(stamps) if (k1, k2) == ("take", "give")]
    handed = [b - a for (k1, a), (k2, b) in itertools.pairwise(stamps) if (k1, k2) == ("give", "take")]
    return {"steps_per_s": len(phases) / wall,
            "phases_us": {p: [row[i] for row in phases] for i, p in enumerate(PHASES)},
            "turn_us": [t * 1e6 for t in held], "hand_over_us": [t * 1e6 for t in handed]}


def profile_nbremote(n: int) -> dict[str, Any]:
    from nbremote import rpc

    rpc.init_rpc("driver", workers=[SERVER, *TRAINERS])
    try:
        return run(rpc, "nbremote", n)
    finally:
        rpc.shutdown()


def _torch_rank(rank: int, port: int, n: int, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    import torch
    import torch.distributed.rpc as trpc

    warnings.simplefilter("ignore")  # torch's own deprecation warnings in its optimizer and RRefs: not ours
    torch.set_num_threads(1)
    names = ["driver", SERVER, *TRAINERS]
    trpc.init_rpc(names[rank], rank=rank, world_size=len(names), rpc_backend_options=trpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=600))
    if rank == 0:
        out.send(run(trpc, "torch", n))
    trpc.shutdown()


def profile_torch(n: int) -> dict[str, Any]:
    from profile_step import spawn_torch_world

    return spawn_torch_world(_torch_rank, 1 + 1 + len(TRAINERS), (n,))


def report(nbr: dict[str, Any], torch: dict[str, Any] | None) -> str:
    worlds = [("nbremote", nbr), *([("torch", torch)] if torch else [])]
    lines = [f"{'median, us':22s}" + "".join(f" {name:>10s}" for name, _ in worlds) + ("  ratio" if torch else "")]
    rows = [(p, "phases_us", p) for p in PHASES] + [("the turn (server)", "turn_us", None),
                                                    ("hand-over (server)", "hand_over_us", None)]
    for label, key, phase in rows:
        values = [statistics.median(w[key][phase] if phase else w[key]) for _, w in worlds]
        lines.append(f"{label:22s}" + "".join(f" {v:10.0f}" for v in values)
                     + (f" {values[0] / values[1]:6.2f}" if torch else ""))
    rates = [w["steps_per_s"] for _, w in worlds]
    lines.append(f"{'steps/s (both)':22s}" + "".join(f" {r:10.0f}" for r in rates)
                 + (f" {rates[1] / rates[0]:6.2f}" if torch else "") + "  (ratio: time per step, as bench.py's)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps each trainer runs, timed (after a warm-up)")
    parser.add_argument("--no-torch", action="store_true", help="leave torch.distributed.rpc out")
    parser.add_argument("--json", help="also write every figure here")
    args = parser.parse_args(argv)
    from profile_step import run_both

    return run_both(lambda: profile_nbremote(args.steps), None if args.no_torch else lambda: profile_torch(args.steps),
                    report, args.json)


if __name__ == "__main__":
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one compute thread per process, as bench.py has it
        os.environ.setdefault(var, "1")
    import profile_ps  # this file by its name: the functions the workers run are found by it there

    sys.exit(profile_ps.main(sys.argv[1:]))
