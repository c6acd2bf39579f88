"""Provisioned starts that fail release what they allocated; encryption follows where the kernel really runs;
a provisioned kernel's death that its provisioner's poll cannot see is caught by its heartbeat.

Real kernels, started through real kernel provisioners registered as any provisioner is: an entry point in
the ``jupyter_client.kernel_provisioners`` group (a ``.dist-info`` on ``sys.path`` for this module's
duration) and a kernelspec naming it (on ``JUPYTER_PATH``). They are jupyter_client's ``LocalProvisioner``
with one misbehaviour each: one fails after launching (its "allocation" a marker file that only its
``cleanup`` removes), one hangs after launching, one makes no CurveZMQ keys, one moves the kernel to this
machine's non-loopback address (as a provisioner moves it to a node's), one whose ``poll`` never sees the
kernel die (as a remote launcher that outlives its kernel).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import remote_fns as fns
from conftest import kill_mid_call, pid_alive, report
from jupyter_client.localinterfaces import public_ips
from jupyter_client.provisioning import LocalProvisioner

import nbremote
from nbremote import rpc
from nbremote.errors import WorkerLostError, WorkerStartError
from nbremote.rpc._core import current_agent
from nbremote.rpc._kernels import provisioned
from nbremote.rpc._kernels.paths import runtime_dir
from nbremote.rpc._transport.zmqlink import KernelLink

pytestmark = pytest.mark.timeout(120)

STATE = "NBR_TEST_PROVISIONER_STATE"  # the directory the provisioners record into (read when they run)
NODE_IP = "NBR_TEST_NODE_IP"  # where MovingProvisioner puts its kernels
NODE = next((ip for ip in public_ips() if not ip.startswith("127.")), None)


def _state() -> Path:
    return Path(os.environ[STATE])


class RecordingProvisioner(LocalProvisioner):
    """jupyter_client's local provisioner, recording every kernel pid it launches (to prove them gone)."""

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        info = await super().launch_kernel(cmd, **kwargs)
        with open(_state() / "launched", "a") as f:
            f.write(f"{self.pid}\n")
        return info


class FailingProvisioner(RecordingProvisioner):
    """Launches, "allocates" (a marker file only its cleanup removes), then raises: a scheduler refusing late."""

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        await super().launch_kernel(cmd, **kwargs)
        (_state() / f"{self.kernel_id}.alloc").write_text(str(self.pid))
        raise RuntimeError("the scheduler refused the job after allocating it")

    async def cleanup(self, restart: bool = False) -> None:
        (_state() / f"{self.kernel_id}.alloc").unlink(missing_ok=True)
        await super().cleanup(restart)


class HangingProvisioner(FailingProvisioner):
    """Launches, allocates, then waits for a scheduler that never answers."""

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        info = await RecordingProvisioner.launch_kernel(self, cmd, **kwargs)
        (_state() / f"{self.kernel_id}.alloc").write_text(str(self.pid))
        await asyncio.sleep(600)
        return info


class KeylessProvisioner(RecordingProvisioner):
    """Ignores the transport-encryption request: the kernel gets no CurveZMQ keys (an old remote launcher)."""

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        return await super().pre_launch(**{**kwargs, "transport_encryption": "disabled"})


class MovingProvisioner(RecordingProvisioner):
    """Runs the kernel on this machine's non-loopback address, whatever address the driver asked for."""

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        assert self.parent is not None, "jupyter_client gives a provisioner its kernel manager"
        self.parent.ip = os.environ[NODE_IP]
        return await super().pre_launch(**kwargs)


class MovingKeylessProvisioner(MovingProvisioner, KeylessProvisioner):
    pass


class BlindProvisioner(RecordingProvisioner):
    """Its poll never sees the kernel die (a remote launcher that outlives its kernel), only its own kill."""

    killed = False

    async def poll(self) -> int | None:
        return await super().poll() if self.killed else None

    async def kill(self, restart: bool = False) -> None:
        self.killed = True
        await super().kill(restart)


PROVISIONERS = {"failing": FailingProvisioner, "hanging": HangingProvisioner, "keyless": KeylessProvisioner,
                "moving": MovingProvisioner, "moving-keyless": MovingKeylessProvisioner,
                "blind": BlindProvisioner, "recording": RecordingProvisioner}


@pytest.fixture(scope="module")
def specs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The provisioners registered by entry point, a kernelspec ``nbr_<name>`` for each (plus
    ``nbr_recording_clear``, which does not declare CurveZMQ), and the directory they record into."""
    d = tmp_path_factory.mktemp("provisioners")
    dist = d / "site" / "nbr_test_provisioners-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nbr-test-provisioners\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[jupyter_client.kernel_provisioners]\n" + "".join(
        f"nbr-test-{name} = {__name__}:{cls.__name__}\n" for name, cls in PROVISIONERS.items()))
    kernels = d / "jupyter" / "kernels"
    for name in [*PROVISIONERS, "recording_clear"]:
        metadata: dict[str, Any] = {"kernel_provisioner": {
            "provisioner_name": f"nbr-test-{name.removesuffix('_clear')}"}}
        if not name.endswith("_clear"):
            metadata["supported_encryption"] = ["curve"]  # ipykernel >= 7.4 takes keys from its connection file
        (kernels / f"nbr_{name}").mkdir(parents=True)
        (kernels / f"nbr_{name}" / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                     "--HistoryManager.enabled=False"],
            "display_name": f"nbremote test: {name}", "language": "python", "interrupt_mode": "signal",
            "metadata": metadata}))
    (d / "state").mkdir()
    saved = {k: os.environ.get(k) for k in ("JUPYTER_PATH", STATE, NODE_IP)}
    os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (str(d / "jupyter"), saved["JUPYTER_PATH"]) if p)
    os.environ[STATE] = str(d / "state")
    if NODE:
        os.environ[NODE_IP] = NODE
    sys.path.insert(0, str(d / "site"))
    try:
        yield d / "state"
    finally:
        sys.path.remove(str(d / "site"))
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launched(state: Path) -> list[int]:
    path = state / "launched"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)], "a kernel of a failed start still runs"


def conn_files(name: str) -> list[Path]:
    return list(runtime_dir().glob(f"kernel-nbremote-{name}-{os.getpid()}-*.json"))


@pytest.fixture
def said(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh record of the clear-text addresses said (once per process otherwise)."""
    monkeypatch.setattr(provisioned, "_said_plaintext", set())


def test_a_provisioner_that_fails_after_allocating_releases_it(world: list[str], specs: Path) -> None:
    before = launched(specs)
    with pytest.raises(WorkerStartError, match=r"'leak1'.*'nbr-test-failing' provisioner.*refused the job") as err:
        rpc.add_worker("leak1", nbremote.LocalKernel(kernel_name="nbr_failing"))
    assert isinstance(err.value.__cause__, RuntimeError), "the provisioner's own error is the cause, not masked"
    pids = launched(specs)[len(before):]
    assert len(pids) == 1, "the provisioner launched a kernel"
    assert_gone(pids)
    assert not list(specs.glob("*.alloc")), "the provisioner's cleanup was not called: its allocation is left"
    assert not conn_files("leak1"), "the failed start left its connection file (the kernel's key)"
    assert "leak1" not in [w.name for w in rpc.workers()]


def test_an_interrupted_provisioned_start_releases_what_it_allocated(world: list[str], specs: Path) -> None:
    """A KeyboardInterrupt while the provisioner waits (for a scheduler, a pod): the start is cancelled, the
    kernel killed and the allocation released before the interrupt reaches the caller."""
    before = len(launched(specs))

    def interrupt_once_allocated() -> None:
        deadline = time.monotonic() + 60
        while not list(specs.glob("*.alloc")) and time.monotonic() < deadline:
            time.sleep(0.05)
        # a real SIGINT to the main thread, as Ctrl-C: interrupt_main() would not wake its blocked wait
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    threading.Thread(target=interrupt_once_allocated, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        nbremote.LocalKernel(kernel_name="nbr_hanging").start("leak2")  # the caller's thread, as a cell runs it
    pids = launched(specs)[before:]
    assert len(pids) == 1
    assert_gone(pids)
    assert not list(specs.glob("*.alloc")), "the interrupted start left the provisioner's allocation"
    assert not conn_files("leak2")


def test_encrypt_true_refuses_a_provisioner_that_makes_no_keys(world: list[str], specs: Path) -> None:
    before = len(launched(specs))
    with pytest.raises(WorkerStartError, match=r"'plain1' with encrypt=True.*'nbr-test-keyless'.*without CurveZMQ "
                                               r"keys.*the kernel was stopped.*encrypt=None or False"):
        rpc.add_worker("plain1", nbremote.LocalKernel(kernel_name="nbr_keyless", encrypt=True))
    pids = launched(specs)[before:]
    assert len(pids) == 1
    assert_gone(pids)
    assert not conn_files("plain1")
    assert "plain1" not in [w.name for w in rpc.workers()]


def test_encrypt_true_refuses_a_kernelspec_without_curve_before_launching(world: list[str], specs: Path) -> None:
    before = len(launched(specs))
    with pytest.raises(WorkerStartError, match=r"'plain2' with encrypt=True.*does not declare CurveZMQ.*"
                                               r"supported_encryption"):
        rpc.add_worker("plain2", nbremote.LocalKernel(kernel_name="nbr_recording_clear", encrypt=True))
    assert len(launched(specs)) == before, "nothing is launched for a start refused up front"


@pytest.mark.skipif(NODE is None, reason="needs a non-loopback address on this machine")
def test_the_default_encrypts_a_kernel_the_provisioner_moved_off_loopback(world: list[str], specs: Path,
                                                                          said: None,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The driver asked for 127.0.0.1; the provisioner put the kernel on the node's address: encrypted."""
    with caplog.at_level(logging.WARNING, logger="nbremote"):
        rpc.add_worker("moved", nbremote.LocalKernel(kernel_name="nbr_moving"))
    try:
        link = current_agent().peers["moved"].link
        assert isinstance(link, KernelLink) and link.conn["ip"] == NODE and link.curve, "beyond loopback, in clear"
        assert rpc.rpc_sync("moved", fns.add, args=(1, 2)) == 3
        assert "without encryption" not in caplog.text
    finally:
        rpc.remove_worker("moved")


@pytest.mark.skipif(NODE is None, reason="needs a non-loopback address on this machine")
def test_a_clear_text_kernel_beyond_loopback_is_said_once_per_address(world: list[str], specs: Path, said: None,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nbremote"):
        rpc.add_worker("bare1", nbremote.LocalKernel(kernel_name="nbr_moving-keyless"))
        rpc.add_worker("bare2", nbremote.LocalKernel(kernel_name="nbr_moving-keyless"))
    try:
        warnings = [r.getMessage() for r in caplog.records if "without encryption" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert f"'bare1' runs on {NODE} without encryption (its provisioner made no CurveZMQ keys)" in warnings[0]
        assert rpc.rpc_sync("bare2", fns.add, args=(2, 3)) == 5
    finally:
        rpc.remove_worker("bare1")
        rpc.remove_worker("bare2")


def test_a_provisioned_kernel_on_loopback_in_clear_text_is_not_said(world: list[str], specs: Path, said: None,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nbremote"):
        rpc.add_worker("local-clear", nbremote.LocalKernel(kernel_name="nbr_keyless"))
    try:
        assert "without encryption" not in caplog.text
    finally:
        rpc.remove_worker("local-clear")


def test_a_death_the_provisioners_poll_cannot_see_is_caught_by_the_heartbeat(world: list[str],
                                                                             specs: Path) -> None:
    rpc.add_worker("blind", nbremote.LocalKernel(kernel_name="nbr_blind"))
    try:
        fut, t0 = kill_mid_call("blind")
        with pytest.raises(WorkerLostError, match=r"'blind' is gone: its heartbeat stopped answering for 1\.5 s"):
            fut.wait(30)
        took = time.monotonic() - t0
        report("provisioned kernels", f"a SIGKILL its provisioner's poll cannot see: lost after {took:.2f} s")
        # 1.5 s of silence, a ping every 0.5 s: ~2 s; the polled limit it had before was 10 s
        assert took < 6, f"lost after {took:.1f} s: the polled limit, not the heartbeat's"
    finally:
        rpc.remove_worker("blind")
