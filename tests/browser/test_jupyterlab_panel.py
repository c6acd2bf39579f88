"""A real browser: JupyterLab on 127.0.0.1, headless Chromium, a notebook that uses nbremote like a user.

The notebook loads the extension, defines a model class, places it on a new worker with
``%remote_module`` and displays the panel. The test checks the parameter table the browser rendered,
clicks the panel's "eval" button, and runs a later cell that prints the remote module's ``training``
flag. A screenshot of the page is kept under ``tests/browser/artifacts/`` (its path is printed).

Chromium is Debian's ``chromium`` package, driven by the ``playwright`` Python package through
``executable_path`` (playwright's own browser download cannot work on a closed network). Without
chromium, jupyterlab or playwright the test skips and says which is missing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest

CHROMIUM = os.environ.get("NBREMOTE_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                       reason=f"no Chromium at {CHROMIUM}: apt-get install chromium (or set NBREMOTE_CHROMIUM)"),
]

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def jupyterlab(tmp_path: Path) -> Iterator[str]:
    """JupyterLab serving a temp dir that holds the notebook; yields the notebook's URL (token included)."""
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (it is in the test extra)")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "panel.ipynb")
    port, token = _free_port(), secrets.token_hex(16)
    home = tmp_path / "home"
    news = home / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text('{"fetchNews": "false"}')  # no "get notified about news?" toast over the screenshot
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "NBREMOTE_LOG_DIR": str(home / "logs"), "PYTHONPATH": os.pathsep.join(sys.path)}
    log = (tmp_path / "jupyterlab.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
         f"--LabApp.user_settings_dir={home / 'settings'}", f"--LabApp.workspaces_dir={home / 'workspaces'}",
         "--LabApp.news_url=None", "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False",
         "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate"],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start: {(tmp_path / 'jupyterlab.log').read_text()[-2000:]}")
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/lab/tree/panel.ipynb?token={token}"
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        ARTIFACTS.mkdir(exist_ok=True)  # the server's log beside the screenshot, for whoever reads a failure
        shutil.copyfile(tmp_path / "jupyterlab.log", ARTIFACTS / "jupyterlab.log")


def _tail(path: Path, chars: int = 2500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"({exc})"


def _diagnostics(page: Any, tmp_path: Path) -> str:
    """The notebook's text as the browser shows it, the server's log and every nbremote worker log."""
    parts = []
    with contextlib.suppress(Exception):
        parts.append("--- the page ---\n" + page.locator(".jp-Notebook").inner_text(timeout=5_000)[-3000:])
    parts.append("--- jupyterlab.log ---\n" + _tail(tmp_path / "jupyterlab.log"))
    for log in sorted((tmp_path / "home" / "logs").rglob("*")):
        if log.is_file():
            parts.append(f"--- {log.name} ---\n" + _tail(log, 1500))
    return "\n".join(parts)


def test_panel_in_jupyterlab(jupyterlab: str, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (it is in the test extra)")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "jupyterlab-panel.png"
    started = time.monotonic()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 1000})
        try:
            page = browser.pages[0] if browser.pages else browser.new_page()
            page.set_default_timeout(120_000)
            page.goto(jupyterlab)
            cells = page.locator(".jp-Notebook .jp-CodeCell")
            cells.nth(3).wait_for()
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for()

            def run_cell(i: int) -> None:
                prompt = cells.nth(i).locator(".jp-InputArea-prompt")
                # JupyterLab's CodeCell.execute silently does nothing while the session has no kernel
                # attached yet (a cold start: the status may already read idle): the prompt stays "[ ]".
                # Press again until the cell is queued ("[*]") or has run.
                for _ in range(10):
                    cells.nth(i).locator(".cm-content").click()
                    page.keyboard.press("Shift+Enter")
                    try:
                        page.wait_for_function("el => /\\[(\\*|\\d+)\\]/.test(el.textContent)",
                                               arg=prompt.element_handle(), timeout=5_000)
                        break
                    except sync_api.TimeoutError:
                        continue
                page.wait_for_function(
                    "el => /\\[\\d+\\]/.test(el.textContent)", arg=prompt.element_handle(), timeout=180_000)

            for i in range(3):
                run_cell(i)
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
            run_cell(3)
            output = cells.nth(3).locator(".jp-OutputArea-output")
            output.wait_for()
            assert output.inner_text().strip() == "remote training flag: False"
            page.screenshot(path=str(shot), full_page=True)
        except Exception as exc:  # what the page showed and what the server and workers logged, for the report
            with contextlib.suppress(Exception):
                page.screenshot(path=str(ARTIFACTS / "jupyterlab-failure.png"), full_page=True)
            pytest.fail(f"{type(exc).__name__}: {exc}\n{_diagnostics(page, tmp_path)}")
        finally:
            browser.close()
    print(f"\nscreenshot: {shot} (browser test took {time.monotonic() - started:.0f} s)")
    assert shot.stat().st_size > 10_000
