"""Where a small call's time goes, hop by hop: ``python benchmarks/profile_call.py [--calls N] [--json F]``.

One local worker kernel; the driver calls ``rpc_sync(worker, noop)`` N times (after a warm-up), one call at
a time, as the benchmark's small call does. Both processes stamp each stage of each call with
``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux: one clock for every process of the machine), by
wrapping the functions that end a stage -- in the driver directly, in the worker through a call that wraps
them there. The stamps of a call are paired across the two processes (the worker's stages of a call lie
between the driver's send and its receive), and each hop's median, p10 and p90 are printed:

- driver: the call's bookkeeping, pickling the payload, encoding (JSON, header, HMAC), sending;
- driver -> worker: libzmq's IO threads on both ends, TCP on loopback, the worker's receiving thread woken;
- worker: taking the message off the shell socket, checking and decoding it, handing it to the call, the
  call itself with its unpickling and the result's pickling, encoding and sending the reply;
- worker -> driver: the same hops back, the calling thread woken from its poll;
- driver: receiving and decoding the reply, completing the call.

Each stamp is a Python call and a list append in a path that is cold after each wake-up: the profile adds
a few microseconds per stage, so its total exceeds the benchmark's median a little. Linux only (the clock).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import operator
import sys
import time
from typing import Any

from nbremote import rpc
from nbremote.rpc._transport.unixlink import unix_wanted

# Where a message leaves: a Unix-domain connection of the link's own between kernels of one machine (unless
# NBREMOTE_UNIX=0, which the workers inherit), else the kernel's zmq shell socket.
_UNIX = unix_wanted()
_WORKER_SEND = ("nbremote.rpc._transport.unixlink", "UnixChannel.send") if _UNIX else \
    ("nbremote.rpc._worker.shellpath", "send_frames")
_WIRE = "Unix socket" if _UNIX else "zmq"
# (stage that ends with this stamp, module path, attribute, when): the stamp is taken when the wrapped
# function is entered ("in") or has returned ("out").
DRIVER = [
    ("driver: call bookkeeping", "nbremote.rpc._wire.serialize", "dumps", "in"),
    ("driver: pickle the payload", "nbremote.rpc._wire.serialize", "dumps", "out"),
    ("driver: bookkeeping until encoding", "nbremote.rpc._wire.codec", "Codec.encode_items", "in"),
    ("driver: encode (JSON, header, HMAC)", "nbremote.rpc._wire.codec", "Codec.encode_items", "out"),
    (f"driver: send ({_WIRE})", "nbremote.rpc._transport.threadsockets", "ThreadSockets.send", "out"),
]
WORKER = [
    ("driver -> worker: wire, wake-up, take it off", "nbremote.rpc._worker.receivers", "Receivers._take", "out"),
    ("worker: check the type, route", "nbremote.rpc._wire.codec", "Codec.decode", "in"),
    ("worker: verify (HMAC, replay) and parse", "nbremote.rpc._wire.codec", "Codec.decode", "out"),
    ("worker: unpack, hand the call to this thread", "nbremote.rpc._core.serving", "Server._run_call", "in"),
    ("worker: unpickle, run, pickle the result", "nbremote.rpc._wire.serialize", "dumps", "out"),
    ("worker: reply bookkeeping until encoding", "nbremote.rpc._wire.codec", "Codec.encode_items", "in"),
    ("worker: encode the reply", "nbremote.rpc._wire.codec", "Codec.encode_items", "out"),
    (f"worker: send the reply ({_WIRE})", *_WORKER_SEND, "out"),
]
BACK = [
    ("worker -> driver: wire, wake-up, receive", "nbremote.rpc._wire.codec", "Codec.decode", "in"),
    ("driver: verify and parse the reply", "nbremote.rpc._wire.codec", "Codec.decode", "out"),
]


def stamp_functions(stages: list[tuple[str, str, str, str]], log: list[tuple[int, int]]) -> None:
    """Wrap each stage's function so that it appends ``(stage index, ns)`` to ``log`` (runs on either side)."""
    import functools
    import importlib
    import time

    now = time.perf_counter_ns
    wrapped: dict[tuple[str, str], dict[str, int]] = {}
    for index, (_, module, attr, when) in enumerate(stages):
        wrapped.setdefault((module, attr), {})[when] = index
    for (module, attr), whens in wrapped.items():
        owner: Any = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        enter, leave = whens.get("in"), whens.get("out")

        def stamped(*args: Any, _f: Any = original, _in: Any = enter, _out: Any = leave, **kwargs: Any) -> Any:
            if _in is not None:
                log.append((_in, now()))
            result = _f(*args, **kwargs)
            if _out is not None:
                log.append((_out, now()))
            return result

        setattr(owner, name, functools.wraps(original)(stamped))


def _install_in_worker(stages: list[tuple[str, str, str, str]]) -> None:
    import builtins

    log: list[tuple[int, int]] = []
    builtins._nbremote_profile_log = log  # type: ignore[attr-defined]
    stamp_functions(stages, log)


def _worker_log(clear: bool) -> list[tuple[int, int]]:
    import builtins

    log: list[tuple[int, int]] = builtins._nbremote_profile_log  # type: ignore[attr-defined]
    out = list(log)
    if clear:
        log.clear()
    return out


def _first(log: list[tuple[int, int]], stage: int, start: int, end: int) -> int | None:
    """The first stamp of ``stage`` in ``[start, end]`` (``log`` sorted by time)."""
    i = bisect.bisect_left(log, (start,), key=lambda entry: (entry[1],))
    while i < len(log) and log[i][1] <= end:
        if log[i][0] == stage:
            return log[i][1]
        i += 1
    return None


def profile(calls: int) -> dict[str, Any]:
    rpc.init_rpc("driver", workers=["worker1"])
    try:
        from _fns import noop  # benchmarks/ is sys.path[0], as for bench.py: imported by name on both sides

        for _ in range(300):
            rpc.rpc_sync("worker1", noop)
        rpc.rpc_sync("worker1", _install_in_worker, args=(WORKER,))
        driver_log: list[tuple[int, int]] = []
        stamp_functions(DRIVER + BACK, driver_log)
        for _ in range(200):
            rpc.rpc_sync("worker1", noop)
        rpc.rpc_sync("worker1", _worker_log, args=(True,))
        driver_log.clear()
        spans = []
        now = time.perf_counter_ns
        for _ in range(calls):
            start = now()
            rpc.rpc_sync("worker1", noop)
            spans.append((start, now()))
        worker = sorted(rpc.rpc_sync("worker1", _worker_log, args=(False,)), key=operator.itemgetter(1))
    finally:
        rpc.shutdown()
    driver = sorted(driver_log, key=operator.itemgetter(1))
    names = [stage[0] for stage in DRIVER + WORKER + BACK] + ["driver: complete the call, return"]
    hops: dict[str, list[float]] = {name: [] for name in names}
    totals = []
    # Every stage's stamp is the first of its kind after the previous stage's, across both processes.
    sequence = ([(driver, i) for i in range(len(DRIVER))] + [(worker, i) for i in range(len(WORKER))]
                + [(driver, len(DRIVER) + i) for i in range(len(BACK))])
    reordered = 0
    for start, end in spans:
        stamps = [start]
        previous: list[tuple[int, int]] | None = None
        for log, stage in sequence:
            # A message sent is stamped after the send returns: a sender descheduled in between (a busy machine)
            # stamps after the receiver's first stamp. So the receiver's is looked for from the stamp before.
            crossing = previous is not None and log is not previous
            previous = log
            found = _first(log, stage, stamps[-2] if crossing else stamps[-1], end)
            if found is None:
                break  # a stage of this call was not seen (a warm-up's leftovers): leave the call out
            if found < stamps[-1]:
                reordered += 1  # its hops would not be that call's: leave it out, counted
                break
            stamps.append(found)
        else:
            stamps.append(end)
            for name, (a, b) in zip(names, itertools.pairwise(stamps), strict=True):  # named by the stamp ending it
                hops[name].append((b - a) / 1000)
            totals.append((end - start) / 1000)
    return {"calls": len(totals), "reordered": reordered, "total_us": totals, "hops_us": hops}


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(result: dict[str, Any]) -> str:
    lines = [f"{'hop':48s} {'p50 us':>8s} {'p10':>7s} {'p90':>7s} {'share':>6s}"]
    total = _q(result["total_us"], 0.5)
    for name, values in result["hops_us"].items():
        lines.append(f"{name:48s} {_q(values, 0.5):8.1f} {_q(values, 0.1):7.1f} {_q(values, 0.9):7.1f} "
                     f"{_q(values, 0.5) / total:6.0%}")
    lines.append(f"{'whole call (rpc_sync returned)':48s} {total:8.1f} {_q(result['total_us'], 0.1):7.1f} "
                 f"{_q(result['total_us'], 0.9):7.1f}")
    lines.append(f"{result['calls']} calls; the medians of the hops need not add up to the call's median")
    if result["reordered"]:
        lines.append(f"{result['reordered']} more calls left out: a sender was descheduled between sending and "
                     "stamping it (a busy machine), so their stamps are out of order")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls profiled (after a warm-up)")
    parser.add_argument("--json", help="also write every call's hops here")
    args = parser.parse_args(argv)
    result = profile(args.calls)
    print(report(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out)
    return 0 if result["calls"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
