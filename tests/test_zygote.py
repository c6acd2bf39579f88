"""Local workers are forked from a warm interpreter (``nbremote.rpc._kernels.zygote``), a jupyter_client provisioner.

The forked kernel is an ordinary ipykernel: it serves RPCs and cells, is interrupted by a signal, and
dies with its zygote, which dies with the driver. Frameworks the driver imported are already imported
in it. A kernel with a custom environment, or of another kernelspec, starts the usual way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import remote_fns as fns
from conftest import pid_alive

import nbremote
from nbremote import rpc
from nbremote.rpc._core import current_agent
from nbremote.rpc._kernels import zygote

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(not zygote.usable(), reason="the zygote needs Linux and nbremote installed "
                                                              "(its provisioner entry point); kernels start the "
                                                              "usual way elsewhere")]


def parent_pid() -> int:
    return os.getppid()


def loaded(module: str) -> bool:
    return module in sys.modules


def env_var(name: str) -> str | None:
    return os.environ.get(name)


def sigpipe_ignored() -> bool:
    import signal

    return signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN


def test_forked_workers_ignore_sigpipe_as_any_python_does(world: list[str]) -> None:
    """Else a write to a socket its peer closed kills the worker silently (seen with a server's websocket)."""
    assert rpc.rpc_sync("worker1", sigpipe_ignored)


def test_default_workers_are_forked_from_the_zygote(world: list[str]) -> None:
    # the world's workers come from this driver's zygote, or from the one it replaced when the driver
    # imported another framework since (retired, it lives on while they do)
    zygotes = {z.proc.pid for z in (zygote._the_zygote(), *zygote._retired) if z.alive}
    for w in world:
        assert rpc.rpc_sync(w, parent_pid) in zygotes
    kernel = current_agent().world.kernel("worker1")  # type: ignore[attr-defined]
    assert type(kernel.km.provisioner).__name__ == "ZygoteProvisioner"


def test_frameworks_the_driver_imported_are_preloaded(world: list[str]) -> None:
    import torch  # noqa: F401 -- the point: the driver has torch

    rpc.add_worker("preloaded")
    try:
        assert rpc.rpc_sync("preloaded", loaded, args=("torch",)), "torch should come with the fork"
    finally:
        rpc.remove_worker("preloaded")


def test_a_custom_environment_starts_the_usual_way(world: list[str]) -> None:
    rpc.add_worker("plain", nbremote.LocalKernel(env={**os.environ, "NBREMOTE_TEST_MARK": "42"}))
    try:
        assert rpc.rpc_sync("plain", parent_pid) == os.getpid()
        assert rpc.rpc_sync("plain", env_var, args=("NBREMOTE_TEST_MARK",)) == "42"
    finally:
        rpc.remove_worker("plain")


def test_a_forked_kernel_takes_signals_and_logs_to_its_file(world: list[str]) -> None:
    rpc.add_worker("forked")
    try:
        pid = rpc.rpc_sync("forked", fns.pid)
        rpc.rpc_sync("forked", os.write, args=(2, b"written by the forked kernel\n"))
        log = current_agent().peers["forked"].log_path
        time.sleep(0.2)
        assert log is not None and "written by the forked kernel" in Path(log).read_text()
        rpc.run_cell("forked", "import time\nstarted = time.monotonic()", background=False)
        run = rpc.run_cell("forked", "time.sleep(30)", background=True)
        time.sleep(0.5)
        rpc.interrupt_worker("forked")
        with pytest.raises(nbremote.errors.RemoteCellError, match="KeyboardInterrupt"):
            run.wait()
        assert pid_alive(pid) and rpc.rpc_sync("forked", fns.whoami) == "forked"
    finally:
        rpc.remove_worker("forked")
    assert not pid_alive(pid)


def test_kernels_die_with_the_zygote_and_the_zygote_with_the_driver() -> None:
    code = textwrap.dedent("""
        import os, time
        from nbremote import rpc
        from nbremote.rpc._kernels import zygote
        rpc.init_rpc("driver", workers=["w1", "w2"])
        print(zygote._the_zygote().proc.pid, *[rpc.rpc_sync(w, os.getpid) for w in ("w1", "w2")], flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        zygote, *kernels = (int(p) for p in proc.stdout.readline().split())
        assert all(pid_alive(p) for p in (zygote, *kernels))
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(pid_alive(p) for p in (zygote, *kernels)):
            time.sleep(0.1)
        assert [p for p in (zygote, *kernels) if pid_alive(p)] == [], "the zygote or a kernel outlived the driver"
    finally:
        proc.kill()


def test_a_framework_imported_later_gets_a_new_zygote_and_the_old_kernels_live_on() -> None:
    # The old zygote cannot simply be closed: its kernels follow its death. It is retired instead, and
    # goes when the last of its kernels has gone.
    code = textwrap.dedent("""
        import os, sys, time
        assert "tensorplay" not in sys.modules
        from nbremote import rpc
        from nbremote.rpc._kernels import zygote
        rpc.init_rpc("driver", workers=["w1"])
        old = zygote._the_zygote()
        w1 = rpc.rpc_sync("w1", os.getpid)
        import tensorplay  # the driver now has a framework the zygote did not preload
        rpc.add_worker("w2")
        new = zygote._the_zygote()
        assert new is not old and "tensorplay" in new.frameworks
        time.sleep(2.5)  # a kernel notices its parent's death within a second
        assert rpc.rpc_sync("w1", os.getpid) == w1, "w1 must still be the same kernel"
        assert rpc.rpc_sync("w2", os.getppid) == new.proc.pid
        assert old.alive, "the old zygote must stay while w1 runs"
        rpc.remove_worker("w1")
        old.proc.wait(5)
        assert rpc.rpc_sync("w2", os.getppid) == new.proc.pid
        rpc.shutdown()
        print("ok", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
