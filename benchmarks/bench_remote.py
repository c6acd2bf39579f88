"""Workers on a second host: nbremote's ways there against torch.distributed.rpc (TensorPipe), in one run.

    python benchmarks/bench_remote.py [--calls 300] [--rounds 3] [--quick]

Makes the tests' second host (``tests/secondhost.py``: a network namespace on a veth pair, root only) and
measures, from this process as the driver, a small call (p50 of ``--calls`` blocking calls) and echoes of
1, 16 and 64 MB (numpy float64, one round trip each, checked) to:

* ``zmq-curve``: ``nbremote worker --ip`` there, attached (nbremote's default beyond loopback: CurveZMQ);
* ``zmq-clear``: the same with ``--no-encrypt`` (signed, buffers digested): TensorPipe's terms;
* ``server``: a kernel of a ``jupyter server`` there whose kernels bind its address, CurveZMQ on: big
  buffers by the direct data channel, the rest through the server's websocket;
* ``EG-ws``: a kernel of Enterprise Gateway 3.3 there (its own environment): kernels on its loopback,
  so every byte goes through the gateway's websocket. Its floor is the gateway's own CPU for relaying
  the bytes (zmq to websocket frames and back), measured from ``/proc`` during each echo and printed
  with the ratio of the echo's time to it: what nbremote adds on top of what the gateway must do;
* ``torch``: torch.distributed.rpc between a process here and one there, TensorPipe over TCP only
  (``uv`` transport, ``basic`` channel: its shared-memory and cma ways would not cross real hosts).

Rounds alternate between them so that drift in the machine's load hits all alike; each figure is the
median over rounds. Ratios are to torch in the same run.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import secondhost  # noqa: E402 -- the tests' second host
from _env import cpu_seconds  # noqa: E402
from _fns import identity as echo  # noqa: E402 -- importable on every side, torch's peer included (by reference)
from _fns import noop  # noqa: E402

import nbremote  # noqa: E402
from nbremote import rpc  # noqa: E402

BIN = Path(sys.executable).parent
SIZES_MB = (1, 16, 64)

TORCH_PEER = """
import os, sys, torch
from torch.distributed import rpc
opts = rpc.TensorPipeRpcBackendOptions(init_method=sys.argv[1], _transports=["uv"], _channels=["basic"],
                                       rpc_timeout=300)
rpc.init_rpc("peer", rank=1, world_size=2, rpc_backend_options=opts)
rpc.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_workers(host: secondhost.SecondHost, tmp: Path, relays: dict[str, int]) -> dict[str, Any]:
    """The workers there, by way; ``relays`` gets the process id of the server each server-hosted way goes
    through (the process is ``exec``'d by the namespace's shell, so it keeps the spawned one's id)."""
    url, token = host.jupyter_server(tmp)
    relays["server"] = host.procs[-1].pid
    gw_url, gw_token = host.enterprise_gateway(tmp)
    relays["EG-ws"] = host.procs[-1].pid
    return {"zmq-curve": nbremote.AttachedKernel(host.start_worker(tmp, "curve")),
            "zmq-clear": nbremote.AttachedKernel(host.start_worker(tmp, "clear", "--no-encrypt")),
            "server": nbremote.ServerKernel(url, token=token, kernel_name="python3"),
            "EG-ws": nbremote.ServerKernel(gw_url, token=gw_token, kernel_name="nbremote",
                                           env={"KERNEL_USERNAME": "bench"})}


def start_torch(host: secondhost.SecondHost, tmp: Path) -> Any:
    from torch.distributed import rpc as trpc

    init = f"tcp://{host.host_ip}:{_free_port()}"
    script = tmp / "torch_peer.py"
    script.write_text(textwrap.dedent(TORCH_PEER))
    host.spawn([sys.executable, str(script), init], tmp / "torch.log",
               env={**os.environ, "TP_SOCKET_IFNAME": host.ns_if, "GLOO_SOCKET_IFNAME": host.ns_if,
                    "PYTHONPATH": str(Path(__file__).parent)})
    # both ranks on their end of the veth (TensorPipe's uv transport and the Gloo group torch's init makes)
    os.environ["TP_SOCKET_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"] = host.host_if
    opts = trpc.TensorPipeRpcBackendOptions(init_method=init, _transports=["uv"], _channels=["basic"],
                                            rpc_timeout=300)
    trpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=opts)
    return trpc


def timed(call: Any, payload: Any) -> float:
    """ms for ``call(payload)`` (``call()`` when None), an echo checked at both ends and in the middle."""
    t0 = time.perf_counter()
    back = call() if payload is None else call(payload)
    elapsed = time.perf_counter() - t0
    mid = len(payload) // 2 if payload is not None else 0
    if payload is not None and (back.shape != payload.shape or back[-1] != payload[-1] or back[mid] != payload[mid]):
        raise SystemExit("an echo came back altered")
    return elapsed * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 20 calls, 1 MB only, 1 round")
    args = parser.parse_args(argv)
    why = secondhost.unavailable()
    if why:
        raise SystemExit(f"no second host here: {why}")
    sizes = (1,) if args.quick else SIZES_MB
    if args.quick:
        args.calls, args.rounds = 20, 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still removes its host (finally)
    tmp = Path(tempfile.mkdtemp(prefix="nbremote-remote-bench-"))
    os.environ.setdefault("NBREMOTE_LOG_DIR", str(tmp))
    host = secondhost.SecondHost()
    try:
        relays: dict[str, int] = {}
        rpc.init_rpc("driver", workers=start_workers(host, tmp, relays))
        trpc = start_torch(host, tmp)
        try:
            import torch

            ways: dict[str, Any] = {w: (lambda x, w=w: rpc.rpc_sync(w, echo, args=(x,), timeout=0),
                                       lambda w=w: rpc.rpc_sync(w, noop)) for w in ("zmq-curve", "zmq-clear",
                                                                                    "server", "EG-ws")}
            ways["torch"] = (lambda x: trpc.rpc_sync("peer", echo, args=(x,)), lambda: trpc.rpc_sync("peer", noop))
            payloads = {mb: np.random.default_rng(mb).standard_normal(mb * (1 << 20) // 8) for mb in sizes}
            tensors = {mb: torch.from_numpy(a) for mb, a in payloads.items()}
            figures: dict[tuple[str, str], list[float]] = {}
            relayed: dict[tuple[str, str], list[float]] = {}  # (case, way) -> the server's CPU ms in each echo

            def one_round(record: bool) -> None:
                for way, (big, small) in ways.items():
                    samples = [timed(small, None) for _ in range(args.calls)]
                    if record:
                        figures.setdefault(("small call", way), []).append(statistics.median(samples))
                    for mb in sizes:
                        relay = relays.get(way)
                        cpu = cpu_seconds(relay) if relay else 0.0
                        ms = timed(big, tensors[mb] if way == "torch" else payloads[mb])
                        if record:
                            figures.setdefault((f"echo {mb} MB", way), []).append(ms)
                            if relay:
                                relayed.setdefault((f"echo {mb} MB", way), []).append(
                                    (cpu_seconds(relay) - cpu) * 1000)

            one_round(record=False)  # warm up: imports, thread sockets, pools
            for _ in range(args.rounds):
                one_round(record=True)
        finally:
            trpc.shutdown()
            rpc.shutdown()
    finally:
        host.close()
    names = list(dict.fromkeys(w for _, w in figures))
    print(f"nbremote {nbremote.__version__}, second host {host.ip} (network namespace, veth), {args.rounds} round(s), "
          f"{os.cpu_count()} cores; medians in ms, (ratio to torch); logs in {tmp}")
    print(f"{'case':<14}" + "".join(f"{w:>20}" for w in names))
    for case in dict.fromkeys(c for c, _ in figures):
        ref = statistics.median(figures[(case, "torch")])
        cells = []
        for w in names:
            ms = statistics.median(figures[(case, w)])
            cells.append(f"{ms:>11.2f} ({ms / ref:4.2f}x)" if w != "torch" else f"{ms:>20.2f}")
        print(f"{case:<14}" + "".join(f"{c:>20}" for c in cells))
    print("\nthrough a server: the echo's time against the server's own CPU in it (its floor; clock ticks of "
          f"{1000 / os.sysconf('SC_CLK_TCK'):.0f} ms), medians in ms")
    print(f"{'case':<14}{'way':>8}{'echo':>10}{'server CPU':>12}{'echo / floor':>14}")
    for (case, way), cpu_ms in relayed.items():
        ms, floor = statistics.median(figures[(case, way)]), statistics.median(cpu_ms)
        enough = floor >= 100  # ten clock ticks: a shorter one is too coarse to divide by
        print(f"{case:<14}{way:>8}{ms:>10.1f}{floor:>12.1f}" + (f"{ms / floor:>13.2f}x" if enough else f"{'-':>14}"))
    print("(the server way sends big buffers by its direct channel, past the server: its CPU stays near 0; "
          "'-': under ten clock ticks, too coarse to divide by)")


if __name__ == "__main__":
    main()
