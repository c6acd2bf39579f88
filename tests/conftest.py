"""Shared fixtures: one world of real worker kernels for the whole session.

Starting kernels costs ~0.3 s each, so tests share ``world`` (driver + worker1..worker3). Tests that
break a worker on purpose add their own with ``rpc.add_worker`` and remove it afterwards; tests that
need a fresh driver process (shutdown, SIGKILL of the driver) run a script in a subprocess.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbremote import rpc

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ["worker1", "worker2", "worker3"]
ARTIFACTS = ROOT / "tests" / "artifacts"  # generated reports (git-ignored)
_REPORT: dict[str, list[str]] = {}


def report(section: str, line: str) -> None:
    """Add a line to the terminal summary under ``section`` (figures a test measured, files it wrote)."""
    _REPORT.setdefault(section, []).append(line)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    for section, lines in _REPORT.items():
        terminalreporter.section(section)
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def world() -> Iterator[list[str]]:
    rpc.init_rpc("driver", workers=WORKERS)
    try:
        yield WORKERS
    finally:
        if rpc.is_initialized():
            rpc.shutdown()


def own_worker(name: str) -> Iterator[str]:
    """The body of a fixture giving a test a local worker of its own (killed, restarted or broken by it), removed
    afterwards unless the test removed it: ``yield from own_worker("spare")``."""
    rpc.add_worker(name)
    yield name
    if name in [w.name for w in rpc.workers()]:
        rpc.remove_worker(name)


def run_script(code: str, timeout: float = 60, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a fresh driver process (``__main__``) and return what it printed."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT), env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          **kwargs)  # type: ignore[call-overload]


def free_port() -> int:
    """A TCP port free on loopback now (the system's pick): for servers and rendezvous a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def kill_mid_call(name: str) -> tuple[Any, float]:
    """SIGKILL worker ``name``'s kernel while it serves a 60 s call: (that call's future, when it was killed)."""
    import remote_fns

    pid = rpc.rpc_sync(name, remote_fns.pid)
    fut = rpc.rpc_async(name, remote_fns.sleep, args=(60,))
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    return fut, time.monotonic()
