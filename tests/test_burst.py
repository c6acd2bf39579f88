"""A burst of calls on the same-host Unix-domain link loses nothing and never falls back (issue 38).

One round of ``burst.one_round`` on the session's workers: 10,000 echo calls issued at once from the driver to
3 workers and from each worker to the next, every core hogged. Before flow control, this lost a worker or a
reply in 2 of 7 runs (both ends blocked writing; the 5 s send timeout gave the connection up). The same round,
20 times over, is ``benchmarks/bench_burst.py``.
"""

from __future__ import annotations

import collections
import operator
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from burst import echo, one_round, payload, served, shut_link_to, slow_echo
from conftest import own_worker, report

from nbremote import rpc
from nbremote.rpc._core import current_agent

pytestmark = pytest.mark.timeout(600)


def test_a_burst_of_10000_calls_under_a_cpu_hog_loses_nothing_and_stays_on_the_unix_link(world: list[str]) -> None:
    peers = current_agent().peers
    logs = {w: str(peers[w].log_path) for w in world}
    before = {w: peers[w].link.unix.sent for w in world if peers[w].link.unix is not None}
    assert len(before) == len(world), "the workers' links are not on Unix-domain connections: nothing to test"
    counts = one_round(world, logs, calls=10_000, seed=38)
    report("burst", f"{counts['calls']} calls ({counts['mb']:.0f} MB each way) in {counts['seconds']:.1f} s under a "
                    f"CPU hog: {counts['ok']} ok, {counts['wrong']} wrong, {counts['lost']} lost, {counts['twice']} "
                    f"served twice, {counts['never']} never served, {counts['fallbacks']} fall-backs logged")
    assert counts["calls"] == 10_000
    bad = [counts[k] for k in ("wrong", "lost", "twice", "never", "fallbacks")]
    assert bad == [0, 0, 0, 0, 0], counts["examples"]
    assert counts["ok"] == counts["calls"]
    for w in world:  # still on the same connections, which carried the burst
        unix = peers[w].link.unix
        assert unix is not None and not unix.broken and unix.sent > before[w], w


@pytest.fixture
def spare() -> Iterator[str]:
    yield from own_worker("burst-spare")


def _calls(to: str, n: int, seed: int) -> list[tuple[int, np.ndarray, rpc.Future[Any]]]:
    rng = random.Random(seed)
    out = []
    for seq in range(n):
        x = payload(rng)
        out.append((seq, x, rpc.rpc_async(to, echo, args=(seq, x), timeout=120)))
    return out


def _all_once(to: str, sent: list[tuple[int, np.ndarray, rpc.Future[Any]]]) -> None:
    """Every call came back right, and ran exactly once on ``to``."""
    for seq, x, fut in sent:
        got, echoed = fut.wait()
        assert got == seq and np.array_equal(echoed, x), f"call {seq}: wrong result"
    counts = collections.Counter(rpc.rpc_sync(to, served, args=(True,)))
    assert sorted(counts) == [seq for seq, _, _ in sent], "a call was never served"
    assert max(counts.values()) == 1, f"served twice: {[s for s, n in counts.items() if n > 1][:5]}"


def test_a_worker_stopped_for_3_s_in_a_burst_continues_and_loses_nothing(spare: str) -> None:
    pid = rpc.rpc_sync(spare, os.getpid)
    rpc.rpc_sync(spare, served, args=(True,))
    timer = threading.Timer(0.2, lambda: (os.kill(pid, signal.SIGSTOP), time.sleep(3), os.kill(pid, signal.SIGCONT)))
    timer.start()
    sent = _calls(spare, 3000, seed=1)
    timer.join()
    _all_once(spare, sent)
    assert current_agent().peers[spare].lost is None
    unix = current_agent().peers[spare].link.unix
    assert unix is not None and not unix.broken, "the pause cost the connection: a timeout stood in for flow control"


@pytest.mark.parametrize("side", ["driver", "worker"])
def test_a_connection_closed_mid_burst_delivers_every_call_once(spare: str, side: str) -> None:
    link = current_agent().peers[spare].link
    rpc.rpc_sync(spare, served, args=(True,))
    unix = link.unix
    assert unix is not None
    if side == "worker":
        assert rpc.rpc_sync(spare, shut_link_to, args=("driver", 0.3))
    else:
        threading.Timer(0.3, unix.shut).start()
    sent = _calls(spare, 3000, seed=2)
    _all_once(spare, sent)
    assert unix.broken, "the connection was not closed mid-burst: the test tested nothing"
    assert unix.sent < 3000, "every call had left before the close: the test tested nothing"
    assert rpc.rpc_sync(spare, operator.add, args=(2, 3)) == 5  # the link goes on (by zmq)


def test_a_driver_that_sends_for_15_s_without_pause_keeps_its_leases(spare: str) -> None:
    held = rpc.remote(spare, bytearray, args=(b"kept",))
    peer = current_agent().peers[spare]
    log_start = Path(peer.log_path).stat().st_size
    rng = random.Random(3)
    pending: collections.deque[rpc.Future[Any]] = collections.deque()
    sent = 0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # calls that wait in the worker, behind which a data-path lease would wait
        pending.append(rpc.rpc_async(spare, slow_echo, args=(payload(rng), 0.002), timeout=300))
        sent += 1
        while len(pending) > 2000:
            pending.popleft().wait()
    for fut in pending:
        fut.wait()
    log = Path(peer.log_path).read_text(errors="replace")[log_start:]
    assert "was not heard from" not in log, log[-2000:]
    assert held.to_here() == bytearray(b"kept")  # the driver's value there was never released
    assert peer.lost is None and sent > 1000
