"""Who the workers are: how a worker kernel is started or attached, and the names and ranks of the world.

``LocalKernel()`` (the embedded default) starts ``sys.executable -m ipykernel_launcher`` through
jupyter_client's ``KernelManager`` so workers see the driver's packages; ``LocalKernel(kernel_name=...)``
starts any installed kernelspec (which lets kernel provisioners run it elsewhere);
``AttachedKernel(connection_file, ssh=None)`` reaches a kernel someone else started. Kernels nbremote
starts write their own stdout/stderr to a log file (never into the notebook) and, because
jupyter_client sets ``JPY_PARENT_PID``, exit by themselves when the driver process dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import KernelManager

from nbremote.errors import WorkerStartError
from nbremote.rpc import _zygote
from nbremote.rpc._tunnel import SSHTunnel
from nbremote.rpc._wire.envelope import is_loopback

if TYPE_CHECKING:
    from nbremote.rpc._transport.base import Connection

_NAME = re.compile(r"^[A-Za-z0-9_:\-]{1,127}$")
EMBEDDED = "nbremote-embedded-python"
EMBEDDED_FORKED = "nbremote-embedded-python-forked"  # the same kernel, forked from a warm zygote


@dataclass(frozen=True)
class WorkerInfo:
    """A member of the world: its unique ``name`` and its rank ``id`` (the driver is 0)."""

    name: str
    id: int

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


def check_name(name: object) -> str:
    """Worker names follow torch's rules: letters, digits, ``_``, ``:``, ``-``; 1 to 127 characters."""
    if not isinstance(name, str):
        raise TypeError(f"a worker name must be a str, got {type(name).__name__}")
    if not _NAME.match(name):
        raise ValueError(
            f"invalid worker name {name!r}: use 1-127 characters from letters, digits, '_', ':' and '-'")
    return name


class _EmbeddedSpecs(KernelSpecManager):
    """Adds one spec: the driver's own interpreter, whatever kernelspecs are installed."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        if kernel_name in (EMBEDDED, EMBEDDED_FORKED):
            # ipykernel >= 7.4 takes CurveZMQ keys from its connection file (see LocalKernel.start)
            metadata: dict[str, Any] = {"debugger": False, "supported_encryption": ["curve"]}
            if kernel_name == EMBEDDED_FORKED:  # started by nbremote's zygote (see _zygote)
                metadata["kernel_provisioner"] = {"provisioner_name": _zygote.PROVISIONER}
            return KernelSpec(
                argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                      "--HistoryManager.enabled=False", "--IPKernelApp.log_level=WARN"],
                display_name="nbremote worker", language="python", interrupt_mode="signal",
                metadata=metadata)
        return super().get_kernel_spec(kernel_name)


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
        from nbremote.rpc._transport.zmqlink import KernelLink

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


class _TunneledKernel(StartedKernel):
    """An attached kernel reached through an SSH tunnel that nbremote owns (and stops)."""

    shareable = False  # the tunnel's ports exist on the driver's machine only

    def __init__(self, tunnel: SSHTunnel) -> None:
        super().__init__(tunnel.conn)
        self.tunnel = tunnel
        self.log_path = tunnel.log_path

    def stop(self, timeout: float = 2.0) -> None:
        self.tunnel.close()  # the kernel itself is not ours


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


_fallback_dirs: dict[str, Path] = {}


def private_dir(path: Path, purpose: str) -> Path:
    """``path`` made if missing (0700); if it is not ours alone (another owner, or open to others -- e.g.
    made in /tmp by someone else first), a fresh private directory of this process instead: connection
    files hold a kernel's key and logs hold its output."""
    with contextlib.suppress(OSError):
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = path.stat()
        if st.st_uid == os.getuid() and not st.st_mode & 0o077:
            return path
    if purpose not in _fallback_dirs:
        _fallback_dirs[purpose] = Path(tempfile.mkdtemp(prefix=f"nbremote-{purpose}-"))  # 0700 by mkdtemp
    return _fallback_dirs[purpose]


def log_dir() -> Path:
    path = Path(os.environ.get("NBREMOTE_LOG_DIR") or Path(tempfile.gettempdir()) / f"nbremote-{os.getuid()}")
    return private_dir(path, "logs")


def runtime_dir() -> Path:
    """Where the connection files of the kernels nbremote starts go: Jupyter's runtime directory (private,
    and where ``jupyter console --existing`` looks), not jupyter_client's default of a file in /tmp."""
    from jupyter_core.paths import jupyter_runtime_dir

    return private_dir(Path(jupyter_runtime_dir()), "runtime")


_CONN_FILE = re.compile(r"^kernel-nbremote-.+-(\d+)-[0-9a-f]{8}\.json$")


def sweep_connection_files() -> int:
    """Remove the connection files of kernels whose driver died without stopping them (SIGKILL): their
    kernels died with it, and their keys need not stay on disk. The driver's pid is in each name; a file
    whose pid is alive (that driver, or a process that reused its pid) is left alone. Returns how many."""
    removed = 0
    with contextlib.suppress(OSError):
        for path in runtime_dir().iterdir():
            match = _CONN_FILE.match(path.name)
            if match is None:
                continue
            try:
                os.kill(int(match.group(1)), 0)
                continue
            except ProcessLookupError:
                pass
            except (PermissionError, OverflowError):
                continue
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    return removed


def open_private(path: Path) -> Any:
    """Open ``path`` for appending, readable by its owner only (0600), also if it existed already."""
    # open() with an opener, not os.fdopen: the file keeps its path as .name (the zygote reopens it by name)
    f = open(path, "ab", opener=lambda p, flags: os.open(p, flags, 0o600))  # noqa: SIM115 -- the caller closes it
    with contextlib.suppress(OSError):
        os.fchmod(f.fileno(), 0o600)
    return f


class LocalKernel:
    """Start a kernel on this machine: the driver's own Python (default) or an installed kernelspec."""

    def __init__(self, kernel_name: str | None = None, *, ip: str = "127.0.0.1",
                 env: dict[str, str] | None = None, cwd: str | None = None, encrypt: bool | None = None) -> None:
        """``encrypt``: CurveZMQ on the kernel's channels. ``None`` (default): beyond loopback, where the
        kernelspec supports it. ``True``: always (a kernelspec without support fails to start). ``False``:
        never -- on a network you trust, big transfers go several times faster (``benchmarks/bench_curve.py``);
        messages stay signed and, beyond loopback, their buffers digested."""
        for what, value in (("kernel_name", kernel_name), ("ip", ip), ("cwd", cwd)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"LocalKernel({what}=...) is a str, got {type(value).__name__} {value!r}")
        if encrypt not in (None, True, False):
            raise TypeError(f"LocalKernel(encrypt=...) is None (automatic), True or False, got {encrypt!r}")
        if encrypt and not zmq.has("curve"):
            raise ValueError("LocalKernel(encrypt=True): this pyzmq's libzmq has no CurveZMQ; "
                             "use encrypt=None (automatic) or an SSH tunnel")
        if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                  for k, v in env.items())):
            raise TypeError("LocalKernel(env=...) is a dict of str to str (the kernel's whole environment)")
        self.kernel_name = kernel_name
        self.ip = ip
        self.env = env
        self.cwd = cwd
        self.encrypt = encrypt

    def start(self, name: str) -> StartedKernel:
        embedded = EMBEDDED_FORKED if self.env is None and _zygote.usable() else EMBEDDED
        # Beyond loopback, encrypt the channels (CurveZMQ) where the kernelspec says the kernel can: Jupyter
        # signs its messages but sends them in clear text. On loopback, the key and 0600 files suffice.
        if self.encrypt is None:
            encrypt = "disabled" if is_loopback(self.ip) or not zmq.has("curve") else "auto"
        else:
            encrypt = "required" if self.encrypt else "disabled"  # required: a kernelspec without it fails
        # Its connection file (the key) goes in the private runtime directory, named as Jupyter names them.
        tag = f"{name.replace(':', '_')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        conn_file = runtime_dir() / f"kernel-nbremote-{tag}.json"
        km = KernelManager(kernel_name=self.kernel_name or embedded, ip=self.ip, connection_file=str(conn_file),
                           kernel_spec_manager=_EmbeddedSpecs(), transport_encryption=encrypt)
        try:
            spec = km.kernel_spec  # resolve now: a missing kernelspec is a start error, named
        except Exception as exc:
            raise WorkerStartError(
                f"cannot start worker {name!r}: no kernelspec {self.kernel_name!r} "
                f"({exc}); `jupyter kernelspec list` shows what is installed", name) from exc
        language = str(getattr(spec, "language", "") or "python")
        if language.lower() != "python":  # it would run, never answer nbremote's bootstrap, and time out
            raise WorkerStartError(
                f"cannot start worker {name!r}: kernelspec {self.kernel_name!r} runs {language}, and nbremote "
                "workers are Python kernels (ipykernel); pick a Python kernelspec (`jupyter kernelspec list`)",
                name)
        provisioner = ((spec.metadata if spec is not None else {}).get("kernel_provisioner") or {}).get(
            "provisioner_name")
        if provisioner not in (None, "local-provisioner", _zygote.PROVISIONER):
            from nbremote.rpc._provisioned import start_provisioned  # the kernel runs where its provisioner says

            return start_provisioned(name, str(self.kernel_name), self.ip, encrypt, self.env, self.cwd)
        path = log_dir() / f"{name.replace(':', '_')}-{os.getpid()}.log"
        log_file = open_private(path)  # owned by the kernel handle, closed in stop()
        log_start = log_file.tell()
        env = dict(os.environ if self.env is None else self.env)
        env.pop("JPY_PARENT_PID", None)
        env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
        try:
            km.start_kernel(stdout=log_file, stderr=log_file, env=env, cwd=self.cwd or os.getcwd())
        except Exception as exc:
            log_file.close()
            argv = " ".join(spec.argv) if spec is not None else "?"
            raise WorkerStartError(f"cannot start worker {name!r}: {exc}; check the kernelspec's argv ({argv})"
                                   f"{log_tail(str(path), log_start)} (log: {path})", name) from exc
        kernel = OwnedKernel(km, str(path), log_file)
        kernel.log_start = log_start  # a kernel that dies at once has written before the driver looks
        return kernel

    def __repr__(self) -> str:
        return f"LocalKernel(kernel_name={self.kernel_name!r})"


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
            try:
                conn = json.loads(Path(self.connection_file).read_text())
            except (OSError, ValueError) as exc:
                raise WorkerStartError(
                    f"cannot attach worker {name!r}: connection file {str(self.connection_file)!r} "
                    f"is unreadable ({exc})", name) from exc
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


WorkerSpec = LocalKernel | AttachedKernel
