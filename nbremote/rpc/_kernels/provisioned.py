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

**A start that fails releases what it allocated.** Once the provisioner was asked to launch, it may hold a
scheduler allocation, a pod or a process even when it raises itself. Any failure from then on -- the
provisioner's own exception, the start's timeout, a KeyboardInterrupt of the waiting thread (the start's
coroutine is cancelled), a kernel without the encryption asked for -- kills the kernel through the
provisioner and runs its ``cleanup`` (``_release``), then raises the original error; a failure of the
release is logged, never raised over it. Not ``KernelManager.shutdown_kernel``: after a failed or
cancelled start it waits on the start's outcome first (re-raising it, or forever). A failed link to a
kernel that did start is the world's to undo, with ``ProvisionedKernel.stop``.

**Encryption is decided from where the kernel runs, known only after the launch.** By default CurveZMQ is
asked for wherever the kernelspec supports it (``auto``): the address the driver knows (``LocalKernel.ip``)
says nothing of the node the provisioner picks. ``encrypt=True`` refuses a kernelspec that does not declare
``curve`` before launching, and a kernel whose connection info came back without keys (a provisioner or
launcher that ignores the request) after it; a kernel that runs beyond loopback (its connection info's
address) in clear text is said once per address.

The provisioner is the authority on the kernel: its ``poll()`` says whether it lives (asked every
``POLL_SECONDS`` by a task on that loop, never by the IO thread: it is a network round trip), its
``send_signal`` interrupts, its ``kill`` stops, and its ``assigned_host`` / ``pid`` are what the driver
shows. A poll cannot see every death (a remote launcher that outlives its kernel, a node that hangs), so the
driver's link also gives up on the kernel's heartbeat after ``HEARTBEAT_TIMEOUT`` (1.5 s), as for an
attached kernel, not the polled limit of a local child (``_ProvisionedLink``). A provisioned kernel does not
follow its driver's death the way a local child does, so the driver's bootstrap asks it to exit when the
driver's lease runs out (``_worker.install(exit_with=...)``).
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
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import zmq
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from nbremote.errors import WorkerStartError
from nbremote.rpc._kernels.handle import StartedKernel
from nbremote.rpc._kernels.paths import runtime_dir
from nbremote.rpc._transport.base import Connection
from nbremote.rpc._transport.heartbeat import HEARTBEAT_TIMEOUT
from nbremote.rpc._transport.zmqlink import KernelLink
from nbremote.rpc._wire import sessions
from nbremote.rpc._wire.envelope import is_loopback

__all__ = ["POLL_SECONDS", "LoopTimeout", "ProvisionedKernel", "start_provisioned"]

log = logging.getLogger("nbremote")

POLL_SECONDS = 1.0
START_TIMEOUT = 180.0  # the provisioner applies its own launch_timeout (30 s by default) well before this
STOP_TIMEOUT = 30.0
KILL_WAIT = 5.0  # s a released kernel is given to be reported gone after its kill (jupyter_client's own wait)
T = TypeVar("T")


class LoopTimeout(concurrent.futures.TimeoutError):
    """A coroutine on the provisioners' loop ran past its caller's timeout (and was cancelled); distinct from
    a ``TimeoutError`` the provisioner raised itself."""


class _Loop:
    """One daemon thread running one asyncio loop for every provisioned kernel of this process."""

    def __init__(self) -> None:
        sessions.own_tornado_jitter()  # a provisioner's PeriodicCallback must not draw from the user's random
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="nbremote-provisioners", daemon=True).start()

    def run(self, awaitable: Awaitable[T], timeout: float,
            undo: Callable[[T], Awaitable[object]] | None = None) -> T:
        """``awaitable``'s result, waited for at most ``timeout`` s. When the wait ends early -- the timeout
        (``LoopTimeout``) or an exception in the waiting thread (KeyboardInterrupt) -- the coroutine is
        cancelled and given ``STOP_TIMEOUT`` s to run its own ``except``/``finally`` (a start releases what it
        allocated) before the error is raised: it never runs on unseen. ``undo``: what to run on a result that
        came too late for its caller (an interrupt as the start succeeded)."""
        outcome: concurrent.futures.Future[T] = concurrent.futures.Future()
        tasks: list[asyncio.Future[T]] = []

        def settle(task: asyncio.Future[T]) -> None:
            if task.cancelled():  # an exception, not outcome.cancel(): wait() does not count a cancel() as done
                outcome.set_exception(concurrent.futures.CancelledError())
            elif (exc := task.exception()) is not None:
                outcome.set_exception(exc)
            else:
                outcome.set_result(task.result())

        def submit() -> None:
            task = asyncio.ensure_future(awaitable, loop=self.loop)
            task.add_done_callback(settle)
            tasks.append(task)

        self.loop.call_soon_threadsafe(submit)
        try:
            try:
                return outcome.result(timeout)
            except concurrent.futures.TimeoutError as exc:
                if outcome.done():  # the coroutine's own TimeoutError, or a result that came just now
                    return outcome.result()
                raise LoopTimeout(f"ran for more than {timeout:.0f} s") from exc
        except BaseException:
            if not outcome.done():
                # submit() ran before this (the loop runs its callbacks in order), so tasks holds the task
                self.loop.call_soon_threadsafe(lambda: tasks[0].cancel())
                concurrent.futures.wait([outcome], STOP_TIMEOUT)
            if undo is not None and outcome.done() and outcome.exception() is None:
                with contextlib.suppress(Exception):  # undo logs its own failures; the caller's error stands
                    self.run(undo(outcome.result()), STOP_TIMEOUT)
            raise


_loop: _Loop | None = None
_loop_lock = threading.Lock()
# Addresses whose clear-text kernels were said (see _say_if_plaintext): once each for the process, not per
# start or restart of a worker there.
_said_plaintext: set[str] = set()


def _the_loop() -> _Loop:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = _Loop()
        return _loop


class _ProvisionedLink(KernelLink):
    """The driver's link to a provisioned kernel: the provisioner's poll says at once when the kernel exits
    (``alive``, as for a local child, so the other workers are told and keep the polled limit), and its
    heartbeat gives up after ``HEARTBEAT_TIMEOUT``, as an attached kernel's does: a poll cannot see every
    death, and a process of ours that could is not there to ask."""

    def heartbeat(self, now: float) -> str | None:
        # KernelLink pings when due and applies the polled limit; a second check of the same ping applies
        # the short one (it sends nothing: the ping is already out, or not yet due).
        return super().heartbeat(now) or self.heart.check(now, HEARTBEAT_TIMEOUT)


class ProvisionedKernel(StartedKernel):
    """A kernel its provisioner runs: alive, interrupted, stopped and located by that provisioner."""

    owned = True
    provisioned = True
    kind = "kernelspec"

    def __init__(self, km: AsyncKernelManager, conn: dict[str, Any], loop: _Loop) -> None:
        super().__init__(conn)
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

    def link(self, name: str) -> Connection:
        return _ProvisionedLink(name, self.conn, alive=self.alive)

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


def _has_curve_keys(conn: dict[str, Any]) -> bool:
    return bool(conn.get("curve_publickey") and conn.get("curve_secretkey"))


def _declares_curve(metadata: dict[str, Any]) -> bool:
    """Whether a kernelspec says its kernel takes CurveZMQ keys (``metadata.supported_encryption``), read as
    jupyter_client and gateway_provisioners read it."""
    supported = metadata.get("supported_encryption")
    if isinstance(supported, str):
        return supported.strip().lower() == "curve"
    return isinstance(supported, (list, tuple, set)) and "curve" in {str(s).strip().lower() for s in supported}


def _encryption_fix(name: str) -> str:
    return (f"use a kernelspec whose provisioner and kernel make CurveZMQ keys (gateway_provisioners' launchers "
            "do, with '{transport_encryption}' in the kernelspec's argv and 'curve' in its "
            "metadata.supported_encryption), reach the kernel through an SSH tunnel, or, on a network you trust, "
            f"LocalKernel(..., encrypt=None or False) for worker {name!r}")


async def _release(km: AsyncKernelManager, name: str, provisioner: str) -> None:
    """Kill what the provisioner launched and let it release what it allocated; log, never raise."""
    prov = km.provisioner
    try:
        if prov is not None and prov.has_process:
            await prov.kill()
            for _ in range(int(KILL_WAIT / 0.1)):  # as jupyter_client's kill waits: until the provisioner says so
                if await prov.poll() is not None:
                    await prov.wait()  # reaps a local launcher's process
                    break
                await asyncio.sleep(0.1)
    except Exception:
        log.warning("the %r provisioner could not kill the kernel of worker %r after its failed start (it may "
                    "still run)", provisioner, name, exc_info=True)
    try:  # its connection file, sockets, and the provisioner's cleanup(): what it allocated for the kernel
        await km.cleanup_resources()
    except Exception:
        log.warning("the %r provisioner could not release what it held for worker %r after its failed start",
                    provisioner, name, exc_info=True)


def _say_if_plaintext(name: str, conn: dict[str, Any], encrypt: bool | None) -> None:
    """Say, once per address, that a kernel beyond loopback talks in clear text (signed, but readable)."""
    ip = str(conn.get("ip", ""))
    if _has_curve_keys(conn) or conn.get("transport") == "ipc" or is_loopback(ip):
        return
    with _loop_lock:
        if ip in _said_plaintext:
            return
        _said_plaintext.add(ip)
    why = "encrypt=False asked for it" if encrypt is False else "its provisioner made no CurveZMQ keys"
    log.warning("worker %r runs on %s without encryption (%s): its messages are signed, and their buffers "
                "digested, but anyone on the network between can read them; %s (said once per address)",
                name, ip, why, _encryption_fix(name))


async def _start(km: AsyncKernelManager, name: str, provisioner: str, encrypt: bool | None,
                 env: dict[str, str], cwd: str) -> dict[str, Any]:
    """Start the kernel and check its connection info; on any failure, release it (``_release``), then raise."""
    try:
        await km.start_kernel(env=env, cwd=cwd)
        conn = dict(km.get_connection_info(session=False))
        if encrypt and not _has_curve_keys(conn):
            raise WorkerStartError(
                f"cannot start worker {name!r} with encrypt=True: the {provisioner!r} provisioner of kernelspec "
                f"{km.kernel_name!r} started its kernel without CurveZMQ keys (its connection info has none), so "
                f"its channels would be clear text; the kernel was stopped. To fix it, {_encryption_fix(name)}",
                name)
        return conn
    except BaseException:  # CancelledError included: the caller's timeout or KeyboardInterrupt
        await _release(km, name, provisioner)
        raise


def start_provisioned(name: str, kernel_name: str, ip: str, encrypt: bool | None, env: dict[str, str] | None,
                      cwd: str | None) -> ProvisionedKernel:
    """Start ``kernel_name`` through its provisioner, on the provisioners' loop. ``encrypt``: as
    ``LocalKernel``'s, except that None asks for CurveZMQ wherever the kernelspec supports it (see above)."""
    loop = _the_loop()
    # its connection file (the key) in the private runtime directory, as for local kernels
    conn_file = runtime_dir() / f"kernel-nbremote-{name.replace(':', '_')}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    # None: "auto" (keys where the kernelspec takes them), since where the kernel lands is known only later
    policy = {None: "auto" if zmq.has("curve") else "disabled", True: "required", False: "disabled"}[encrypt]
    km = AsyncKernelManager(kernel_name=kernel_name, ip=ip, kernel_spec_manager=KernelSpecManager(),
                            transport_encryption=policy, connection_file=str(conn_file))
    kernel_env = dict(os.environ if env is None else env)
    kernel_env.pop("JPY_PARENT_PID", None)  # ipykernel would watch a pid of this machine
    metadata: dict[str, Any] = dict(getattr(km.kernel_spec, "metadata", None) or {})
    provisioner = str((metadata.get("kernel_provisioner") or {}).get("provisioner_name", "?"))
    if encrypt and not _declares_curve(metadata):  # refused before anything is launched or allocated
        raise WorkerStartError(
            f"cannot start worker {name!r} with encrypt=True: kernelspec {kernel_name!r} does not declare CurveZMQ "
            f"('curve' in its metadata.supported_encryption), so its {provisioner!r} provisioner would start it "
            f"in clear text. To fix it, {_encryption_fix(name)}", name)
    try:
        conn = loop.run(_start(km, name, provisioner, encrypt, kernel_env, cwd or os.getcwd()), START_TIMEOUT,
                        undo=lambda _: _release(km, name, provisioner))
    except WorkerStartError:
        raise
    except LoopTimeout as exc:
        raise WorkerStartError(f"cannot start worker {name!r}: its provisioner ({provisioner}) did not start "
                               f"kernelspec {kernel_name!r} in {START_TIMEOUT:.0f} s; what it had launched was "
                               "stopped", name) from exc
    except Exception as exc:
        raise WorkerStartError(
            f"cannot start worker {name!r}: the {provisioner!r} provisioner of kernelspec {kernel_name!r} "
            f"failed: {exc}", name) from exc
    try:
        kernel = ProvisionedKernel(km, conn, loop)
    except BaseException:
        loop.run(_release(km, name, provisioner), STOP_TIMEOUT)
        raise
    _say_if_plaintext(name, conn, encrypt)
    return kernel
