"""An SSH tunnel to an attached kernel's five ports: one ``ssh -N -L ...`` process that nbremote owns.

jupyter_client's ``tunnel_to_kernel`` starts one ``ssh -f ... sleep 60`` per port under pexpect; on
this kind of machine those backgrounded processes often died as pexpect closed its terminal (3 of 5
tunnels lost in one try), and the ones that live are nobody's to stop. One ssh process carrying all
five forwards, without a terminal, fails loudly (``ExitOnForwardFailure``, ``BatchMode``: key or agent
login only, never a password prompt that would hang) and is stopped with its worker.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from typing import Any

from nbremote.errors import WorkerStartError

_READY = "nbremote-tunnel-ready"
PORTS = ("shell_port", "iopub_port", "stdin_port", "hb_port", "control_port")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def parse_server(server: str) -> tuple[str, str | None]:
    """``user@host:port`` -> (``user@host``, ``port``); the port is optional."""
    host, _, port = server.rpartition(":") if server.count(":") == 1 else (server, "", "")
    if port and not port.isdigit():
        raise ValueError(f"bad SSH server {server!r}: expected user@host or user@host:port")
    return (host or server), (port or None)


class SSHTunnel:
    """Forwards local loopback ports to the kernel's ports as seen from ``server``."""

    def __init__(self, name: str, conn: dict[str, Any], server: str, keyfile: str | None, log_path: str,
                 timeout: float = 20.0) -> None:
        host, port = parse_server(server)
        remote_ip = str(conn.get("ip", "127.0.0.1"))
        if remote_ip in ("0.0.0.0", ""):
            remote_ip = "127.0.0.1"
        local = _free_ports(len(PORTS))
        # ssh runs LocalCommand once its forwards are bound (a bind that fails exits it first): the marker
        # in the log says the ports are ssh's, not some other process's that happens to listen there
        cmd = ["ssh", "-N", "-o", "ExitOnForwardFailure=yes", "-o", "BatchMode=yes",
               "-o", "ServerAliveInterval=15", "-o", "PermitLocalCommand=yes",
               "-o", f"LocalCommand=echo {_READY}"]
        if keyfile:
            cmd += ["-i", os.path.expanduser(keyfile)]
        if port:
            cmd += ["-p", port]
        for lp, key in zip(local, PORTS, strict=True):
            cmd += ["-L", f"127.0.0.1:{lp}:{remote_ip}:{conn[key]}"]
        cmd.append(host)
        self.log_path = log_path
        self._log_start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        self.conn = {**conn, **dict(zip(PORTS, local, strict=True)), "ip": "127.0.0.1"}
        self._wait_ready(name, server, local, timeout)

    def _wait_ready(self, name: str, server: str, ports: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(ports)
        while pending:
            if self.proc.poll() is not None:
                raise WorkerStartError(
                    f"cannot attach worker {name!r}: ssh to {server!r} exited with {self.proc.returncode} "
                    f"(see {self.log_path}; key or agent login must work without a prompt: "
                    f"try `ssh {parse_server(server)[0]} true`)", name)
            if time.monotonic() > deadline:
                self.close()
                raise WorkerStartError(f"cannot attach worker {name!r}: the SSH tunnel to {server!r} was not "
                                       f"up after {timeout:.0f} s (see {self.log_path})", name)
            if self._ready():
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", pending[0])) == 0:
                        pending.pop(0)
                        continue
            time.sleep(0.05)

    def _ready(self) -> bool:
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            return _READY.encode() in log.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(3)
