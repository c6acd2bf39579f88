"""A kernel the world can talk to, however it was started: ``StartedKernel`` and the handles derived from it.

``StartedKernel`` is what the driver holds of any worker's kernel: its connection info, whether it lives,
how to interrupt and stop it (when it is the driver's to stop), where its log is, and a new link to it
(``link``). ``OwnedKernel`` is one nbremote started on this machine through jupyter_client's
``KernelManager`` (``local``); provisioned and server-hosted kernels have handles of their own
(``provisioned``, ``hosted``), and an attached kernel is a plain ``StartedKernel`` (``attached``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

from jupyter_client.manager import KernelManager

from nbremote.rpc._transport.base import Connection
from nbremote.rpc._transport.zmqlink import KernelLink

__all__ = ["EMBEDDED", "EMBEDDED_FORKED", "OwnedKernel", "StartedKernel", "log_says", "log_size", "log_tail",
           "thread_event_loop_closed"]

EMBEDDED = "nbremote-embedded-python"
EMBEDDED_FORKED = "nbremote-embedded-python-forked"  # the same kernel, forked from a warm zygote


class StartedKernel:
    """A kernel the world can talk to: its connection info, and how to tell it is alive / stop it."""

    owned: bool = False
    kind: str = "attached"  # "local" (the embedded default), "kernelspec", "attached" or "server"
    pid: int | None = None
    host: str | None = None  # where the kernel runs, when the driver knows better than the worker's own name
    provisioned = False  # started through a provisioner that runs it beyond this machine's processes

    def after_driver(self) -> dict[str, Any] | None:
        """How this kernel ends if its driver dies without stopping it (told to the worker at bootstrap, see
        ``_worker.install``): None when something else sees to it (a local child follows its parent)."""
        return {"how": "exit"} if self.provisioned and self.owned else None
    log_path: str | None = None
    log_start: int | None = None  # where this kernel's part of its log begins (written before it started)
    shareable: bool = True  # other workers can use the same connection info (not so through an SSH tunnel)

    def __init__(self, conn: dict[str, Any]) -> None:
        self.conn = conn

    def alive(self) -> bool:
        return True

    def stop(self, timeout: float = 2.0) -> None:
        """Attached kernels are not ours to stop."""

    def interrupt(self) -> bool:
        """Interrupt the kernel's main shell the way its starter can; False: not ours (send a request)."""
        return False

    def link(self, name: str) -> Connection:
        """A new, not yet handshaken link to this kernel (a ``KernelLink``; a server's kernel has its own)."""
        return KernelLink(name, self.conn, alive=self.alive if self.owned else None)


class OwnedKernel(StartedKernel):
    owned = True

    def __init__(self, km: KernelManager, log_path: str, log_file: Any) -> None:
        super().__init__(dict(km.get_connection_info(session=False)))
        self.km = km
        self.log_path = log_path
        self._log_file = log_file
        # the local provisioner keeps the Popen; other provisioners have none and we poll nothing
        proc = getattr(km.provisioner, "process", None)
        self._proc: subprocess.Popen[bytes] | None = proc
        self.pid = proc.pid if proc is not None else None
        self.kind = "local" if km.kernel_name in (EMBEDDED, EMBEDDED_FORKED) else "kernelspec"

    def alive(self) -> bool:
        # Without a local process (a remote provisioner) the heartbeat alone tells.
        return self._proc is None or self._proc.poll() is None

    def interrupt(self) -> bool:
        """Interrupt the kernel's running cell the way its kernelspec asks (a signal, or a message)."""
        with thread_event_loop_closed():
            self.km.interrupt_kernel()
        return True

    def stop(self, timeout: float = 2.0) -> None:
        proc = self._proc
        if proc is None:  # provisioned elsewhere: ask jupyter_client to stop it
            with contextlib.suppress(Exception):
                self.km.shutdown_kernel(now=True)
        elif proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # SIGTERM first: ipykernel exits
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout)
        with contextlib.suppress(Exception):  # cleanup of files only; never fail a shutdown over it
            self.km.cleanup_resources()
        self._log_file.close()


@contextlib.contextmanager
def thread_event_loop_closed() -> Iterator[None]:
    """Close the asyncio loop jupyter_client's sync methods leave behind in a helper thread.

    ``KernelManager.start_kernel`` & co. run a coroutine on an event loop they create for the calling
    thread and never close; a pool thread that ends leaves it to the garbage collector, which then
    complains ("Exception ignored in BaseEventLoop.__del__").
    """
    try:
        yield
    finally:
        if threading.current_thread() is not threading.main_thread():
            loop: asyncio.AbstractEventLoop | None = None
            with contextlib.suppress(RuntimeError):  # RuntimeError: this thread never made one
                loop = asyncio.get_event_loop_policy().get_event_loop()
            if loop is not None and not loop.is_running():
                loop.close()
                asyncio.set_event_loop(None)


def log_tail(path: str | None, offset: int = 0, lines: int = 12, limit: int = 2000) -> str:
    """The last lines ``path`` got after ``offset``, to quote in a start error ("" if none).

    A kernel that dies at start says why on its stderr (a missing module, a bad flag, a traceback);
    the error should show it, not only where the log is.
    """
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    tail = [line for line in text.splitlines() if line.strip()][-lines:]
    quoted = "\n".join(tail)[-limit:]
    return f"; its log ends with:\n{quoted}\n" if quoted else ""


def log_size(path: str | None) -> int:
    """How long the log at ``path`` is now (0 if there is none): where a kernel's part of it will begin."""
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def log_says(path: str | None, offset: int, text: str) -> bool:
    """Whether ``text`` was written to the log at ``path`` after ``offset``."""
    if not path:
        return False
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return text.encode() in f.read()
    except OSError:
        return False
