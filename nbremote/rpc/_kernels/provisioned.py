"""Kernels started through a kernel provisioner that runs them elsewhere (SSH hosts, Docker, Kubernetes, YARN).

``LocalKernel(kernel_name=...)`` lands here when the kernelspec's ``metadata.kernel_provisioner`` names a
provisioner other than jupyter_client's local one or nbremote's zygote -- e.g. ``gateway_provisioners``'
``distributed-provisioner``, which starts the kernel over SSH on one of its ``remote_hosts``.

Such provisioners are written for a Jupyter server's one long-lived event loop: ``gateway_provisioners``
keeps a process-wide *response manager* (the socket remote launchers send their connection info to) whose
periodic callback lives on the loop that first created it. jupyter_client's synchronous ``KernelManager``
runs every call on a fresh loop of the calling thread, which starves that callback (the second kernel
never hears back). So every provisioned kernel is managed on one thread of nbremote's own that runs one
event loop for the life of the process, with ``AsyncKernelManager``; callers submit coroutines to it.

The provisioner is the authority on the kernel: its ``poll()`` says whether it lives (asked every
``POLL_SECONDS`` by a task on that loop, never by the IO thread: it is a network round trip), its
``send_signal`` interrupts, its ``kill`` stops, and its ``assigned_host`` / ``pid`` are what the driver
shows. A provisioned kernel does not follow its driver's death the way a local child does, so the
driver's bootstrap asks it to exit when the driver's lease runs out (``_worker.install(exit_with=...)``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Awaitable
from typing import TypeVar

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from nbremote.errors import WorkerStartError
from nbremote.rpc._kernels.handle import StartedKernel
from nbremote.rpc._kernels.paths import runtime_dir

__all__ = ["POLL_SECONDS", "ProvisionedKernel", "start_provisioned"]

log = logging.getLogger("nbremote")

POLL_SECONDS = 1.0
START_TIMEOUT = 180.0  # the provisioner applies its own launch_timeout (30 s by default) well before this
STOP_TIMEOUT = 30.0
T = TypeVar("T")


class _Loop:
    """One daemon thread running one asyncio loop for every provisioned kernel of this process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="nbremote-provisioners", daemon=True).start()

    def run(self, awaitable: Awaitable[T], timeout: float) -> T:
        async def wait() -> T:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(wait(), self.loop).result(timeout)


_loop: _Loop | None = None
_loop_lock = threading.Lock()


def _the_loop() -> _Loop:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = _Loop()
        return _loop


class ProvisionedKernel(StartedKernel):
    """A kernel its provisioner runs: alive, interrupted, stopped and located by that provisioner."""

    owned = True
    provisioned = True
    kind = "kernelspec"

    def __init__(self, km: AsyncKernelManager, loop: _Loop) -> None:
        super().__init__(dict(km.get_connection_info(session=False)))
        self.km = km
        self._loop = loop
        prov = km.provisioner
        host = str(getattr(prov, "assigned_host", "") or self.conn.get("ip", ""))
        self.host = host if host and host not in ("127.0.0.1", "localhost", "0.0.0.0") else socket.gethostname()
        pid = getattr(prov, "pid", 0)
        self.pid = pid if isinstance(pid, int) and pid > 0 else None
        kernel_log = getattr(prov, "kernel_log", None)  # on the kernel's host (gateway_provisioners' launchers)
        self.log_path = f"{self.host}:{kernel_log}" if kernel_log else None
        self._exited = threading.Event()
        self._poller = asyncio.run_coroutine_threadsafe(self._poll(), loop.loop)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_SECONDS)
            try:
                alive = await self.km.is_alive()
            except Exception:  # an unanswered poll is no proof of death: the heartbeat decides then
                log.debug("polling the provisioner of %s failed", self.host, exc_info=True)
                continue
            if not alive:
                self._exited.set()
                return

    def alive(self) -> bool:
        return not self._exited.is_set()

    def interrupt(self) -> bool:
        """The kernelspec's interrupt: a signal the provisioner delivers, or an ``interrupt_request``."""
        self._loop.run(self.km.interrupt_kernel(), STOP_TIMEOUT)
        return True

    def stop(self, timeout: float = 2.0) -> None:
        self._poller.cancel()
        # now=True: the provisioner's kill (SIGTERM, then SIGKILL, through its launcher's listener). Not a
        # shutdown_request first: gateway_provisioners stops the listener on that request, its poll then
        # reports the kernel gone at once, and jupyter_client closes the control socket before the request
        # has left -- the kernel ran on, ended only by its lease.
        try:
            self._loop.run(self.km.shutdown_kernel(now=True), STOP_TIMEOUT)
        except Exception:  # never fail a shutdown over one kernel; say so, it may still run over there
            log.warning("the provisioner could not stop the kernel on %s (it may still run there)", self.host,
                        exc_info=True)


def start_provisioned(name: str, kernel_name: str, ip: str, encrypt: str, env: dict[str, str] | None,
                      cwd: str | None) -> ProvisionedKernel:
    """Start ``kernel_name`` through its provisioner, on the provisioners' loop."""
    loop = _the_loop()
    # its connection file (the key) in the private runtime directory, as for local kernels
    conn_file = runtime_dir() / f"kernel-nbremote-{name.replace(':', '_')}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    km = AsyncKernelManager(kernel_name=kernel_name, ip=ip, kernel_spec_manager=KernelSpecManager(),
                            transport_encryption=encrypt, connection_file=str(conn_file))
    kernel_env = dict(os.environ if env is None else env)
    kernel_env.pop("JPY_PARENT_PID", None)  # ipykernel would watch a pid of this machine
    provisioner = "?"
    try:
        provisioner = km.kernel_spec.metadata["kernel_provisioner"]["provisioner_name"]  # type: ignore[union-attr]
        loop.run(km.start_kernel(env=kernel_env, cwd=cwd or os.getcwd()), START_TIMEOUT)
    except concurrent.futures.TimeoutError as exc:
        with contextlib.suppress(Exception):
            loop.run(km.shutdown_kernel(now=True), STOP_TIMEOUT)
        raise WorkerStartError(f"cannot start worker {name!r}: its provisioner ({provisioner}) did not start "
                               f"kernelspec {kernel_name!r} in {START_TIMEOUT:.0f} s", name) from exc
    except Exception as exc:
        raise WorkerStartError(
            f"cannot start worker {name!r}: the {provisioner!r} provisioner of kernelspec {kernel_name!r} "
            f"failed: {exc}", name) from exc
    return ProvisionedKernel(km, loop)
