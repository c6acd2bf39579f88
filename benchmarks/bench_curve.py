"""What a kernel bound beyond loopback costs: CurveZMQ encryption plus SHA-256 buffer digests, in one run.

    python benchmarks/bench_curve.py [--calls 500] [--echo-mb 16] [--rounds 5]

Three workers on this machine, all with shared memory off (``NBREMOTE_SHM=0``) so that every byte takes
the socket: ``loopback``, a kernel bound to 127.0.0.1 (signed messages, nothing more); ``digests``, a
kernel bound to 0.0.0.0 (reached through 127.0.0.1) with ``encrypt=False``: a SHA-256 digest of each
buffer in the signed content; and ``curve``, the same with nbremote's default beyond loopback: CurveZMQ
on every channel as well. Rounds alternate between them, so drift in the machine's load hits all alike.
Prints, per case, the median over rounds of each round's figure (a small call: the p50 of ``--calls``
blocking calls; an echo: the median of 5 round trips of ``--echo-mb`` MB of numpy data) and the ratios
to ``loopback``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np

import nbremote
from nbremote import rpc
from nbremote.rpc._core import current_agent


def echo(x: Any) -> Any:
    return x


def noop() -> None:
    return None


def small_call(worker: str, calls: int) -> float:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        rpc.rpc_sync(worker, noop)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def big_echo(worker: str, data: np.ndarray) -> float:
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        back = rpc.rpc_sync(worker, echo, args=(data,))
        samples.append(time.perf_counter() - t0)
        assert back.shape == data.shape
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--echo-mb", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "NBREMOTE_SHM": "0"}
    os.environ["NBREMOTE_SHM"] = "0"  # this process too: one side off is enough, both is clearer
    workers = ("loopback", "digests", "curve")
    rpc.init_rpc("driver", workers={"loopback": nbremote.LocalKernel(env=env),
                                    "digests": nbremote.LocalKernel(ip="0.0.0.0", env=env, encrypt=False),
                                    "curve": nbremote.LocalKernel(ip="0.0.0.0", env=env)})
    try:
        link = current_agent().peers["curve"].link
        curve = bool(getattr(link, "conn", {}).get("curve_publickey"))
        data = np.random.default_rng(0).standard_normal(args.echo_mb * (1 << 20) // 8)
        figures: dict[tuple[str, str], list[float]] = {}
        for worker in workers:  # warm them
            small_call(worker, 50)
            big_echo(worker, data)
        for _ in range(args.rounds):
            for worker in workers:
                figures.setdefault(("small call", worker), []).append(small_call(worker, args.calls))
                figures.setdefault((f"echo {args.echo_mb} MB", worker), []).append(big_echo(worker, data))
        print(f"curve: CurveZMQ {'on' if curve else 'OFF (libzmq has no curve)'}; digests and curve: SHA-256 "
              "buffer digests; shared memory off for all")
        print(f"{'case':<14}" + "".join(f"{w:>13}" for w in workers) + f"{'digests/lo':>12}{'curve/lo':>10}")
        for case in dict.fromkeys(c for c, _ in figures):
            ms = [statistics.median(figures[(case, w)]) * 1e3 for w in workers]
            ratios = f"{ms[1] / ms[0]:>11.2f}x{ms[2] / ms[0]:>9.2f}x"
            print(f"{case:<14}" + "".join(f"{m:>10.3f} ms" for m in ms) + ratios)
    finally:
        rpc.shutdown()


if __name__ == "__main__":
    main()
