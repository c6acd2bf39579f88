"""Kernels started on this machine: ``LocalKernel()``, the embedded default, or ``LocalKernel(kernel_name=...)``.

The embedded default starts ``sys.executable -m ipykernel_launcher`` through jupyter_client's
``KernelManager``, so workers see the driver's packages (forked from a warm interpreter where it can:
``zygote``); a kernelspec name starts any installed kernelspec, and one whose provisioner runs it
elsewhere is handed to that provisioner (``provisioned``). Kernels nbremote starts write their own
stdout/stderr to a log file (never into the notebook) and, because jupyter_client sets
``JPY_PARENT_PID``, exit by themselves when the driver process dies.

The embedded kernel on loopback talks over Unix-domain sockets (zmq's ``ipc`` transport), files in the
private runtime directory beside its connection file, rather than TCP on 127.0.0.1: a small call took
~13% less, a training step ~6% (``benchmarks/ab.py``, paired; no TCP stack on the way, the same zmq
otherwise); only processes of this user on this machine can reach them, as only they can read the key.
``transport="tcp"`` keeps TCP.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from typing import Any

import zmq
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import KernelManager

from nbremote.errors import WorkerStartError
from nbremote.rpc._kernels import zygote
from nbremote.rpc._kernels.handle import EMBEDDED, EMBEDDED_FORKED, OwnedKernel, StartedKernel, log_tail
from nbremote.rpc._kernels.paths import log_dir, open_private, runtime_dir
from nbremote.rpc._kernels.provisioned import start_provisioned
from nbremote.rpc._wire.envelope import is_loopback

__all__ = ["LocalKernel"]

_SUN_PATH_MAX = 104  # bytes a Unix socket's path may have: 108 on Linux, 104 on macOS (the smaller one)


def _ipc_possible(kernel_name: str | None, ip: str) -> bool:
    """Whether a kernel may listen on Unix-domain sockets: the embedded one (another kernelspec's may run
    elsewhere), on loopback, where zmq has them."""
    return kernel_name is None and is_loopback(ip) and zmq.has("ipc")


class _EmbeddedSpecs(KernelSpecManager):
    """Adds one spec: the driver's own interpreter, whatever kernelspecs are installed."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        if kernel_name in (EMBEDDED, EMBEDDED_FORKED):
            # ipykernel >= 7.4 takes CurveZMQ keys from its connection file (see LocalKernel.start)
            metadata: dict[str, Any] = {"debugger": False, "supported_encryption": ["curve"]}
            if kernel_name == EMBEDDED_FORKED:  # started by nbremote's zygote (see _kernels.zygote)
                metadata["kernel_provisioner"] = {"provisioner_name": zygote.PROVISIONER}
            return KernelSpec(
                argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                      "--HistoryManager.enabled=False", "--IPKernelApp.log_level=WARN"],
                display_name="nbremote worker", language="python", interrupt_mode="signal",
                metadata=metadata)
        return super().get_kernel_spec(kernel_name)


class LocalKernel:
    """Start a kernel on this machine: the driver's own Python (default) or an installed kernelspec."""

    def __init__(self, kernel_name: str | None = None, *, ip: str = "127.0.0.1",
                 env: dict[str, str] | None = None, cwd: str | None = None, encrypt: bool | None = None,
                 transport: str | None = None) -> None:
        """``encrypt``: CurveZMQ on the kernel's channels. ``None`` (default): beyond loopback, where the
        kernelspec supports it; a kernelspec whose provisioner runs the kernel elsewhere: wherever it supports
        it (where the kernel lands is known only once it runs), and a warning, once per address, for a kernel
        that then runs beyond loopback in clear text. ``True``: always (a kernelspec or provisioner without it
        fails to start, and nothing is left running). ``False``: never -- on a network you trust, big transfers
        go several times faster (``benchmarks/bench_curve.py``); messages stay signed and, beyond loopback,
        their buffers digested.

        ``transport``: ``None`` (default): Unix-domain sockets (``"ipc"``) for the embedded kernel on loopback
        where zmq has them, else TCP; ``"tcp"``: TCP on ``ip``; ``"ipc"``: Unix-domain sockets (the embedded
        kernel only: another kernelspec's kernel may run elsewhere)."""
        for what, value in (("kernel_name", kernel_name), ("ip", ip), ("cwd", cwd)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"LocalKernel({what}=...) is a str, got {type(value).__name__} {value!r}")
        if transport not in (None, "tcp", "ipc"):
            raise ValueError(f"LocalKernel(transport=...) is None (automatic), 'tcp' or 'ipc', got {transport!r}")
        if transport == "ipc" and not _ipc_possible(kernel_name, ip):
            raise ValueError("LocalKernel(transport='ipc') is for the embedded kernel on loopback (no kernel_name, "
                             "ip='127.0.0.1') where zmq has Unix-domain sockets; use transport='tcp'")
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
        self.transport = transport

    def _ipc_prefix(self, conn_file: Path) -> str | None:
        """The path zmq's ipc sockets of the kernel start with (``<prefix>-<port>``), or None for TCP."""
        if self.transport == "tcp" or not _ipc_possible(self.kernel_name, self.ip):
            return None
        prefix = str(conn_file.with_suffix(".ipc"))
        # "+ 6": zmq's "-<port>" after the prefix. A long home directory: TCP, unless ipc was asked for.
        if len(os.fsencode(prefix)) + 6 > _SUN_PATH_MAX:
            if self.transport == "ipc":
                raise ValueError(f"LocalKernel(transport='ipc'): the socket paths under {conn_file.parent} are "
                                 f"longer than the {_SUN_PATH_MAX} bytes a Unix socket's path may have; use "
                                 "transport='tcp', or a shorter JUPYTER_RUNTIME_DIR")
            return None
        return prefix

    def start(self, name: str, threads: int | None = None) -> StartedKernel:
        """Start the kernel of worker ``name``. ``threads``: the intra-op threads it should use (the world's share
        of this machine's cores, see ``_driver.world``), as ``OMP_NUM_THREADS`` -- unless its environment names
        a number already (the driver's, or ``env``): the user's choice stands."""
        embedded = EMBEDDED_FORKED if self.env is None and zygote.usable() else EMBEDDED
        # Beyond loopback, encrypt the channels (CurveZMQ) where the kernelspec says the kernel can: Jupyter
        # signs its messages but sends them in clear text. On loopback, the key and 0600 files suffice.
        if self.encrypt is None:
            encrypt = "disabled" if is_loopback(self.ip) or not zmq.has("curve") else "auto"
        else:
            encrypt = "required" if self.encrypt else "disabled"  # required: a kernelspec without it fails
        # Its connection file (the key) goes in the private runtime directory, named as Jupyter names them.
        tag = f"{name.replace(':', '_')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        conn_file = runtime_dir() / f"kernel-nbremote-{tag}.json"
        ipc = self._ipc_prefix(conn_file)
        where: dict[str, Any] = {"ip": self.ip} if ipc is None else {"ip": ipc, "transport": "ipc"}
        km = KernelManager(kernel_name=self.kernel_name or embedded, connection_file=str(conn_file),
                           kernel_spec_manager=_EmbeddedSpecs(), transport_encryption=encrypt, **where)
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
        if provisioner not in (None, "local-provisioner", zygote.PROVISIONER):  # it runs where that one says
            return start_provisioned(name, str(self.kernel_name), self.ip, self.encrypt, self.env, self.cwd)
        path = log_dir() / f"{name.replace(':', '_')}-{os.getpid()}.log"
        log_file = open_private(path)  # owned by the kernel handle, closed in stop()
        log_start = log_file.tell()
        env = dict(os.environ if self.env is None else self.env)
        env.pop("JPY_PARENT_PID", None)
        env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
        if threads is not None and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(threads)
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
