"""While messages flow, each process of a world asks the OS for idle CPUs that wake at once (a PM QoS
request on ``/dev/cpu_dma_latency``), and once idle it asks for nothing (``_transport.cpuwake``).

The request is the kernel's: reading the device gives the strictest request in force, and a process
holds one through an open file of it, which ``/proc/<pid>/fd`` shows. Tests that read it need Linux and
root (CI runs as root); the watcher's own logic is also tested on a plain file, which needs neither.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import nbremote
from nbremote import rpc
from nbremote.rpc._transport import cpuwake

pytestmark = pytest.mark.timeout(60)

needs_device = pytest.mark.skipif(
    not os.access(cpuwake.DEVICE, os.R_OK | os.W_OK),
    reason=f"needs {cpuwake.DEVICE} (Linux) and the right to write it (root); runs in CI, which is root",
)


def strictest() -> int:
    """The wake-up latency (us) that the requests in force allow: 0 while some process holds ours."""
    with open(cpuwake.DEVICE, "rb") as device:  # opening it to read adds no request
        return int(struct.unpack("=i", device.read(4))[0])


def requests_held(pid: int) -> int:
    """How many files of the device ``pid`` has open: each is one request."""
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            held += os.readlink(fd) == cpuwake.DEVICE
    return held


def eventually(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@needs_device
def test_driver_and_worker_hold_the_request_while_calls_flow_and_drop_it_when_idle(world: list[str]) -> None:
    worker_pid = rpc.rpc_sync("worker1", os.getpid)
    seen = False
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:  # a slow machine may idle past IDLE_S between looks
        rpc.rpc_sync("worker1", os.getpid)
        seen = requests_held(os.getpid()) == 1 and requests_held(worker_pid) == 1 and strictest() == 0
    assert seen, "after a call, the driver and the worker should each hold one request, and it should be in force"
    # idle: both withdraw theirs (IDLE_S after their last message); nothing else of this machine holds one
    assert eventually(lambda: requests_held(os.getpid()) == 0 and requests_held(worker_pid) == 0)
    assert eventually(lambda: strictest() > 0), "the request should no longer be in force once the world is idle"


@needs_device
def test_a_worker_with_the_request_turned_off_never_makes_it(world: list[str]) -> None:
    rpc.add_worker("noqos", nbremote.LocalKernel(env={**os.environ, "NBREMOTE_CPU_QOS": "0"}))
    try:
        pid = rpc.rpc_sync("noqos", os.getpid)
        for _ in range(50):
            rpc.rpc_sync("noqos", os.getpid)
            assert requests_held(pid) == 0
        assert rpc.rpc_sync("noqos", lambda: cpuwake.CPU_WAKE.possible) is False
    finally:
        rpc.remove_worker("noqos")


def test_the_request_is_kept_while_touched_and_released_after_idle(tmp_path: Path) -> None:
    device = tmp_path / "device"  # a plain file takes the 4 bytes as the device would
    device.touch()
    wake = cpuwake.CpuWake(str(device), idle_s=0.05, enabled=True)
    wake.touch()
    assert wake.held and device.read_bytes() == struct.pack("=i", 0)
    until = time.monotonic() + 0.3
    while time.monotonic() < until:  # touched every 10 ms: never idle for 50
        wake.touch()
        assert wake.held
        time.sleep(0.01)
    assert eventually(lambda: not wake.held, 2.0)
    wake.touch()  # and made again by the next message
    assert wake.held
    wake.release()
    assert not wake.held


def test_a_refused_or_missing_device_is_never_retried_and_never_raises(tmp_path: Path) -> None:
    missing = tmp_path / "cpu_dma_latency"
    wake = cpuwake.CpuWake(str(missing), enabled=True)
    wake.touch()
    assert not wake.held and not wake.possible
    missing.touch()  # present now, but this process does not ask again
    wake.touch()
    assert not wake.held and missing.read_bytes() == b""


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for value, on in (("0", False), ("off", False), ("no", False), ("1", True), ("", True)):
        monkeypatch.setenv("NBREMOTE_CPU_QOS", value)
        assert cpuwake.enabled_by_env() is on, value
    device = tmp_path / "device"
    device.touch()
    monkeypatch.setenv("NBREMOTE_CPU_QOS", "0")
    wake = cpuwake.CpuWake(str(device))
    wake.touch()
    assert not wake.held and device.read_bytes() == b""


@needs_device
def test_a_forked_child_does_not_keep_its_parents_request() -> None:
    wake = cpuwake.CpuWake(enabled=True)
    wake.touch()
    assert wake.held and strictest() == 0
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then stay alive while the parent looks
        try:
            os.close(read_end)
            os.write(write_end, b"held" if wake.held or requests_held(os.getpid()) else b"free")
            time.sleep(2)
        finally:
            os._exit(0)
    try:
        os.close(write_end)
        assert os.read(read_end, 4) == b"free"
        wake.release()
        # with the child alive: had it kept a copy of the parent's file, the request would stay in force
        assert eventually(lambda: strictest() > 0, 1.5)
    finally:
        os.close(read_end)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
