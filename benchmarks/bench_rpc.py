"""Benchmark nbremote.rpc against a raw pyzmq echo measured in the same run, on the same machine.

What it measures (``python benchmarks/bench_rpc.py [--quick]``):

1. **Small call**: round trip of ``rpc_sync(worker, noop)`` vs a one-byte REQ/REP echo over
   ``tcp://127.0.0.1`` to a server in another process; p50 and p90 of per-call latencies. The two are
   measured in alternating blocks so that drift on a busy machine hits both alike. A third path, a *bare
   comm* (a kernel whose comm target answers at once: no pickling, executor or subshell), is the floor
   of any RPC through ipykernel's comm machinery; nbremote's ratio to it is the overhead nbremote adds.
2. **Echo 1 MB / 64 MB**: ``rpc_sync(worker, identity, args=(x,))`` for a numpy array and a torch CPU
   tensor vs a raw zmq echo of the same bytes (``copy=False`` both ways, the reply rebuilt as an array
   over the received frame). Medians of several trials, run in alternating blocks of back-to-back echoes
   (1 MB) or interleaved one by one (64 MB). Every path is checked bit-exact once, outside the timing.
3. **Throughput**: 1,000 ``rpc_async(noop)`` calls put in flight at once (round robin over 3 workers,
   then on 1 worker), calls/s from the first submit to the last completion; median of trials.
4. **Kernel start**: wall time of ``init_rpc`` with 1 and with 4 local workers (``shutdown`` shown too).

How to read the ratios: ``nbr/raw`` is nbremote's time over the raw zmq time, so 1.0 means nbremote adds
nothing over the bare socket and 3.0 means it takes three times as long. For small calls it is p50 over
p50 (p90 over p90); for echoes it is the median of per-trial ratios (adjacent raw/nbremote echoes form a
pair, so a burst of load elsewhere cancels out), which can differ a little from the ratio of the two
medians shown. The raw echo is a floor, not a target (no framing, no pickling, no kernel): the aims are
small call p50 <= 1 ms (absolute) and 64 MB echo <= 1.2x raw zmq. The "TRANSPORT-NOTES" column repeats the
figures of /work/shared/TRANSPORT-NOTES.md (a throwaway comm prototype, torch.distributed.rpc,
ipyparallel) for orientation only: they come from another run, and small-call figures move by up to
±40 % between runs. The script prints how busy the cores were (other processes) before and after; on a
2-core machine any other load inflates every figure, the 64 MB ones most.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import multiprocessing
import multiprocessing.connection
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from nbremote import rpc

MB = 1 << 20
# Seconds before a call counts as lost. Far above any figure here (a 64 MB echo takes ~0.1 s), yet a lost
# reply costs the run 20 s rather than the default 60 s per call.
CALL_TIMEOUT = 20.0


# -- functions shipped to the workers (module-level in __main__: cloudpickle sends them by value) ------
def noop() -> None:
    return None


def identity(x: Any) -> Any:
    return x


# -- raw pyzmq baseline ---------------------------------------------------------------------------------
def _echo_server(conn: multiprocessing.connection.Connection) -> None:
    """REP socket on a loopback port that sends every message back as it came, without copying."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent ends us
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    conn.close()
    try:
        while True:
            sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
    finally:
        sock.close()
        ctx.term()


class RawEcho:
    """Client of an echo server in a separate process (spawned, so it shares nothing with this one)."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        mp = multiprocessing.get_context("spawn")
        parent, child = mp.Pipe(duplex=False)
        self._proc = mp.Process(target=_echo_server, args=(child,), name="bench-zmq-echo", daemon=True)
        self._proc.start()
        child.close()
        with parent:
            if not parent.poll(60):
                self.close()
                raise RuntimeError("the zmq echo server did not report its endpoint within 60 s")
            self._sock.connect(parent.recv())

    def small(self) -> None:
        self._sock.send(b"x")
        self._sock.recv()

    def echo(self, x: np.ndarray) -> np.ndarray:
        self._sock.send(x.data, copy=False)  # ndarray.data: a memoryview, no copy
        frame = self._sock.recv(copy=False)
        return np.frombuffer(frame.buffer, dtype=x.dtype).reshape(x.shape)

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join(10)


class BareComm:
    """The floor of the Jupyter comm path: a kernel whose comm target answers each message at once.

    No pickling, no executor, no subshell: a ``comm_msg`` on the shell channel, ``comm.send`` back on
    IOPub, read zero-copy from a raw SUB socket. nbremote's small call cannot be faster than this on
    the same machine, so its ratio to this is the overhead nbremote itself adds.
    """

    TARGET = "bench_bare_echo"

    def __init__(self) -> None:
        from jupyter_client.manager import KernelManager
        from jupyter_client.session import Session

        self._km = KernelManager(kernel_name="python3")
        self._km.start_kernel(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        kc = self._km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(60)
            reply = kc.execute_interactive(
                "import comm\n"
                "def _bench_target(c, msg):\n"
                "    c.on_msg(lambda m: c.send({'i': m['content']['data']['i']}))\n"
                f"comm.get_comm_manager().register_target({self.TARGET!r}, _bench_target)\n",
                timeout=60,
            )
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"could not register the bare comm target: {reply['content']}")
        finally:
            kc.stop_channels()
        info = self._km.get_connection_info(session=False)
        self._session = Session(key=info["key"])
        self._ctx = zmq.Context()
        self._shell = self._ctx.socket(zmq.DEALER)
        self._iopub = self._ctx.socket(zmq.SUB)
        for sock, port in ((self._shell, info["shell_port"]), (self._iopub, info["iopub_port"])):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
        self._comm_id = uuid.uuid4().hex
        self._iopub.setsockopt(zmq.SUBSCRIBE, f"comm-{self._comm_id}".encode())
        time.sleep(0.5)  # let the subscription reach the kernel before the first reply
        self._session.send(self._shell, "comm_open", {"comm_id": self._comm_id, "target_name": self.TARGET, "data": {}})
        self.small()  # the comm is open once a message comes back

    def small(self) -> None:
        self._session.send(self._shell, "comm_msg", {"comm_id": self._comm_id, "data": {"i": 1}})
        while True:
            if not self._iopub.poll(int(CALL_TIMEOUT * 1000)):
                raise TimeoutError("the bare comm kernel did not answer")
            _, frames = self._session.feed_identities(self._iopub.recv_multipart(copy=False), copy=False)
            if self._session.deserialize(frames, content=False, copy=False)["header"]["msg_type"] == "comm_msg":
                return

    def close(self) -> None:
        self._shell.close()
        self._iopub.close()
        self._ctx.term()
        self._km.shutdown_kernel(now=True)


# -- measuring ------------------------------------------------------------------------------------------
def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _percentile(samples: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def _paired_ratio(nbr: Sequence[float], raw: Sequence[float]) -> float:
    """Median of per-trial ratios: trial i of each path ran back to back, so a burst of load elsewhere on
    the machine hits both sides of a pair and cancels out, where a ratio of two medians would not."""
    return statistics.median(n / r for n, r in zip(nbr, raw, strict=True))


def _same_bits(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor) -> bool:
    """Same type, dtype, shape and bytes (NaN-safe, unlike ==)."""
    if type(a) is not type(b) or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    return bool(np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)))


@dataclass
class Row:
    case: str
    nbremote: str
    baseline: str = "-"
    ratio: str = "-"
    aim: str = "-"
    notes: str = "-"


@dataclass
class EchoPlan:
    nbytes: int
    rounds: int  # alternating blocks: raw zmq, numpy, torch
    block: int  # back-to-back echoes per block


@dataclass
class Settings:
    small_rounds: int  # alternating blocks: raw zmq, nbremote
    small_calls: int  # per block
    echoes: list[EchoPlan]
    inflight: int
    throughput_trials: int
    start_trials: int


FULL = Settings(  # about 45 s on 2 cores
    small_rounds=6,
    small_calls=1000,
    echoes=[EchoPlan(MB, rounds=5, block=20), EchoPlan(64 * MB, rounds=15, block=1)],
    inflight=1000,
    throughput_trials=5,
    start_trials=5,
)
QUICK = Settings(  # about 15 s
    small_rounds=2,
    small_calls=150,
    echoes=[EchoPlan(MB, rounds=2, block=5), EchoPlan(64 * MB, rounds=5, block=1)],
    inflight=1000,
    throughput_trials=1,
    start_trials=1,
)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _spread(seconds: Sequence[float]) -> str:
    return f"[{_ms(min(seconds))} .. {_ms(max(seconds))}]"


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


@contextlib.contextmanager
def _world(n_workers: int) -> Iterator[list[str]]:
    names = [f"worker{i}" for i in range(1, n_workers + 1)]
    rpc.init_rpc("driver", workers=names)
    try:
        yield names
    finally:
        # Not graceful: every call made here is waited for, except after a failure, when draining the
        # calls still pending could take CALL_TIMEOUT each.
        rpc.shutdown(graceful=False)


def bench_small(raw: RawEcho, bare: BareComm, worker: str, s: Settings) -> list[Row]:
    for _ in range(100):  # warm-up: connections, code paths, the worker's unpickling cache
        raw.small()
        bare.small()
        rpc.rpc_sync(worker, noop, timeout=CALL_TIMEOUT)
    raw_t: list[float] = []
    bare_t: list[float] = []
    nbr_t: list[float] = []
    for _ in range(s.small_rounds):
        raw_t += [_timed(raw.small) for _ in range(s.small_calls)]
        bare_t += [_timed(bare.small) for _ in range(s.small_calls)]
        nbr_t += [_timed(lambda: rpc.rpc_sync(worker, noop, timeout=CALL_TIMEOUT)) for _ in range(s.small_calls)]
    nbr50, bare50 = _percentile(nbr_t, 50), _percentile(bare_t, 50)
    rows = [Row(f"small call p50 vs bare comm (n={len(nbr_t)})", _ms(nbr50), f"bare comm {_ms(bare50)}",
                f"{nbr50 / bare50:.2f}x", "-", "proto 1.21 ms (the notes' bare comm)")]
    for q in (50, 90):
        nbr, base = _percentile(nbr_t, q), _percentile(raw_t, q)
        aim = f"<= 1 ms: {_verdict(nbr <= 1e-3)}" if q == 50 else "-"
        notes = "raw 0.13 / proto 1.21 / torch.rpc 0.38 / ipp 2.7 ms" if q == 50 else "-"
        rows.append(Row(f"small call p{q} (n={len(nbr_t)})", _ms(nbr), _ms(base), f"{nbr / base:.1f}x", aim, notes))
    return rows


def bench_echo(raw: RawEcho, worker: str, s: Settings) -> list[Row]:
    notes = {MB: "raw 0.37 / proto 1.65 / torch.rpc 1.0 ms", 64 * MB: "raw 88 / proto 97 / torch.rpc 82 ms"}
    rows = []
    rng = np.random.default_rng(0)
    for plan in s.echoes:
        arr = rng.standard_normal(plan.nbytes // 4, dtype=np.float32)
        ten = torch.from_numpy(rng.standard_normal(plan.nbytes // 4, dtype=np.float32))
        paths: dict[str, Callable[[], Any]] = {
            "raw zmq": functools.partial(raw.echo, arr),
            "numpy": functools.partial(rpc.rpc_sync, worker, identity, args=(arr,), timeout=CALL_TIMEOUT),
            "torch": functools.partial(rpc.rpc_sync, worker, identity, args=(ten,), timeout=CALL_TIMEOUT),
        }
        # checked once, outside the timing; doubles as the warm-up (the first tensor makes the worker import torch)
        bad = [name for name, echo in paths.items() if not _same_bits(echo(), ten if name == "torch" else arr)]
        if bad:
            raise AssertionError(f"echo of {plan.nbytes // MB} MB came back different through: {', '.join(bad)}")
        times: dict[str, list[float]] = {name: [] for name in paths}
        # Blocks of back-to-back echoes, alternating between paths so drift hits all alike. No gc.collect()
        # or sleep in between: either leaves caches cold and doubled the raw 1 MB echo in trials.
        for _ in range(plan.rounds):
            for name, echo in paths.items():
                times[name] += [_timed(echo) for _ in range(plan.block)]
        base = statistics.median(times["raw zmq"])
        n = plan.rounds * plan.block
        for kind in ("numpy", "torch"):
            nbr = statistics.median(times[kind])
            ratio = _paired_ratio(times[kind], times["raw zmq"])
            aim = f"<= 1.2x: {_verdict(ratio <= 1.2)}" if plan.nbytes >= 64 * MB else "-"
            rows.append(
                Row(
                    f"echo {plan.nbytes // MB} MB {kind} (median of {n})",
                    f"{_ms(nbr)} {_spread(times[kind])}",
                    f"{_ms(base)} {_spread(times['raw zmq'])}",
                    f"{ratio:.2f}x",
                    aim,
                    notes[plan.nbytes],
                )
            )
    return rows


def bench_throughput(workers: Sequence[str], s: Settings) -> Row:
    def burst(n: int) -> None:
        futs = [rpc.rpc_async(workers[i % len(workers)], noop, timeout=CALL_TIMEOUT) for i in range(n)]
        for f in futs:
            f.wait()

    burst(100)  # warm-up
    rates = []
    for _ in range(s.throughput_trials):
        gc.collect()
        rates.append(s.inflight / _timed(lambda: burst(s.inflight)))
    rate = statistics.median(rates)
    spread = f" [{min(rates):,.0f} .. {max(rates):,.0f}]" if len(rates) > 1 else ""
    return Row(
        f"{s.inflight:,} calls in flight, {len(workers)} worker{'s' * (len(workers) > 1)}",
        f"{rate:,.0f} /s{spread}",
        notes="proto 865 / torch.rpc 11,054 / ipp 555 /s",
    )


def bench_start(s: Settings) -> list[Row]:
    rows = []
    for n in (1, 4):
        starts, stops = [], []
        for _ in range(s.start_trials):
            names = [f"worker{i}" for i in range(1, n + 1)]
            t0 = time.perf_counter()
            rpc.init_rpc("driver", workers=names)
            starts.append(time.perf_counter() - t0)
            ok = False
            try:
                rpc.rpc_sync(names[-1], noop, timeout=CALL_TIMEOUT)  # the world is usable, not merely started
                ok = True
            finally:
                stops.append(_timed(functools.partial(rpc.shutdown, graceful=ok)))
        ref = "proto 0.31 s / torch init_rpc 1.25 s" if n == 1 else "proto 4 in parallel 0.61 s"
        label = f"(median of {s.start_trials})" if s.start_trials > 1 else ""
        rows.append(
            Row(
                f"init_rpc, {n} worker{'s' * (n > 1)} {label}".rstrip(), f"{statistics.median(starts):.2f} s", notes=ref
            )
        )
        rows.append(Row(f"shutdown, {n} worker{'s' * (n > 1)}", f"{statistics.median(stops):.2f} s"))
    return rows


def _cpu_busy(window: float = 0.5) -> float | None:
    """Fraction of all cores busy over ``window`` seconds (Linux ``/proc/stat``), while this script idles."""
    try:
        with open("/proc/stat") as f:
            before = [int(v) for v in f.readline().split()[1:]]
        time.sleep(window)
        with open("/proc/stat") as f:
            after = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    delta = [b - a for a, b in zip(before, after, strict=True)]
    idle = delta[3] + delta[4]  # idle + iowait
    return 1 - idle / sum(delta) if sum(delta) else None


def _load_note(when: str) -> str:
    """How busy the machine is without us: other processes on the same cores inflate every figure."""
    busy = _cpu_busy()
    if busy is None:
        return f"load average {when}: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    flag = "  <- BUSY: other processes compete for the cores, figures are inflated" if busy > 0.2 else ""
    return f"CPU busy {when} (other processes): {busy:.0%}{flag}"


def print_table(rows: Sequence[Row]) -> None:
    header = Row("case", "nbremote", "raw zmq", "nbr/raw", "aim", "TRANSPORT-NOTES (other run)")
    cols = list(zip(*[(r.case, r.nbremote, r.baseline, r.ratio, r.aim, r.notes) for r in (header, *rows)], strict=True))
    widths = [max(len(c) for c in col) for col in cols]
    for i, r in enumerate((header, *rows)):
        cells = (r.case, r.nbremote, r.baseline, r.ratio, r.aim, r.notes)
        print(" | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (under a minute)")
    s = QUICK if parser.parse_args(argv).quick else FULL

    print(
        f"nbremote bench ({'quick' if s is QUICK else 'full'}): python {platform.python_version()}, "
        f"torch {torch.__version__}, numpy {np.__version__}, pyzmq {zmq.__version__}, {os.cpu_count()} cores"
    )
    print(_load_note("before"))
    t_start = time.perf_counter()
    rows: list[Row] = []
    failed: list[str] = []

    def section(title: str, bench: Callable[[], list[Row]]) -> None:
        """Run one part; a failure becomes a row (traceback on stderr) and the others still run."""
        print(f"{title} ...", flush=True)
        try:
            rows.extend(bench())
        except Exception as exc:
            traceback.print_exc()
            failed.append(title)
            rows.append(Row(f"{title}: FAILED", f"{type(exc).__name__}: {exc}"[:60]))

    raw = RawEcho()
    bare = BareComm()
    try:
        with _world(3) as workers:
            section("small calls", lambda: bench_small(raw, bare, workers[0], s))
            section("echo", lambda: bench_echo(raw, workers[0], s))
            section("throughput, 3 workers", lambda: [bench_throughput(workers, s)])
            section("throughput, 1 worker", lambda: [bench_throughput(workers[:1], s)])
    finally:
        raw.close()
        bare.close()
    section("kernel start", lambda: bench_start(s))
    print()
    print_table(rows)
    print("\nnbr/raw: nbremote time / raw zmq time (1.0 = no overhead over the bare socket); echoes: median of")
    print("per-trial ratios; ranges in [..] are min .. max")
    print(f"total {time.perf_counter() - t_start:.0f} s; {_load_note('after')}")
    if failed:
        print(f"FAILED: {', '.join(failed)} (tracebacks above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
