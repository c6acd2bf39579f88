"""Workers started together whose kernels come up far apart (issue 38): the one that is up early holds the
driver's lease while its sibling still starts, and a start call never returns with a dead member.

Real kernels from kernelspecs in a throwaway ``JUPYTER_PATH``: a fast one (its lease shortened to ``LEASE``
seconds through the kernelspec's env, so the test need not wait out the default 10 s) and a slow one whose
argv sleeps before it execs ipykernel, far longer than that lease.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import remote_fns as fns
from conftest import pid_alive

import nbremote
from nbremote import rpc
from nbremote.errors import WorkerStartError

pytestmark = pytest.mark.timeout(90)

LEASE = 3.0  # NBREMOTE_LEASE_SECONDS of the fast kernels
SLOW = 12.0  # s the slow kernel sleeps before it starts ipykernel: four leases


@pytest.fixture
def jupyter_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return tmp_path


def kernelspec(root: Path, name: str, shell: str, env: dict[str, str] | None = None) -> None:
    """A Python kernelspec whose kernel is ``shell`` (a bash command line that ends by exec-ing ipykernel)."""
    spec_dir = root / "kernels" / name
    spec_dir.mkdir(parents=True)
    spec = {"argv": ["bash", "-c", shell], "display_name": name, "language": "python", "env": env or {}}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))


def ipykernel(pid_file: Path) -> str:
    """Write the shell's pid (the kernel's, after ``exec``) to ``pid_file``, then become the kernel."""
    return (f"echo $$ > {shlex.quote(str(pid_file))}; "
            f"exec {shlex.quote(sys.executable)} -m ipykernel_launcher -f {{connection_file}}")


def read_pid(pid_file: Path, deadline: float) -> int:
    while time.monotonic() < deadline:
        text = pid_file.read_text().strip() if pid_file.exists() else ""
        if text:
            return int(text)
        time.sleep(0.05)
    raise AssertionError(f"{pid_file} was never written")


@pytest.fixture
def specs(jupyter_path: Path) -> Iterator[Path]:
    """``fast`` (lease LEASE) and ``slow`` (sleeps SLOW s first); each kernel writes its pid to <name>.pid."""
    kernelspec(jupyter_path, "fast", ipykernel(jupyter_path / "fast.pid"), {"NBREMOTE_LEASE_SECONDS": str(LEASE)})
    kernelspec(jupyter_path, "slow", f"sleep {SLOW:g}; " + ipykernel(jupyter_path / "slow.pid"))
    yield jupyter_path
    names = [w.name for w in rpc.workers()] if rpc.is_initialized() else []
    for name in ("early", "late", "doomed", "sibling"):
        if name in names:
            rpc.remove_worker(name)


def log_of(name: str) -> str:
    (status,) = [s for s in rpc.worker_status() if s.name == name]
    assert status.log_path is not None
    return Path(status.log_path).read_text(errors="replace")


def test_an_early_worker_keeps_its_lease_while_a_slow_sibling_starts(world: list[str], specs: Path) -> None:
    t0 = time.monotonic()
    infos = rpc.add_workers({"early": nbremote.LocalKernel(kernel_name="fast"),
                             "late": nbremote.LocalKernel(kernel_name="slow")})
    took = time.monotonic() - t0
    assert [w.name for w in infos] == ["early", "late"]
    assert took > SLOW  # the slow one really held the call up for several of the early one's leases
    assert rpc.rpc_sync("early", fns.whoami) == "early"
    assert rpc.rpc_sync("late", fns.whoami) == "late"
    log = log_of("early")
    # With its lease not renewed the early worker released the driver's link ("was not heard from"), or,
    # started for the driver alone (a provisioned kernel), exited ("... which started this kernel, is gone").
    assert "was not heard from" not in log and "is gone" not in log, log
    assert {s.name: s.state for s in rpc.worker_status()}["early"] == "idle"


def test_a_member_that_dies_while_its_sibling_starts_fails_the_start(world: list[str], specs: Path) -> None:
    outcome: list[BaseException | list[nbremote.WorkerInfo]] = []

    def start() -> None:
        try:
            outcome.append(rpc.add_workers({"doomed": nbremote.LocalKernel(kernel_name="fast"),
                                            "sibling": nbremote.LocalKernel(kernel_name="slow")}))
        except BaseException as exc:
            outcome.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    deadline = time.monotonic() + SLOW
    fast_pid = read_pid(specs / "fast.pid", deadline)
    # Up (handshaken and in the world, under the driver's lease) while its sibling still sleeps: kill it then.
    while "doomed" not in [w.name for w in rpc.workers()] and time.monotonic() < deadline and starter.is_alive():
        time.sleep(0.05)
    assert not (specs / "slow.pid").exists(), "the slow kernel started before the fast one was up: no race to test"
    os.kill(fast_pid, signal.SIGKILL)
    starter.join(60)
    assert not starter.is_alive()
    (result,) = outcome
    assert isinstance(result, WorkerStartError), repr(result)
    assert result.worker == "doomed" and "'doomed'" in str(result), str(result)
    assert "started, then died" in str(result), str(result)  # up and then lost, not a start that failed
    names = [w.name for w in rpc.workers()]
    assert "doomed" not in names and "sibling" not in names  # the sibling that did start was stopped
    slow_pid = read_pid(specs / "slow.pid", time.monotonic() + 1)
    deadline = time.monotonic() + 10
    while pid_alive(slow_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(slow_pid)
    assert rpc.rpc_sync("worker1", fns.whoami) == "worker1"  # the world goes on
