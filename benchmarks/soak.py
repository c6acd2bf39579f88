"""A bounded soak: ``rpc_async`` calls with mixed payloads for a fixed time, then the figures.

``python benchmarks/soak.py [--seconds 120] [--workers 3] [--window 128] [--kill-every 0]``

Keeps ``--window`` calls in flight over ``--workers`` local worker kernels for ``--seconds`` (default
two minutes), each call echoing a random payload (0 B to 8 MB, log-uniform, numpy or torch; a fifth of
them above 64 KB) that the driver checks bit for bit. With ``--kill-every N`` one worker is killed
with SIGKILL every N seconds and restarted with ``rpc.restart_worker``; calls to it then fail with
``WorkerLostError`` and are counted apart. Prints calls/s, errors by type, wrong results (must be 0),
and the RSS (private / shared memory) of the driver and each worker at the start (after a warm-up)
and at the end. Exit status 1 if any result was wrong or any call failed other than by a kill.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

from nbremote import rpc
from nbremote.errors import WorkerLostError

MAX_BYTES = 8 << 20


def echo(x: Any) -> Any:
    return x


def rss() -> tuple[int, int]:
    """(private, shared) resident MB of this process."""
    import gc

    gc.collect()
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                fields[key] = int(value.split()[0]) >> 10
    return fields.get("RssAnon", 0), fields.get("RssShmem", 0)


def payload(rng: random.Random) -> Any:
    top = 23 if rng.random() < 0.2 else 16
    size = 0 if rng.random() < 0.02 else int(2 ** rng.uniform(0, top))
    data = np.frombuffer(rng.randbytes(min(size, 4096)) * (1 + size // 4096), dtype=np.uint8)[:size].copy()
    if rng.random() < 0.5:
        import torch

        return torch.from_numpy(data)
    return data


def same(a: Any, b: Any) -> bool:
    if hasattr(a, "numpy"):
        a, b = a.numpy(), b.numpy() if hasattr(b, "numpy") else None
    return isinstance(b, np.ndarray) and a.shape == b.shape and bool(np.array_equal(a, b))


def rss_all(names: list[str]) -> dict[str, tuple[int, int]]:
    out = {"driver": rss()}
    for name in names:
        out[name] = rpc.rpc_sync(name, rss)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--kill-every", type=float, default=0.0, help="kill and restart a worker every N s")
    args = parser.parse_args(argv)
    names = [f"worker{i}" for i in range(1, args.workers + 1)]
    rpc.init_rpc("driver", workers=names)
    try:
        rng = random.Random(0)
        for _ in range(200):  # warm-up: pools and caches reach their working size before the baseline
            rpc.rpc_sync(rng.choice(names), echo, args=(payload(rng),))
        start_rss = rss_all(names)
        slots = threading.Semaphore(args.window)
        lock = threading.Lock()
        counts: collections.Counter[str] = collections.Counter()
        victim = names[-1]

        def done(x: Any, fut: rpc.Future[Any]) -> None:
            try:
                ok = same(x, fut.value())
                key = "ok" if ok else "wrong result"
            except WorkerLostError:
                key = "WorkerLostError (killed worker)"
            except BaseException as exc:
                key = type(exc).__name__
            with lock:
                counts[key] += 1
            slots.release()

        t0 = time.monotonic()
        next_kill = t0 + args.kill_every if args.kill_every else float("inf")
        sent = 0
        restarting: threading.Thread | None = None
        while time.monotonic() - t0 < args.seconds:
            if time.monotonic() >= next_kill and not (restarting and restarting.is_alive()):
                os.kill(rpc.rpc_sync(victim, os.getpid), signal.SIGKILL)
                restarting = threading.Thread(target=rpc.restart_worker, args=(victim,), daemon=True)
                restarting.start()
                next_kill = time.monotonic() + args.kill_every
            x = payload(rng)
            slots.acquire()
            try:
                fut = rpc.rpc_async(rng.choice(names), echo, args=(x,), timeout=60)
            except WorkerLostError:  # refused at once: the killed worker is being restarted
                with lock:
                    counts["refused (worker restarting)"] += 1
                slots.release()
                continue
            sent += 1
            fut.add_done_callback(functools.partial(done, x))
        for _ in range(args.window):  # every call answered
            slots.acquire()
        if restarting is not None:
            restarting.join(60)
        elapsed = time.monotonic() - t0
        time.sleep(0.5)
        end_rss = rss_all(names)
    finally:
        rpc.shutdown()
    print(f"soak: {sent} calls sent in {elapsed:.1f} s = {sent / elapsed:.0f} calls/s over {args.workers} workers")
    for key, n in sorted(counts.items()):
        print(f"  {key:32s} {n}")
    print("RSS MB (private / shared memory), start -> end:")
    for who in start_rss:
        (a0, s0), (a1, s1) = start_rss[who], end_rss[who]
        print(f"  {who:10s} {a0:5d} / {s0:4d} -> {a1:5d} / {s1:4d}")
    bad = sum(n for k, n in counts.items()
              if k not in ("ok", "WorkerLostError (killed worker)", "refused (worker restarting)"))
    return 1 if bad or counts["ok"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
