"""A real browser: JupyterLab on 127.0.0.1, headless Chromium, a notebook that uses nbremote like a user.

The notebook loads the extension, defines a model class, places it on a new worker with
``%remote_module`` and displays the panel. The test checks the parameter table the browser rendered,
clicks the panel's "eval" button, and runs a later cell that prints the remote module's ``training``
flag. A screenshot of the page is kept under ``tests/browser/artifacts/`` (its path is printed). The server
and the browser are ``lab``'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lab import ARTIFACTS, NEEDS_CHROMIUM, chromium_page, diagnostics, jupyterlab, run_cell

pytestmark = [pytest.mark.timeout(300), NEEDS_CHROMIUM]

CELLS = [
    "%load_ext nbremote",
    ("import torch\n\n"
     "class MyNet(torch.nn.Module):\n"
     "    def __init__(self, n_in=8, hidden=16):\n"
     "        super().__init__()\n"
     "        self.fc1 = torch.nn.Linear(n_in, hidden)\n"
     "        self.fc2 = torch.nn.Linear(hidden, 2)\n\n"
     "    def forward(self, x):\n"
     "        return self.fc2(torch.relu(self.fc1(x)))"),
    "net = %remote_module worker1/cpu MyNet(8, hidden=16)\nnet(torch.randn(4, 8))\nnet",
    "print('remote training flag:', net.training)",
]


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[str]:
    with jupyterlab(tmp_path, CELLS, "panel") as url:
        yield url


def test_panel_in_jupyterlab(lab: str, tmp_path: Path) -> None:
    shot = ARTIFACTS / "jupyterlab-panel.png"
    started = time.monotonic()
    with chromium_page(tmp_path, lab, len(CELLS)) as (page, sync_api):
        try:
            cells = page.locator(".jp-Notebook .jp-CodeCell")
            for i in range(3):
                run_cell(page, sync_api, i)
            panel = page.locator(".nbremote-panel")
            panel.wait_for()
            rows = panel.locator("table.nbremote-parameters tbody tr")
            names = [rows.nth(i).locator("td").first.inner_text() for i in range(rows.count())]
            assert names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "total (4)"]
            assert rows.nth(0).locator("td").nth(1).inner_text() == "(16, 8)"
            train_button = panel.locator(".widget-toggle-button", has_text="train")
            assert "mod-active" in (train_button.get_attribute("class") or "")
            panel.locator(".widget-toggle-button", has_text="eval").click()
            panel.locator("b", has_text="eval").wait_for()  # the panel re-read the remote mode
            run_cell(page, sync_api, 3)
            output = cells.nth(3).locator(".jp-OutputArea-output")
            output.wait_for()
            assert output.inner_text().strip() == "remote training flag: False"
            page.screenshot(path=str(shot), full_page=True)
        except Exception as exc:  # what the page showed and what the server and workers logged, for the report
            with contextlib.suppress(Exception):
                page.screenshot(path=str(ARTIFACTS / "jupyterlab-failure.png"), full_page=True)
            pytest.fail(f"{type(exc).__name__}: {exc}\n{diagnostics(page, tmp_path)}")
    print(f"\nscreenshot: {shot} (browser test took {time.monotonic() - started:.0f} s)")
    assert shot.stat().st_size > 10_000
