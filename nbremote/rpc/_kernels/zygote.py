"""Starting local worker kernels fast: a warm interpreter that forks them (a jupyter_client provisioner).

A kernel start is mostly CPU: importing ipykernel, IPython, jupyter_client, tornado and zmq (~0.5 s
here), then nbremote at bootstrap, then torch when the first tensor arrives. Four kernels started
together on two cores take twice as long as one, and each imports the same modules again. So the
embedded default kernelspec names the ``nbremote-zygote`` provisioner: one *zygote* process per driver
imports all that once -- and the frameworks the driver has imported (numpy, torch, tensorplay) -- and
then forks a kernel for each start. A forked kernel is an ordinary ipykernel: ``python -m
ipykernel_launcher -f <connection file>`` run in a child that already holds the imports.

Rules that keep forking safe: the zygote starts no thread, zmq context or event loop before it forks
(its children create their own); a child resets the signal handlers the zygote set, starts its own
session (as ``start_new_session`` would), points stdin at /dev/null and stdout/stderr at the worker's
log, and sets ``JPY_PARENT_PID`` to the zygote, whose death it then follows (ipykernel's parent
poller). The zygote reads its requests on stdin and exits when that closes: when the driver dies,
however it dies, its kernels follow within about a second. A driver that imports a framework after its
zygote started gets a new zygote that preloads it; the old one is retired, not closed: it exits when the
last kernel it forked has exited, since closing it would take those kernels with it.

The provisioner keeps jupyter_client's contract (``LocalProvisioner`` with a ``process`` that can be
polled, signalled and waited for); the zygote reports each kernel's exit, so a reused pid is never taken
for a live kernel. Used only on Linux (fork), and only for kernels that run in the driver's own
environment (a custom ``env`` would not reach the modules already imported); elsewhere, or when the
zygote cannot be started, kernels start the usual way.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, cast

from jupyter_client.provisioning import LocalProvisioner

__all__ = ["PROVISIONER", "ZygoteProvisioner", "stop", "usable"]

PROVISIONER = "nbremote-zygote"
# Imported in the zygote when the driver has imported them (torch._dynamo: torch's optimizers import it
# on first use, ~3 s here -- a cost every worker would pay again for its first optimizer step)
FRAMEWORKS = ("numpy", "torch", "torch._dynamo", "tensorplay")
# What a kernel imports up to its first RPC (ipykernel imports most of it lazily while it initialises,
# debugpy through ipykernel.debugger alone costs ~0.2 s); a module missing here is simply imported later.
# nbremote.nn too (17 ms, no framework): two calls that import it at once in a fresh kernel -- a restore and
# a forward after a restart -- trip on the submodule locks its package takes (``serialize.loads`` waits that
# out; imported before the fork, it cannot happen).
_PRELOAD = (
    "ipykernel.kernelapp", "ipykernel.ipkernel", "ipykernel.zmqshell", "ipykernel.debugger", "ipykernel.comm",
    "IPython", "IPython.core.completerlib", "IPython.core.debugger", "IPython.core.oinspect",
    "IPython.extensions.storemagic", "tornado.gen", "tornado.locks", "tornado.queues", "tornado.platform.asyncio",
    "psutil", "jupyter_client", "comm", "cloudpickle", "nbremote.rpc._worker.install", "nbremote.nn",
)


def _threads_as_asked() -> None:
    """In a forked kernel: the intra-op threads its environment asks for (``OMP_NUM_THREADS``, see
    ``LocalKernel.start``). A kernel started the usual way reads that when it imports torch; here torch was
    imported before the fork, with the zygote's environment, so it is told. The zygote ran no parallel
    region (it starts no thread), so no thread pool is there yet to resize."""
    torch = sys.modules.get("torch")
    wanted = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and wanted.isdigit() and int(wanted) > 0:
        torch.set_num_threads(int(wanted))


@functools.cache
def usable() -> bool:
    """Linux (fork), with this provisioner registered (``pip install`` of nbremote does that)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    from importlib.metadata import entry_points

    return any(ep.name == PROVISIONER for ep in entry_points(group="jupyter_client.kernel_provisioners"))


class _Zygote:
    """The driver's handle on its zygote: launch requests out, pids and exit reports in."""

    def __init__(self, frameworks: tuple[str, ...]) -> None:
        self.frameworks = frameworks
        self._lock = threading.Lock()
        self._replies: dict[int, dict[str, Any]] = {}
        self._arrived = threading.Condition(self._lock)
        self._exited: dict[int, int] = {}  # pid -> exit status
        self._live: set[int] = set()  # kernels forked here that have not exited: they follow this process
        self._retired = False  # replaced by a newer zygote: exits once its last kernel has
        self._launching = 0  # launch requests waiting for their reply
        self._ids = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nbremote.rpc._kernels.zygote", *frameworks], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1)
        threading.Thread(target=self._read, name="nbremote-zygote", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None  # made with stdout=PIPE
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                report = json.loads(line)
                with self._lock:
                    if "exit" in report:
                        self._exited[int(report["exit"])] = int(report.get("status", 0))
                        self._live.discard(int(report["exit"]))
                        if self._retired and not self._live and not self._launching:
                            self._close_stdin()
                    else:
                        self._replies[int(report["id"])] = report
                    self._arrived.notify_all()
        with self._lock:  # the zygote is gone: nobody waits for it any more
            self._arrived.notify_all()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def launch(self, argv: list[str], env: dict[str, str], cwd: str, log: str | None, timeout: float = 30.0) -> int:
        with self._lock:
            self._ids += 1
            request_id = self._ids
            self._launching += 1  # a retirement meanwhile must not close us under this launch
        request = {"id": request_id, "argv": argv, "env": env, "cwd": cwd, "log": log}
        assert self.proc.stdin is not None  # made with stdin=PIPE
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:  # gone, or retired and closed since it was handed out
            with self._lock:
                self._launching -= 1
            raise RuntimeError(f"nbremote's kernel zygote cannot take requests ({exc})") from exc
        deadline = time.monotonic() + timeout
        with self._lock:
            try:
                while request_id not in self._replies:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self.alive:
                        raise RuntimeError("nbremote's kernel zygote did not start the kernel")
                    self._arrived.wait(min(left, 0.5))
                reply = self._replies.pop(request_id)
                if "error" in reply:
                    raise RuntimeError(f"nbremote's kernel zygote could not fork a kernel: {reply['error']}")
                pid = int(reply["pid"])
                if pid not in self._exited:
                    self._live.add(pid)
            finally:
                self._launching -= 1
                if self._retired and not self._live and not self._launching:
                    self._close_stdin()
        return pid

    def exit_status(self, pid: int) -> int | None:
        with self._lock:
            return self._exited.get(pid)

    def retire(self) -> None:
        """Start no more kernels here; exit once the last of those started here has exited.

        Closing at once would take the live kernels with it: they follow the zygote's death.
        """
        with self._lock:
            self._retired = True
            if not self._live and not self._launching:
                self._close_stdin()

    def _close_stdin(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # its signal to exit

    def close(self) -> None:
        with self._lock:
            self._close_stdin()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(0.5)  # it exits at once; if it is slow to, subprocess reaps it later


_zygote: list[_Zygote] = []  # this driver's zygote (zero or one): a process-wide resource, like a thread pool
_retired: list[_Zygote] = []  # replaced zygotes whose kernels still run
_zygote_lock = threading.Lock()


def stop() -> None:
    """Let the zygotes go (``rpc.shutdown``): nothing of nbremote stays running; a new world starts another."""
    with _zygote_lock:
        while _zygote or _retired:
            (_zygote or _retired).pop().close()


def _the_zygote() -> _Zygote:
    frameworks = tuple(f for f in FRAMEWORKS if f in sys.modules)
    with _zygote_lock:
        _retired[:] = [z for z in _retired if z.alive]
        if _zygote and not _zygote[0].alive:
            _zygote.pop()
        if _zygote and not set(frameworks) <= set(_zygote[0].frameworks):
            # the driver has imported a framework since: a new zygote preloads it; the old one stays for
            # as long as a kernel it forked runs (they follow its death)
            old = _zygote.pop()
            old.retire()
            _retired.append(old)
        if not _zygote:
            _zygote.append(_Zygote(frameworks))
        return _zygote[0]


class _ForkedProcess:
    """A kernel the zygote forked, shaped like the ``Popen`` jupyter_client's provisioner keeps."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int, zygote: _Zygote) -> None:
        self.pid = pid
        self._zygote = zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            status = self._zygote.exit_status(self.pid)
            if status is not None or (not self._zygote.alive and not _exists(self.pid)):
                self.returncode = status if status is not None else -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["kernel"], timeout or 0)
            time.sleep(0.02)
        assert self.returncode is not None  # poll() returned it
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ZygoteProvisioner(LocalProvisioner):
    """jupyter_client's local provisioner, but the kernel process comes from nbremote's zygote."""

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        env = kwargs.get("env")
        if env is None:
            return await super().launch_kernel(cmd, **kwargs)
        stdout = kwargs.get("stdout")
        log = getattr(stdout, "name", None) if stdout is not None else None
        try:
            zygote = _the_zygote()
            pid = zygote.launch(list(cmd), dict(env), str(kwargs.get("cwd") or os.getcwd()),
                                log if isinstance(log, str) else None)
        except (OSError, RuntimeError) as exc:  # no zygote: start this kernel the usual way
            self.log.warning("nbremote's kernel zygote failed (%s); starting the kernel directly", exc)
            return await super().launch_kernel(cmd, **kwargs)
        self.process = cast(Any, _ForkedProcess(pid, zygote))  # Popen-shaped, which is all it is used as
        self.pid = self.pgid = pid  # the child made itself a session (and group) leader
        self.cwd = kwargs.get("cwd") or os.getcwd()
        return self.connection_info


# -- the zygote process itself ---------------------------------------------------------------------------


def _child(request: dict[str, Any], zygote_pid: int) -> None:
    """In the forked child: become the kernel ``request`` describes (never returns)."""
    try:
        for signum in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        # What Python sets at startup, which an exec'd kernel would redo and a forked one never does: with
        # SIGPIPE at its default, a write to a socket its peer closed kills the kernel without a word
        # (BrokenPipeError is what Python code expects).
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        log = request.get("log")
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) if log else os.open(os.devnull, os.O_WRONLY)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["JPY_PARENT_PID"] = str(zygote_pid)  # follow the zygote, which follows the driver
        _threads_as_asked()
        argv = list(request["argv"])
        if argv[1:3] != ["-m", "ipykernel_launcher"]:
            raise RuntimeError(f"the zygote only runs ipykernel_launcher, not {argv!r}")
        sys.argv = ["ipykernel_launcher", *argv[3:]]
        sys.stdin = open(0)  # noqa: SIM115 -- the process's own stdin, for its lifetime
        sys.stdout = open(1, "w", buffering=1)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1)  # noqa: SIM115
        from ipykernel import kernelapp

        kernelapp.launch_new_instance()
        os._exit(0)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            os.write(2, f"nbremote zygote child: {type(exc).__name__}: {exc}\n".encode())
        os._exit(1)


def _serve(frameworks: list[str]) -> None:
    import importlib

    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # debugpy's import-time warning, for nobody
    # ipykernel reads JPY_PARENT_PID when it is imported (a trait default): set it to us before, so that
    # every kernel forked from here follows this process (and this process follows the driver)
    os.environ["JPY_PARENT_PID"] = str(os.getpid())

    for module in (*_PRELOAD, *frameworks):
        with contextlib.suppress(Exception):  # a module that fails here fails again, clearly, in the kernel
            importlib.import_module(module)
    out_lock = threading.RLock()  # the SIGCHLD handler may report while the loop itself is reporting

    def report(message: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    def reap(signum: int, frame: Any) -> None:
        del signum, frame
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            report({"exit": pid, "status": os.waitstatus_to_exitcode(status)})

    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    me = os.getpid()
    for line in sys.stdin:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        try:
            pid = os.fork()
        except OSError as exc:
            report({"id": request.get("id"), "error": str(exc)})
            continue
        if pid == 0:
            _child(request, me)
        report({"id": request["id"], "pid": pid})
    os._exit(0)  # the driver is gone or let us go: no interpreter teardown of all that was preloaded


if __name__ == "__main__":
    _serve(sys.argv[1:])
