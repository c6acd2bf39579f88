"""torch's DDP+RPC program trains under nbremote what it trains under torch (issue 40).

``examples/ddp_rpc/main.py`` is pytorch/examples' ``distributed/rpc/ddp_rpc`` (the tutorial "Combining
Distributed DataParallel with Distributed RPC Framework"): an ``EmbeddingBag`` RemoteModule on a parameter
server, a DDP-wrapped ``Linear`` on two trainers with a gloo group between them, ``dist_autograd`` and a
``DistributedOptimizer``. Changed for the test: the CPU, seeds, one thread, fewer epochs, ports, and the
losses returned instead of printed (``# test:`` lines); for nbremote, the imports and the start-up
(``# nbremote:`` lines). Both runs happen here, with the same seeds and thread counts.

What must hold:

* the first step's losses are the same numbers bit for bit: same data, same initial weights;
* the replicas' DDP weights are equal at the end (under nbremote before issue 40, they drifted 0.19 to 0.31
  apart: DDP never all-reduced inside the distributed backward);
* every epoch's mean loss is torch's within torch's own run-to-run spread, measured here by running
  torch twice (the two trainers update the parameter server's table concurrently, so the order of those
  updates, and with it the last bits, depends on timing; under nbremote before issue 40 the last epoch's
  mean loss was off by ~0.1).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, report

pytestmark = pytest.mark.timeout(300)

PROGRAM = Path(__file__).parent / "examples" / "ddp_rpc"
EPOCHS = 10  # of 10 steps each
STEPS_PER_EPOCH = 10
LINE = re.compile(r"^trainer(\d) ([0-9a-f]{64}) (.+)$")
FLOOR = 1e-4  # the tolerance when the two torch runs happen to agree more closely than that


def run(backend: str) -> dict[int, tuple[str, list[float]]]:
    """Run the program under ``backend``: per trainer, its DDP weights' digest and every step's loss."""
    env = {**os.environ, "EXAMPLE_BACKEND": backend, "EXAMPLE_EPOCHS": str(EPOCHS),
           "EXAMPLE_RPC_PORT": str(free_port()), "EXAMPLE_PG_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "main.py"], cwd=PROGRAM, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, f"under {backend}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    found = {}
    for line in done.stdout.splitlines():
        match = LINE.match(line)
        if match:
            found[int(match[1])] = (match[2], [float(x) for x in match[3].split()])
    assert sorted(found) == [0, 1], f"under {backend}, no result from both trainers:\n{done.stdout[-3000:]}"
    assert all(len(losses) == EPOCHS * STEPS_PER_EPOCH for _, losses in found.values())
    return found


def epoch_means(losses: list[float]) -> list[float]:
    return [sum(losses[i:i + STEPS_PER_EPOCH]) / STEPS_PER_EPOCH for i in range(0, len(losses), STEPS_PER_EPOCH)]


def spread(a: dict[int, tuple[str, list[float]]], b: dict[int, tuple[str, list[float]]]) -> float:
    """The largest difference between two runs' epoch means, over both trainers."""
    return max(abs(x - y) for t in (0, 1) for x, y in zip(epoch_means(a[t][1]), epoch_means(b[t][1]), strict=True))


def test_the_ddp_rpc_program_trains_what_it_trains_under_torch() -> None:
    torch_runs = [run("torch"), run("torch")]
    ours = run("nbremote")
    for t in (0, 1):
        assert ours[t][1][0] == torch_runs[0][t][1][0], f"trainer{t}'s first loss differs from torch's"
    assert ours[0][0] == ours[1][0], "the trainers' DDP replicas differ at the end"
    assert torch_runs[0][0][0] == torch_runs[0][1][0]  # torch's own replicas, as a check of the check
    torch_spread = spread(*torch_runs)
    allowed = max(3 * torch_spread, FLOOR)
    off = spread(ours, torch_runs[0])
    last = {t: (epoch_means(ours[t][1])[-1], epoch_means(torch_runs[0][t][1])[-1]) for t in (0, 1)}
    report("DDP+RPC program vs torch", f"{EPOCHS} epochs: torch run to run {torch_spread:.2e}, nbremote vs torch "
           f"{off:.2e} (allowed {allowed:.2e}); last epoch's mean loss, nbremote/torch: "
           + ", ".join(f"trainer{t} {ours_:.6f}/{theirs:.6f}" for t, (ours_, theirs) in last.items()))
    assert off <= allowed, f"epoch mean losses differ from torch's by {off:.2e}; torch's own spread: {torch_spread:.2e}"
