"""Workers on Slurm nodes, for real: a Slurm 22.05 cluster of the tests' own (``slurmcluster``), a controller here
and two compute nodes in network namespaces of their own (own address, hostname and /dev/shm; a shared
filesystem, as on an HPC cluster).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import slurmcluster

from nbremote import cli


@pytest.fixture(scope="session")
def cluster() -> Iterator[slurmcluster.SlurmCluster]:
    """The cluster, started once; its slurm.conf is this process's (``SLURM_CONF``) while it runs."""
    why = slurmcluster.unavailable()
    if why is not None:
        pytest.skip(f"no Slurm test cluster: {why}")
    c = slurmcluster.SlurmCluster()
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(c.conf)
    try:
        yield c
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        c.close()


@pytest.fixture
def idle(cluster: slurmcluster.SlurmCluster) -> Iterator[slurmcluster.SlurmCluster]:
    """The cluster with an empty queue before and after the test."""
    cluster.cancel_all()
    cluster.wait_idle(30)
    yield cluster
    cluster.cancel_all()


def test_the_cluster_runs_a_job_on_each_node_apart(idle: slurmcluster.SlurmCluster, tmp_path: Path) -> None:
    """Two ``--gres=gpu:1`` jobs land on the two nodes, each with its own hostname, address and /dev/shm."""
    for i in (1, 2):
        done = idle.run("sbatch", "--gres=gpu:1", "-o", str(tmp_path / f"job{i}.log"), "--wrap",
                        "hostname; ip -o -4 addr show nbr0; touch /dev/shm/nbr-mark; ls /dev/shm; sleep 1")
        assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + 30
    while idle.queue() and time.monotonic() < deadline:
        time.sleep(0.2)
    logs = [(tmp_path / f"job{i}.log").read_text() for i in (1, 2)]
    assert {log.split()[0] for log in logs} == set(slurmcluster.NODES)
    for log in logs:
        assert idle.nodes[log.split()[0]] in log
    assert not Path("/dev/shm/nbr-mark").exists()  # each node's /dev/shm is its own


# -- nbremote worker --ip auto ---------------------------------------------------------------------------------


def test_ip_auto_is_the_address_on_the_route_to_the_driver() -> None:
    assert cli.own_address("127.0.0.1") == "127.0.0.1"


@pytest.mark.parametrize(("argv", "says"), [
    (["--ip", "auto"], "--ip auto needs --driver ADDR"),
    (["--ip", "0.0.0.0"], "--ip 0.0.0.0 listens on every address"),
    (["--ip", "198.51.100.7"], "--ip 198.51.100.7: this host cannot listen on that address"),
    (["--ip", "127.0.1.1", "--driver", "198.51.100.1"], "--ip 127.0.1.1 is a loopback address, which the driver at "
                                                         "198.51.100.1"),
])
def test_a_wrong_ip_is_refused_naming_the_address(argv: list[str], says: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Such an address used to end in a 60 s handshake timeout on the driver that named no address (issue 39)."""
    assert cli.main(["worker", "--connection-file", str(tmp_path / "k.json"), *argv]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "k.json").exists()


def test_ip_auto_on_a_node_is_its_own_address(idle: slurmcluster.SlurmCluster, tmp_path: Path) -> None:
    """In a job on a node, ``--ip auto --driver <login node>`` finds the node's address on its route back."""
    probe = f"from nbremote.cli import own_address; print('ADDR', own_address({idle.host_ip!r}))"
    done = idle.run("sbatch", "--gres=gpu:1", "-o", str(tmp_path / "auto.log"), "--wrap",
                    f"{sys.executable} -c \"{probe}\"")
    assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + 30
    while idle.queue() and time.monotonic() < deadline:
        time.sleep(0.2)
    text = (tmp_path / "auto.log").read_text()
    assert f"ADDR {idle.nodes['nbrnode1']}" in text or f"ADDR {idle.nodes['nbrnode2']}" in text, text
