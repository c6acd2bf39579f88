"""Load with nothing lost: 10,000 ``rpc_async`` calls over 3 workers, payloads of 0 B to 8 MB (numpy and
torch), every result checked; the same while one worker is killed and restarted midway; RSS afterwards.

Each call carries its sequence number; the worker notes it as served and returns it with the payload and
the payload's SHA-256. The driver checks the echo bit for bit and the digest against its own, and asks
each worker which numbers it served: every call ran exactly once, where it was sent (none lost, none
duplicated). Payload sizes are log-uniform so that all sizes occur (a fifth of the calls range up to
8 MB, the rest up to 64 KB; those of 1 MB or more go by shared memory) while the total stays near
1.5 GB each way on a 2-core machine.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import report
from faults import fault_fns as ffns

from nbremote import rpc
from nbremote.errors import WorkerLostError
from nbremote.rpc._core import current_agent
from nbremote.rpc._transport.shm import POOL_CAP

pytestmark = pytest.mark.timeout(180)

CALLS = 10_000
WINDOW = 256  # calls in flight at most: what the driver holds is bounded, as a real producer would be
MAX_BYTES = 8 << 20
# Private memory (RssAnon) may grow this much over the warm baseline and still be "back": allocators
# keep some freed memory (glibc arenas of the IO and pool threads, pymalloc pools, zmq's message
# buffers). A leak of the payloads themselves (~1.5 GB moved each way) would be far above it. Shared
# memory (RssShmem) is counted apart: the same-host pool keeps segments mapped for reuse by design
# (rpc._shm), up to POOL_CAP per process plus its mappings of the peers' segments.
RSS_SLACK = 96 << 20


def payload(rng: random.Random) -> Any:
    """0 B .. 8 MB, log-uniform (sizes 0 and the exact maximum included); numpy or torch, several dtypes."""
    roll = rng.random()
    top = 23 if rng.random() < 0.2 else 16  # a fifth of the calls up to 8 MB, the rest up to 64 KB
    size = 0 if roll < 0.02 else MAX_BYTES if roll > 0.999 else int(2 ** rng.uniform(0, top))
    kind = rng.choice(["np-u8", "np-f32", "torch-f32", "torch-i64"])
    itemsize = 1 if kind == "np-u8" else 4 if kind.endswith("f32") else 8
    n = size // itemsize
    raw = np.frombuffer(rng.randbytes(min(n * itemsize, 4096)) * (1 + n * itemsize // 4096), dtype=np.uint8)
    data = raw[: n * itemsize]
    if kind == "np-u8":
        return data.copy()
    if kind == "np-f32":
        return data.view(np.float32).copy()
    return torch.from_numpy(data.view(np.float32 if kind == "torch-f32" else np.int64).copy())


def digest(x: Any) -> str:
    arr = x.numpy() if isinstance(x, torch.Tensor) else x
    return hashlib.sha256(np.ascontiguousarray(arr).view(np.uint8).data).hexdigest()


def same(a: Any, b: Any) -> bool:
    """Bit for bit (random bytes make NaNs, which ``==`` would call different), and of the same kind."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.numpy(), b.numpy()
    elif not isinstance(b, np.ndarray) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)))


def rss_everywhere(workers: list[str]) -> dict[str, dict[str, int]]:
    return {"driver": ffns.rss_bytes(), **{w: rpc.rpc_sync(w, ffns.rss_bytes) for w in workers}}


class Run:
    """Issue ``CALLS`` calls round-robin at random over ``workers``, at most WINDOW in flight."""

    def __init__(self, workers: list[str], seed: int) -> None:
        self.rng = random.Random(seed)
        self.workers = workers
        self.ok: dict[int, str] = {}  # seq -> worker, checked
        self.failed: dict[int, tuple[str, BaseException]] = {}
        self.sent_to: dict[int, str] = {}
        self.bad: list[str] = []
        self.bytes = 0
        self._slots = threading.Semaphore(WINDOW)
        self._lock = threading.Lock()

    def _done(self, seq: int, to: str, x: Any, fut: rpc.Future[Any]) -> None:
        try:
            got_seq, echoed, their_digest = fut.value()
        except BaseException as exc:
            with self._lock:
                self.failed[seq] = (to, exc)
        else:
            with self._lock:
                if got_seq != seq or not same(x, echoed) or their_digest != digest(x):
                    self.bad.append(f"call {seq} to {to}: wrong result")
                elif seq in self.ok:
                    self.bad.append(f"call {seq} completed twice")
                self.ok[seq] = to
        finally:
            self._slots.release()

    def call(self, seq: int, to: str | None = None) -> None:
        to = to or self.rng.choice(self.workers)
        x = payload(self.rng)
        self.bytes += int(x.nbytes)
        self._slots.acquire()
        self.sent_to[seq] = to
        try:
            fut = rpc.rpc_async(to, ffns.echo_checked, args=(seq, x), timeout=60)
        except BaseException as exc:  # refused at once (e.g. the worker is being restarted)
            with self._lock:
                self.failed[seq] = (to, exc)
            self._slots.release()
            return
        fut.add_done_callback(functools.partial(self._done, seq, to, x))

    def finish(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ok) + len(self.failed) < len(self.sent_to):
            assert time.monotonic() < deadline, f"{len(self.sent_to) - len(self.ok) - len(self.failed)} calls hang"
            time.sleep(0.01)


def served_once(run: Run, worker: str, served: list[int]) -> None:
    """Every call ``run`` sent to ``worker`` and saw succeed ran there exactly once, and nothing else did."""
    counts = collections.Counter(served)
    dup = [s for s, n in counts.items() if n > 1]
    assert not dup, f"{worker} ran calls {dup[:5]} more than once"
    expected = {s for s, w in run.ok.items() if w == worker}
    assert set(counts) == expected, (f"{worker}: ran but not reported {sorted(set(counts) - expected)[:5]}, "
                                     f"reported but not run {sorted(expected - set(counts))[:5]}")


@pytest.fixture
def clean_served(world: list[str]) -> Iterator[None]:
    for w in world:
        rpc.rpc_sync(w, ffns.served, args=(True,))
    yield


def test_10000_calls_with_random_payloads_lose_nothing(world: list[str], clean_served: None) -> None:
    warm = Run(world, seed=1)  # warm-up: pools, shared-memory segments, thread pools reach their size
    for seq in range(1000):
        warm.call(seq)
    warm.finish()
    for w in world:
        rpc.rpc_sync(w, ffns.served, args=(True,))
    before = rss_everywhere(world)
    run = Run(world, seed=2)
    t0 = time.monotonic()
    for seq in range(CALLS):
        run.call(seq)
    run.finish()
    elapsed = time.monotonic() - t0
    assert run.bad == []
    assert run.failed == {}, list(run.failed.items())[:3]
    assert len(run.ok) == CALLS
    for w in world:
        served_once(run, w, rpc.rpc_sync(w, ffns.served, args=(True,)))
    after = rss_everywhere(world)
    report("load", f"{CALLS} calls, {run.bytes / 1e6:.0f} MB each way in {elapsed:.1f} s "
          f"({CALLS / elapsed:.0f} calls/s), 0 lost; RSS MB before -> after (private / shared memory): "
          + ", ".join(f"{k} {before[k]['RssAnon'] >> 20}/{before[k]['RssShmem'] >> 20} -> "
                      f"{after[k]['RssAnon'] >> 20}/{after[k]['RssShmem'] >> 20}" for k in before))
    for who in before:
        kept = after[who]["RssAnon"] - before[who]["RssAnon"]
        assert kept < RSS_SLACK, f"{who} kept {kept / 1e6:.0f} MB of private memory"
        assert after[who]["RssShmem"] <= 2 * POOL_CAP, f"{who}'s shared-memory pool passed its cap"


def test_a_worker_killed_and_restarted_midway_loses_nothing_else(world: list[str], clean_served: None) -> None:
    rpc.add_worker("lv")
    workers = ["worker1", "worker2", "lv"]
    try:
        run = Run(workers, seed=3)
        old_pid = rpc.rpc_sync("lv", os.getpid)
        restarted = threading.Event()

        def kill_and_restart() -> None:
            os.kill(old_pid, 9)
            deadline = time.monotonic() + 10
            while current_agent().peers["lv"].lost is None and time.monotonic() < deadline:
                time.sleep(0.01)
            rpc.restart_worker("lv")
            restarted.set()

        killer = threading.Thread(target=kill_and_restart)
        after_restart: list[int] = []
        for seq in range(CALLS):
            if seq == CALLS // 2:
                killer.start()
            if restarted.is_set():
                after_restart.append(seq)
            run.call(seq)
        killer.join(30)
        assert restarted.is_set(), "the restart did not finish"
        run.finish()
        assert run.bad == []
        lost_elsewhere = {s: e for s, (w, e) in run.failed.items() if w != "lv"}
        assert lost_elsewhere == {}, list(lost_elsewhere.items())[:3]
        for _, exc in run.failed.values():  # calls to the victim fail typed, naming it
            assert isinstance(exc, WorkerLostError) and exc.worker == "lv", repr(exc)
            assert "restart_worker" in str(exc), str(exc)
        to_lv_after = [s for s in after_restart if run.sent_to[s] == "lv"]
        assert to_lv_after and all(s in run.ok for s in to_lv_after), "calls to the restarted worker failed"
        for w in ("worker1", "worker2"):
            served_once(run, w, rpc.rpc_sync(w, ffns.served, args=(True,)))
        new_served = rpc.rpc_sync("lv", ffns.served, args=(True,))
        assert len(new_served) == len(set(new_served)) and set(new_served) <= set(run.ok)
        kinds = collections.Counter(type(e).__name__ for _, e in run.failed.values())
        report("load", f"with a kill and restart midway: {CALLS} calls, {len(run.ok)} ok, {len(run.failed)} "
                       f"failed typed (all to lv: {dict(kinds)}), 0 lost or duplicated")
    finally:
        if "lv" in [w.name for w in rpc.workers()]:
            rpc.remove_worker("lv")
