"""Workers on Slurm nodes, for real: a Slurm 22.05 cluster of the tests' own (``slurmcluster``), a controller here
and two compute nodes in network namespaces of their own (own address, hostname and /dev/shm; a shared
filesystem, as on an HPC cluster).

Figures are printed (``pytest -s``): time to two workers from submit, a call, 16 MB, time to a typed error
after ``scancel``, time for the jobs to end after the driver dies.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import remote_fns as fns
import slurmcluster
from conftest import WORKERS

import nbremote
from nbremote import cli, rpc
from nbremote.errors import WorkerLostError, WorkerStartError

# The fixture's jobs have no time limit: squeue's %L says UNLIMITED when Slurm's main scheduler started the job,
# and a year less its run time when sched/backfill did (it gives such a job 365 days, YEAR_MINUTES).
NO_LIMIT = r"(?:UNLIMITED|36[45]-\d\d:\d\d:\d\d)"


@pytest.fixture(scope="module", autouse=True)
def without_the_shared_world() -> Iterator[None]:
    """These tests start worlds of their own in this process, so the session's shared world (conftest's
    ``world``, started by earlier modules) steps aside for this module and is started again after it, with the
    same workers: a test here could neither ``init_rpc`` beside it nor shut its own world down without ending
    that one for every later module."""
    shared = rpc.is_initialized()
    if shared:
        rpc.shutdown()
    try:
        yield
    finally:
        if rpc.is_initialized():
            rpc.shutdown()
        if shared:
            rpc.init_rpc("driver", workers=WORKERS)


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


# -- SlurmKernel -----------------------------------------------------------------------------------------------


def gpu(tmp: Path, sbatch: str = "--gres=gpu:1", **kw: object) -> nbremote.SlurmKernel:
    """One pretend GPU a job: each job on a node of its own, as on a GPU partition."""
    return nbremote.SlurmKernel(sbatch, shared_dir=tmp / "slurm", **kw)  # type: ignore[arg-type]


@pytest.fixture
def shared(idle: slurmcluster.SlurmCluster, tmp_path: Path) -> Iterator[Path]:
    """A private directory the nodes share (the whole filesystem is shared here); no world left after the test."""
    try:
        yield tmp_path
    finally:
        if rpc.is_initialized():
            rpc.shutdown()


def _figure(what: str, seconds: float) -> None:
    print(f"\n[slurm figure] {what}: {seconds * 1000:.1f} ms" if seconds < 1 else
          f"\n[slurm figure] {what}: {seconds:.2f} s")


@pytest.mark.timeout(180)
def test_two_slurm_workers_on_two_nodes_call_each_other(idle: slurmcluster.SlurmCluster, shared: Path) -> None:
    t0 = time.monotonic()
    rpc.init_rpc("driver", workers={"w1": gpu(shared), "w2": gpu(shared)}, start_timeout=60)
    _figure("2 workers ready, from sbatch", time.monotonic() - t0)
    hosts = {rpc.rpc_sync(w, socket.gethostname) for w in ("w1", "w2")}
    assert hosts == set(slurmcluster.NODES)  # a node each, apart
    jobs = idle.queue()
    assert len(jobs) == 2 and all(" RUNNING nbremote-w" in j for j in jobs), jobs
    rows = {r.name: r for r in rpc.worker_status()}
    for name in ("w1", "w2"):
        assert rows[name].kind == "slurm"
        assert rows[name].detail.startswith("job ") and "RUNNING" in rows[name].detail, rows[name]
        assert re.fullmatch(rf"job \d+ \(RUNNING on {rows[name].host} with gpu:1, {NO_LIMIT} left\)",
                            rows[name].detail), rows[name]  # its job, node and GPUs as Slurm says, once each
        assert rows[name].host in slurmcluster.NODES
    # workers reach each other directly (node to node), and the driver
    assert rpc.rpc_sync("w1", fns.call_peer, args=("w2", fns.whoami)) == "w2"
    assert rpc.rpc_sync("w2", fns.call_peer, args=("driver", fns.whoami)) == "driver"
    times = []
    for _ in range(200):
        t = time.perf_counter()
        rpc.rpc_sync("w1", fns.add, args=(1, 2))
        times.append(time.perf_counter() - t)
    _figure("a call, median of 200", float(np.median(times)))
    big = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8)
    t = time.perf_counter()
    back = rpc.rpc_sync("w2", fns.echo, args=(big,))
    _figure("16 MB echo (CurveZMQ)", time.perf_counter() - t)
    assert np.array_equal(back, big)
    _train_a_step_across(("w1", "w2"))
    t = time.monotonic()
    rpc.shutdown()
    _figure("rpc.shutdown with 2 jobs", time.monotonic() - t)
    assert idle.queue() == []  # shutdown leaves no job of ours


def _train_a_step_across(workers: tuple[str, str]) -> None:
    """A RemoteModule on each node, trained one step with distributed autograd and DistributedOptimizer."""
    torch = pytest.importorskip("torch")
    import nbremote.autograd as dist_autograd
    from nbremote.nn import RemoteModule
    from nbremote.optim import DistributedOptimizer

    first = RemoteModule(f"{workers[0]}/cpu", torch.nn.Linear, args=(8, 8))
    last = RemoteModule(f"{workers[1]}/cpu", torch.nn.Linear, args=(8, 1))
    opt = DistributedOptimizer(torch.optim.SGD, first.remote_parameters() + last.remote_parameters(), lr=0.05)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    before = [p.to_here().clone() for p in last.remote_parameters()]
    losses = []
    for _ in range(3):
        with dist_autograd.context() as context_id:
            loss = ((last(torch.tanh(first(x))) - y) ** 2).mean()
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(float(loss.detach()))
    after = [p.to_here() for p in last.remote_parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # the owner on the node stepped
    assert losses[-1] < losses[0]


@pytest.mark.timeout(180)
def test_a_worker_queued_20_s_behind_its_sibling_does_not_cost_the_sibling_its_lease(
        idle: slurmcluster.SlurmCluster, shared: Path) -> None:
    """The lease (10 s) renews from the moment a worker's kernel answers (issue 38): a sibling that waits in the
    queue twice as long does not make the first worker release the driver or exit."""
    rpc.init_rpc("driver", workers={"early": gpu(shared), "late": gpu(shared, "--gres=gpu:1 --begin=now+20")},
                 start_timeout=90)
    assert rpc.rpc_sync("early", fns.whoami) == "early"
    assert rpc.rpc_sync("late", fns.call_peer, args=("early", fns.whoami)) == "early"
    assert {r.state for r in rpc.worker_status()} == {"idle"}
    assert len(idle.queue()) == 2


@pytest.mark.timeout(120)
def test_the_magic_starts_slurm_workers_and_says_where_they_wait(idle: slurmcluster.SlurmCluster, shared: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from ipython_shell import open_shell, run

    monkeypatch.setenv("NBREMOTE_SLURM_DIR", str(shared / "slurm"))
    with open_shell() as sh:
        ran = run(sh, '%remote_workers start m1 m2 --slurm "--gres=gpu:1 --begin=now+3"  # a job each')
        assert ran.error is None, f"{ran.error!r} {ran.out} {ran.err}"
        assert re.search(r"nbremote: started m1, m2 \(Slurm job \d+, job \d+; sbatch '--gres=gpu:1 --begin=now\+3'\)",
                         ran.out), ran.out
        texts = [d["data"]["text/plain"] for d in ran.displays]
        assert any(re.search(r"m1: PENDING \(BeginTime\), job \d+, 0:0\d in queue", t) for t in texts), texts
        assert re.match(r"\u2713 m1, m2 up in \d+\.\d s", texts[-1]), texts
        rows = {r.name: r for r in rpc.worker_status()}
        assert rows["m1"].kind == "slurm" and rows["m1"].detail.startswith("job ")
        # cells run on the nodes (a client of the driver's own, over CurveZMQ), and are interrupted there
        ran = run(sh, "%%remote m1 m2\nimport socket\nprint(socket.gethostname())")
        assert ran.error is None, f"{ran.error!r} {ran.err}"
        assert {f"[m{i}] nbrnode{j}" for i in (1, 2) for j in (1, 2)} & set(ran.out.splitlines()), ran.out
        assert len({line.split()[-1] for line in ran.out.splitlines() if line.startswith("[m")}) == 2, ran.out
        cell = rpc.run_cell("m1", "import time\ntime.sleep(60)", background=True)
        time.sleep(1.0)
        rpc.interrupt_worker("m1")
        with pytest.raises(Exception, match="KeyboardInterrupt"):
            cell.wait(20)
        ran = run(sh, "%remote_workers stop m1 m2")
        assert ran.error is None and ran.out.strip() == "nbremote: stopped m1, m2"
        assert idle.queue() == []


@pytest.mark.timeout(120)
def test_a_held_job_is_cancelled_at_start_timeout_and_named(idle: slurmcluster.SlurmCluster, shared: Path) -> None:
    rpc.init_rpc("driver")
    t0 = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"worker 'held': its Slurm job \d+ was still PENDING \(JobHeldUser\) "
                                               r"in the queue after 4 s; the job was cancelled"):
        rpc.add_worker("held", gpu(shared, "--gres=gpu:1 --hold"), start_timeout=4)
    assert time.monotonic() - t0 < 15
    assert idle.queue() == []
    assert "held" not in {r.name for r in rpc.worker_status()}


@pytest.mark.timeout(120)
def test_a_job_that_ends_before_its_worker_is_up_fails_at_once_with_its_log(idle: slurmcluster.SlurmCluster,
                                                                           shared: Path) -> None:
    rpc.init_rpc("driver")
    t0 = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"(?s)worker 'broken': its Slurm job \d+ ended \((FAILED|COMPLETED)\) "
                                               r"before its kernel was up.*no such module, said the setup"):
        rpc.add_worker("broken", gpu(shared, setup="echo no such module, said the setup >&2; exit 3"),
                       start_timeout=60)
    assert time.monotonic() - t0 < 20  # not the start_timeout
    assert idle.queue() == []


@pytest.mark.timeout(180)
def test_scancel_under_a_call_is_a_worker_lost_error_naming_the_job(idle: slurmcluster.SlurmCluster,
                                                                    shared: Path) -> None:
    torch = pytest.importorskip("torch")
    from nbremote.nn import RemoteModule

    rpc.init_rpc("driver", workers={"doomed": gpu(shared), "other": gpu(shared)}, start_timeout=60)
    job = next(r.detail.split()[1] for r in rpc.worker_status() if r.name == "doomed")
    net = RemoteModule("doomed/cpu", torch.nn.Linear, args=(4, 2))
    net.snapshot()
    weights = [p.to_here() for p in net.remote_parameters()]
    fut = rpc.rpc_async("doomed", fns.sleep, args=(120,))
    time.sleep(0.3)
    assert idle.run("scancel", job).returncode == 0
    t0 = time.monotonic()
    with pytest.raises(WorkerLostError, match=rf"worker 'doomed' is gone: its Slurm job {job} ended: CANCELLED"):
        fut.wait(30)
    took = time.monotonic() - t0
    _figure("WorkerLostError after scancel", took)
    assert took < 2.5
    rows = {r.name: r for r in rpc.worker_status()}
    assert rows["doomed"].state == "dead" and f"job {job}" in rows["doomed"].detail
    assert rpc.rpc_sync("other", fns.whoami) == "other"  # its sibling lives on
    # a preempted worker comes back in a new job under the same name, its module restored from the snapshot
    rpc.restart_worker("doomed")
    assert not any(line.startswith(f"{job} ") for line in idle.queue())
    assert all(torch.equal(a, b) for a, b in zip([p.to_here() for p in net.remote_parameters()], weights,
                                                  strict=True))
    assert net(torch.ones(1, 4)).shape == (1, 2)
    rpc.restart_worker("other")  # a new job for a live one too; the old one is gone
    assert rpc.rpc_sync("other", fns.whoami) == "other"
    assert len(idle.queue()) == 2, idle.queue()
    rpc.remove_worker("doomed")
    rpc.remove_worker("other")
    assert idle.queue() == []


@pytest.mark.timeout(120)
def test_a_node_cut_off_is_a_worker_lost_error_naming_the_running_job(idle: slurmcluster.SlurmCluster,
                                                                       shared: Path) -> None:
    """The heartbeat stops before Slurm knows anything: the error says so, and that the job still runs."""
    rpc.init_rpc("driver", workers={"cut": gpu(shared)}, start_timeout=60)
    node = rpc.rpc_sync("cut", socket.gethostname)
    fut = rpc.rpc_async("cut", fns.sleep, args=(120,))
    time.sleep(0.3)
    idle.cut(node)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerLostError, match=rf"its heartbeat stopped answering.*; its Slurm job \d+ is RUNNING "
                                                  rf"on {node} with gpu:1, {NO_LIMIT} left"):
            fut.wait(30)
        assert time.monotonic() - t0 < 5
    finally:
        idle.cut(node, up=True)
    rpc.remove_worker("cut")  # the job is cancelled all the same
    assert idle.queue() == []


# -- SlurmKernel(packed=True): one job, a node and a step per worker ------------------------------------------------


def _steps(cluster: slurmcluster.SlurmCluster) -> list[str]:
    """The job steps in the queue, as ``job.step name`` lines (the batch script's own left out)."""
    out = cluster.run("squeue", "-h", "-s", "-o", "%i %j").stdout.split("\n")[:-1]
    return [line for line in out if ".batch " not in line]


@pytest.mark.timeout(180)
def test_a_packed_world_of_two_is_one_job_with_a_node_a_gpu_and_a_step_each(idle: slurmcluster.SlurmCluster,
                                                                            shared: Path) -> None:
    packed = gpu(shared, packed=True)
    t0 = time.monotonic()
    rpc.init_rpc("driver", workers={"p1": packed, "p2": packed}, start_timeout=60)
    _figure("a packed world of 2 ready, from sbatch", time.monotonic() - t0)
    jobs = idle.queue()
    assert len(jobs) == 1 and re.fullmatch(r"\d+ RUNNING nbremote-p1\+p2", jobs[0]), jobs
    job = jobs[0].split()[0]
    assert sorted(_steps(idle)) == sorted([f"{job}.0 nbremote-p1.0", f"{job}.1 nbremote-p2.0"]) or \
        sorted(_steps(idle)) == sorted([f"{job}.0 nbremote-p2.0", f"{job}.1 nbremote-p1.0"]), _steps(idle)
    # each member on a node of its own, with that node's GPU (the job's --gres=gpu:1 reaches its step)
    where = {w: (rpc.rpc_sync(w, socket.gethostname), rpc.rpc_sync(w, os.getenv, args=("CUDA_VISIBLE_DEVICES",)),
                 rpc.rpc_sync(w, os.getenv, args=("SLURM_STEP_ID",))) for w in ("p1", "p2")}
    assert {h for h, _, _ in where.values()} == set(slurmcluster.NODES), where
    assert all(gpu == "0" for _, gpu, _ in where.values()), where
    rows = {r.name: r for r in rpc.worker_status()}
    for w, (host, _, step) in where.items():
        assert rows[w].kind == "slurm" and rows[w].host == host, rows[w]
        assert re.fullmatch(rf"job {job}\.{step} \(RUNNING on {host} with gpu:1, {NO_LIMIT} left\)", rows[w].detail), \
            rows[w]
    assert rpc.rpc_sync("p1", fns.call_peer, args=("p2", fns.whoami)) == "p2"  # node to node
    # a member restarted runs again in a new step of the same job, on its node (which the job holds)
    t = time.monotonic()
    rpc.restart_worker("p1")
    _figure("restart_worker of a packed member (a new step)", time.monotonic() - t)
    assert [j.split()[0] for j in idle.queue()] == [job]
    again = (rpc.rpc_sync("p1", socket.gethostname), rpc.rpc_sync("p1", os.getenv, args=("CUDA_VISIBLE_DEVICES",)),
             rpc.rpc_sync("p1", os.getenv, args=("SLURM_STEP_ID",)))
    assert again[:2] == where["p1"][:2] and again[2] not in (where["p1"][2], where["p2"][2]), (again, where)
    assert rpc.rpc_sync("p1", fns.call_peer, args=("p2", fns.whoami)) == "p2"
    where["p1"] = again
    # one member stopped: its step goes, the job and the other member stay
    rpc.remove_worker("p1")
    assert _steps(idle) == [f"{job}.{where['p2'][2]} nbremote-p2.0"], _steps(idle)
    assert [j.split()[0] for j in idle.queue()] == [job]
    assert rpc.rpc_sync("p2", fns.add, args=(2, 3)) == 5
    t = time.monotonic()
    rpc.shutdown()
    _figure("rpc.shutdown of the packed job's last member", time.monotonic() - t)
    assert idle.queue() == []


@pytest.mark.timeout(120)
def test_two_packed_specs_in_one_start_are_two_jobs(idle: slurmcluster.SlurmCluster, shared: Path) -> None:
    """A pack is the workers one start gives one spec: two specs, two jobs (each across both nodes, a CPU a node)."""
    x, y = gpu(shared, "", packed=True), gpu(shared, "", packed=True)
    rpc.init_rpc("driver", workers={"x1": x, "y1": y, "x2": x, "y2": y}, start_timeout=60)
    jobs = sorted(j.split(maxsplit=1)[1] for j in idle.queue())
    assert jobs == ["RUNNING nbremote-x1+x2", "RUNNING nbremote-y1+y2"], jobs
    for a, b in (("x1", "x2"), ("y1", "y2")):  # a pack's members on nodes apart
        assert {rpc.rpc_sync(w, socket.gethostname) for w in (a, b)} == set(slurmcluster.NODES)
    assert rpc.rpc_sync("x1", fns.call_peer, args=("y2", fns.whoami)) == "y2"
    rpc.shutdown()
    assert idle.queue() == []


@pytest.mark.timeout(120)
def test_a_packed_step_has_the_jobs_environment_even_with_export_none(idle: slurmcluster.SlurmCluster,
                                                                      shared: Path) -> None:
    """``--export=NONE`` leaves ``SLURM_EXPORT_ENV=NONE`` in the job, which would have the steps' ``srun`` pass them
    nothing of what ``env=`` and ``setup`` set (the README says the steps inherit it)."""
    packed = gpu(shared, "--gres=gpu:1 --export=NONE", packed=True, env={"NBR_SAID": "by env"},
                 setup=f"export NBR_SETUP=by-setup SLURM_CONF={idle.conf}")
    rpc.init_rpc("driver", workers={"e1": packed}, start_timeout=60)
    assert [rpc.rpc_sync("e1", os.getenv, args=(v,)) for v in ("NBR_SAID", "NBR_SETUP")] == ["by env", "by-setup"]
    rpc.shutdown()
    assert idle.queue() == []


@pytest.mark.timeout(150)
def test_restarting_a_member_beside_a_crashed_one_is_a_job_of_its_own(idle: slurmcluster.SlurmCluster,
                                                                       shared: Path) -> None:
    """A sibling lost but not removed (its kernel crashed, its step ended) has no step left running: restarting the
    other member ends the job's last step and so the job, and the restart is a new job, not a request no one reads."""
    packed = gpu(shared, packed=True)
    rpc.init_rpc("driver", workers={"r1": packed, "r2": packed}, start_timeout=60)
    job = idle.queue()[0].split()[0]
    fut = rpc.rpc_async("r2", os._exit, args=(3,))
    with pytest.raises(WorkerLostError, match="worker 'r2' is gone"):
        fut.wait(30)
    rpc.restart_worker("r1")
    assert rpc.rpc_sync("r1", fns.call_peer, args=("driver", fns.whoami)) == "driver"
    deadline = time.monotonic() + 30  # the old job ends with its script, which no step keeps
    while any(line.startswith(f"{job} ") for line in idle.queue()):
        assert time.monotonic() < deadline, idle.queue()
        time.sleep(0.2)
    assert len(idle.queue()) == 1, idle.queue()  # r1's own
    rpc.shutdown()
    assert idle.queue() == []


@pytest.mark.timeout(120)
def test_a_pack_that_cannot_have_all_its_nodes_is_cancelled_at_start_timeout_and_named(
        idle: slurmcluster.SlurmCluster, shared: Path) -> None:
    """Three workers packed on a cluster of two nodes: the job waits for a third node that never comes, and no
    member starts on the two there are (all or none)."""
    rpc.init_rpc("driver")
    packed = nbremote.SlurmKernel(packed=True, shared_dir=shared / "slurm")
    t0 = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"(?s)worker 'q\d': its Slurm job \d+ \(the pack of q1, q2, q3\) was "
                                               r"still PENDING \(\w+\) in the queue after 2 s; the job was cancelled.*"
                                               r"a pack needs all its 3 nodes at once.*: start fewer workers in it, or "
                                               r"pass packed=False for a job each"):
        rpc.add_workers({"q1": packed, "q2": packed, "q3": packed}, start_timeout=2)
    # it gave up at its start_timeout, not at the test's (120 s): the job never runs. The bound is loose on purpose:
    # sbatch, squeue and scancel on a loaded 2-core machine take seconds each, and the time is the benchmark's to say
    assert time.monotonic() - t0 < 60
    assert idle.queue() == []
    assert not {"q1", "q2", "q3"} & {r.name for r in rpc.worker_status()}


@pytest.mark.timeout(120)
def test_a_member_whose_step_fails_fails_the_pack_at_once_with_its_log(idle: slurmcluster.SlurmCluster,
                                                                       shared: Path) -> None:
    """The job runs on when one step ends (its sibling's runs), so the step's own end must fail the start."""
    python = shared / "python-but-not-on-nbrnode2"
    python.write_text(f'#!/bin/bash\n[ "$(hostname)" != nbrnode2 ] || {{ echo "no python on $(hostname)" >&2; exit 3; '
                      f'}}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    rpc.init_rpc("driver")
    packed = gpu(shared, packed=True, python=str(python))
    t0 = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"(?s)worker 'f\d': the step of worker 'f2' in Slurm job \d+ \(the "
                                               r"pack of f1, f2\) ended \(exit status 3\) before its kernel was up.*no "
                                               r"python on nbrnode2.*the job was cancelled"):
        rpc.add_workers({"f1": packed, "f2": packed}, start_timeout=60)
    assert time.monotonic() - t0 < 20  # not the start_timeout
    assert idle.queue() == []


@pytest.mark.timeout(150)
def test_the_magic_packs_workers_and_a_cancelled_step_or_job_loses_its_members(idle: slurmcluster.SlurmCluster,
                                                                       shared: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from ipython_shell import open_shell, run

    monkeypatch.setenv("NBREMOTE_SLURM_DIR", str(shared / "slurm"))
    with open_shell() as sh:
        ran = run(sh, '%remote_workers start k1 k2 --slurm "--gres=gpu:1" --packed')
        assert ran.error is None, f"{ran.error!r} {ran.out} {ran.err}"
        match = re.search(r"nbremote: started k1, k2 \(Slurm job (\d+)\.\d, job \1\.\d; sbatch '--gres=gpu:1', "
                          r"packed\)", ran.out)
        assert match, ran.out
        job = match.group(1)
        assert [j.split()[0] for j in idle.queue()] == [job]
        # one member's step cancelled under a call: that member is lost, naming its step; the other runs on
        step = next(r.detail.split()[1] for r in rpc.worker_status() if r.name == "k1")
        fut = rpc.rpc_async("k1", fns.sleep, args=(120,))
        time.sleep(0.3)
        assert idle.run("scancel", step).returncode == 0
        with pytest.raises(WorkerLostError, match=rf"worker 'k1' is gone: its Slurm job step {re.escape(step)} ended "
                                                  r"\(exit status \d+\) on nbrnode\d; the job runs on for the other "
                                                  r"workers in it, and rpc.restart_worker\('k1'\) runs it again"):
            fut.wait(30)
        assert rpc.rpc_sync("k2", fns.add, args=(1, 1)) == 2
        ran = run(sh, "%remote_workers restart k1")  # back in a new step of the same job
        assert ran.error is None, f"{ran.error!r} {ran.out} {ran.err}"
        assert rpc.rpc_sync("k1", fns.call_peer, args=("k2", fns.whoami)) == "k2"
        # the job cancelled under calls: every member is lost, naming the job and its state
        futs = [rpc.rpc_async(w, fns.sleep, args=(120,)) for w in ("k1", "k2")]
        time.sleep(0.3)
        assert idle.run("scancel", job).returncode == 0
        for w, fut in zip(("k1", "k2"), futs, strict=True):
            with pytest.raises(WorkerLostError, match=rf"worker '{w}' is gone: its Slurm job {job} ended: CANCELLED"):
                fut.wait(30)
        ran = run(sh, "%remote_workers stop k1 k2")
        assert ran.error is None and ran.out.strip() == "nbremote: stopped k1, k2"
        assert idle.queue() == []


_INTERRUPTED = """
import sys, time
sys.path[:0] = {path!r}
import nbremote
from nbremote import rpc
try:
    rpc.init_rpc("driver", workers={{"queued": nbremote.SlurmKernel("--hold", shared_dir={shared!r})}},
                 start_timeout=60)
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
"""


@pytest.mark.timeout(120)
def test_ctrl_c_while_a_job_waits_cancels_it_at_once(idle: slurmcluster.SlurmCluster, tmp_path: Path) -> None:
    """The notebook's stop button (SIGINT) during a start whose job waits in the queue: the job is cancelled
    now, not at the start's timeout, and the KeyboardInterrupt reaches the user."""
    code = _INTERRUPTED.format(path=sys.path, shared=str(tmp_path / "slurm"))
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "SLURM_CONF": str(idle.conf)})
    try:
        deadline = time.monotonic() + 30
        while not any(" PENDING nbremote-queued" in j for j in idle.queue()):
            assert time.monotonic() < deadline and driver.poll() is None, driver.communicate()
            time.sleep(0.2)
        t0 = time.monotonic()
        driver.send_signal(signal.SIGINT)
        out, err = driver.communicate(timeout=30)
        _figure("Ctrl-C to job cancelled and start ended", time.monotonic() - t0)
        assert out.strip() == b"INTERRUPTED", err.decode()[-3000:]
        assert time.monotonic() - t0 < 20
        assert idle.queue() == []
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(10)


_DRIVER = """
import sys, time
sys.path[:0] = {path!r}
import nbremote
from nbremote import rpc
pack = nbremote.SlurmKernel(shared_dir={shared!r}, packed=True)  # a node each, beside a's job (2 CPUs a node)
rpc.init_rpc("driver", workers={{"a": nbremote.SlurmKernel("--gres=gpu:1", shared_dir={shared!r}), "p1": pack,
                                "p2": pack}})
print("UP", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(180)
def test_a_driver_killed_with_9_leaves_no_job_after_15_s(idle: slurmcluster.SlurmCluster, tmp_path: Path) -> None:
    """A job of its own and a packed job both end through their workers' lease: each worker exits, so its step,
    so the job (a pack's script ends with its last step)."""
    code = _DRIVER.format(path=sys.path, shared=str(tmp_path / "slurm"))
    with open(tmp_path / "driver.log", "wb") as log:
        driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log,
                                  env={**os.environ, "SLURM_CONF": str(idle.conf)})
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()  # bounded: the driver's start_timeout (60 s)
        assert line.strip() == b"UP", (tmp_path / "driver.log").read_text()[-3000:]
        assert len(idle.queue()) == 2 and len(_steps(idle)) == 2  # a's job; the pack's job, a step a member
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        t0 = time.monotonic()
        while idle.queue() and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        took = time.monotonic() - t0
        _figure("jobs ended after the driver died (kill -9)", took)
        assert idle.queue() == [] and took < 15
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(10)


# -- %remote_workers start ... --slurm, parsed ------------------------------------------------------------------


def test_the_slurm_option_takes_sbatch_options_as_one_value() -> None:
    from nbremote.jupyter._parse import MagicUsageError, parse_workers

    assert parse_workers('start w1 w2 --slurm "--gres=gpu:1 -t 2:00:00"').slurm == "--gres=gpu:1 -t 2:00:00"
    assert parse_workers("start w1 --slurm='-p gpu'").slurm == "-p gpu"
    assert parse_workers('start w1 --slurm ""').slurm == ""  # the cluster's defaults
    with pytest.raises(MagicUsageError, match="option --slurm needs a value"):
        parse_workers("start w1 --slurm")
    with pytest.raises(MagicUsageError, match="--slurm starts each worker in a Slurm job: leave out --kernel"):
        parse_workers("start w1 --slurm x --kernel python3")
    assert parse_workers('start w1 w2 --slurm "-p gpu" --packed').packed
    assert parse_workers('start w1 --packed --slurm ""').packed
    assert not parse_workers('start w1 --slurm "-p gpu"').packed
    with pytest.raises(MagicUsageError, match="--packed puts the workers in one Slurm job: give --slurm"):
        parse_workers("start w1 w2 --packed")
    with pytest.raises(MagicUsageError, match="option --packed takes no value"):
        parse_workers("start w1 --slurm x --packed=yes")
    with pytest.raises(MagicUsageError, match="option --slurm needs a value"):
        parse_workers("start w1 --slurm --packed")


def test_a_slurm_kernel_checks_its_arguments(tmp_path: Path) -> None:
    assert nbremote.SlurmKernel("-p gpu --gres=gpu:1").sbatch == ["-p", "gpu", "--gres=gpu:1"]
    assert nbremote.SlurmKernel(["-p", "gpu"]).sbatch == ["-p", "gpu"]
    with pytest.raises(TypeError, match=r"SlurmKernel\(sbatch=...\) is a str of sbatch options or a list"):
        nbremote.SlurmKernel(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"SlurmKernel\(env=...\) is a dict of variable names"):
        nbremote.SlurmKernel(env={"NOT A NAME": "x"})
    with pytest.raises(TypeError, match=r"SlurmKernel\(packed=...\) is True .* or False .*, got 'yes'"):
        nbremote.SlurmKernel(packed="yes")  # type: ignore[arg-type]
    for option in ("-N 2", "-N2", "--nodes=2", "-n 4", "--ntasks=4", "--ntasks-per-node=1", "--array=0-3"):
        with pytest.raises(ValueError, match=rf"SlurmKernel\(packed=True\) cannot take the sbatch option "
                                             rf"'{option.split()[0]}' .*leave '{option.split()[0]}' out"):
            nbremote.SlurmKernel(f"-p gpu {option}", packed=True)
    assert nbremote.SlurmKernel("-N 2").sbatch == ["-N", "2"]  # a job each: the user's to ask for
    assert repr(nbremote.SlurmKernel("-p gpu", packed=True)) == "SlurmKernel('-p gpu', packed=True)"
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(WorkerStartError, match="is not private to this user"):
        nbremote.SlurmKernel(shared_dir=open_dir).start("w")


def _fake_slurm(tmp_path: Path, worker_s: float) -> tuple[Path, dict[str, str]]:
    """A pretend ``srun`` on PATH that logs its arguments and runs the step's command, and a pretend python whose
    worker lives ``worker_s``: the python, and the environment to run a job script in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "srun"
    fake.write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/srun.log\nshift 6\nSLURM_STEP_ID=$RANDOM '
                    'SLURMD_NODENAME=n1 "$@"\n')
    fake.chmod(0o755)
    python = bin_dir / "python"
    python.write_text(f"#!/bin/bash\nsleep {worker_s}\n")
    python.chmod(0o755)
    return python, {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}


def _until(done: Callable[[], bool], what: str, within: float = 10.0) -> None:
    """Wait (at most ``within`` s) until ``done()`` is true."""
    deadline = time.monotonic() + within
    while not done():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        time.sleep(0.05)


def test_a_packed_job_script_runs_a_step_per_worker_and_launches_one_again_when_asked(tmp_path: Path) -> None:
    """Without Slurm: a pretend ``srun`` and workers that live a second each."""
    from nbremote.rpc._kernels.slurmpack import member_files, script

    python, env = _fake_slurm(tmp_path, 1)
    (tmp_path / "job.sh").write_text(script(["a", "b:1"], tmp_path, str(python), "198.51.100.1", {"X": "1 2"},
                                            "echo set up"))
    job = subprocess.Popen(["bash", str(tmp_path / "job.sh")], env=env, stdout=subprocess.PIPE, text=True)
    _until(lambda: member_files(tmp_path, "a").step.exists() and member_files(tmp_path, "b:1").step.exists(),
           "both steps started")
    # a restart of a (launch 1) while b still runs, asked as Pack.relaunch asks: written whole, then renamed
    again = member_files(tmp_path, "a").again
    again.with_suffix(".asking").write_text("1\n")
    os.replace(again.with_suffix(".asking"), again)
    out, _ = job.communicate(timeout=20)
    launched = (tmp_path / "srun.log").read_text().splitlines()
    steps = [line.split()[3:5] for line in launched]  # the first two in either order (they start at once)
    assert sorted(steps[:2]) == [["--relative=0", "--job-name=nbremote-a.0"],
                                 ["--relative=1", "--job-name=nbremote-b:1.0"]], launched
    assert steps[2:] == [["--relative=0", "--job-name=nbremote-a.1"]], launched  # its launch in its step's name
    assert all(line.startswith("--whole -N1 -n1 ") for line in launched)
    assert member_files(tmp_path, "b:1").step.read_text().split()[1] == "n1"  # the step file: "<step> <node>"
    assert member_files(tmp_path, "a").ended.read_text() == "0 1\n"  # its srun's exit status, and which launch
    assert not again.exists() and not Path(f"{again}.taken").exists()  # the request claimed, read and gone
    assert job.returncode == 0 and "set up" in out  # it ended once no step ran


def test_a_packed_job_script_ends_with_its_steps_not_with_setups_background_jobs(tmp_path: Path) -> None:
    """A daemon that ``setup`` starts (``&``) is no step: the script ends when its steps do (the job with it, and
    Slurm ends the daemon), not when the daemon does -- which might be never, the job running to its time limit."""
    from nbremote.rpc._kernels.slurmpack import member_files, script

    python, env = _fake_slurm(tmp_path, 0.5)
    (tmp_path / "job.sh").write_text(script(["a"], tmp_path, str(python), "198.51.100.1", {},
                                            "sleep 60 > /dev/null 2>&1 &"))
    job = subprocess.Popen(["bash", str(tmp_path / "job.sh")], env=env, stdout=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        assert job.wait(timeout=30) == 0  # far less than setup's 60 s sleep (a bound no loaded machine reaches)
        assert member_files(tmp_path, "a").ended.read_text() == "0 0\n"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # setup's sleep, as Slurm would at the job's end
        if job.poll() is None:
            job.wait(10)


def test_a_packed_job_script_ignores_a_request_with_no_launch_number(tmp_path: Path) -> None:
    """A request deleted or emptied under the script (a failed restart withdraws it) launches no step."""
    from nbremote.rpc._kernels.slurmpack import member_files, script

    python, env = _fake_slurm(tmp_path, 1)
    (tmp_path / "job.sh").write_text(script(["a", "b"], tmp_path, str(python), "198.51.100.1", {}, ""))
    job = subprocess.Popen(["bash", str(tmp_path / "job.sh")], env=env, stdout=subprocess.DEVNULL)
    _until(lambda: member_files(tmp_path, "a").step.exists() and member_files(tmp_path, "b").step.exists(),
           "both steps started")
    member_files(tmp_path, "a").again.write_text("")
    member_files(tmp_path, "b").again.write_text("x1\n")
    assert job.wait(timeout=20) == 0
    assert len((tmp_path / "srun.log").read_text().splitlines()) == 2  # the first steps only


def test_workers_whose_names_differ_have_files_apart() -> None:
    """``a:b`` and ``a_b`` (and ``a/b``, ``a%3Ab``) are different workers: never one file, in a pack or a job each."""
    from nbremote.rpc._kernels.slurmpack import member_files
    from nbremote.rpc._kernels.slurmscript import file_name

    names = ["a:b", "a_b", "a/b", "a%3Ab", "a+3Ab", "a.b"]
    assert len({file_name(n) for n in names}) == len(names)
    assert not any(c in file_name(n) for n in names for c in "/%")  # % is Slurm's in --output (%A, %j)
    files = [member_files(Path("/p"), n) for n in names]
    assert len({f.conn for f in files}) == len(names) and all(f.conn.parent == Path("/p") for f in files)


def test_a_job_says_its_gpus_and_that_its_time_limit_is_near() -> None:
    from nbremote.rpc._kernels.slurmqueue import JobInfo, gres, seconds_left

    assert [seconds_left(t) for t in ("1-02:03:04", "2:03:04", "03:04", "UNLIMITED")] == [93784, 7384, 184, None]
    job = JobInfo("7", "w1")
    job.state, job.reason = "PENDING", "Resources"
    assert re.fullmatch(r"PENDING \(Resources\), job 7, 0:0\d in queue", job.describe())
    job.state, job.node, job.time_left = "RUNNING", "node3", "1:52:10"
    assert job.describe() == "RUNNING on node3, job 7, 1:52:10 left"
    assert [gres(t) for t in ("gres:gpu:1", "gres/gpu:a100:2,gres/shard:1", "N/A", "")] == [
        "gpu:1", "gpu:a100:2,shard:1", "", ""]  # squeue's %b: 22.05's form, later releases', none
    job.gres = "gpu:1"
    assert job.describe() == "RUNNING on node3 with gpu:1, job 7, 1:52:10 left"
    assert job.describe(named=False) == "RUNNING on node3 with gpu:1, 1:52:10 left"  # in a text that names the job
    job.time_left = "9:30"
    assert job.describe().endswith("9:30 left -- its time limit is near: save what you need from it")


@pytest.mark.timeout(120)
def test_the_slurm_benchmark_measures_nbremote_on_real_jobs(idle: slurmcluster.SlurmCluster, shared: Path) -> None:
    """A smoke run of ``benchmarks/bench_slurm.py``'s nbremote round on this cluster: two workers ready (split at
    Slurm's allocation, from its controller's log), calls, checked echoes, a typed error after a ``scancel``, and
    the table. (Its ipyparallel and dask-jobqueue rounds need an environment the benchmark builds from the package
    index, so they run in the benchmark only.)"""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_slurm

    r = bench_slurm.with_allocation(bench_slurm.nbremote_round(idle, 20, shared, full=True),
                                    bench_slurm.allocations(idle))
    assert 0 <= r["alloc_s"] < r["ready_s"] and 0 < r["after_s"] < r["ready_s"], r  # this round's allocations found
    assert r["call_ms"] > 0 and r["echo16_ms"] > 0, r
    assert r["lost_s"] is not None, "no WorkerLostError after the scancel"
    assert bench_slurm.table({"nbremote": [r]}).splitlines()[2].startswith("| nbremote | 1 | ")
    assert not rpc.is_initialized()
