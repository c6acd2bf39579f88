"""Big buffers between processes of one machine go by shared memory (``nbremote.rpc._transport.shm``).

Against real worker kernels: the links see each other's ``/dev/shm``; a 64 MB array or tensor echoes
bit-exact through pooled segments that are reused (not one per call); ``rpc_async`` still snapshots;
a worker killed while holding segments leaves nothing behind. The pool and the descriptor checks are
also tested on a ``SharedMemory`` object alone.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import remote_fns as fns
import torch
from conftest import pid_alive

from nbremote import rpc
from nbremote.errors import ProtocolError, WorkerLostError
from nbremote.rpc._core import current_agent
from nbremote.rpc._transport import shm

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm (Linux); elsewhere "
                                                             "every buffer takes the socket path")]

MB = 1 << 20


def segments_of(pid: int) -> list[Path]:
    return [p for p in shm.SHM_DIR.glob(f"nbr-{pid}-*") if not p.name.endswith("probe")]


def shm_counts() -> tuple[int, int]:
    """(segments this process owns, of which lent out) -- run on a worker."""
    own = list(current_agent().shm._own.values())
    return len(own), sum(s.lent_to is not None for s in own)


def sum_after(x: Any, seconds: float) -> float:
    time.sleep(seconds)
    return float(x.sum())


def test_links_between_local_processes_use_shared_memory(world: list[str]) -> None:
    agent = current_agent()
    assert all(agent.peers[w].link.same_host for w in world)
    assert rpc.rpc_sync("worker1", fns.call_peer, args=("worker2", fns.whoami)) == "worker2"


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_big_echo_is_bit_exact_and_reuses_its_segments(world: list[str], kind: str) -> None:
    rng = np.random.default_rng(7)
    data = rng.standard_normal(16 * MB, dtype=np.float32)  # 64 MB
    x: Any = data if kind == "numpy" else torch.from_numpy(data)
    mine_before, (theirs_before, _) = len(segments_of(os.getpid())), rpc.rpc_sync("worker3", shm_counts)
    for _ in range(5):
        y = rpc.rpc_sync("worker3", fns.echo, args=(x,))
        assert type(y) is type(x) and y.tobytes() == x.tobytes() if kind == "numpy" else torch.equal(y, x)
        del y
    for _ in range(5):
        y = rpc.rpc_async("worker3", fns.echo, args=(x,)).wait()
        del y
    time.sleep(0.2)  # the last "free" rides the IO thread's next tick
    own, lent = rpc.rpc_sync("worker3", shm_counts)
    # Ten calls, at most two new segments each side: one for the echo, and one more when the "free" of the
    # last reply loses the race with the next request (it rides the IO thread's socket, the request the
    # calling thread's own; on a busy machine the worker may read the request first). One per call: +10.
    assert own <= theirs_before + 2 and lent == 0, "replies must reuse the worker's segments, not make new ones"
    assert len(segments_of(os.getpid())) <= mine_before + 2


def test_rpc_async_snapshots_what_goes_by_shared_memory(world: list[str]) -> None:
    x = np.ones(4 * MB, dtype=np.float64)  # 32 MB
    fut = rpc.rpc_async("worker2", sum_after, args=(x, 0.3))
    x[:] = 0  # changed as soon as rpc_async returned: the worker must see the original
    assert fut.wait() == 4 * MB


def test_small_buffers_keep_to_the_socket(world: list[str]) -> None:
    x = np.arange(1000, dtype=np.float64)  # 8 KB: not worth a segment
    before = len(current_agent().shm._own)
    assert np.array_equal(rpc.rpc_sync("worker1", fns.echo, args=(x,)), x)
    assert len(current_agent().shm._own) == before


def test_a_killed_worker_leaves_no_segments_behind(world: list[str]) -> None:
    rpc.add_worker("shmvictim")
    try:
        pid = rpc.rpc_sync("shmvictim", fns.pid)
        held = rpc.rpc_sync("shmvictim", fns.make_rref_here, args=(np.ones(2 * MB),))  # kept there...
        rpc.rpc_sync("shmvictim", fns.echo, args=(np.ones(2 * MB),))  # ...and a segment of its own lent back
        assert segments_of(pid), "the worker should have made a segment for its reply"
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerLostError):
            rpc.rpc_sync("shmvictim", fns.pid, timeout=10)
        del held
    finally:
        rpc.remove_worker("shmvictim")
    assert segments_of(pid) == []
    assert all(s.lent_to != "shmvictim" for s in current_agent().shm._own.values())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_worker_ended_by_a_signal_unlinks_its_segments(world: list[str], signum: int) -> None:
    """A kernel's manager stops it with SIGTERM, whose default ends a process without atexit: its segments,
    its probe and its Unix-domain socket must go with it all the same, not wait for a later driver's sweep."""
    if signal.getsignal(signum) is signal.SIG_IGN:  # inherited: a kernel keeps an ignored signal ignored, as it should
        pytest.skip(f"this test run ignores {signal.Signals(signum).name} (started under nohup?), and so do the "
                    "kernels it starts: they cannot die of it; runs where pytest is started without that")
    rpc.add_worker("shmterm")
    try:
        pid = rpc.rpc_sync("shmterm", fns.pid)
        rpc.rpc_sync("shmterm", fns.echo, args=(np.ones(2 * MB),))  # a segment of its own, lent back to us
        assert segments_of(pid) and list(shm.SHM_DIR.glob(f"nbr-{pid}-*-probe"))
        assert list(shm.SHM_DIR.glob(f"nbr-{pid}-*-sock")), "its Unix-domain socket (see test_unixlink)"
        os.kill(pid, signum)
        deadline = time.monotonic() + 5
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(pid), f"the kernel should die of signal {signum} as before"
        # before remove_worker, whose sweep would hide what the kernel left
        assert list(shm.SHM_DIR.glob(f"nbr-{pid}-*")) == [], "segments and probe outlived their process"
        with pytest.raises(WorkerLostError):
            rpc.rpc_sync("shmterm", fns.pid, timeout=10)
    finally:
        rpc.remove_worker("shmterm")


def test_a_worker_with_shared_memory_turned_off_gets_everything_by_socket(world: list[str]) -> None:
    import nbremote

    rpc.add_worker("noshm", nbremote.LocalKernel(env={**os.environ, "NBREMOTE_SHM": "0"}))
    try:
        pid = rpc.rpc_sync("noshm", fns.pid)
        assert not current_agent().peers["noshm"].link.same_host
        x = np.arange(2 * MB, dtype=np.float64)  # 16 MB: would take a segment otherwise
        assert np.array_equal(rpc.rpc_sync("noshm", fns.echo, args=(x,)), x)
        assert segments_of(pid) == [] and rpc.rpc_sync("noshm", shm_counts) == (0, 0)
    finally:
        rpc.remove_worker("noshm")


# -- one SharedMemory object, no kernels ------------------------------------------------------------------


def test_pool_cap_sends_the_rest_by_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "POOL_CAP", 3 * MB)
    lender = shm.SharedMemory()
    try:
        frames: list[Any] = [b"pickle", np.ones(MB // 8).data, np.ones(MB // 8).data, np.ones(MB // 8).data]
        env, out = lender.export("peer", {"k": "ok", "id": 1}, frames)
        assert out[1:] == [b"", b"", b""]
        assert [d[0] for d in env["shm"]] == [1, 2, 3]
        env2, out2 = lender.export("peer", {"k": "ok", "id": 2}, [b"p", np.ones(MB // 8).data])
        assert "shm" not in env2 and out2[1].nbytes == MB, "past the cap a frame takes the socket"
        lender.returned("peer", [d[1] for d in env["shm"]])
        env3, _ = lender.export("peer", {"k": "ok", "id": 3}, [b"p", np.ones(MB // 8).data])
        assert env3["shm"][0][1] in {d[1] for d in env["shm"]}, "a returned segment is reused"
    finally:
        lender.close()
    assert not any(shm.SHM_DIR.glob(f"{lender._tag}-*"))


def test_received_descriptors_are_checked() -> None:
    reader = shm.SharedMemory()
    try:
        for bad in ("nope", [[1, "/etc/passwd", 0, 1]], [[1, "nbr-1-00000000-0", -1, 1]], [[0, "x", 0, 1]],
                    [[1, reader.probe, 0, 1]]):
            with pytest.raises(ProtocolError):
                reader.attach("peer", bad, [b"", b""])
        assert not reader.sees("nbr-1-00000000-probe") and reader.sees(reader.probe)
    finally:
        reader.close()
