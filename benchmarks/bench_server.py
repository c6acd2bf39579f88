"""zmq vs a Jupyter server's websocket: the same worker calls through both transports, in one run.

    python benchmarks/bench_server.py [--calls 500] [--echo-mb 64] [--rounds 5] [--quick]

Starts a ``jupyter server`` on loopback (a token, stock settings: tornado's 10 MiB message limit
included) and two workers: ``zmq``, a local kernel (the embedded default, KernelLink), and ``server``, a
kernel of that server (``ServerKernel``, ServerLink). Rounds alternate between the two so that drift in
the machine's load hits both alike. Prints, per case, the median over rounds of each round's figure (a
small call: the p50 of ``--calls`` blocking calls; an echo: one round trip of ``--echo-mb`` MB of numpy
data) and the ratio server / zmq. Timing only: ``benchmarks/bench.py`` is the comparison harness.
"""

from __future__ import annotations

import argparse
import operator
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

import nbremote
from nbremote import rpc


def echo(x: Any) -> Any:
    return x


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(log_dir: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    port, token = _free_port(), secrets.token_hex(16)
    jupyter = str(Path(sys.executable).parent / "jupyter")
    log = open(log_dir / "jupyter-server.log", "wb")  # noqa: SIM115 -- lives as long as the server
    proc = subprocess.Popen([jupyter, "server", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
                             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={log_dir}"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=str(log_dir))
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(urllib.request.Request(url + "api/status",
                                   headers={"Authorization": f"token {token}"}), timeout=2).close()
            return proc, url, token
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"jupyter server did not start; its log: {log_dir / 'jupyter-server.log'}")


def small_call_ms(worker: str, calls: int) -> float:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        rpc.rpc_sync(worker, operator.add, args=(1, 2))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1000


def echo_ms(worker: str, payload: np.ndarray) -> float:
    t0 = time.perf_counter()
    back = rpc.rpc_sync(worker, echo, args=(payload,), timeout=0)
    elapsed = time.perf_counter() - t0
    if back.shape != payload.shape or back[-1] != payload[-1]:
        raise SystemExit(f"{worker}: the echo came back altered")
    return elapsed * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="blocking small calls per round (default 500)")
    parser.add_argument("--echo-mb", type=int, default=64, help="echo payload in MB (default 64)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, alternating the transports (default 5)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny samples, 1 MB echo, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.echo_mb, args.rounds = 20, 1, 1
    log_dir = Path(tempfile.mkdtemp(prefix="nbremote-server-bench-"))
    os.environ.setdefault("NBREMOTE_LOG_DIR", str(log_dir))
    proc, url, token = start_server(log_dir)
    try:
        rpc.init_rpc("driver", workers={"zmq": nbremote.LocalKernel(),
                                        "server": nbremote.ServerKernel(url, token=token, kernel_name="python3")})
        try:
            payload = np.arange(args.echo_mb * (1 << 20) // 4, dtype=np.float32)
            for worker in ("zmq", "server"):  # warm up: first-call imports, the thread sockets, page faults
                small_call_ms(worker, 50)
                echo_ms(worker, payload)
            figures: dict[tuple[str, str], list[float]] = {}
            for _ in range(args.rounds):
                for worker in ("zmq", "server"):
                    figures.setdefault(("small call", worker), []).append(small_call_ms(worker, args.calls))
                    figures.setdefault((f"echo {args.echo_mb} MB", worker), []).append(echo_ms(worker, payload))
        finally:
            rpc.shutdown()
    finally:
        proc.terminate()
        proc.wait(15)
    print(f"nbremote {nbremote.__version__}: zmq (LocalKernel) vs Jupyter server websocket (ServerKernel), "
          f"{args.rounds} round(s), {os.cpu_count()} cores; logs in {log_dir}")
    print(f"{'case':<16}{'zmq ms':>10}{'server ms':>12}{'server/zmq':>12}")
    for case in dict.fromkeys(c for c, _ in figures):
        zmq_ms = statistics.median(figures[(case, "zmq")])
        server_ms = statistics.median(figures[(case, "server")])
        print(f"{case:<16}{zmq_ms:>10.3f}{server_ms:>12.3f}{server_ms / zmq_ms:>11.2f}x")
    print("(zmq on one host sends big buffers through shared memory; through a server every byte crosses its "
          "websocket twice and tornado unmasks, copies and re-frames it)")


if __name__ == "__main__":
    main()
