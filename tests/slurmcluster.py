"""A real Slurm cluster for the tests, on this one machine: a controller here and two compute nodes apart.

``SlurmCluster()`` starts Debian's Slurm 22.05 (``slurm-wlm``) with ``munge``: ``slurmctld`` on this host's
side of a bridge, and one ``slurmd`` per node, each in a network namespace of its own (a veth on that
bridge), its own UTS namespace (its own hostname) and its own ``/dev/shm`` (a tmpfs in a private mount
namespace) -- so, for nbremote, another machine: a worker there cannot take the same-host shared-memory or
Unix-domain paths. The filesystem stays shared, as an HPC home is. Each node has one pretend GPU (GRES
``gpu``, ``File=/dev/null``), so ``--gres=gpu:1`` puts each job on a node of its own.

Addresses come from one private /24 of 198.19.0.0/16 (RFC 2544's benchmarking range) that no interface or
route here uses; the namespaces get no default route. Every name is in ``/etc/hosts`` (lines marked with
this cluster's tag, removed by ``close``) or given as an address, and the daemons and clients read this
cluster's own ``slurm.conf`` (``SLURM_CONF``, in a private temporary directory): no Slurm command runs
without one, since its clients would then look the controller up in DNS. No systemd, no cgroups:
``proctrack/linuxproc``, ``task/none``. ``slurmd`` is entered with ``nsenter --net`` + ``unshare``, not
``ip netns exec`` (which remounts ``/sys``; slurmd 22.05 wants ``/sys/fs/cgroup``).

Every wait is bounded; ``close`` undoes everything that was made (jobs, daemons by their pid files, what is
left in the namespaces by pid, namespaces, links, hosts lines, files), also after a start that failed half
way. Needs root and ``apt-get install -y slurm-wlm munge``; ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NODES = ("nbrnode1", "nbrnode2")
BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo", "munged", "munge", "ip",
            "nsenter", "unshare")
MUNGE_PID = Path("/run/munge/munged.pid")


def unavailable() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    if sys.platform != "linux":
        return "the test cluster uses Linux namespaces"
    if os.geteuid() != 0:
        return "starting Slurm's daemons and network namespaces needs root (CI runs as root)"
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install -y slurm-wlm munge iproute2 util-linux)"
    return None


def _run(*argv: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def _free_subnet() -> str:
    """The first three octets of a /24 of 198.19.0.0/16 that no address or route here touches."""
    used = _run("ip", "-o", "addr").stdout + _run("ip", "route").stdout
    for third in range(200, 256):
        prefix = f"198.19.{third}"
        if f" {prefix}." not in used:
            return prefix
    raise RuntimeError("no free /24 in 198.19.200.0-198.19.255.0 for the Slurm test cluster")


def _pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


class SlurmCluster:
    """The controller here, ``NODES`` apart; ``env`` is what a Slurm client needs (``SLURM_CONF``)."""

    def __init__(self) -> None:
        self.tag = f"nbr{os.getpid() % 100000}"
        self.dir = Path(tempfile.mkdtemp(prefix="nbremote-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.bridge = f"{self.tag}br"[:15]
        self.prefix = _free_subnet()
        self.host_ip = f"{self.prefix}.1"
        self.nodes = {name: f"{self.prefix}.{i + 2}" for i, name in enumerate(NODES)}
        self.namespaces: list[str] = []
        self.links: list[str] = []
        self.started_munge = False
        self.hosts_marker = f"# nbremote-slurm-{self.tag}"
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # -- start -------------------------------------------------------------------------------------------------
    def _step(self, *argv: str) -> None:
        done = _run(*argv)
        if done.returncode != 0:
            raise RuntimeError(f"Slurm test cluster: {' '.join(argv)} failed: {done.stderr.strip()}")

    def _start(self) -> None:
        if Path("/etc/slurm/slurm.conf").exists() or _run("pgrep", "-x", "slurmctld").stdout.strip():
            raise RuntimeError("another Slurm runs on this machine (/etc/slurm/slurm.conf or a slurmctld): the test "
                               "cluster needs ports 6817/6818 for itself")
        for sub in ("state", "spool", "run", "log"):
            (self.dir / sub).mkdir()
        self._network()
        with open("/etc/hosts", "a") as hosts:
            for name, addr in self.nodes.items():
                hosts.write(f"{addr} {name} {self.hosts_marker}\n")
        self._write_conf()
        self._munge()
        self._step("slurmctld", "-i", "-f", str(self.conf))
        for name in self.nodes:
            (self.dir / "spool" / name).mkdir()
            ns = f"{self.tag}-{name}"
            # own hostname and own /dev/shm for the node and everything its slurmd starts (jobs included)
            script = (f"hostname {name} && mount -t tmpfs -o mode=1777,size=1g {self.tag}-shm /dev/shm && "
                      f"exec slurmd -f {self.conf}")
            done = subprocess.run(["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount",
                                   "--propagation", "private", "sh", "-c", script], env=self.env,
                                  capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise RuntimeError(f"Slurm test cluster: slurmd on {name} did not start: {done.stderr.strip()}")
        self.wait_idle(60)

    def _network(self) -> None:
        self._step("ip", "link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        self._step("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        self._step("ip", "link", "set", self.bridge, "up")
        for i, (name, addr) in enumerate(self.nodes.items(), 1):
            ns, outside, inside = f"{self.tag}-{name}", f"{self.tag}h{i}"[:15], f"{self.tag}n{i}"[:15]
            self._step("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            self._step("ip", "link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns)
            self.links.append(outside)
            self._step("ip", "link", "set", outside, "master", self.bridge)
            self._step("ip", "link", "set", outside, "up")
            # inside, every node's interface has one name, as on a real cluster
            self._step("ip", "netns", "exec", ns, "ip", "link", "set", inside, "name", "nbr0")
            self._step("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", "nbr0")
            self._step("ip", "netns", "exec", ns, "ip", "link", "set", "nbr0", "up")
            self._step("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")

    def _write_conf(self) -> None:
        d = self.dir
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs=2 RealMemory=2000 Gres=gpu:1 "
                          "State=UNKNOWN" for n, a in self.nodes.items())
        self.conf.write_text(f"""# the nbremote test cluster (tests/slurmcluster.py)
ClusterName=nbrtest
SlurmctldHost={socket.gethostname().split('.')[0]}({self.host_ip})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
SwitchType=switch/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
GresTypes=gpu
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5
KillWait=5
InactiveLimit=0
MinJobAge=60
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        (d / "gres.conf").write_text("AutoDetect=off\nName=gpu File=/dev/null\n")  # beside slurm.conf

    def _munge(self) -> None:
        if _pid(MUNGE_PID) is None:
            Path("/run/munge").mkdir(exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            self._step("runuser", "-u", "munge", "--", "munged")
            self.started_munge = True
        deadline = time.monotonic() + 10
        while _run("munge", "-n").returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("Slurm test cluster: munged does not answer after 10 s")
            time.sleep(0.1)

    # -- use -----------------------------------------------------------------------------------------------------
    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster (never without its slurm.conf)."""
        return _run(*argv, env=self.env, timeout=timeout)

    def wait_idle(self, timeout: float) -> None:
        """Until every node is idle (no job left on it), at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split()
            states = dict(zip(out[::2], out[1::2], strict=False))
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test cluster: nodes not idle after {timeout:.0f} s ({states}); see "
                                   f"{self.dir / 'log'}")
            time.sleep(0.3)

    def cut(self, node: str, up: bool = False) -> None:
        """Take ``node``'s link to the others down (a pulled cable; ``up=True`` mends it)."""
        i = list(self.nodes).index(node) + 1
        _run("ip", "link", "set", f"{self.tag}h{i}"[:15], "up" if up else "down")

    def queue(self) -> list[str]:
        """The jobs in the queue (pending, running or completing), as ``id state name`` lines."""
        return self.run("squeue", "-h", "-o", "%i %T %j").stdout.split("\n")[:-1]

    def cancel_all(self, timeout: float = 20) -> None:
        """Cancel every job and wait (at most ``timeout`` s) until the queue is empty."""
        self.run("scancel", "--full", "--user=root")
        deadline = time.monotonic() + timeout
        while self.queue() and time.monotonic() < deadline:
            time.sleep(0.2)

    # -- stop ----------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Undo everything ``__init__`` made, whatever state it got to."""
        if self.conf.exists() and _pid(self.dir / "run" / "slurmctld.pid") is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.cancel_all(10)
        for name in self.nodes:
            self._stop(self.dir / "run" / f"slurmd-{name}.pid")
        self._stop(self.dir / "run" / "slurmctld.pid")
        if self.started_munge:
            self._stop(MUNGE_PID)
        for ns in self.namespaces:  # job steps or kernels left in a node: end them by pid
            for sig in (signal.SIGTERM, signal.SIGKILL):
                pids = [int(p) for p in _run("ip", "netns", "pids", ns).stdout.split()]
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                if pids and sig == signal.SIGTERM:
                    time.sleep(0.5)
            _run("ip", "netns", "del", ns)
        for link in reversed(self.links):
            _run("ip", "link", "del", link)
        with contextlib.suppress(OSError):
            lines = Path("/etc/hosts").read_text().splitlines(keepends=True)
            kept = [line for line in lines if self.hosts_marker not in line]
            if len(kept) != len(lines):
                Path("/etc/hosts").write_text("".join(kept))
        shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def _stop(pidfile: Path, wait: float = 10) -> None:
        """SIGTERM the process in ``pidfile``, SIGKILL after ``wait`` s."""
        pid = _pid(pidfile)
        if pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
