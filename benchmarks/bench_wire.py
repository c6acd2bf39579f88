"""The floor under every message: a round trip between two processes of this machine, by transport, in one run.

    python benchmarks/bench_wire.py [--rounds 5] [--trips 1000] [--quick]

A training step is a chain of messages, each waiting for the one before (a parameter server's turn: about
eight), so what one message costs before any of nbremote's work is what a step can never go below. Each
round measures, in an order rotated from round to round, the median round trip of a 200-byte message
between this process and a child process that sends it back:

- ``zmq-tcp``: a DEALER to a ROUTER on 127.0.0.1, what a kernel bound to loopback over TCP is reached by;
- ``zmq-ipc``: the same over a Unix-domain socket file, what nbremote's local kernels use (``LocalKernel``);
- ``unix``: a ``SOCK_SEQPACKET`` Unix-domain socket that the two threads read and write themselves;
- ``unix-poll``: the same, each side waiting in ``zmq.Poller.poll`` on the socket's descriptor, as a thread that
  also polls zmq sockets (nbremote's IO thread) would;
- ``nbremote``: ``rpc_sync(worker, noop)`` to a local worker kernel, everything included.

Each case runs back to back (``hot``) and with a 2 ms sleep before each trip (``after idle``): a step's
messages leave after compute or a wait, when the CPUs went idle. zmq hands every message to its I/O
thread on both sides, so a zmq round trip wakes six threads where a Unix socket wakes two. Prints each
case's median over rounds of its per-round median, and the ratio to ``zmq-ipc``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import zmq

MESSAGE = b"x" * 200
STOP = b"stop"
IDLE_S = 0.002
CASES = ("zmq-tcp", "zmq-ipc", "unix", "unix-poll", "nbremote")


def _echo_zmq(url: str, ready: Connection) -> None:
    """The child of a zmq case: a ROUTER that sends every message back until it gets STOP."""
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(url)
    ready.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while True:
        frames = sock.recv_multipart()
        if frames[-1] == STOP:
            return
        sock.send_multipart(frames)


def _echo_unix(path: str, poll: bool, ready: Connection) -> None:
    """The child of a Unix-socket case: it sends every message back until it gets STOP."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(1)
    ready.send(path)
    conn, _ = server.accept()
    poller = zmq.Poller()
    poller.register(conn.fileno(), zmq.POLLIN)
    while True:
        if poll:
            poller.poll()
        message = conn.recv(65536)
        if message == STOP or not message:
            return
        conn.send(message)


def _endpoint(conn: Connection, case: str) -> str:
    """Where a case's child listens, once it says so (60 s at most, as ``_zmq``'s echo server is waited for)."""
    if not conn.poll(60):
        raise RuntimeError(f"the {case} echo process did not report where it listens within 60 s")
    return str(conn.recv())


class Peer:
    """One case's child process and this side's end of its transport; ``trip()`` is one round trip."""

    def __init__(self, case: str, folder: Path) -> None:
        spawn = multiprocessing.get_context("spawn")  # no fork after the world's threads have started
        ours, theirs = spawn.Pipe()
        if case.startswith("zmq"):
            url = "tcp://127.0.0.1:*" if case == "zmq-tcp" else f"ipc://{folder / 'zmq.sock'}"
            self.child = spawn.Process(target=_echo_zmq, args=(url, theirs), daemon=True)
            self.child.start()
            self._dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
            self._dealer.connect(_endpoint(ours, case))
            self.trip: Callable[[], None] = self._zmq_trip
        else:
            path = str(folder / f"{case}.sock")
            self.child = spawn.Process(target=_echo_unix, args=(path, case == "unix-poll", theirs), daemon=True)
            self.child.start()
            self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._unix.connect(_endpoint(ours, case))
            self._poller = zmq.Poller()
            self._poller.register(self._unix.fileno(), zmq.POLLIN)
            self.trip = self._poll_trip if case == "unix-poll" else self._unix_trip

    def _zmq_trip(self) -> None:
        self._dealer.send(MESSAGE)
        if self._dealer.recv() != MESSAGE:
            raise RuntimeError("the zmq echo sent back something else")

    def _unix_trip(self) -> None:
        self._unix.send(MESSAGE)
        if self._unix.recv(65536) != MESSAGE:
            raise RuntimeError("the Unix-socket echo sent back something else")

    def _poll_trip(self) -> None:
        self._unix.send(MESSAGE)
        self._poller.poll()
        if self._unix.recv(65536) != MESSAGE:
            raise RuntimeError("the Unix-socket echo sent back something else")

    def close(self) -> None:
        if self.trip == self._zmq_trip:
            self._dealer.send(STOP)
            self._dealer.close(linger=0)
        else:
            self._unix.send(STOP)
            self._unix.close()
        self.child.join(5)


def noop() -> None:
    return None


def median_trip(trip: Callable[[], None], trips: int, idle: bool) -> float:
    """The median of ``trips`` round trips, in seconds (after a 2 ms sleep before each where ``idle``)."""
    samples = []
    for _ in range(trips):
        if idle:
            time.sleep(IDLE_S)
        t0 = time.perf_counter()
        trip()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trips", type=int, default=1000, help="round trips per case and round (hot; after idle: "
                        "a fifth of them)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round of 50 trips; figures mean nothing")
    args = parser.parse_args()
    rounds, trips = (1, 50) if args.quick else (args.rounds, args.trips)
    from nbremote import rpc

    with tempfile.TemporaryDirectory(prefix="nbr-wire-") as folder:
        peers = {case: Peer(case, Path(folder)) for case in CASES if case != "nbremote"}
        rpc.init_rpc("driver", workers=["worker1"])
        try:
            trips_of: dict[str, Callable[[], None]] = {case: peer.trip for case, peer in peers.items()}
            trips_of["nbremote"] = lambda: rpc.rpc_sync("worker1", noop)
            for trip in trips_of.values():  # warm every path
                median_trip(trip, 50, False)
            figures: dict[tuple[str, bool], list[float]] = {}
            for r in range(rounds):
                order = CASES[r % len(CASES):] + CASES[:r % len(CASES)]
                for idle in (False, True):
                    for case in order:
                        n = max(trips // 5, 10) if idle else trips
                        figures.setdefault((case, idle), []).append(median_trip(trips_of[case], n, idle))
        finally:
            rpc.shutdown()
            for peer in peers.values():
                peer.close()
    print(f"round trip of {len(MESSAGE)} bytes between two processes, median over {rounds} round(s)")
    print(f"{'case':<11}{'hot us':>9}{'/zmq-ipc':>10}{'after idle us':>15}{'/zmq-ipc':>10}")
    base = {idle: statistics.median(figures[("zmq-ipc", idle)]) for idle in (False, True)}
    for case in CASES:
        cells = []
        for idle in (False, True):
            us = statistics.median(figures[(case, idle)])
            cells.append(f"{us * 1e6:>{13 if idle else 9}.0f}{us / base[idle]:>9.2f}x")
        print(f"{case:<11}" + " ".join(cells))


if __name__ == "__main__":
    main()
