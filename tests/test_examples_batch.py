"""pytorch/examples' ``distributed/rpc/batch`` programs, run under torch's RPC and under nbremote in the same test.

Each program (``examples/reinforce``, ``examples/parameter_server``) is one file that picks its RPC by
``EXAMPLE_BACKEND``: torch's world is ``mp.spawn``-ed ranks on a loopback port, nbremote's is the rank-0 process
starting its peers' kernels and running the program's own ``run_worker`` / ``run`` on every rank, unchanged --
``init_rpc`` with its rank, ``init_process_group``, ``shutdown`` (issue 40's start-up); every other line is the
same, seeds and thread counts included
(``torch.set_num_threads(1)`` everywhere). The two runs go at once, and their outputs are compared as far as
torch itself repeats them (checked run to run here before these were written):

- reinforce, every mode whose actions one sampling decides -- batch mode at any world size (one policy call
  for all observers per step), and either mode with one observer: the rewards of every episode exactly, the
  policy loss to 1e-5 relative (torch's own runs differ in the last bits of the loss from the second
  episode on). Non-batch mode with two observers is checked only for having run: which observer's call
  draws first from the agent's generator is decided by their race, in torch as here.
- parameter server with two trainers: every loss of every trainer and the server's first weights, exactly
  (the server sums two gradients onto zeros: the same whatever order they arrive in).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port

pytestmark = [pytest.mark.timeout(240)]

EXAMPLES = Path(__file__).parent / "examples"
RUN_TIMEOUT = 200


def _run_both(example: str, env: dict[str, str], *args: str) -> dict[str, list[str]]:
    """Run ``example`` under torch's RPC and under nbremote at once; each one's output lines."""
    rpc = pytest.importorskip("torch.distributed.rpc")
    if not rpc.is_available():
        pytest.skip("this torch has no torch.distributed.rpc")
    runs = {}
    for backend in ("torch", "nbremote"):
        runs[backend] = subprocess.Popen(
            [sys.executable, "main.py", *args], cwd=EXAMPLES / example, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
            env={**os.environ, **env, "EXAMPLE_BACKEND": backend, "EXAMPLE_RPC_PORT": str(free_port()),
                 "PYTHONUNBUFFERED": "1"})
    lines = {}
    try:
        for backend, run in runs.items():
            out, err = run.communicate(timeout=RUN_TIMEOUT)
            assert run.returncode == 0, f"{example} under {backend} failed:\n{out}\n{err}"
            lines[backend] = out.splitlines()
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
    return lines


def _reinforce_runs(lines: list[str]) -> dict[tuple[int, bool], list[tuple[str, float]]]:
    """Per (world size, batch): each episode's line and loss, from the program's output."""
    runs: dict[tuple[int, bool], list[tuple[str, float]]] = {}
    episodes: list[tuple[str, float]] = []
    episode = ""
    for line in lines:
        if line.startswith("Episode "):
            episode = line
        elif line.startswith("loss "):
            episodes.append((episode, float(line.split()[1])))
        elif line.startswith("episodes "):
            _, world_size, batch, _seconds = line.split()
            runs[(int(world_size), batch == "True")], episodes = episodes, []
    return runs


def test_batch_reinforce_trains_what_torch_trains() -> None:
    """The agent (rank 0) answers every observer's step through ``@async_execution`` in batch mode."""
    pytest.importorskip("gymnasium", reason="the reinforce example needs gymnasium (in the test extra)")
    episodes = 3
    out = _run_both("reinforce", {"EXAMPLE_STEPS": "50"}, "--num-episode", str(episodes), "--max-world-size", "4")
    torch_runs, ours = _reinforce_runs(out["torch"]), _reinforce_runs(out["nbremote"])
    assert sorted(ours) == sorted(torch_runs) == [(2, False), (2, True), (3, False), (3, True)]
    for (world_size, batch), theirs in torch_runs.items():
        mine = ours[(world_size, batch)]
        assert len(mine) == len(theirs) == episodes
        if not batch and world_size > 2:
            continue  # the observers' race decides whose step draws first, in torch's runs too
        assert [line for line, _ in mine] == [line for line, _ in theirs], (world_size, batch)
        assert [loss for _, loss in mine] == pytest.approx([loss for _, loss in theirs], rel=1e-5), (world_size, batch)


def test_batch_parameter_server_trains_what_torch_trains() -> None:
    """Trainers' gradients meet in an ``@async_execution`` method that answers them all once the last arrives."""
    out = _run_both("parameter_server", {"EXAMPLE_TRAINERS": "2"})

    def results(lines: list[str]) -> list[str]:
        return [line for line in lines if line.startswith(("trainer", "weights "))]

    theirs, mine = results(out["torch"]), results(out["nbremote"])
    assert [line.split()[0] for line in theirs] == ["trainer1", "trainer2", "weights"]
    assert all(len(line.split()) == 7 for line in theirs[:2])  # six batches each
    assert mine == theirs
