"""A second host for the tests and benchmarks: a network namespace with an address of its own on a veth pair.

What runs in it (``SecondHost.spawn``) has its own network stack and a private ``/dev/shm`` (a tmpfs
mounted in its own mount namespace), so for nbremote it is another machine: its address is not loopback
(CurveZMQ on by default, buffers cross a real interface) and shared-memory probes do not cross. The files
are shared with this machine, which only saves copying venvs and connection files. Addresses come from
198.18.0.0/15, the range set aside for network benchmarks (RFC 2544), one /30 per process, so that runs
side by side do not collide. ``cut`` / ``mend`` take the link down and up (a cable pulled).

Needs root (namespaces, veth, mounts) and iproute2; ``unavailable()`` says why not, for a skip.
Enterprise Gateway runs from a virtual environment of its own (``eg_venv``: EG 3 pins jupyter_client < 7),
built once per machine into ``~/.cache/nbremote-tests``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

EG_VERSION = "3.3.0"
BIN = Path(sys.executable).parent
CACHE = Path(os.environ.get("NBREMOTE_TEST_CACHE", Path.home() / ".cache" / "nbremote-tests"))


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why a second host cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making a network namespace needs root (CI runs as root)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install iproute2)"
    return None


class SecondHost:
    """One network namespace, its veth pair and the processes started in it; ``close`` removes them all."""

    def __init__(self, tag: str | None = None) -> None:
        tag = tag or str(os.getpid())
        self.ns = f"nbremote-{tag}"
        self.host_if, self.ns_if = f"nbrh{tag}"[-15:], f"nbrn{tag}"[-15:]
        self.host_ip, self.ip = self._addresses(int(tag) if tag.isdigit() else os.getpid())
        self.procs: list[subprocess.Popen[bytes]] = []
        steps = [("ip", "netns", "add", self.ns),
                 ("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if, "netns", self.ns),
                 ("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if),
                 ("ip", "link", "set", self.host_if, "up"),
                 ("ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.ip}/30", "dev", self.ns_if),
                 ("ip", "netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up"),
                 ("ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up")]
        for step in steps:
            done = _run(*step)
            if done.returncode != 0:
                self.close()
                raise RuntimeError(f"cannot make the second host ({' '.join(step)}): {done.stderr.strip()}")

    @staticmethod
    def _addresses(seed: int) -> tuple[str, str]:
        """A free /30 of 198.18.0.0/15 (131,072 addresses): ours is the first host, the namespace's the second."""
        taken = _run("ip", "-o", "addr").stdout
        for i in range(32768):
            base = 4 * ((seed + i) % 32768)
            host = f"198.{18 + base // 65536}.{base // 256 % 256}.{base % 256 + 1}"
            if f" {host}/" not in taken:
                return host, f"198.{18 + base // 65536}.{base // 256 % 256}.{base % 256 + 2}"
        raise RuntimeError("no free /30 in 198.18.0.0/15")

    def spawn(self, argv: list[str], log: Path, env: dict[str, str] | None = None,
              cwd: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` on the second host (its own network, a private /dev/shm), output to ``log``."""
        script = 'mount -t tmpfs -o mode=1777,size=2g nbremote-shm /dev/shm && exec "$@"'
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns, "sh", "-c", script, "sh", *argv],
                                    stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait_port(self, port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
        """Until something listens on ``port`` of the second host (reached from here, across the veth)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}: {log.read_text()[-3000:]}")
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex((self.ip, port)) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"nothing listens on {self.ip}:{port} after {timeout:.0f} s: {log.read_text()[-3000:]}")

    def start_worker(self, tmp: Path, name: str, *extra: str, ip: str | None = None,
                     env: dict[str, str] | None = None) -> Path:
        """``nbremote worker`` here (on our address, or ``ip``); its connection file once the kernel listens."""
        conn_file, log = tmp / f"{name}.json", tmp / f"{name}.log"
        proc = self.spawn([str(BIN / "nbremote"), "worker", "--connection-file", str(conn_file), "--ip",
                           ip or self.ip, *extra], log, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                port = json.loads(conn_file.read_text()).get("shell_port")
                if port and _run("ip", "netns", "exec", self.ns, "ss", "-Hltn", f"sport = :{port}").stdout.strip():
                    return conn_file
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"nbremote worker {name} did not start: {log.read_text()[-2000:]}")

    def jupyter_server(self, tmp: Path, env: dict[str, str] | None = None) -> tuple[str, str]:
        """A ``jupyter server`` here whose kernels bind our address with CurveZMQ on (as a shared GPU box's
        would be set up for direct data channels); (url, token)."""
        port, token = _free_port(), secrets.token_hex(16)
        log = tmp / "jupyter-server.log"
        proc = self.spawn([str(BIN / "jupyter"), "server", "--no-browser", "--allow-root", f"--ip={self.ip}",
                           f"--port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp}",
                           f"--KernelManager.ip={self.ip}", "--KernelManager.transport_encryption=auto"], log,
                          env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"), **(env or {})}, cwd=str(tmp))
        return _serving(f"http://{self.ip}:{port}/", token, proc, log), token

    def enterprise_gateway(self, tmp: Path, env: dict[str, str] | None = None) -> tuple[str, str]:
        """Enterprise Gateway from its own environment (``eg_venv``) here, with a kernelspec ``nbremote`` that runs
        this Python (nbremote, jupyter_client >= 8.6) beside that environment's own ``python3``; (url, token)."""
        venv = eg_venv()
        kernels = tmp / "eg-share" / "kernels" / "nbremote"
        kernels.mkdir(parents=True, exist_ok=True)
        (kernels / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "nbremote worker", "language": "python"}))
        port, token = _free_port(), secrets.token_hex(16)
        log = tmp / "enterprise-gateway.log"
        proc = self.spawn([str(venv / "bin" / "jupyter"), "enterprisegateway", f"--ip={self.ip}", f"--port={port}",
                           f"--EnterpriseGatewayApp.auth_token={token}", "--EnterpriseGatewayApp.port_retries=0",
                           "--EnterpriseGatewayApp.env_process_whitelist=PYTHONPATH"], log,
                          env={"PATH": os.environ["PATH"], "HOME": str(Path.home()),
                               "JUPYTER_PATH": str(kernels.parent.parent),
                               "JUPYTER_RUNTIME_DIR": str(tmp / "eg-runtime"), **(env or {})}, cwd=str(tmp))
        return _serving(f"http://{self.ip}:{port}/", token, proc, log), token

    def cut(self) -> None:
        _run("ip", "link", "set", self.host_if, "down")

    def mend(self) -> None:
        _run("ip", "link", "set", self.host_if, "up")

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """End a process started here, and its process group (what it started), by its id."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        with contextlib.suppress(ProcessLookupError):  # what it left in its group (kernels it started)
            os.killpg(proc.pid, signal.SIGKILL)

    def close(self) -> None:
        for proc in self.procs:
            self.stop(proc)
        self.procs.clear()
        _run("ip", "netns", "del", self.ns)  # takes the namespace's end of the veth, and so the pair, with it
        _run("ip", "link", "del", self.host_if)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # a port free here is almost surely free there (a fresh namespace)
        return int(s.getsockname()[1])


def _serving(url: str, token: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 90) -> str:
    """``url`` once the server there answers its REST API."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(urllib.request.Request(url + "api/kernelspecs",
                                                          headers={"Authorization": f"token {token}"}), timeout=5)
            return url
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.3)
    raise RuntimeError(f"{proc.args!r} did not start: {log.read_text()[-3000:]}")


def eg_venv() -> Path:
    """A virtual environment with Enterprise Gateway ``EG_VERSION`` (and an ipykernel 6 of its era), built once."""
    venv = CACHE / f"eg-{EG_VERSION}"
    ready = venv / ".nbremote-ready"
    if ready.exists():
        return venv
    CACHE.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"jupyter_enterprise_gateway=={EG_VERSION}",
                           "ipykernel<7"], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"cannot build Enterprise Gateway's environment in {venv}: {done.stderr[-3000:]}")
    ready.write_text(EG_VERSION)
    return venv
