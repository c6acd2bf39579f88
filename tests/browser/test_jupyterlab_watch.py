"""A real browser watching a training cell: the panel's sparklines move, the dashboard's task stream fills.

JupyterLab and headless Chromium as ``lab`` sets them up. The notebook places a model on a worker, shows
its panel with auto-refresh (every 0.5 s) and the worker dashboard, then runs a training cell that steps
for ~25 s, logging its loss. While that cell runs -- the notebook's main thread busy -- the test takes two
screenshots of the panel a few seconds apart and checks that the sparklines the browser drew changed
(the ``points`` they were drawn from, and the pixels), that the loss chart grew, and that the
dashboard's task stream shows ``Net.forward`` in worker1's lane. The screenshots are kept under
``tests/browser/artifacts/``; with ``NBREMOTE_PICTURES=<dir>`` the panel's and the dashboard's are also
written there as ``panel-training.png`` and ``dashboard.png`` (the README's pictures:
``NBREMOTE_PICTURES=docs pytest tests/browser/test_jupyterlab_watch.py``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lab import ARTIFACTS, NEEDS_CHROMIUM, chromium_page, diagnostics, jupyterlab, run_cell, start_cell, wait_cell

pytestmark = [pytest.mark.timeout(400), NEEDS_CHROMIUM]

TRAIN_SECONDS = 25

CELLS = [
    "%load_ext nbremote",
    ("import time\n"
     "import torch\n"
     "import nbremote.autograd as dist_autograd\n"
     "from nbremote.jupyter import WorkerDashboard, panel_for\n"
     "from nbremote.optim import DistributedOptimizer\n\n"
     "class Net(torch.nn.Module):\n"
     "    def __init__(self):\n"
     "        super().__init__()\n"
     "        self.fc1 = torch.nn.Linear(8, 32)\n"
     "        self.fc2 = torch.nn.Linear(32, 1)\n\n"
     "    def forward(self, x):\n"
     "        return self.fc2(torch.tanh(self.fc1(x)))"),
    ("net = %remote_module worker1/cpu Net()\n"
     "opt = DistributedOptimizer(torch.optim.SGD, net.remote_parameters(), lr=0.05)\n"
     "panel_for(net).set_auto_refresh(True, interval=0.5)\n"
     "net"),
    "WorkerDashboard(interval=0.5, window=10)",
    ("_ = torch.manual_seed(0)\n"
     "x = torch.randn(256, 8)\n"
     "y = torch.sin(x.sum(dim=1, keepdim=True))\n"
     f"end = time.monotonic() + {TRAIN_SECONDS}\n"
     "while time.monotonic() < end:\n"
     "    with dist_autograd.context() as context_id:\n"
     "        loss = ((net(x) - y) ** 2).mean()\n"
     "        dist_autograd.backward(context_id, [loss])\n"
     "        opt.step(context_id)\n"
     "    net.log(loss=loss.item())\n"
     "    time.sleep(0.02)"),
]


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[str]:
    with jupyterlab(tmp_path, CELLS, "watch") as url:
        yield url


def _drawn(panel: Any) -> list[str]:
    """The ``points`` of every sparkline the browser shows in the parameter table, in order."""
    points: list[str] = panel.locator("table.nbremote-parameters svg.nbremote-spark polyline").evaluate_all(
        "lines => lines.map(l => l.getAttribute('points'))")
    return points


def _steps_drawn(panel: Any) -> int:
    counts: list[str] = panel.locator("table.nbremote-parameters svg.nbremote-spark").evaluate_all(
        "svgs => svgs.map(s => s.getAttribute('data-n'))")
    return min((int(c) for c in counts), default=0)


def test_watching_a_training_cell(lab: str, tmp_path: Path) -> None:
    first, second = ARTIFACTS / "jupyterlab-training-1.png", ARTIFACTS / "jupyterlab-training-2.png"
    board_shot = ARTIFACTS / "jupyterlab-dashboard.png"
    with chromium_page(tmp_path, lab, len(CELLS), width=1700) as (page, sync_api):
        try:
            page.locator(".jp-SideBar .lm-TabBar-tab.lm-mod-current").first.click()  # fold the file browser away
            for i in range(4):
                run_cell(page, sync_api, i)
            panel = page.locator(".nbremote-panel")
            board = page.locator(".nbremote-dashboard")
            panel.wait_for()
            board.wait_for()
            prompt = start_cell(page, sync_api, 4)  # the training cell: runs for TRAIN_SECONDS
            deadline = time.monotonic() + 60
            while _steps_drawn(panel) < 10 and time.monotonic() < deadline:
                time.sleep(0.25)
            assert _steps_drawn(panel) >= 10, "the panel drew no history while the training cell ran"
            before, steps_before = _drawn(panel), _steps_drawn(panel)
            table = panel.locator("table.nbremote-parameters")
            table.screenshot(path=str(first))
            time.sleep(4)
            after, steps_after = _drawn(panel), _steps_drawn(panel)
            table.screenshot(path=str(second))
            panel.screenshot(path=str(ARTIFACTS / "panel-training.png"))
            assert "[*]" in (prompt.text_content() or ""), "the training cell ended before the second look"
            assert steps_after > steps_before and len(after) == len(before) == 4 * 3
            assert sum(a != b for a, b in zip(after, before, strict=True)) >= 4  # the lines moved
            assert first.read_bytes() != second.read_bytes()  # and so did the pixels
            chart = panel.locator("svg.nbremote-chart[data-metric='loss']")
            assert int(chart.get_attribute("data-n") or 0) > 10
            lane = board.locator("g.nbremote-lane[data-worker='worker1']")
            lane.locator("rect[data-task='Net.forward']").first.wait_for(timeout=10_000)
            assert lane.locator("rect[data-task='Net.forward']").count() >= 1
            cpu = board.locator(".widget-html", has_text="%").first.inner_text()
            assert cpu.endswith("%"), cpu
            board.screenshot(path=str(board_shot))
            wait_cell(page, prompt)
            shot = ARTIFACTS / "jupyterlab-training-page.png"
            page.screenshot(path=str(shot), full_page=True)
        except Exception as exc:  # what the page showed and what the server and workers logged, for the report
            with contextlib.suppress(Exception):
                page.screenshot(path=str(ARTIFACTS / "jupyterlab-watch-failure.png"), full_page=True)
            pytest.fail(f"{type(exc).__name__}: {exc}\n{diagnostics(page, tmp_path)}")
    pictures = os.environ.get("NBREMOTE_PICTURES")
    if pictures:
        shutil.copyfile(ARTIFACTS / "panel-training.png", Path(pictures) / "panel-training.png")
        shutil.copyfile(board_shot, Path(pictures) / "dashboard.png")
    print(f"\nscreenshots: {first}, {second}, {board_shot}")
