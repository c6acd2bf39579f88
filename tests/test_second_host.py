"""Workers on another host, for real: a network namespace with its own address (``secondhost``), reached as a
user would reach a GPU box -- ``nbremote worker --ip`` attached directly and through SSH, the SSH kernel
provisioner, ``ServerKernel`` on a ``jupyter server`` and on an Enterprise Gateway from its own environment.

What these prove, that the loopback tests cannot: beyond loopback the traffic is encrypted (a capture on the
veth finds a payload's marker only when encryption is turned off), no shared memory is used across hosts
(the probes do not cross: the second host has its own /dev/shm), 64 MB arrive bit-exact both ways over a
real interface, and a killed remote kernel or a cut link (veth down) fails pending calls with
``WorkerLostError`` within the times the README states. Skipped, saying why, where a namespace cannot be
made (not root, no iproute2) or sshd is missing; CI runs as root with both.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import remote_fns as fns
import secondhost
from conftest import ROOT

import nbremote
from nbremote import rpc
from nbremote.errors import WorkerLostError, WorkerStartError
from nbremote.rpc._core import current_agent

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
BIN = Path(sys.executable).parent
MB = 1 << 20
MARKER = b"nbremote-plaintext-marker-"  # what a capture looks for: a payload's bytes in clear text

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(secondhost.unavailable() is not None, reason=f"no second host: {secondhost.unavailable()}"),
]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[secondhost.SecondHost]:
    try:
        second = secondhost.SecondHost()
    except RuntimeError as exc:
        pytest.skip(f"no second host: {exc}")
    second.tmp = tmp_path_factory.mktemp("secondhost")  # type: ignore[attr-defined]
    try:
        yield second
    finally:
        second.close()


def _tmp(host: secondhost.SecondHost) -> Path:
    return host.tmp  # type: ignore[attr-defined,no-any-return]


TESTS_ENV = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}  # remote_fns, importable by reference there


def start_worker(host: secondhost.SecondHost, name: str, *extra: str, ip: str | None = None) -> tuple[Path, Path]:
    """``nbremote worker`` on the second host: (its connection file once the kernel listens, its log)."""
    return host.start_worker(_tmp(host), name, *extra, ip=ip, env=TESTS_ENV), _tmp(host) / f"{name}.log"


class Capture:
    """Everything that crosses our end of the veth, both ways (an AF_PACKET socket: root only)."""

    def __init__(self, interface: str) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
        self.sock.bind((interface, 0))
        self.sock.settimeout(0.2)
        self.seen = False
        self._tail = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                return
            # the marker may straddle two segments: keep the end of the last one
            if MARKER in self._tail + frame:
                self.seen = True
            self._tail = frame[-len(MARKER):]

    def close(self) -> bool:
        time.sleep(0.3)  # the last segments
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        return self.seen


def marked(n_bytes: int) -> np.ndarray:
    """An array whose bytes are the marker over and over: in clear text it shows in any capture."""
    return np.frombuffer((MARKER * (n_bytes // len(MARKER) + 1))[:n_bytes], dtype=np.uint8).copy()


def _attach(name: str, spec: nbremote.AttachedKernel) -> None:
    rpc.add_worker(name, spec)


def test_a_worker_beyond_loopback_is_encrypted_and_shares_no_memory(world: list[str],
                                                                    host: secondhost.SecondHost) -> None:
    conn_file, _ = start_worker(host, "enc")
    assert stat.S_IMODE(conn_file.stat().st_mode) == 0o600, "the connection file holds the keys: owner only"
    conn = json.loads(conn_file.read_text())
    assert conn["ip"] == host.ip and conn.get("curve_publickey") and conn.get("curve_secretkey")
    _attach("remote-enc", nbremote.AttachedKernel(conn_file))
    try:
        link = current_agent().peers["remote-enc"].link
        assert link is not None and link.curve and not link.same_host, "another host: encrypted, no shared memory"
        assert rpc.rpc_sync("remote-enc", fns.whoami) == "remote-enc"
        a = np.random.default_rng(22).standard_normal(8 * MB)  # 64 MB, over the veth both ways
        b = rpc.rpc_sync("remote-enc", fns.echo, args=(a,), timeout=120)
        assert np.array_equal(a, b) and b.flags.writeable
        assert not list(Path("/dev/shm").glob(f"nbr-{rpc.rpc_sync('remote-enc', fns.pid)}-*")), \
            "the remote kernel's segments must not be on this host"
        capture = Capture(host.host_if)
        rpc.rpc_sync("remote-enc", fns.echo, args=(marked(4 * MB),))
        assert not capture.close(), "a payload crossed the link in clear text"
        # the worker calls the driver back with 16 MB, over its comm
        c = np.random.default_rng(23).standard_normal(2 * MB)
        assert np.array_equal(rpc.rpc_sync("remote-enc", fns.call_peer, args=("driver", fns.echo, c)), c)
        pid = rpc.rpc_sync("remote-enc", fns.pid)
    finally:
        rpc.remove_worker("remote-enc")
    os.kill(pid, signal.SIGQUIT)  # the Ctrl-\ that ipykernel's banner says stops it: the keys go with it
    deadline = time.monotonic() + 10
    while conn_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not conn_file.exists(), "the connection file with the keys outlived its kernel"


def test_no_encrypt_is_plaintext_and_says_so(world: list[str], host: secondhost.SecondHost) -> None:
    """The control for the capture above (it does see clear text), and the warning ``--no-encrypt`` prints."""
    conn_file, log = start_worker(host, "clear", "--no-encrypt")
    assert "WARNING" in log.read_text() and "without encryption" in log.read_text()
    assert not json.loads(conn_file.read_text()).get("curve_publickey")
    _attach("remote-clear", nbremote.AttachedKernel(conn_file))
    try:
        link = current_agent().peers["remote-clear"].link
        assert link is not None and link.digests, "unencrypted beyond loopback: buffers are digested"
        capture = Capture(host.host_if)
        rpc.rpc_sync("remote-clear", fns.echo, args=(marked(4 * MB),))
        assert capture.close(), "the capture should see an unencrypted payload"
    finally:
        rpc.remove_worker("remote-clear")


def test_a_killed_remote_kernel_and_a_cut_link_fail_calls_in_time(world: list[str],
                                                                  host: secondhost.SecondHost) -> None:
    """README: an attached worker whose heartbeat stops for 1.5 s is lost; pending calls fail within ~2 s."""
    for how in ("kill", "cut"):
        conn_file, _ = start_worker(host, f"doomed-{how}")
        name = f"remote-{how}"
        _attach(name, nbremote.AttachedKernel(conn_file))
        try:
            _lose(host, name, how, 4.0)
        finally:
            host.mend()
            rpc.remove_worker(name)


def _lose(host: secondhost.SecondHost, name: str, how: str, limit: float) -> None:
    """Kill worker ``name``'s kernel (``how="kill"``) or cut the link (``"cut"``) while a call of it runs: the
    call must fail with ``WorkerLostError`` within ``limit`` seconds, and so must the next one."""
    pid = rpc.rpc_sync(name, fns.pid)
    fut = rpc.rpc_async(name, fns.sleep, args=(120,))
    time.sleep(0.3)
    if how == "kill":
        os.kill(pid, 9)
    else:
        host.cut()
    t0 = time.monotonic()
    with pytest.raises(WorkerLostError, match=name):
        fut.wait(limit + 15)
    took = time.monotonic() - t0
    assert took < limit, f"{how}: the pending call failed after {took:.1f} s, not within {limit:.0f} s"
    with pytest.raises(WorkerLostError):
        rpc.rpc_sync(name, fns.pid)


@pytest.fixture(scope="module")
def sshd(host: secondhost.SecondHost) -> Iterator[tuple[str, Path]]:
    """An sshd on the second host (key login), and an ``ssh`` on PATH that skips host-key prompts for it."""
    if not os.path.exists(SSHD) or shutil.which("ssh") is None:
        pytest.skip("needs openssh-server and an ssh client (apt-get install openssh-server); CI has them")
    d = _tmp(host) / "ssh"
    home = d / "home"
    (home / ".ssh").mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key")], check=True)
    key = home / ".ssh" / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    (d / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    (d / "sshd_config").write_text(
        f"Port 22\nListenAddress {host.ip}\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        f"PidFile {d / 'sshd.pid'}\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n"
        "PermitRootLogin prohibit-password\nAllowTcpForwarding yes\n")
    kind, host_key = (d / "host_key.pub").read_text().split()[:2]
    (home / ".ssh" / "known_hosts").write_text(f"{host.ip} {kind} {host_key}\n")  # paramiko's (the provisioner)
    Path("/run/sshd").mkdir(exist_ok=True)
    log = d / "sshd.log"
    proc = host.spawn([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], log)
    host.wait_port(22, proc, log)
    wrapper = d / "bin" / "ssh"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -F none -o StrictHostKeyChecking=no "
                       "-o UserKnownHostsFile=/dev/null -o BatchMode=yes -o LogLevel=ERROR \"$@\"\n")
    wrapper.chmod(0o755)
    old_path = os.environ["PATH"]
    os.environ["PATH"] = f"{wrapper.parent}{os.pathsep}{old_path}"
    try:
        yield f"root@{host.ip}", key
    finally:
        os.environ["PATH"] = old_path
        host.stop(proc)


def ssh_client() -> str:
    return os.environ.get("SSH_CONNECTION", "")


def test_attach_through_ssh_to_the_second_hosts_loopback(world: list[str], host: secondhost.SecondHost,
                                                        sshd: tuple[str, Path]) -> None:
    server, key = sshd
    conn_file, _ = start_worker(host, "tunneled", ip="127.0.0.1")  # its loopback: only SSH reaches it
    rpc.add_worker("remote-ssh", nbremote.AttachedKernel(conn_file, ssh=server, sshkey=str(key)))
    try:
        assert rpc.rpc_sync("remote-ssh", fns.whoami) == "remote-ssh"
        link = current_agent().peers["remote-ssh"].link
        assert link is not None and not link.same_host, "through the tunnel it is still another host"
        a = np.random.default_rng(5).standard_normal(2 * MB)
        assert np.array_equal(rpc.rpc_sync("remote-ssh", fns.echo, args=(a,)), a)
    finally:
        rpc.remove_worker("remote-ssh")


def test_the_ssh_provisioner_starts_a_worker_on_the_second_host(host: secondhost.SecondHost,
                                                               sshd: tuple[str, Path]) -> None:
    """gateway_provisioners' SSH provisioner, in a driver of its own (its response manager is per process and
    must listen where the second host can answer: GP_RESPONSE_IP)."""
    installer = BIN / "jupyter-ssh-spec"
    if not installer.exists():
        pytest.skip("needs gateway_provisioners (pip install -e '.[provisioners]')")
    _, key = sshd
    prefix = _tmp(host) / "prefix"
    subprocess.run([str(installer), "install", f"--prefix={prefix}", "--kernel-name=nbr_second",
                    f"--remote-hosts={host.ip}", "--unauthorized-users=nobody"], check=True, capture_output=True)
    spec_file = prefix / "share" / "jupyter" / "kernels" / "nbr_second" / "kernel.json"
    spec = json.loads(spec_file.read_text())
    spec["argv"][0] = sys.executable
    spec["env"] = {"PYTHONPATH": str(ROOT / "tests")}
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "HOME": str(key.parent.parent), "GP_SSH_PORT": "22", "GP_RESPONSE_IP": host.host_ip,
           "GP_KERNEL_LOG_DIR": str(_tmp(host)), "JUPYTER_PATH": str(prefix / "share" / "jupyter")}
    code = """
        import numpy as np, remote_fns as fns, nbremote
        from nbremote import rpc
        from nbremote.rpc._core import current_agent
        rpc.init_rpc("driver", workers={"prov": nbremote.LocalKernel(kernel_name="nbr_second")})
        def ssh_client():
            import os
            return os.environ.get("SSH_CONNECTION", "")
        link = current_agent().peers["prov"].link
        a = np.random.default_rng(6).standard_normal(2 << 20)
        print(rpc.rpc_sync("prov", ssh_client).split()[2], rpc.worker_status()[0].host, link.same_host,
              np.array_equal(rpc.rpc_sync("prov", fns.echo, args=(a,)), a), flush=True)
        rpc.shutdown()
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=150,
                          cwd=str(ROOT / "tests"), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [host.ip, host.ip, "False", "True"], done.stdout


@pytest.fixture(scope="module")
def remote_server(host: secondhost.SecondHost) -> tuple[str, str]:
    """A ``jupyter server`` on the second host whose kernels bind its address, CurveZMQ on (stopped with it)."""
    return host.jupyter_server(_tmp(host), env={"PYTHONPATH": str(ROOT / "tests")})


def test_a_server_on_the_second_host_gives_big_buffers_a_direct_encrypted_channel(
        world: list[str], host: secondhost.SecondHost, remote_server: tuple[str, str]) -> None:
    url, token = remote_server
    rpc.add_worker("remote-srv", nbremote.ServerKernel(url, token=token, kernel_name="python3"))
    try:
        link = current_agent().peers["remote-srv"].link
        assert link is not None and link.fast and not link.same_host, "another host: no shared memory"
        assert link.direct is not None and link.direct.curve, "its kernel's port is reachable and encrypted"
        a = np.random.default_rng(7).standard_normal(8 * MB)  # 64 MB both ways, by the direct channel
        assert np.array_equal(rpc.rpc_sync("remote-srv", fns.echo, args=(a,), timeout=120), a)
        capture = Capture(host.host_if)
        rpc.rpc_sync("remote-srv", fns.echo, args=(marked(4 * MB),))
        assert not capture.close(), "the direct channel must not carry a payload in clear text"
    finally:
        rpc.remove_worker("remote-srv")


@pytest.mark.timeout(150)
def test_a_killed_or_cut_off_server_kernel_fails_calls_in_time(
        world: list[str], host: secondhost.SecondHost, remote_server: tuple[str, str]) -> None:
    """README: a server-hosted worker whose kernel's ports the driver reaches is watched by that kernel's
    heartbeat too: killed, or with the way to it cut, its pending calls fail typed within ~2 s (where the
    server's websocket would take up to 20 s of silence)."""
    url, token = remote_server
    for how in ("kill", "cut"):
        name = f"remote-srv-{how}"
        rpc.add_worker(name, nbremote.ServerKernel(url, token=token, kernel_name="python3"))
        try:
            link = current_agent().peers[name].link
            assert link is not None and link.direct is not None and link.direct.heart is not None
            _lose(host, name, how, 4.0)
        finally:
            host.mend()
            rpc.remove_worker(name)
    assert rpc.rpc_sync("worker1", fns.whoami) == "worker1", "the rest of the world keeps working"


@pytest.fixture(scope="module")
def gateway(host: secondhost.SecondHost) -> tuple[str, str]:
    """Enterprise Gateway from an environment of its own (it pins jupyter_client < 7), on the second host: its
    ``nbremote`` kernelspec runs this checkout's Python, its own ``python3`` has jupyter_client 6."""
    try:
        return host.enterprise_gateway(_tmp(host), env={"PYTHONPATH": str(ROOT / "tests")})
    except (RuntimeError, subprocess.SubprocessError) as exc:
        pytest.skip(f"no Enterprise Gateway environment: {exc}")


def test_an_enterprise_gateway_in_its_own_environment(world: list[str], gateway: tuple[str, str]) -> None:
    url, token = gateway
    spec = nbremote.ServerKernel(url, token=token, kernel_name="nbremote", env={"KERNEL_USERNAME": "nbremote"})
    rpc.add_worker("remote-eg", spec)
    try:
        link = current_agent().peers["remote-eg"].link
        assert link is not None and link.fast and link.v1, "EG 3.3 speaks the v1 protocol"
        assert not link.same_host and link.direct is None, "its kernels bind the gateway host's loopback"
        assert rpc.rpc_sync("remote-eg", fns.whoami) == "remote-eg"
        a = np.random.default_rng(8).standard_normal(8 * MB)  # 64 MB through the gateway's websocket, in pieces
        assert np.array_equal(rpc.rpc_sync("remote-eg", fns.echo, args=(a,), timeout=120), a)
        assert rpc.rpc_sync("remote-eg", fns.call_peer, args=("driver", fns.pid)) == os.getpid()
    finally:
        rpc.remove_worker("remote-eg")


def test_a_gateway_kernel_with_an_old_jupyter_client_is_a_clear_start_error(
        world: list[str], gateway: tuple[str, str]) -> None:
    url, token = gateway
    spec = nbremote.ServerKernel(url, token=token, kernel_name="python3", env={"KERNEL_USERNAME": "nbremote"})
    with pytest.raises(WorkerStartError, match=r"jupyter_client 6\.\d+\.\d+; nbremote needs >= 8\.6 in the kernel"):
        rpc.add_worker("remote-old", spec)
    assert "remote-old" not in [w.name for w in rpc.worker_status()]


def test_a_gateway_refusing_root_says_how_to_pass_a_user(world: list[str], gateway: tuple[str, str]) -> None:
    url, token = gateway
    if os.geteuid() != 0:
        pytest.skip("EG refuses root only")
    with pytest.raises(nbremote.errors.ServerError, match="KERNEL_USERNAME"):
        rpc.add_worker("remote-root", nbremote.ServerKernel(url, token=token, kernel_name="nbremote"))



def test_the_remote_benchmark_runs() -> None:
    """A smoke run of benchmarks/bench_remote.py (a second host of its own): every way there and torch measured,
    nothing about speed."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_remote.py"), "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    header = next(line for line in done.stdout.splitlines() if line.startswith("case"))
    assert header.split()[1:] == ["zmq-curve", "zmq-clear", "server", "EG-ws", "torch"], done.stdout
    rows = {line.split()[0] + " " + line.split()[1]: line for line in done.stdout.splitlines()
            if line.startswith(("small call", "echo 1 MB"))}
    assert set(rows) == {"small call", "echo 1"}, done.stdout
