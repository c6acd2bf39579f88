"""Workers on Slurm nodes: nbremote's ``SlurmKernel`` against ipyparallel and dask-jobqueue, on one cluster, in one run.

    python benchmarks/bench_slurm.py [--rounds 5] [--calls 200] [--skip ipyparallel,dask]

Starts the tests' Slurm cluster (``tests/slurmcluster.py``: slurmctld here, two nodes in network namespaces of
their own; root, ``slurm-wlm`` and ``munge``) and, for each library, from a driver on this machine:

- the time to two ready workers (a pretend GPU each, so a node each), in ``--rounds`` rounds taken in turn
  (library after library, so a busy moment of the machine falls on all of them), split in two: from the
  library's first call until Slurm allocated the last node (the controller's log says when, to the ms), and
  from that allocation until the workers answer. The first part is the library's work before and during its
  ``sbatch`` calls, and then Slurm's: a batch job waits for the scheduler's next pass, which comes
  ``batch_sched_delay`` (3 s by default) after the previous one at the earliest, on the controller's 1 s
  tick. So each round begins ``SETTLE_S`` after the cluster went idle, and no library's jobs wait on the pass
  the previous round's end caused (without that pause, the library that runs right after a round's cleanup
  pays up to 3 s more). The second part is the library's own;
- in the last round: a small call (median of ``--calls`` blocking calls), a 16 MB echo (numpy uint8,
  checked; the median of ``ECHOES``), and the time from a ``scancel`` of one worker's job to a typed error
  of the call pending on it (at most 60 s: longer is "none").

Where each library's clock starts: nbremote before ``init_rpc`` (the driver's own start included);
ipyparallel before ``Cluster.start_and_connect_sync`` (its controller's start included); dask-jobqueue before
``cluster.scale(2)`` (its scheduler runs already). ipyparallel 9.2 and dask-jobqueue 0.9 run from an
environment of their own (built once into ``~/.cache/nbremote-tests``), the nodes using the same one through
the shared filesystem; each round runs as a subprocess that prints its figures as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
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
ECHOES = 5  # 16 MB echoes a round (the median is shown), each checked
SETTLE_S = 4.0  # s between an idle cluster and a round: Slurm's batch_sched_delay (3 s) and its 1 s tick


def bench_venv() -> Path:
    ready = VENV / ".nbremote-ready"
    if ready.exists() and ready.read_text() == " ".join(PACKAGES):
        return VENV
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True, timeout=300)
    subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", *PACKAGES], check=True, timeout=900)
    ready.write_text(" ".join(PACKAGES))
    return VENV


def nbremote_round(cluster: slurmcluster.SlurmCluster, calls: int, shared: Path, full: bool) -> dict[str, Any]:
    """One round of nbremote: two ``SlurmKernel`` workers ready (``t0`` / ``ready_at``, wall clock), and with
    ``full`` the call, echo and loss figures."""
    import nbremote
    from nbremote import rpc

    spec = nbremote.SlurmKernel("--gres=gpu:1", shared_dir=shared)
    t0 = time.time()
    rpc.init_rpc("driver", workers={"w1": spec, "w2": spec})
    out: dict[str, Any] = {"t0": t0, "ready_at": time.time(), "lines": 1}
    try:
        if full:
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                rpc.rpc_sync("w1", int, args=(1,))
                times.append(time.perf_counter() - t)
            big = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8)
            echoes = []
            for _ in range(ECHOES):
                t = time.perf_counter()
                back = rpc.rpc_sync("w2", np.copy, args=(big,))
                echoes.append(time.perf_counter() - t)
                assert np.array_equal(back, big)
            echo = statistics.median(echoes)
            job = next(r.detail.split()[1] for r in rpc.worker_status() if r.name == "w2")
            fut = rpc.rpc_async("w2", time.sleep, args=(120,))
            time.sleep(0.3)
            cluster.run("scancel", job)
            t = time.monotonic()
            lost: float | None = None
            try:
                fut.wait(LOST_LIMIT)
            except nbremote.WorkerLostError:
                lost = time.monotonic() - t
            except Exception:
                lost = None
            out.update(call_ms=1000 * statistics.median(times), echo16_ms=1000 * echo, lost_s=lost)
    finally:
        rpc.shutdown()
    return out


_IPP = """
import json, statistics, subprocess, sys, time
import numpy as np
import ipyparallel as ipp
HOST, CALLS, ECHOES, LIMIT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
FULL = sys.argv[5] == "1"
# the user's ~10 lines: the controller's address, and a job template that puts one engine on each node
cluster = ipp.Cluster(engines="slurm", n=2, controller_ip=HOST, log_level=40)
cluster.config.SlurmEngineSetLauncher.batch_template = (
    "#!/bin/sh\\n#SBATCH --job-name=ipengine\\n#SBATCH --ntasks={n}\\n#SBATCH --ntasks-per-node=1\\n"
    "#SBATCH --gres=gpu:1\\nsrun {program_and_args}\\n")
t0 = time.time()
client = cluster.start_and_connect_sync(activate=False)
client.wait_for_engines(2, timeout=120)
out = {"t0": t0, "ready_at": time.time(), "lines": 10}
if FULL:
    view = client[0]
    times = []
    for _ in range(CALLS):
        t = time.perf_counter(); view.apply_sync(int, 1); times.append(time.perf_counter() - t)
    big = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8)
    echoes = []
    for _ in range(ECHOES):
        t = time.perf_counter(); back = client[1].apply_sync(np.copy, big); echoes.append(time.perf_counter() - t)
        assert np.array_equal(back, big)
    echo = statistics.median(echoes)
    ar = client[1].apply_async(time.sleep, 120)
    time.sleep(0.3)
    jobs = subprocess.run(["squeue", "-h", "-n", "ipengine", "-o", "%i"], capture_output=True, text=True).stdout
    job = jobs.split()[0]
    subprocess.run(["scancel", job])
    t = time.monotonic()
    try:
        ar.get(timeout=LIMIT)
        lost = None
    except ipp.error.TimeoutError:
        lost = None
    except Exception:
        lost = time.monotonic() - t
    out.update(call_ms=1000 * statistics.median(times), echo16_ms=1000 * echo, lost_s=lost)
print(json.dumps(out), flush=True)
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
BRIDGE, CALLS, ECHOES, LIMIT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
FULL = sys.argv[5] == "1"
# the user's 6 lines: two interface names (the nodes' and the login node's)
cluster = SLURMCluster(cores=1, memory="1GB", processes=1, interface="nbr0", scheduler_options={"interface": BRIDGE},
                       job_extra_directives=["--gres=gpu:1"], python=sys.executable, job_name="dask-worker")
client = Client(cluster)
t0 = time.time()
cluster.scale(2)
client.wait_for_workers(2, timeout=120)
out = {"t0": t0, "ready_at": time.time(), "lines": 6}
if FULL:
    w1, w2 = sorted(client.scheduler_info()["workers"])
    times = []
    for _ in range(CALLS):
        t = time.perf_counter()
        client.submit(int, 1, workers=[w1], pure=False).result()
        times.append(time.perf_counter() - t)
    big = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8)
    echoes = []
    for _ in range(ECHOES):
        t = time.perf_counter()
        back = client.submit(np.copy, big, workers=[w2], pure=False).result()
        echoes.append(time.perf_counter() - t)
        assert np.array_equal(back, big)
    echo = statistics.median(echoes)
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
    out.update(call_ms=1000 * statistics.median(times), echo16_ms=1000 * echo, lost_s=lost)
print(json.dumps(out), flush=True)
client.close()
cluster.close()
"""


def _other(code: str, args: list[str], cluster: slurmcluster.SlurmCluster, tmp: Path) -> dict[str, Any]:
    venv = bench_venv()
    env = {**cluster.env, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp)}
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code, *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": (done.stderr or done.stdout)[-1500:]}
    return dict(json.loads(lines[-1]))


# the main scheduler's "sched: Allocate JobId=12 NodeList=..." and the backfill scheduler's
# "sched/backfill: _start_job: Started JobId=19 in debug on nbrnode1"
_ALLOCATE = re.compile(r"^\[(\S+)\] sched(?:: Allocate|/backfill: _start_job: Started) JobId=(\d+) ", re.M)


def allocations(cluster: slurmcluster.SlurmCluster) -> list[float]:
    """When (wall clock, to the ms) the controller allocated each job so far, from its log."""
    log = (cluster.dir / "log" / "slurmctld.log").read_text(errors="replace")
    # the log's stamps are this machine's local time, as time.time() is once converted
    return [datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f").timestamp()
            for stamp, _ in _ALLOCATE.findall(log)]


def with_allocation(r: dict[str, Any], allocated: list[float]) -> dict[str, Any]:
    """``r`` with ``ready_s`` (from the library's first call), ``alloc_s`` (until Slurm allocated the last node of
    this round) and ``after_s`` (from that allocation until ready)."""
    if "error" in r:
        return r
    mine = [t for t in allocated if r["t0"] - 0.01 <= t <= r["ready_at"]]
    last = max(mine) if mine else float("nan")
    return {**r, "ready_s": r["ready_at"] - r["t0"], "alloc_s": last - r["t0"], "after_s": r["ready_at"] - last}


def _spread(values: list[float], unit: str = "s", digits: int = 1) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f} {unit}"
    return f"{med:.{digits}f} {unit} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """The comparison: medians (range) over the rounds for the start, the last round's figures for the rest."""
    rows = ["| library | lines | 2 workers ready | until the last node was allocated | after allocation | a call | "
            "16 MB echo | typed error after scancel |", "|---|---|---|---|---|---|---|---|"]
    for name, rounds in results.items():
        good = [r for r in rounds if "error" not in r]
        failed = [r for r in rounds if "error" in r]
        if not good:
            why = failed[-1]["error"].strip().splitlines()[-1] if failed[-1]["error"].strip() else "?"
            rows.append(f"| {name} | failed: {why} | | | | | | |")
            continue
        last = good[-1]
        lost = ("-" if "lost_s" not in last else
                "none in 60 s" if last["lost_s"] is None else f"{last['lost_s']:.1f} s")
        call = f"{last['call_ms']:.2f} ms" if "call_ms" in last else "-"
        echo = f"{last['echo16_ms']:.0f} ms" if "echo16_ms" in last else "-"
        note = f" ({len(failed)} of {len(rounds)} rounds failed)" if failed else ""
        rows.append(f"| {name}{note} | {last['lines']} | {_spread([r['ready_s'] for r in good])} | "
                    f"{_spread([r['alloc_s'] for r in good])} | {_spread([r['after_s'] for r in good], digits=2)} | "
                    f"{call} | {echo} | {lost} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="starts per library (the last one also measures "
                        "calls, the echo and the loss)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--skip", default="", help="comma-separated: ipyparallel, dask")
    args = parser.parse_args()
    if args.rounds < 1 or args.calls < 1:
        parser.error("--rounds and --calls are at least 1")
    why = slurmcluster.unavailable()
    if why:
        print(f"bench_slurm: no Slurm test cluster here: {why}", file=sys.stderr)
        return 2
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="nbremote-bench-slurm-"))
    cluster = slurmcluster.SlurmCluster()
    os.environ["SLURM_CONF"] = str(cluster.conf)
    nodes = list(cluster.nodes.values())
    def figures(full: bool) -> list[str]:  # what the other libraries' scripts take after their address
        return [str(args.calls), str(ECHOES), str(LOST_LIMIT), "1" if full else "0"]

    libraries: dict[str, Any] = {"nbremote SlurmKernel": lambda full: nbremote_round(
        cluster, args.calls, tmp / "nbremote", full)}
    if "ipyparallel" not in args.skip:
        libraries["ipyparallel Cluster(engines='slurm')"] = lambda full: _other(
            _IPP, [cluster.host_ip, *figures(full)], cluster, tmp)
    if "dask" not in args.skip:
        code = _DASK.replace("NODE1_IP", nodes[0]).replace("NODE2_IP", nodes[1])
        libraries["dask-jobqueue SLURMCluster"] = lambda full: _other(
            code, [cluster.bridge, *figures(full)], cluster, tmp)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in libraries}
    try:
        for i in range(args.rounds):
            for name, run in libraries.items():
                time.sleep(SETTLE_S)
                r = with_allocation(run(i == args.rounds - 1), allocations(cluster))
                results[name].append(r)
                print(f"round {i + 1} {name}: " + (f"failed: {r['error'].strip()[-300:]}" if "error" in r else
                      f"ready {r['ready_s']:.2f} s = Slurm {r['alloc_s']:.2f} s + {r['after_s']:.2f} s"),
                      file=sys.stderr, flush=True)
                cluster.cancel_all()
                cluster.wait_idle(30)
    finally:
        cluster.close()
    print(f"\n{args.rounds} rounds per library; median (range)\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
