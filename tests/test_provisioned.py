"""LocalKernel(kernel_name=...) with a kernelspec that names a kernel provisioner: gateway_provisioners' SSH one.

A real sshd listens on 127.0.0.2 (another address than the driver's 127.0.0.1, so the provisioner takes the
kernel for a remote one and starts it over SSH with paramiko), the kernelspec is made by the provisioner's
own installer (``jupyter-ssh-spec install``), and the worker's host, lifecycle and liveness must come from
the provisioner. paramiko reads its keys and known hosts from ``~/.ssh`` and its port from
``GP_SSH_PORT``: the fixture points ``HOME`` at a throwaway directory for the module's duration (never at
the user's own ``~/.ssh``). Skipped where openssh-server or gateway_provisioners is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import remote_fns as fns
from conftest import ROOT, kill_mid_call, pid_alive

import nbremote
from nbremote import rpc
from nbremote.errors import RemoteCellError, WorkerLostError
from nbremote.rpc._core import current_agent
from nbremote.rpc._transport.zmqlink import KernelLink

try:  # imported with the module, as the other test modules do: a framework the driver imports later
    import torch  # makes nbremote start a new zygote, which the zygote tests would not expect
except ImportError:
    torch = None

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SPEC_INSTALLER = Path(sys.executable).with_name("jupyter-ssh-spec")
HOST = "127.0.0.2"
LEASE = 3.0  # NBREMOTE_LEASE_SECONDS in the provisioned kernels (the kernelspec's env reaches them)

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not os.path.exists(SSHD), reason="needs openssh-server (apt-get install openssh-server)"),
    pytest.mark.skipif(not SPEC_INSTALLER.exists(),
                       reason="needs gateway_provisioners (pip install -e '.[provisioners]')"),
]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ssh_spec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An sshd on 127.0.0.2 and a kernelspec for gateway_provisioners' DistributedProvisioner aimed at it."""
    d = tmp_path_factory.mktemp("provisioned")
    home = d / "home"
    (home / ".ssh").mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / ".ssh" / "id_ed25519")],
                   check=True)
    (d / "authorized_keys").write_text((home / ".ssh" / "id_ed25519.pub").read_text())
    port = _free_port(HOST)
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress {HOST}\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        f"PidFile {d / 'sshd.pid'}\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n"
        "PermitRootLogin prohibit-password\n")
    kind, key = (d / "host_key.pub").read_text().split()[:2]
    (home / ".ssh" / "known_hosts").write_text(f"[{HOST}]:{port} {kind} {key}\n")  # paramiko rejects unknown hosts
    Path("/run/sshd").mkdir(exist_ok=True)
    sshd = subprocess.Popen([SSHD, "-D", "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")])
    prefix = d / "prefix"
    # The provisioner's documented installer; --unauthorized-users: its default refuses root, who runs CI.
    subprocess.run([str(SPEC_INSTALLER), "install", f"--prefix={prefix}", "--kernel-name=nbr_ssh",
                    "--display-name=nbremote over SSH", f"--remote-hosts={HOST}", "--unauthorized-users=nobody"],
                   check=True, capture_output=True)
    spec_file = prefix / "share" / "jupyter" / "kernels" / "nbr_ssh" / "kernel.json"
    spec = json.loads(spec_file.read_text())
    # What its docs ask of a site: the remote host's interpreter (here: this one, which has nbremote), and
    # the environment the remote kernel needs (the kernelspec's env is what the SSH command exports).
    spec["argv"][0] = sys.executable
    spec["env"] = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                   "NBREMOTE_LEASE_SECONDS": str(LEASE)}
    spec_file.write_text(json.dumps(spec))
    # the same with a long lease: for telling a stop through the provisioner from the lease's exit
    long_dir = spec_file.parent.with_name("nbr_ssh_long")
    shutil.copytree(spec_file.parent, long_dir)
    spec["env"]["NBREMOTE_LEASE_SECONDS"] = "120"
    (long_dir / "kernel.json").write_text(json.dumps(spec))
    saved = {k: os.environ.get(k) for k in ("HOME", "GP_SSH_PORT", "JUPYTER_PATH", "GP_KERNEL_LOG_DIR")}
    os.environ["HOME"] = str(home)
    os.environ["GP_KERNEL_LOG_DIR"] = str(d)  # the remote kernels' logs (its default: /tmp)
    os.environ["GP_SSH_PORT"] = str(port)  # read by gateway_provisioners when it is first imported
    os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (str(prefix / "share" / "jupyter"),
                                                             saved["JUPYTER_PATH"]) if p)
    if "gateway_provisioners.distributed" in sys.modules:  # imported earlier in this process: tell it too
        sys.modules["gateway_provisioners.distributed"].ssh_port = port  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((HOST, port)) == 0:
                break
        time.sleep(0.1)
    try:
        yield "nbr_ssh"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        sshd.terminate()
        sshd.wait(5)


def ssh_client() -> str:
    return os.environ.get("SSH_CONNECTION", "")


@pytest.fixture(scope="module")
def provisioned(world: list[str], ssh_spec: str) -> Iterator[str]:
    rpc.add_worker("ssh1", nbremote.LocalKernel(kernel_name=ssh_spec))
    try:
        yield "ssh1"
    finally:
        if "ssh1" in [w.name for w in rpc.worker_status()]:
            rpc.remove_worker("ssh1")


def test_a_provisioned_worker_runs_where_the_provisioner_put_it(provisioned: str) -> None:
    assert rpc.rpc_sync(provisioned, fns.whoami) == provisioned
    assert rpc.rpc_sync(provisioned, ssh_client).split()[2] == HOST, "the kernel was not started over SSH"
    row = next(r for r in rpc.worker_status() if r.name == provisioned)
    assert (row.kind, row.host, row.state) == ("kernelspec", HOST, "idle")
    assert row.pid == rpc.rpc_sync(provisioned, fns.pid), "the pid shown is the provisioner's, the kernel's own"
    # encrypted by default: where a provisioner puts the kernel is known only once it runs (its kernelspec,
    # made by gateway_provisioners' installer, declares CurveZMQ and passes the request to its launcher)
    link = current_agent().peers[provisioned].link
    assert isinstance(link, KernelLink) and link.curve, "the default did not ask the provisioner for CurveZMQ"
    big = bytes(range(256)) * 4096 * 4  # 4 MB
    assert rpc.rpc_sync(provisioned, fns.echo, args=(big,)) == big
    # peers reach it directly (its connection info names 127.0.0.2), and it calls the driver back
    assert rpc.rpc_sync("worker1", fns.call_peer, args=(provisioned, fns.whoami)) == provisioned
    assert rpc.rpc_sync(provisioned, fns.call_peer, args=("driver", fns.pid)) == os.getpid()


@pytest.mark.skipif(torch is None, reason="needs torch (pip install torch==2.13.0)")
def test_a_remote_module_forward_on_a_provisioned_worker(provisioned: str) -> None:
    from nbremote.nn import RemoteModule

    net = RemoteModule(f"{provisioned}/cpu", torch.nn.Linear, args=(4, 2))
    x = torch.randn(3, 4)
    expected = torch.nn.functional.linear(x, *[p.to_here() for p in net.remote_parameters()])
    assert torch.allclose(net(x), expected)


def test_interrupt_goes_through_the_provisioner(provisioned: str) -> None:
    run = rpc.run_cell(provisioned, "import time\nfor _ in range(600): time.sleep(0.1)", background=True,
                       on_output=lambda *a: None)
    time.sleep(0.5)
    t0 = time.monotonic()
    rpc.interrupt_worker(provisioned)
    with pytest.raises(RemoteCellError, match="KeyboardInterrupt"):
        run.wait(10)
    assert time.monotonic() - t0 < 5
    assert rpc.rpc_sync(provisioned, fns.add, args=(1, 2)) == 3


def test_restart_and_remove_go_through_the_provisioner(ssh_spec: str, world: list[str]) -> None:
    rpc.add_worker("ssh2", nbremote.LocalKernel(kernel_name=ssh_spec))
    try:
        old = rpc.rpc_sync("ssh2", fns.pid)
        rpc.restart_worker("ssh2")
        new = rpc.rpc_sync("ssh2", fns.pid)
        assert new != old and rpc.rpc_sync("ssh2", ssh_client).split()[2] == HOST
        deadline = time.monotonic() + 10
        while pid_alive(old) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(old), "restart left the old kernel running"
    finally:
        rpc.remove_worker("ssh2")
    deadline = time.monotonic() + 10
    while pid_alive(new) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(new), "remove_worker did not stop the provisioned kernel"


def test_a_dead_provisioned_kernel_is_lost_promptly(ssh_spec: str, world: list[str]) -> None:
    rpc.add_worker("ssh3", nbremote.LocalKernel(kernel_name=ssh_spec))
    try:
        # The provisioner's poll (every second, a round trip over SSH) and the heartbeat (1.5 s of silence, as
        # for an attached kernel; tests/test_provisioned_release.py has a death no poll sees) race to tell.
        fut, t0 = kill_mid_call("ssh3")
        with pytest.raises(WorkerLostError,
                           match=r"'ssh3' is gone: its (kernel process exited|heartbeat stopped answering for 1\.5 s)"):
            fut.wait(30)
        assert time.monotonic() - t0 < 6, "a polled kernel's heartbeat limit (10 s), not the provisioned one's"
    finally:
        rpc.remove_worker("ssh3")


def test_a_provisioned_kernel_exits_when_its_driver_dies(ssh_spec: str, world: list[str]) -> None:
    code = f"""
        import os, sys
        sys.path.insert(0, {str(ROOT / "tests")!r})  # absolute: the kernel's own cwd is its SSH login's
        import remote_fns as fns
        import nbremote
        from nbremote import rpc
        rpc.init_rpc("lone-driver", workers={{"ssh9": nbremote.LocalKernel(kernel_name={ssh_spec!r})}})
        print(rpc.rpc_sync("ssh9", fns.pid), flush=True)
        os.kill(os.getpid(), 9)  # no goodbye: nothing stops the kernel but its lease
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          cwd=str(ROOT), env=dict(os.environ))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + LEASE + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_alive(pid), "the provisioned kernel outlived its driver's lease"


def test_shutdown_stops_provisioned_kernels_through_the_provisioner(ssh_spec: str) -> None:
    ssh_spec += "_long"  # a lease of 120 s: only the provisioner can have stopped it in time
    code = f"""
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import remote_fns as fns
        import nbremote
        from nbremote import rpc
        rpc.init_rpc("tidy-driver", workers={{"ssh8": nbremote.LocalKernel(kernel_name={ssh_spec!r})}})
        print(rpc.rpc_sync("ssh8", fns.pid), rpc.worker_status()[0].log_path, flush=True)
        rpc.shutdown()
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          cwd=str(ROOT), env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    pid, log_path = int(proc.stdout.split()[0]), proc.stdout.split()[1]
    assert log_path.startswith(f"{HOST}:"), "the kernel's log is on its host, and the status says where"
    deadline = time.monotonic() + 5  # the provisioner may report it gone while its process is still exiting
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pid), "rpc.shutdown() left the provisioned kernel running"
    assert "nbremote: exiting" not in Path(log_path.partition(":")[2]).read_text()
