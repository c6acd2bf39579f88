"""Kernels that cannot start: each is a ``WorkerStartError`` naming the worker, quoting the tail of its
log (why it died), leaving nothing in the world; the same name then starts fine."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import remote_fns as fns

import nbremote
from nbremote import rpc
from nbremote.errors import WorkerStartError

from .conftest import failure_of, worker_names

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def jupyter_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return tmp_path


def kernelspec(root: Path, name: str, argv: list[str], language: str = "python") -> None:
    spec_dir = root / "kernels" / name
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": name, "language": language}))


def crash_script(root: Path) -> str:
    path = root / "crash.py"
    path.write_text("import sys\nsys.path.insert(0, '.')\nraise RuntimeError('boom in start-up: no licence file')\n")
    return str(path)


CASES: dict[str, tuple[Callable[[Path], list[str]], str, str]] = {
    # name: (argv, language, what the error must quote: the log's tail, or the refusal)
    "no-such-exe": (lambda root: ["/nonexistent/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "python", "No such file or directory: '/nonexistent/bin/python3'"),
    # -S: a python that cannot see site-packages, so no ipykernel (as a bare system python)
    "no-ipykernel": (lambda root: [sys.executable, "-S", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                     "python", "No module named ipykernel_launcher"),
    "crashes-at-start": (lambda root: [sys.executable, crash_script(root), "{connection_file}"],
                         "python", "RuntimeError: boom in start-up: no licence file"),
    "not-python": (lambda root: ["/bin/sh", "-c", "sleep 30", "{connection_file}"], "bash",
                   "runs bash, and nbremote workers are Python kernels"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_kernel_that_cannot_start_is_a_start_error_with_its_log_tail(
        world: list[str], jupyter_path: Path, case: str, record: Callable[..., None]) -> None:
    argv, language, quoted = CASES[case]
    kernelspec(jupyter_path, case, argv(jupyter_path), language)
    t0 = time.monotonic()
    exc, to_error = failure_of(lambda: rpc.add_worker("doomed", nbremote.LocalKernel(kernel_name=case),
                                                      start_timeout=20), t0)
    assert isinstance(exc, WorkerStartError) and exc.worker == "doomed", repr(exc)
    assert "'doomed'" in str(exc) and quoted in str(exc), str(exc)
    assert "doomed" not in worker_names()
    t1 = time.monotonic()
    rpc.add_worker("doomed")  # the name is free again, and a good spec starts
    try:
        assert rpc.rpc_sync("doomed", fns.whoami) == "doomed"
        recovery = time.monotonic() - t1
    finally:
        rpc.remove_worker("doomed")
    expected = "WorkerStartError naming the language" if case == "not-python" else "WorkerStartError + log tail"
    record(f"kernel cannot start: {case}", expected, exc, to_error, recovery, "nothing")
