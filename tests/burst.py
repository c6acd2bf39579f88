"""The burst that once lost a worker on the same-host Unix-domain link (issue 38), as one reusable round.

A round sends ``calls`` echo calls of numpy arrays at once -- every ``rpc_async`` issued before any result is
waited on -- from the driver to every worker and, at the same time, from each worker to the next, while
processes that spin hog every core. Sizes are log-uniform from 1 B to 800 KB (the Unix-domain connection
carries those whole), and 1 in 100 is 1-8 MB (those go by shared memory). Each call carries a sequence
number that its worker notes as served; the round counts what came back right, wrong or not at all, what a
worker ran twice or never, and the fall-backs to zmq that the driver's and the workers' logs mention.

Used by ``test_burst.py`` (one round, in CI) and ``benchmarks/bench_burst.py`` (20 rounds, counts printed).
Everything a worker runs here is in this module, which workers import by name (the tests' directory is on
their path).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nbremote import rpc

SMALL_MAX = 800_000  # bytes: the biggest payload that goes whole by the Unix-domain connection
BIG = (1 << 20, 8 << 20)  # 1 in BIG_EVERY calls carries this much (shared memory)
BIG_EVERY = 100
CALL_TIMEOUT = 300.0  # s: a generous bound for one call in a round; a lost reply fails the round there
# What the transport logs when a Unix-domain connection ends, fails or is dropped, and its link falls back to zmq
FALLBACK_WORDS = ("Unix-domain connection ended", "Unix-domain connection failed",
                  "dropped {}'s Unix-domain connection", "did not answer; keeping to its shell socket")
_SERVED: list[int] = []


def payload(rng: random.Random) -> np.ndarray:
    big = rng.randrange(BIG_EVERY) == 0
    size = rng.randint(*BIG) if big else int(2 ** rng.uniform(0, np.log2(SMALL_MAX)))
    block = rng.randbytes(min(size, 4096))
    return np.frombuffer(block * (size // len(block) + 1), dtype=np.uint8)[:size].copy()


def echo(seq: int, x: np.ndarray) -> tuple[int, np.ndarray]:
    _SERVED.append(seq)
    return seq, x


def served(clear: bool = False) -> list[int]:
    out = list(_SERVED)
    if clear:
        _SERVED.clear()
    return out


def burst(targets: list[str], calls: int, seed: int, first: int) -> dict[str, Any]:
    """Send ``calls`` echoes numbered from ``first`` over ``targets`` at once, then wait for every one: the counts,
    and which numbers went where (for the served-once check)."""
    rng = random.Random(seed)
    sent: list[tuple[int, str, np.ndarray, rpc.Future[Any]]] = []
    for seq in range(first, first + calls):
        to = rng.choice(targets)
        x = payload(rng)
        sent.append((seq, to, x, rpc.rpc_async(to, echo, args=(seq, x), timeout=CALL_TIMEOUT)))
    ok = wrong = 0
    failed: list[str] = []
    for seq, to, x, fut in sent:
        try:
            got_seq, echoed = fut.wait()
        except Exception as exc:
            failed.append(f"call {seq} to {to}: {type(exc).__name__}: {exc}")
            continue
        if got_seq == seq and isinstance(echoed, np.ndarray) and echoed.dtype == x.dtype and np.array_equal(echoed, x):
            ok += 1
        else:
            wrong += 1
    return {"ok": ok, "wrong": wrong, "failed": failed, "bytes": sum(int(x.nbytes) for _, _, x, _ in sent),
            "to": {seq: to for seq, to, _, _ in sent}}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fallbacks(text: str, names: list[str]) -> list[str]:
    words = [w.format(repr(n)) for w in FALLBACK_WORDS for n in (names if "{}" in w else [""])]
    return [line for line in text.splitlines() if any(w in line for w in words)]


@contextlib.contextmanager
def cpu_hog(processes: int | None = None) -> Iterator[None]:
    """Processes that spin on every core (or ``processes``) while the block runs."""
    n = processes or len(os.sched_getaffinity(0))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def one_round(workers: list[str], log_paths: dict[str, str], calls: int, seed: int, *,
              peer_share: float = 0.3) -> dict[str, Any]:
    """One round: ``calls`` in all, ``peer_share`` of them worker to worker (each worker to the next), the rest
    from the driver over all workers, every core hogged. Returns the counts (``lost``, ``wrong``, ``twice``,
    ``never``, ``fallbacks``: all 0 in a good round) and what it measured."""
    for w in workers:
        rpc.rpc_sync(w, served, args=(True,))
    per_peer = int(calls * peer_share / len(workers))
    mine = calls - per_peer * len(workers)
    log_start = {w: Path(p).stat().st_size for w, p in log_paths.items()}
    lines = _Lines()
    logger = logging.getLogger("nbremote")
    logger.addHandler(lines)
    level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        with cpu_hog():
            t0 = time.monotonic()
            peers = [rpc.rpc_async(w, burst, args=([workers[(i + 1) % len(workers)]], per_peer, seed * 10 + i,
                                                   (i + 1) * 1_000_000), timeout=2 * CALL_TIMEOUT)
                     for i, w in enumerate(workers)]
            results = [burst(workers, mine, seed, 0)] + [p.wait() for p in peers]
            elapsed = time.monotonic() - t0
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    sent_to: dict[str, set[int]] = collections.defaultdict(set)
    for result in results:
        for seq, to in result["to"].items():
            sent_to[to].add(seq)
    twice = never = 0
    for w in workers:
        counts = collections.Counter(rpc.rpc_sync(w, served, args=(True,)))
        twice += sum(1 for n in counts.values() if n > 1)
        never += len(sent_to[w] - set(counts))
    fallbacks = _fallbacks("\n".join(lines.lines), workers)
    for w, p in log_paths.items():
        with open(p, errors="replace") as f:
            f.seek(log_start[w])
            fallbacks += [f"{w}: {line}" for line in _fallbacks(f.read(), ["driver", *workers])]
    failed = [line for r in results for line in r["failed"]]
    return {"calls": sum(len(r["to"]) for r in results), "ok": sum(r["ok"] for r in results),
            "wrong": sum(r["wrong"] for r in results), "lost": len(failed), "twice": twice, "never": never,
            "fallbacks": len(fallbacks), "seconds": elapsed, "mb": sum(r["bytes"] for r in results) / 1e6,
            "examples": (failed + fallbacks)[:5]}


def shut_link_to(caller: str, after: float) -> bool:
    """On a worker: in ``after`` s, end the Unix-domain connection of ``caller``'s link here (from this side),
    whatever it is carrying then. False where that link has none."""
    import threading

    from IPython import get_ipython

    path = getattr(get_ipython().kernel, "_nbremote_shell_path", None)
    links = [] if path is None else [link for link in path._links.values() if link.name == caller and not link.alias]
    unix = next((link.unix for link in links if link.unix is not None), None)
    if unix is None:
        return False
    threading.Timer(after, unix.shut).start()
    return True


def slow_echo(x: np.ndarray, seconds: float) -> int:
    time.sleep(seconds)
    return int(x.nbytes)
