"""pytorch/examples' distributed/rpc programs, ported by changing only imports and start-up (see examples/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

EXAMPLES = Path(__file__).parent / "examples"


def _run(example: str, *args: str) -> list[str]:
    result = subprocess.run([sys.executable, "main.py", *args], cwd=EXAMPLES / example, capture_output=True,
                            text=True, timeout=150)
    assert result.returncode == 0, f"{example} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout.splitlines()


def test_rnn_trainer_with_a_parameter_server() -> None:
    """dist_autograd + DistributedOptimizer, modules on a parameter server through rpc.remote."""
    assert _run("rnn") == [f"Training epoch {epoch}" for epoch in range(10)]


def test_rl_agent_called_back_by_its_observers() -> None:
    """Observers (workers) call the agent on the driver through an RRef, every step."""
    pytest.importorskip("gymnasium", reason="the RL example needs gymnasium (in the test extra)")
    lines = _run("rl", "--world-size", "3", "--log-interval", "1", "--episodes", "3")
    assert [line.split("\t")[0] for line in lines] == ["Episode 1", "Episode 2", "Episode 3"]
    assert all(float(line.split("Last reward: ")[1].split("\t")[0]) > 0 for line in lines)
