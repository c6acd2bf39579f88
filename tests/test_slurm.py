"""Workers on Slurm nodes, for real: a Slurm 22.05 cluster of the tests' own (``slurmcluster``), a controller here
and two compute nodes in network namespaces of their own (own address, hostname and /dev/shm; a shared
filesystem, as on an HPC cluster).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import slurmcluster

pytestmark = [
    pytest.mark.skipif(slurmcluster.unavailable() is not None,
                       reason=f"no Slurm test cluster: {slurmcluster.unavailable()}"),
]


@pytest.fixture(scope="session")
def cluster() -> Iterator[slurmcluster.SlurmCluster]:
    """The cluster, started once; its slurm.conf is this process's (``SLURM_CONF``) while it runs."""
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
