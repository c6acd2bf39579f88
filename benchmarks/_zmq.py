"""Raw pyzmq, the floor: a REQ/REP echo to a server in a spawned process, over ``tcp://127.0.0.1``.

No framing, no pickling, no kernel: the least a round trip of these bytes can cost on this machine. Both
ends send without copying and the reply is rebuilt as an array over the received frame.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq
from _cases import ZMQ, Case
from _payload import as_bytes, make_payload, same_bits
from _system import CALL_TIMEOUT, OpSystem


def _echo_server(conn: multiprocessing.connection.Connection) -> None:
    """REP socket on a loopback port (the OS picks it) that sends every message back as it came."""
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


class RawZmq(OpSystem):
    name = ZMQ

    def __init__(self) -> None:
        super().__init__()
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None

    def start(self) -> None:
        mp = multiprocessing.get_context("spawn")
        parent, child = mp.Pipe(duplex=False)
        self._proc = mp.Process(target=_echo_server, args=(child,), name="bench-zmq-echo", daemon=True)
        self._proc.start()
        child.close()
        with parent:
            if not parent.poll(60):
                raise RuntimeError("the zmq echo server did not report its endpoint within 60 s")
            endpoint = parent.recv()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVTIMEO, int(CALL_TIMEOUT * 1000))
        self._sock.connect(endpoint)

    def _socket(self) -> zmq.Socket[Any]:
        if self._sock is None:
            raise RuntimeError("the raw zmq client is not connected")
        return self._sock

    def _small(self) -> None:
        sock = self._socket()
        sock.send(b"x")
        sock.recv()

    def _echo(self, x: Any) -> Any:
        sock = self._socket()
        sock.send(as_bytes(x).data, copy=False)  # ndarray.data: a memoryview, no copy
        frame = sock.recv(copy=False)
        array = np.frombuffer(frame.buffer, dtype=np.float32).reshape(tuple(x.shape))
        if isinstance(x, np.ndarray):
            return array
        import torch

        return torch.from_numpy(array)

    def supports(self, case: Case) -> bool:
        return case.kind in ("call", "echo")

    def make(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        if case.kind == "call":
            return {}, self._small
        x = make_payload(case.nbytes, case.payload)
        return {"bit_exact": same_bits(self._echo(x), x)}, lambda: self._echo(x)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.terminate()
            self._proc.join(10)
            self._proc = None
