"""Timeouts, dead workers, interrupts, membership changes, attached kernels, and start errors."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import remote_fns as fns
import zmq
from conftest import own_worker
from jupyter_client.manager import KernelManager

import nbremote
from nbremote import rpc
from nbremote.errors import NbRemoteError, RPCTimeoutError, UnknownWorkerError, WorkerLostError, WorkerStartError
from nbremote.rpc._core import current_agent

pytestmark = pytest.mark.timeout(60)


def test_default_and_per_call_timeouts(world: list[str]) -> None:
    assert rpc.get_rpc_timeout() == 60.0
    with pytest.raises(RPCTimeoutError, match="RPC ran for more than 200 ms") as info:
        rpc.rpc_sync("worker1", fns.sleep, args=(1.0,), timeout=0.2)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, NbRemoteError)
    assert "fns.sleep" in str(info.value) or "sleep" in str(info.value)
    fut = rpc.rpc_async("worker1", fns.sleep, args=(1.0,), timeout=0.2)
    with pytest.raises(TimeoutError):
        fut.wait()
    assert rpc.rpc_sync("worker1", fns.sleep, args=(0.5,), timeout=0) == 0.5  # 0 = no timeout
    assert rpc.rpc_sync("worker1", fns.add, args=(1, 2)) == 3  # the worker is fine afterwards


def test_a_blocking_call_that_runs_out_of_time_wakes_its_waiting_thread_at_once(
        world: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """rpc_sync's thread waits on its own socket for the reply; the IO thread that fails the call when its time
    runs out wakes it there. Its wait's slices, made seconds long, would show a wake-up it missed."""
    from nbremote.rpc._core import future

    monkeypatch.setattr(future, "PUMP_SLICE", 5.0)
    started = time.monotonic()
    with pytest.raises(RPCTimeoutError):
        rpc.rpc_sync("worker1", fns.sleep, args=(3.0,), timeout=0.3)
    took = time.monotonic() - started
    assert took < 2.0, f"the timed-out call returned after {took:.1f} s: its waiting thread was not woken"


def test_interrupt_cancels_the_remote_call(world: list[str], tmp_path: Path) -> None:
    flag = tmp_path / "finished"
    timer = threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGINT))  # what the stop button does
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        rpc.rpc_sync("worker2", fns.busy_loop, args=(5.0, str(flag)))
    assert time.monotonic() - t0 < 3
    assert rpc.rpc_sync("worker2", fns.add, args=(2, 2)) == 4  # the worker is usable
    time.sleep(5.5)
    assert not flag.exists(), "the remote loop kept running after the interrupt"


def test_a_call_stuck_in_c_is_abandoned_at_once_and_restart_is_offered(world: list[str]) -> None:
    rpc.add_worker("stuck")
    try:
        timer = threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt) as info:
            rpc.rpc_sync("stuck", time.sleep, args=(60,))  # blocked in C: no bytecode to interrupt it at
        assert time.monotonic() - t0 < 3, "the caller must get its error at once"
        assert "rpc.restart_worker('stuck') stops it" in "\n".join(info.value.__notes__)
        stuck_pid = rpc.rpc_sync("stuck", fns.pid)  # still served meanwhile, by another thread
        rpc.restart_worker("stuck")
        assert rpc.rpc_sync("stuck", fns.pid) != stuck_pid and rpc.rpc_sync("stuck", fns.add, args=(1, 1)) == 2
    finally:
        rpc.remove_worker("stuck")


@pytest.fixture
def victim() -> Iterator[str]:
    """A worker that is killed by the test, removed afterwards."""
    yield from own_worker("victim")


def test_kill_9_mid_call_fails_pending_calls_fast(world: list[str], victim: str) -> None:
    pid = rpc.rpc_sync(victim, fns.pid)
    pending = [rpc.rpc_async(victim, fns.sleep, args=(30,)) for _ in range(3)]
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    for fut in pending:
        with pytest.raises(WorkerLostError, match="victim") as info:
            fut.wait(10)
        assert info.value.worker == victim
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(WorkerLostError, match="remove_worker"):
        rpc.rpc_sync(victim, fns.pid)
    assert [rpc.rpc_sync(w, fns.whoami) for w in world] == world  # the rest keep working
    assert rpc.rpc_sync("worker1", fns.call_peer, args=("worker2", fns.whoami)) == "worker2"


class LostWhilePickled:
    """An argument that, as it is pickled -- between the call's lookup of its worker's link and its joining the
    pending calls -- has the driver see that worker die, as its IO thread does (the loss marked, the calls then
    pending on it failed), and restores itself on the worker as a plain int."""

    def __init__(self, worker: str) -> None:
        self.worker = worker

    def __reduce__(self) -> tuple[type, tuple[int]]:
        agent = current_agent()
        link = agent.peers[self.worker].link
        if link is not None:
            agent._on_lost(link, "killed by the test while a call to it was being pickled")
        return int, (0,)


def test_a_worker_lost_while_a_call_to_it_is_pickled_fails_that_call_at_once(world: list[str], victim: str) -> None:
    """The sweep of the calls pending on a lost worker ran before this one was added; its link is dropped by the IO
    thread later, if at all. The call must still fail typed at once, not wait for its timeout (nor, here, where
    the kernel is in fact alive, succeed on a worker the driver counts as gone)."""
    rpc.rpc_sync(victim, fns.add, args=(1, 1))  # the link is open
    started = time.monotonic()
    with pytest.raises(WorkerLostError, match="left the world while") as info:
        rpc.rpc_sync(victim, fns.add, args=(LostWhilePickled(victim), 1), timeout=10)
    assert info.value.worker == victim and time.monotonic() - started < 5


def test_add_workers_starts_several_in_parallel(world: list[str]) -> None:
    infos = rpc.add_workers(["many1", "many2"])
    try:
        assert [i.name for i in infos] == ["many1", "many2"] and infos[1].id == infos[0].id + 1
        assert [rpc.rpc_sync(n, fns.whoami) for n in ("many1", "many2")] == ["many1", "many2"]
        with pytest.raises(ValueError, match="already in the world"):
            rpc.add_workers(["many1"])
    finally:
        for name in ("many1", "many2"):
            rpc.remove_worker(name)


def test_add_and_remove_worker(world: list[str]) -> None:
    info = rpc.add_worker("extra")
    assert info.name == "extra" and info.id > 3
    assert rpc.rpc_sync("extra", fns.whoami) == "extra"
    assert rpc.rpc_sync("worker1", fns.call_peer, args=("extra", fns.whoami)) == "extra"  # peers learn of it
    pid = rpc.rpc_sync("extra", fns.pid)
    pending = rpc.rpc_async("extra", fns.sleep, args=(30,))
    rpc.remove_worker("extra")
    with pytest.raises(WorkerLostError, match="removed"):
        pending.wait(5)
    with pytest.raises(UnknownWorkerError, match="known: driver, worker1"):
        rpc.rpc_sync("extra", fns.pid)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid), "remove_worker left the kernel process running"
    with pytest.raises(UnknownWorkerError, match="no worker 'extra' to remove"):
        rpc.remove_worker("extra")


def _alive(pid: int) -> bool:
    from conftest import pid_alive

    return pid_alive(pid)


@pytest.mark.parametrize("bad", ["", "has space", "a/b", "x" * 128, "dötted"])
def test_invalid_worker_names(world: list[str], bad: str) -> None:
    with pytest.raises(ValueError, match="invalid worker name"):
        rpc.add_worker(bad)


def test_duplicate_worker_name(world: list[str]) -> None:
    with pytest.raises(ValueError, match="already in the world"):
        rpc.add_worker("worker1")


def test_unknown_kernelspec_is_a_start_error(world: list[str]) -> None:
    with pytest.raises(WorkerStartError, match=r"no kernelspec 'no-such-kernel'.*jupyter kernelspec list"):
        rpc.add_worker("ghost", nbremote.LocalKernel(kernel_name="no-such-kernel"))
    assert "ghost" not in [w.name for w in rpc.workers()]


def test_installed_kernelspec_by_name(world: list[str], tmp_path: Path) -> None:
    spec_dir = tmp_path / "kernels" / "nbremote-test-py"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(
        f'{{"argv": ["{sys.executable}", "-m", "ipykernel_launcher", "-f", "{{connection_file}}"], '
        '"display_name": "test", "language": "python"}')
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(tmp_path)
    try:
        rpc.add_worker("specced", nbremote.LocalKernel(kernel_name="nbremote-test-py"))
        assert rpc.rpc_sync("specced", fns.whoami) == "specced"
    finally:
        if old is None:
            os.environ.pop("JUPYTER_PATH")
        else:
            os.environ["JUPYTER_PATH"] = old
        if "specced" in [w.name for w in rpc.workers()]:
            rpc.remove_worker("specced")


def test_worker_output_outside_calls_goes_to_its_log(world: list[str]) -> None:
    log_dir = Path(os.environ.get("NBREMOTE_LOG_DIR") or f"/tmp/nbremote-{os.getuid()}")
    logs = list(log_dir.glob(f"worker1-{os.getpid()}.log"))
    assert logs, f"no log file for worker1 in {log_dir}"
    rpc.rpc_sync("worker1", os.write, args=(2, b"written to fd 2 by a test\n"))
    time.sleep(0.2)
    assert "written to fd 2 by a test" in logs[0].read_text()


@pytest.fixture(scope="module")
def running_kernel() -> KernelManager:
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(30)
    yield km
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def test_attached_kernel_serves_calls_while_its_cell_runs(world: list[str], running_kernel: KernelManager) -> None:
    rpc.add_worker("attached", nbremote.AttachedKernel(running_kernel.connection_file))
    try:
        assert rpc.rpc_sync("attached", fns.whoami) == "attached"
        kc = running_kernel.client()
        kc.start_channels()
        try:
            kc.execute("import time; time.sleep(3)")  # the kernel's main shell is now busy
            time.sleep(0.3)
            t0 = time.monotonic()
            assert rpc.rpc_sync("attached", fns.add, args=(20, 22)) == 42
            assert time.monotonic() - t0 < 1.5, "the RPC waited behind the running cell"
        finally:
            kc.stop_channels()
        assert rpc.rpc_sync("worker2", fns.call_peer, args=("attached", fns.whoami)) == "attached"
        assert rpc.rpc_sync("attached", fns.call_peer, args=("driver", fns.pid)) == os.getpid()
    finally:
        rpc.remove_worker("attached")
    assert running_kernel.is_alive(), "remove_worker must not stop a kernel nbremote did not start"


def test_a_kernel_is_one_worker_until_it_is_removed(world: list[str], running_kernel: KernelManager) -> None:
    """Attaching a member's kernel again under another name is refused, and the member keeps working; once
    removed, the same kernel joins under the new name."""
    rpc.add_worker("first", nbremote.AttachedKernel(running_kernel.connection_file))
    try:
        with pytest.raises(WorkerStartError, match=r"'second'.* already worker 'first' of this world.*remove_worker"):
            rpc.add_worker("second", nbremote.AttachedKernel(running_kernel.connection_file))
        assert "second" not in current_agent().peers
        assert rpc.rpc_sync("first", fns.whoami) == "first"
        assert rpc.rpc_sync("worker2", fns.call_peer, args=("first", fns.whoami)) == "first"
    finally:
        rpc.remove_worker("first")
    rpc.add_worker("second", nbremote.AttachedKernel(running_kernel.connection_file))
    try:
        assert rpc.rpc_sync("second", fns.whoami) == "second"
    finally:
        rpc.remove_worker("second")


def test_attach_with_a_bad_connection_file(world: list[str], tmp_path: Path) -> None:
    with pytest.raises(WorkerStartError, match=r"connection file .* is unreadable"):
        rpc.add_worker("nofile", nbremote.AttachedKernel(tmp_path / "missing.json"))
    cut = tmp_path / "cut.json"
    cut.write_text('{"shell_port": 1')  # stays cut short: an error once the re-reads are over
    t0 = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"connection file .* is unreadable"):
        rpc.add_worker("cutfile", nbremote.AttachedKernel(cut))
    assert 1.5 < time.monotonic() - t0 < 10


def test_attach_reads_again_a_connection_file_being_written(world: list[str], tmp_path: Path) -> None:
    """ipykernel writes its connection file again once its sockets are bound (truncate, then write): a
    worker attached just then reads it empty, and must read it again rather than fail."""
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    try:
        conn = tmp_path / "rewritten.json"
        conn.write_text("")
        threading.Timer(0.3, lambda: conn.write_text(Path(km.connection_file).read_text())).start()
        rpc.add_worker("rewritten", nbremote.AttachedKernel(conn))
        try:
            assert rpc.rpc_sync("rewritten", fns.whoami) == "rewritten"
        finally:
            rpc.remove_worker("rewritten")
    finally:
        km.shutdown_kernel(now=True)


def test_non_loopback_links_are_encrypted_or_sign_their_buffers(world: list[str]) -> None:
    """A kernel bound beyond loopback: its channels are encrypted (CurveZMQ, whose per-frame authenticator
    covers the buffers), or, without CurveZMQ, every envelope carries keyed digests of its frames."""
    import numpy as np

    rpc.add_worker("wide", nbremote.LocalKernel(ip="0.0.0.0"))
    try:
        agent = current_agent()
        link = agent.peers["wide"].link
        assert link is not None and link.digests != zmq.has("curve")
        if zmq.has("curve"):  # beyond loopback the channels are encrypted (CurveZMQ)
            assert link.conn.get("curve_publickey") and link.conn.get("curve_secretkey")
            plain = zmq.Context.instance().socket(zmq.REQ)  # a client without the keys gets nothing
            plain.linger = 0
            plain.rcvtimeo = 1000
            plain.connect(f"tcp://127.0.0.1:{link.conn['hb_port']}")
            plain.send(b"ping")
            with pytest.raises(zmq.Again):
                plain.recv()
            plain.close()
        arr = np.arange(1 << 18, dtype=np.float64)
        assert rpc.rpc_sync("wide", fns.echo, args=(arr,)).tobytes() == arr.tobytes()
        assert rpc.rpc_sync("worker1", fns.call_peer, args=("wide", fns.whoami)) == "wide"
        # the other way round: the worker calls the driver with an array, over the signed comm
        assert rpc.rpc_sync("wide", fns.call_peer, args=("driver", fns.echo, arr)).tobytes() == arr.tobytes()
    finally:
        rpc.remove_worker("wide")


def test_encryption_beyond_loopback_can_be_turned_off_and_stays_signed(world: list[str]) -> None:
    import numpy as np

    rpc.add_worker("clear", nbremote.LocalKernel(ip="0.0.0.0", encrypt=False))
    try:
        link = current_agent().peers["clear"].link
        assert link is not None and link.digests, "beyond loopback the buffers stay digested"
        assert not link.conn.get("curve_publickey"), "encrypt=False: no CurveZMQ keys"
        arr = np.arange(1 << 18, dtype=np.float64)
        assert rpc.rpc_sync("clear", fns.echo, args=(arr,)).tobytes() == arr.tobytes()
    finally:
        rpc.remove_worker("clear")
    with pytest.raises(TypeError, match=r"encrypt=.*None \(automatic\), True or False"):
        nbremote.LocalKernel(encrypt="yes")  # type: ignore[arg-type]


def _kernelspec(root: Path, name: str, script: str) -> None:
    spec_dir = root / "kernels" / name
    spec_dir.mkdir(parents=True)
    (spec_dir / "run.py").write_text(script)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, str(spec_dir / "run.py"), "{connection_file}"],
        "display_name": name, "language": "python"}))


@pytest.fixture
def jupyter_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return tmp_path


def test_a_kernel_that_dies_at_start_is_a_start_error_with_its_log(world: list[str], jupyter_path: Path) -> None:
    _kernelspec(jupyter_path, "dies-at-start", "import sys\nprint('boom: missing CUDA driver', file=sys.stderr)\n"
                                                "sys.exit(3)\n")
    with pytest.raises(WorkerStartError, match=r"(?s)'doomed' died during .*worker log: .*doomed-") as info:
        rpc.add_worker("doomed", nbremote.LocalKernel(kernel_name="dies-at-start"))
    assert "its log ends with:\nboom: missing CUDA driver\n" in str(info.value)  # the why, in the error itself
    log = str(info.value).rsplit("worker log: ", 1)[1].rstrip(")")
    assert "boom: missing CUDA driver" in Path(log).read_text()
    assert "doomed" not in [w.name for w in rpc.workers()]


def test_a_port_clash_at_start_is_retried_on_new_ports(world: list[str], jupyter_path: Path) -> None:
    marker = jupyter_path / "first-start-done"
    _kernelspec(jupyter_path, "port-clash-once", textwrap.dedent(f"""
        import os, sys
        marker = {str(marker)!r}
        if not os.path.exists(marker):  # the first start loses its port to someone else
            open(marker, "w").close()
            print("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5555')", file=sys.stderr)
            sys.exit(1)
        from ipykernel import kernelapp
        kernelapp.launch_new_instance(["-f", sys.argv[1]])
    """))
    rpc.add_worker("retried", nbremote.LocalKernel(kernel_name="port-clash-once"))
    try:
        assert marker.exists()
        assert rpc.rpc_sync("retried", fns.whoami) == "retried"
    finally:
        rpc.remove_worker("retried")
