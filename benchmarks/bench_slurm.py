"""Workers on Slurm nodes: nbremote's ``SlurmKernel`` against ipyparallel and dask-jobqueue, on one cluster, in one run.

    python benchmarks/bench_slurm.py [--calls 200] [--skip ipyparallel,dask]

Starts the tests' Slurm cluster (``tests/slurmcluster.py``: slurmctld here, two nodes in network namespaces of
their own; root, ``slurm-wlm`` and ``munge``) and, for each library, from a driver on this machine: the time to
two ready workers from the submit (a pretend GPU each, so a node each), a small call (median of ``--calls``
blocking calls), a 16 MB echo (numpy uint8, checked), and the time from a ``scancel`` of one worker's job to a
typed error of the call pending on it (at most 60 s: longer is "none"). ipyparallel 9.2 and dask-jobqueue 0.9
run from an environment of their own (built once into ``~/.cache/nbremote-tests``), the nodes using the same
one through the shared filesystem; each runs as a subprocess that prints its figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import slurmcluster  # noqa: E402 -- the tests' cluster

CACHE = Path(os.environ.get("NBREMOTE_TEST_CACHE", Path.home() / ".cache" / "nbremote-tests"))
VENV = CACHE / "slurm-bench"
PACKAGES = ("ipyparallel==9.2.0", "dask-jobqueue==0.9.0", "numpy")
LOST_LIMIT = 60.0


def bench_venv() -> Path:
    ready = VENV / ".nbremote-ready"
    if ready.exists() and ready.read_text() == " ".join(PACKAGES):
        return VENV
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True, timeout=300)
    subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", *PACKAGES], check=True, timeout=900)
    ready.write_text(" ".join(PACKAGES))
    return VENV


def _nbremote(cluster: slurmcluster.SlurmCluster, calls: int, shared: Path) -> dict[str, Any]:
    import nbremote
    from nbremote import rpc

    spec = nbremote.SlurmKernel("--gres=gpu:1", shared_dir=shared)
    t0 = time.monotonic()
    rpc.init_rpc("driver", workers={"w1": spec, "w2": spec})
    ready = time.monotonic() - t0
    try:
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            rpc.rpc_sync("w1", int, args=(1,))
            times.append(time.perf_counter() - t)
        big = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8)
        t = time.perf_counter()
        assert np.array_equal(rpc.rpc_sync("w2", np.copy, args=(big,)), big)
        echo = time.perf_counter() - t
        job = next(r.detail.split()[1] for r in rpc.worker_status() if r.name == "w2")
        fut = rpc.rpc_async("w2", time.sleep, args=(120,))
        time.sleep(0.3)
        cluster.run("scancel", job)
        t = time.monotonic()
        try:
            fut.wait(LOST_LIMIT)
            lost: float | None = None
        except nbremote.WorkerLostError:
            lost = time.monotonic() - t
        except Exception:
            lost = None
    finally:
        rpc.shutdown()
    return {"ready_s": ready, "call_ms": 1000 * statistics.median(times), "echo16_ms": 1000 * echo, "lost_s": lost,
            "lines": 1}


_IPP = """
import json, statistics, subprocess, sys, time
import numpy as np
import ipyparallel as ipp
HOST, CALLS, LIMIT = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
# the user's ~10 lines: the controller's address, and a job template that puts one engine on each node
cluster = ipp.Cluster(engines="slurm", n=2, controller_ip=HOST, log_level=40)
cluster.config.SlurmEngineSetLauncher.batch_template = (
    "#!/bin/sh\\n#SBATCH --job-name=ipengine\\n#SBATCH --ntasks={n}\\n#SBATCH --ntasks-per-node=1\\n"
    "#SBATCH --gres=gpu:1\\nsrun {program_and_args}\\n")
t0 = time.monotonic()
client = cluster.start_and_connect_sync(activate=False)
client.wait_for_engines(2, timeout=120)
ready = time.monotonic() - t0
view = client[0]
times = []
for _ in range(CALLS):
    t = time.perf_counter(); view.apply_sync(int, 1); times.append(time.perf_counter() - t)
big = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8)
t = time.perf_counter(); back = client[1].apply_sync(np.copy, big); echo = time.perf_counter() - t
assert np.array_equal(back, big)
ar = client[1].apply_async(time.sleep, 120)
time.sleep(0.3)
job = subprocess.run(["squeue", "-h", "-n", "ipengine", "-o", "%i"], capture_output=True, text=True).stdout.split()[0]
subprocess.run(["scancel", job])
t = time.monotonic()
try:
    ar.get(timeout=LIMIT)
    lost = None
except ipp.error.TimeoutError:
    lost = None
except Exception:
    lost = time.monotonic() - t
print(json.dumps({"ready_s": ready, "call_ms": 1000 * statistics.median(times), "echo16_ms": 1000 * echo,
                  "lost_s": lost, "lines": 10}), flush=True)
try:
    cluster.stop_cluster_sync()
except Exception:
    pass
"""

_DASK = """
import json, statistics, subprocess, sys, time
import numpy as np
from dask_jobqueue import SLURMCluster
from distributed import Client
BRIDGE, CALLS, LIMIT = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
# the user's 6 lines: two interface names (the nodes' and the login node's)
cluster = SLURMCluster(cores=1, memory="1GB", processes=1, interface="nbr0", scheduler_options={"interface": BRIDGE},
                       job_extra_directives=["--gres=gpu:1"], python=sys.executable, job_name="dask-worker")
client = Client(cluster)
t0 = time.monotonic()
cluster.scale(2)
client.wait_for_workers(2, timeout=120)
ready = time.monotonic() - t0
w1, w2 = sorted(client.scheduler_info()["workers"])
times = []
for _ in range(CALLS):
    t = time.perf_counter()
    client.submit(int, 1, workers=[w1], pure=False).result()
    times.append(time.perf_counter() - t)
big = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8)
t = time.perf_counter()
back = client.submit(np.copy, big, workers=[w2], pure=False).result()
echo = time.perf_counter() - t
assert np.array_equal(back, big)
fut = client.submit(time.sleep, 120, workers=[w2], pure=False, allow_other_workers=False)
time.sleep(0.3)
host = w2.split("://")[1].split(":")[0]
jobs = subprocess.run(["squeue", "-h", "-n", "dask-worker", "-o", "%i %N"], capture_output=True, text=True).stdout
node = {"NODE1_IP": "nbrnode1", "NODE2_IP": "nbrnode2"}[host]
job = next(line.split()[0] for line in jobs.splitlines() if line.split()[1] == node)
subprocess.run(["scancel", job])
t = time.monotonic()
try:
    fut.result(timeout=LIMIT)
    lost = None
except TimeoutError:
    lost = None
except Exception:
    lost = time.monotonic() - t
print(json.dumps({"ready_s": ready, "call_ms": 1000 * statistics.median(times), "echo16_ms": 1000 * echo,
                  "lost_s": lost, "lines": 6}), flush=True)
client.close()
cluster.close()
"""


def _other(name: str, code: str, args: list[str], cluster: slurmcluster.SlurmCluster, tmp: Path) -> dict[str, Any]:
    venv = bench_venv()
    env = {**cluster.env, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp)}
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code, *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": (done.stderr or done.stdout)[-1500:]}
    return dict(json.loads(lines[-1]))


def _row(name: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {name} | failed: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'} | | | | |"
    lost = "none in 60 s" if r["lost_s"] is None else f"{r['lost_s']:.1f} s"
    return (f"| {name} | {r['lines']} | {r['ready_s']:.1f} s | {r['call_ms']:.2f} ms | {r['echo16_ms']:.0f} ms | "
            f"{lost} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--skip", default="", help="comma-separated: ipyparallel, dask")
    args = parser.parse_args()
    why = slurmcluster.unavailable()
    if why:
        print(f"bench_slurm: no Slurm test cluster here: {why}", file=sys.stderr)
        return 2
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="nbremote-bench-slurm-"))
    cluster = slurmcluster.SlurmCluster()
    os.environ["SLURM_CONF"] = str(cluster.conf)
    results: dict[str, dict[str, Any]] = {}
    try:
        results["nbremote SlurmKernel"] = _nbremote(cluster, args.calls, tmp / "nbremote")
        cluster.cancel_all()
        cluster.wait_idle(30)
        nodes = list(cluster.nodes.values())
        if "ipyparallel" not in args.skip:
            results["ipyparallel Cluster(engines='slurm')"] = _other(
                "ipyparallel", _IPP, [cluster.host_ip, str(args.calls), str(LOST_LIMIT)], cluster, tmp)
            cluster.cancel_all()
            cluster.wait_idle(30)
        if "dask" not in args.skip:
            code = _DASK.replace("NODE1_IP", nodes[0]).replace("NODE2_IP", nodes[1])
            results["dask-jobqueue SLURMCluster"] = _other(
                "dask", code, [cluster.bridge, str(args.calls), str(LOST_LIMIT)], cluster, tmp)
            cluster.cancel_all()
    finally:
        cluster.close()
    print("\n| library | lines | 2 workers ready | a call | 16 MB echo | typed error after scancel |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(_row(name, r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
