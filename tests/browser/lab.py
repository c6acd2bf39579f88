"""What the real-browser tests share: JupyterLab serving a notebook on 127.0.0.1, headless Chromium driving it.

Chromium is Debian's ``chromium`` package, driven by the ``playwright`` Python package through
``executable_path`` (playwright's own browser download cannot work on a closed network). Without
chromium, jupyterlab or playwright a test skips and says which is missing.
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import nbformat
import pytest

CHROMIUM = os.environ.get("NBREMOTE_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NEEDS_CHROMIUM = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK),
    reason=f"no Chromium at {CHROMIUM}: apt-get install chromium (or set NBREMOTE_CHROMIUM)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def jupyterlab(tmp_path: Path, cells: Sequence[str], name: str) -> Iterator[str]:
    """JupyterLab serving a temp dir that holds a notebook of ``cells``; yields the notebook's URL (token included)."""
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (it is in the test extra)")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / f"{name}.ipynb")
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
        yield f"http://127.0.0.1:{port}/lab/tree/{name}.ipynb?token={token}"
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        ARTIFACTS.mkdir(exist_ok=True)  # the server's log beside the screenshot, for whoever reads a failure
        shutil.copyfile(tmp_path / "jupyterlab.log", ARTIFACTS / f"jupyterlab-{name}.log")


@contextlib.contextmanager
def chromium_page(tmp_path: Path, url: str, n_cells: int, width: int = 1280) -> Iterator[tuple[Any, Any]]:
    """A Chromium page ``width`` pixels wide showing the notebook at ``url`` once its kernel is idle; yields
    (page, sync_api)."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (it is in the test extra)")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": width, "height": 1000})
        try:
            page = browser.pages[0] if browser.pages else browser.new_page()
            page.set_default_timeout(120_000)
            page.goto(url)
            page.locator(".jp-Notebook .jp-CodeCell").nth(n_cells - 1).wait_for()
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for()
            yield page, sync_api
        finally:
            browser.close()


def start_cell(page: Any, sync_api: Any, i: int) -> Any:
    """Run cell ``i`` (shift-enter) and return once it is queued or running; returns its prompt's element."""
    cells = page.locator(".jp-Notebook .jp-CodeCell")
    prompt = cells.nth(i).locator(".jp-InputArea-prompt")
    # JupyterLab's CodeCell.execute silently does nothing while the session has no kernel attached yet (a
    # cold start: the status may already read idle): the prompt stays "[ ]". Press again until the cell is
    # queued ("[*]") or has run.
    for _ in range(10):
        cells.nth(i).locator(".cm-content").click()
        page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function("el => /\\[(\\*|\\d+)\\]/.test(el.textContent)",
                                   arg=prompt.element_handle(), timeout=5_000)
            break
        except sync_api.TimeoutError:
            continue
    return prompt.element_handle()


def wait_cell(page: Any, prompt: Any, timeout_ms: int = 180_000) -> None:
    page.wait_for_function("el => /\\[\\d+\\]/.test(el.textContent)", arg=prompt, timeout=timeout_ms)


def run_cell(page: Any, sync_api: Any, i: int) -> None:
    wait_cell(page, start_cell(page, sync_api, i))


def _tail(path: Path, chars: int = 2500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"({exc})"


def diagnostics(page: Any, tmp_path: Path) -> str:
    """The notebook's text as the browser shows it, the server's log and every nbremote worker log."""
    parts = []
    with contextlib.suppress(Exception):
        parts.append("--- the page ---\n" + page.locator(".jp-Notebook").inner_text(timeout=5_000)[-3000:])
    parts.append("--- jupyterlab.log ---\n" + _tail(tmp_path / "jupyterlab.log"))
    for log in sorted((tmp_path / "home" / "logs").rglob("*")):
        if log.is_file():
            parts.append(f"--- {log.name} ---\n" + _tail(log, 1500))
    return "\n".join(parts)
