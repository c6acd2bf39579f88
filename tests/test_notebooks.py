"""The tutorials around the notebooks: what nbval does not check by running them.

nbval (``pyproject.toml``'s addopts) runs every notebook and compares its checked cells. These tests
check that its sanitize rules are in force, and the rest: the saved notebooks are clean and end with a
shutdown, every one is linked from the README, the README's magics example runs in a fresh kernel as a
new user would run it, Binder's files install what the notebooks import, and ``panel_for`` (which the
notebooks use to click the panel from code) is the panel a module displays.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import ROOT

pytestmark = pytest.mark.timeout(120)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
BINDER = ROOT / "binder"


def _code_cells(path: Path) -> list[nbformat.NotebookNode]:
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def _python_of(cell_source: str) -> str:
    """A cell as plain Python: a ``%%`` cell's body (it runs on workers, with the same packages), or the
    cell with its line magics turned into calls."""
    from IPython.core.inputtransformer2 import TransformerManager

    if cell_source.startswith("%%"):
        return cell_source.split("\n", 1)[1] if "\n" in cell_source else ""
    return TransformerManager().transform_cell(cell_source)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_tutorials_are_numbered_one_to_nine() -> None:
    assert [p.name[:3] for p in NOTEBOOKS] == [f"{i:02d}-" for i in range(1, 10)], [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_saved_notebook_is_clean_and_ends_with_a_shutdown(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    assert nb.metadata.kernelspec.name == "python3"
    cells = [c for c in nb.cells if c.cell_type == "code"]
    checked = 0
    for i, cell in enumerate(cells):
        assert cell.execution_count == i + 1, f"cell {i} was not run in order from the top (re-run the notebook)"
        for out in cell.outputs:
            assert out.output_type != "error", f"cell {i} saved an error: {out.get('ename')}"
            assert not (out.output_type == "stream" and out.name == "stderr"), f"cell {i} wrote to stderr"
        assert "NBVAL_SKIP" not in cell.source, "no cell is skipped: one that needs infrastructure says so itself"
        checked += "NBVAL_CHECK_OUTPUT" in cell.source or "nbval-check-output" in cell.metadata.get("tags", [])
    assert checked >= 2, "each tutorial checks the outputs that prove its point"
    shows_widgets = any("application/vnd.jupyter.widget-view+json" in out.get("data", {})
                        for cell in cells for out in cell.outputs)
    if shows_widgets:  # saved outputs make JupyterLab distrust the notebook, and then it renders no widget
        assert "Clear Outputs of All Cells" in nb.cells[0].source, "say how to see the widgets live, at the top"
    source = "\n".join(c.source for c in cells)
    starts = [m.start() for m in re.finditer(r"rpc\.init_rpc\(|%remote_module |%remote_workers start", source)]
    assert starts, "each tutorial starts its own workers"
    assert source.rfind("rpc.shutdown()") > max(starts), "each tutorial shuts its workers down at the end"


def test_nbval_applies_the_sanitize_rules() -> None:
    from nbval.plugin import get_sanitize_patterns

    tomllib = pytest.importorskip("tomllib")
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    found = re.search(r"--nbval-sanitize-with=(\S+)", addopts)
    assert found is not None and "--nbval-lax" in addopts
    rules = get_sanitize_patterns((ROOT / found[1]).read_text())
    assert len(rules) >= 5
    sanitized = "pid 4242 took 0.25 s"
    for regex, replace in rules:
        sanitized = re.sub(regex, replace, sanitized)
    assert sanitized == "pid <PID> took <DURATION>"
    # A conftest.py beside the notebooks would be imported as "conftest" and shadow tests/conftest.py.
    assert not (ROOT / "notebooks" / "conftest.py").exists()


def test_readme_and_quickstart_link_every_notebook() -> None:
    readme = (ROOT / "README.md").read_text()
    quickstart = "\n".join(c.source for c in nbformat.read(NOTEBOOKS[0], as_version=4).cells)
    for path in NOTEBOOKS:
        assert f"(notebooks/{path.name})" in readme, f"README does not link {path.name}"
        if path != NOTEBOOKS[0]:
            assert f"({path.name})" in quickstart, f"the quickstart's 'where next' does not link {path.name}"
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"README links a missing file: {target}"
    binder_links = re.findall(r"https://mybinder\.org/v2/gh/[^)\s]+", readme)
    assert binder_links and "badge_logo.svg" in readme
    for link in binder_links:
        labpath = re.search(r"labpath=([^&)]+)", link)
        assert labpath is not None and (ROOT / labpath[1].replace("%2F", "/")).exists(), link


def test_binder_installs_a_cpu_torch_then_the_package() -> None:
    requirements = (BINDER / "requirements.txt").read_text()
    assert re.search(r"^--extra-index-url https://download\.pytorch\.org/whl/cpu$", requirements, re.M)
    pinned = re.search(r"^torch==(\S+)\+cpu$", requirements, re.M)
    assert pinned is not None, "binder pins torch's CPU-only build"
    readme_torch = re.search(r"pip install torch==(\S+) ", (ROOT / "README.md").read_text())
    assert readme_torch is not None and pinned[1] == readme_torch[1], "binder and the README pin one torch"

    runtime = (BINDER / "runtime.txt").read_text().strip()
    assert re.fullmatch(r"python-3\.\d+", runtime), runtime
    from packaging.specifiers import SpecifierSet

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert runtime.removeprefix("python-") + ".0" in SpecifierSet(project["requires-python"])

    post_build = BINDER / "postBuild"
    assert os.access(post_build, os.X_OK) and post_build.read_text().startswith("#!/bin/bash\n")
    assert "set -euo pipefail" in post_build.read_text()
    install = re.search(r'pip install .*-e "\.\[([a-z,]+)\]"', post_build.read_text())
    assert install is not None, "postBuild installs this package (repo2docker does not, with binder/ present)"
    extras = install[1].split(",")
    assert set(extras) <= set(project["optional-dependencies"]) and {"torch", "notebooks"} <= set(extras)
    listed = subprocess.run(["git", "ls-files", "-s", "binder/postBuild"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout:  # a git checkout: the executable bit must be committed
        assert listed.stdout.startswith("100755"), listed.stdout


def test_binder_and_the_notebooks_extra_install_what_the_notebooks_import() -> None:
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = re.search(r'-e "\.\[([a-z,]+)\]"', (BINDER / "postBuild").read_text())
    assert extras is not None
    requirements = list(project["dependencies"])
    for extra in extras[1].split(","):
        requirements += project["optional-dependencies"][extra]
    requirements += [line for line in (BINDER / "requirements.txt").read_text().splitlines()
                     if line and not line.startswith(("#", "-"))]
    installed = {_normalize(Requirement(r).name) for r in requirements} | {"nbremote"}

    imported: set[str] = set()
    for path in NOTEBOOKS:
        for cell in _code_cells(path):
            for node in ast.walk(ast.parse(_python_of(cell.source))):
                if isinstance(node, ast.Import):
                    imported |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "__main__"}
    assert {"torch", "matplotlib", "tensorplay", "nbremote"} <= third_party
    distributions = importlib.metadata.packages_distributions()
    for module in sorted(third_party - {"nbremote"}):
        dists = {_normalize(d) for d in distributions.get(module, [module])}
        assert dists & installed, f"the notebooks import {module}, which Binder's setup does not install"


def test_readme_magics_example_runs_in_a_fresh_kernel(tmp_path: Path) -> None:
    """The README's "notebook in 15 lines", run by a real kernel as a user runs it (nothing started before)."""
    from nbclient import NotebookClient

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## A notebook in 15 lines", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```ipython\n(.*?)```", section, re.S)
    assert len(blocks) == 3 and len("".join(blocks).strip().splitlines()) <= 18
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(b.strip()) for b in blocks]
                                  + [nbformat.v4.new_code_cell("from nbremote import rpc\nrpc.shutdown()")])
    env_before = os.environ.get("NBREMOTE_LOG_DIR")
    os.environ["NBREMOTE_LOG_DIR"] = str(tmp_path / "logs")  # the kernel's workers log here
    try:
        NotebookClient(nb, timeout=90, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("NBREMOTE_LOG_DIR")
        else:
            os.environ["NBREMOTE_LOG_DIR"] = env_before
    first, remote, dashboard = (nb.cells[i].outputs for i in range(3))
    text = "".join(o.get("text", "") for o in first)
    assert "nbremote: started worker 'worker1'" in text
    shown = [o for o in first if o.output_type == "execute_result"]
    assert shown and shown[-1].data["text/plain"] == "RemoteModule(Net on worker1/cpu)"
    assert "application/vnd.jupyter.widget-view+json" in shown[-1].data  # the panel
    assert re.search(r"\[worker1\] running in worker1's own namespace, pid \d+", remote[0].text)
    assert any("WorkerDashboard(worker1" in o.data.get("text/plain", "") for o in dashboard if "data" in o)


def test_panel_for_returns_the_panel_a_module_displays(world: list[str]) -> None:
    import torch

    from nbremote.jupyter import _display, panel_for
    from nbremote.nn import RemoteModule

    net = RemoteModule("worker1/cpu", torch.nn.Linear, args=(2, 2))
    panel = panel_for(net)
    try:
        assert panel_for(net) is panel and panel.module is net
        bundle = _display.module_bundle(net)
        assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == panel.model_id
        panel.mode_buttons.value = "eval"  # what the notebooks do instead of a click
        assert net.training is False
    finally:
        panel.close()


def test_magic_lines_may_end_with_a_comment() -> None:
    """As in the README's example: a ``# comment`` after a magic's arguments is a comment, not an argument."""
    from nbremote.jupyter._parse import ReloadCommand, parse_cell, parse_module, parse_workers

    assert parse_workers("  # the dashboard").action == "show"
    assert parse_workers("start w1 w2  # two of them").names == ("w1", "w2")
    assert parse_workers("start w1 --attach k#1.json").attach == "k#1.json"  # '#' inside a word stays
    assert parse_workers("start w1 --attach 'a #b.json'").attach == "a #b.json"  # and inside quotes
    assert parse_cell("worker1 --bg  # later").background is True
    assert parse_module("--reload net  # keep the weights") == ReloadCommand("net")
    built = parse_module("worker1/cpu Net(8, name='a #b')  # build it")
    assert not isinstance(built, ReloadCommand) and ast.literal_eval(built.keywords[0].value) == "a #b"
