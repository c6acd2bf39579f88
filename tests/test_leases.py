"""Kernels nbremote did not start: a lease frees a dead driver's state, restarts behind our back are
detected, and the nbremote comm admits only members of the world."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import remote_fns as fns
from conftest import ROOT
from jupyter_client import KernelManager

import nbremote
from nbremote import rpc
from nbremote.errors import WorkerLostError, WorkerStartError
from nbremote.rpc._core import current_agent
from nbremote.rpc._transport.zmqlink import KernelLink

pytestmark = pytest.mark.timeout(90)

LEASE = 2.0  # seconds, for the kernels these tests attach (NBREMOTE_LEASE_SECONDS)


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[KernelManager]:
    """A kernel someone else started (not nbremote), with a short lease."""
    km = KernelManager(kernel_name="python3")
    env = {**os.environ, "NBREMOTE_LEASE_SECONDS": str(LEASE), "PYTHONPATH": os.pathsep.join(sys.path)}
    km.start_kernel(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield km
    finally:
        km.shutdown_kernel(now=True)


def held_here() -> tuple[int, int]:
    agent = current_agent()
    return len(agent.table), len(agent.grad)


def test_a_dead_drivers_values_and_contexts_are_freed_by_its_lease(world: list[str], kernel: KernelManager) -> None:
    code = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, "tests")
        import torch
        import remote_fns as fns
        import nbremote, nbremote.autograd as dist_autograd
        from nbremote import rpc
        from nbremote.rpc._core import current_agent
        rpc.init_rpc("other-driver", workers={{"att": nbremote.AttachedKernel({kernel.connection_file!r})}})
        kept = [rpc.remote("att", fns.make_list, args=(1000,)) for _ in range(20)]
        ctx = dist_autograd.context(); ctx.__enter__()
        rpc.rpc_sync("att", torch.mul, args=(torch.ones(2, requires_grad=True), 2.0))
        print(*rpc.rpc_sync("att", lambda: (len(current_agent().table), len(current_agent().grad))),
              flush=True)
        os.kill(os.getpid(), 9)  # no goodbye
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    table, contexts = map(int, proc.stdout.split())
    assert table >= 20 and contexts == 1
    rpc.add_worker("att", nbremote.AttachedKernel(kernel.connection_file))  # a new driver attaches
    try:
        deadline = time.monotonic() + LEASE + 5
        while rpc.rpc_sync("att", held_here) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rpc.rpc_sync("att", held_here) == (0, 0), "the dead driver's state outlived its lease"
        assert rpc.rpc_sync("att", fns.whoami) == "att"
    finally:
        rpc.remove_worker("att")


def test_a_live_driver_keeps_its_lease(world: list[str], kernel: KernelManager) -> None:
    rpc.add_worker("att", nbremote.AttachedKernel(kernel.connection_file))
    try:
        kept = rpc.remote("att", fns.make_list, args=(3,))
        time.sleep(LEASE * 2.5)  # idle, but the IO thread renews the lease
        assert kept.to_here() == [0, 1, 2]
    finally:
        rpc.remove_worker("att")


def test_a_kernel_restarted_behind_our_back_is_reported_lost(world: list[str], kernel: KernelManager) -> None:
    rpc.add_worker("att", nbremote.AttachedKernel(kernel.connection_file))
    try:
        value = rpc.remote("att", fns.make_list, args=(3,))
        assert value.to_here() == [0, 1, 2]
        pending = rpc.rpc_async("att", fns.sleep, args=(30,))
        kernel.restart_kernel(now=True)
        t0 = time.monotonic()
        # whichever notices first: the session check (a new process answers) or the heartbeat (mid-restart)
        with pytest.raises(WorkerLostError, match="restarted"):
            pending.wait(15)
        assert time.monotonic() - t0 < 5, "a restart must be seen within the session check, not by a timeout"
        with pytest.raises(WorkerLostError, match="restarted"):
            value.to_here()
    finally:
        rpc.remove_worker("att")
    rpc.add_worker("att", nbremote.AttachedKernel(kernel.connection_file))  # the restarted kernel attaches anew
    try:
        assert rpc.rpc_sync("att", fns.whoami) == "att"
    finally:
        rpc.remove_worker("att")


def test_the_nbremote_comm_admits_only_members_of_the_world(world: list[str]) -> None:
    conn = current_agent().peers["worker1"].conn
    assert conn is not None
    intruder = KernelLink("worker1", conn)
    try:
        with pytest.raises(WorkerStartError, match="'mallory' is not a member of the world of worker 'worker1'"):
            intruder.open("mallory", bootstrap=None, timeout=20)
    finally:
        intruder.close()
    assert rpc.rpc_sync("worker1", fns.whoami) == "worker1"
    assert rpc.rpc_sync("worker1", fns.call_peer, args=("worker2", fns.whoami)) == "worker2"  # members still can
