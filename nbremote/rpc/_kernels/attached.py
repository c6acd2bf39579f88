"""A kernel someone else started, reached through its connection file: ``AttachedKernel(connection_file,
ssh=None)``, directly or through an SSH tunnel nbremote owns (``tunnel``). nbremote neither starts nor
stops such a kernel; a lease (``nbremote.rpc._wire.lease``) frees what the driver held there if the
driver goes away."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from nbremote.errors import WorkerStartError
from nbremote.rpc._kernels.handle import StartedKernel
from nbremote.rpc._kernels.paths import log_dir
from nbremote.rpc._kernels.tunnel import SSHTunnel

__all__ = ["AttachedKernel"]

REREAD_S = 2.0  # how long a connection file that is being written again is read again


class _TunneledKernel(StartedKernel):
    """An attached kernel reached through an SSH tunnel that nbremote owns (and stops)."""

    shareable = False  # the tunnel's ports exist on the driver's machine only

    def __init__(self, tunnel: SSHTunnel) -> None:
        super().__init__(tunnel.conn)
        self.tunnel = tunnel
        self.log_path = tunnel.log_path

    def stop(self, timeout: float = 2.0) -> None:
        self.tunnel.close()  # the kernel itself is not ours


class AttachedKernel:
    """A kernel that is already running, reached through its connection file (optionally over SSH)."""

    def __init__(self, connection_file: str | os.PathLike[str] | dict[str, Any], ssh: str | None = None,
                 sshkey: str | None = None) -> None:
        if not isinstance(connection_file, (str, os.PathLike, dict)):
            raise TypeError("AttachedKernel needs the path of a kernel's connection file (str or Path) or its "
                            f"contents (dict), got {type(connection_file).__name__}")
        if ssh is not None and not isinstance(ssh, str):
            raise TypeError(f"AttachedKernel(ssh=...) is a str such as 'user@host', got {type(ssh).__name__}")
        if sshkey is not None and not isinstance(sshkey, (str, os.PathLike)):
            raise TypeError(f"AttachedKernel(sshkey=...) is the path of a key file, got {type(sshkey).__name__}")
        self.connection_file = connection_file
        self.ssh = ssh
        self.sshkey = sshkey

    def start(self, name: str) -> StartedKernel:
        if isinstance(self.connection_file, dict):
            conn = dict(self.connection_file)
        else:
            conn = _read_connection_file(Path(self.connection_file), name)
        missing = [k for k in ("shell_port", "iopub_port", "control_port", "hb_port", "key") if k not in conn]
        if missing:
            where = "the connection info" if isinstance(self.connection_file, dict) else \
                f"{str(self.connection_file)!r}"
            raise WorkerStartError(f"cannot attach worker {name!r}: {where} is not a kernel connection file: it lacks "
                                   f"{missing}; pass the kernel-*.json its kernel wrote", name)
        if self.ssh:
            path = log_dir() / f"{name.replace(':', '_')}-{os.getpid()}-ssh.log"
            return _TunneledKernel(SSHTunnel(name, conn, self.ssh, self.sshkey, str(path)))
        return StartedKernel(conn)

    def __repr__(self) -> str:
        return f"AttachedKernel({str(self.connection_file)!r}, ssh={self.ssh!r})"


def _read_connection_file(path: Path, name: str) -> dict[str, Any]:
    """The connection file's contents. ipykernel writes its file again once its sockets are bound (truncate,
    then write), so a file read just then is empty or cut short: such a read is tried again for up to
    ``REREAD_S``; a file that cannot be read, or stays malformed, is an error."""
    deadline = time.monotonic() + REREAD_S
    while True:
        try:
            conn = json.loads(path.read_text())
            if not isinstance(conn, dict):
                raise ValueError(f"it holds a {type(conn).__name__}, not a JSON object")
            return conn
        except (OSError, ValueError) as exc:
            if isinstance(exc, OSError) or time.monotonic() > deadline:
                raise WorkerStartError(f"cannot attach worker {name!r}: connection file {str(path)!r} is unreadable "
                                       f"({exc})", name) from exc
        time.sleep(0.05)
