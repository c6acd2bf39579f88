"""AttachedKernel(..., ssh="user@host:port"): a kernel reached through jupyter_client's SSH tunnel.

Runs a real sshd on a loopback port (key login only, host keys made here) and a real kernel behind
it. ``ssh`` on PATH is wrapped only to skip host-key prompts for this throwaway server.
Skipped where openssh-server is not installed; ``.ci/run`` installs it, so CI runs it.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import remote_fns as fns
from conftest import free_port
from jupyter_client.manager import KernelManager

import nbremote
from nbremote import rpc
from nbremote.errors import WorkerError, WorkerStartError
from nbremote.rpc._core import current_agent

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not os.path.exists(SSHD) or shutil.which("ssh") is None,
                       reason="needs openssh-server and an ssh client (apt-get install openssh-server); CI has them"),
]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    (d / "authorized_keys").chmod(0o600)
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        f"PidFile {d / 'sshd.pid'}\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n"
        "PermitRootLogin prohibit-password\nAllowTcpForwarding yes\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    proc = subprocess.Popen([SSHD, "-D", "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")])
    wrapper = d / "bin" / "ssh"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -F none -o StrictHostKeyChecking=no "
                       "-o UserKnownHostsFile=/dev/null -o BatchMode=yes -o LogLevel=ERROR \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    old_path = os.environ["PATH"]
    os.environ["PATH"] = f"{wrapper.parent}{os.pathsep}{old_path}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    try:
        yield f"{getpass.getuser()}@127.0.0.1:{port}", str(d / "user_key")
    finally:
        os.environ["PATH"] = old_path
        proc.terminate()
        proc.wait(5)


@pytest.fixture(scope="module")
def kernel() -> Iterator[KernelManager]:
    km = KernelManager(kernel_name="python3")
    km.start_kernel(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield km
    km.shutdown_kernel(now=True)


def test_attach_through_an_ssh_tunnel(world: list[str], sshd: tuple[str, str], kernel: KernelManager) -> None:
    server, key = sshd
    rpc.add_worker("tunneled", nbremote.AttachedKernel(kernel.connection_file, ssh=server, sshkey=key))
    try:
        link = current_agent().peers["tunneled"].link
        assert link is not None
        assert link.conn["shell_port"] != kernel.shell_port, "the link should go through the tunnel's ports"
        assert rpc.rpc_sync("tunneled", fns.whoami) == "tunneled"
        assert rpc.rpc_sync("tunneled", fns.pid) == kernel.provisioner.process.pid  # type: ignore[union-attr]
        big = bytes(range(256)) * 4096
        assert rpc.rpc_sync("tunneled", fns.echo, args=(big,)) == big
        with pytest.raises(WorkerError, match="SSH tunnel"):
            rpc.rpc_sync("worker1", fns.call_peer, args=("tunneled", fns.whoami))
        # the tunneled kernel calls the driver back through the comm the driver opened on it
        assert rpc.rpc_sync("tunneled", fns.call_peer, args=("driver", fns.pid)) == os.getpid()
    finally:
        rpc.remove_worker("tunneled")
    assert kernel.is_alive(), "remove_worker must not stop an attached kernel"
    leftover = subprocess.run(["pgrep", "-f", f"ssh -N .*-i {key}"], capture_output=True, text=True)
    assert leftover.stdout == "", f"the SSH tunnel outlived its worker: {leftover.stdout}"


def test_ssh_login_failure_is_a_clear_start_error(world: list[str], sshd: tuple[str, str], kernel: KernelManager,
                                                   tmp_path: Path) -> None:
    server, _ = sshd
    stranger = tmp_path / "stranger_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    with pytest.raises(WorkerStartError, match=r"ssh to .* exited with 255.*without a prompt"):
        rpc.add_worker("refused", nbremote.AttachedKernel(kernel.connection_file, ssh=server, sshkey=str(stranger)))
    assert "refused" not in [w.name for w in rpc.workers()]
