"""The comparison benchmark (``benchmarks/bench.py``): its arithmetic, and a smoke run of every path.

The smoke run (``--quick``) starts every system -- nbremote's world, two torch.distributed.rpc worlds,
the raw zmq echo server, ipyparallel when installed -- and runs every case once with tiny samples. It
asserts that everything *works*: exit status 0, every case measured by nbremote and torch, nbremote's echoes
bit-exact, every system's checks held. It asserts nothing about speed (STYLE.md: timing belongs in
benchmarks, not in assertions).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmark's modules import each other by bare name, as bench.py does

from _cases import IPP, NBREMOTE, TORCH, Case, catalogue, select  # noqa: E402
from _harness import Entry, run_group  # noqa: E402
from _report import failures, table  # noqa: E402
from _stats import Outcome, judge, paired_ratio, percentile  # noqa: E402
from _system import Block, System  # noqa: E402


# -- arithmetic ---------------------------------------------------------------------------------------------
def test_paired_ratio_cancels_drift_between_rounds() -> None:
    # round 2 ran while the machine was three times slower: both systems suffered alike
    nbr = [[2.0, 2.0, 2.0], [6.0, 6.0, 6.0]]
    ref = [[1.0, 1.0, 1.0], [3.0, 3.0, 3.0]]
    assert paired_ratio(nbr, ref) == pytest.approx(2.0)


def test_paired_ratio_uses_only_rounds_both_finished() -> None:
    assert paired_ratio([[2.0], [4.0], [100.0]], [[1.0], [2.0]]) == pytest.approx(2.0)
    assert paired_ratio([[1.0]], []) is None


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 90) == pytest.approx(9.1)


def test_world_start_target_compares_nbremote_with_itself() -> None:
    cases = {c.id: c for c in catalogue(quick=False)}
    results = {"start-1": {NBREMOTE: Outcome(NBREMOTE, [[1.0], [2.0]])},
               "start-4": {NBREMOTE: Outcome(NBREMOTE, [[1.2], [2.8]])}}
    (target,) = cases["start-4"].targets
    verdict = judge(cases["start-4"], target, results)
    assert verdict.ratio == pytest.approx(1.3)
    assert verdict.met is True


def test_only_selects_groups_and_ids() -> None:
    cases = catalogue(quick=False)
    assert [c.id for c in select(cases, "small,echo-64MB-torch", None)] == ["small", "echo-64MB-torch"]
    assert {c.group for c in select(cases, "echo", None)} == {"echo"}
    assert all(c.rounds == 2 for c in select(cases, None, 2))
    with pytest.raises(ValueError, match="unknown case"):
        select(cases, "smal", None)


def test_full_run_has_every_case_the_issue_names() -> None:
    ids = {c.id for c in catalogue(quick=False)}
    assert {"small", "burst-1", "burst-3", "module", "train", "start-1", "start-4"} <= ids
    assert {f"echo-{n}MB-{kind}" for n in (1, 16, 64) for kind in ("numpy", "torch")} <= ids


# -- the harness, with stand-in systems (what is under test is the loop, not a transport) ------------------
class Steady(System):
    name = "steady"

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def supports(self, case: Case) -> bool:
        return True

    def block(self, case: Case) -> Block:
        self.log.append(self.name)
        return Block([0.001] * case.block)


class Breaks(Steady):
    name = "breaks"

    def block(self, case: Case) -> Block:
        self.log.append(self.name)
        if len(self.log) > 2:
            raise RuntimeError("worker lost")
        return Block([0.002] * case.block)


class Absent(Steady):
    name = "absent"


def test_a_failing_system_is_reported_and_the_others_go_on() -> None:
    case = Case("small", "small", "small call", "call", rounds=3, block=2)
    log: list[str] = []
    entries = [Entry(Steady(log)), Entry(Breaks(log)),
               Entry(Absent(log), problem="ipyparallel is not installed", skipped=True)]
    results: dict[str, dict[str, Outcome]] = {}
    run_group([case], entries, results)
    steady, breaks, skipped = (results["small"][n] for n in ("steady", "breaks", "absent"))
    assert log[:4] == ["steady", "breaks", "breaks", "steady"]  # round 2 starts with the next system
    assert len(steady.rounds) == 3 and steady.status == "ok"
    assert breaks.rounds == [[0.002, 0.002]] and breaks.error == "round 2: RuntimeError: worker lost"
    assert skipped.status == "skipped"
    assert failures([case], results) == ["small / breaks: round 2: RuntimeError: worker lost"]
    text = table([case], results, [])
    assert "ERROR round 2: RuntimeError: worker lost" in text
    assert "skipped: ipyparallel is not installed" in text


# -- smoke run ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    result = subprocess.run([sys.executable, str(BENCH / "bench.py"), "--quick", "--json", str(out)],
                            capture_output=True, text=True, timeout=360, cwd=str(ROOT),
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, f"stdout:\n{result.stdout[-6000:]}\nstderr:\n{result.stderr[-6000:]}"
    assert "smoke run: figures mean nothing" in result.stdout
    data: dict[str, Any] = json.loads(out.read_text())
    return data


# The quick run takes under a minute on 2 idle cores and ~100 s with a load average of 10 on them (other
# engineers' test runs): the margin is for a machine shared with other work.
@pytest.mark.timeout(420)
def test_quick_run_measures_every_case_on_nbremote_and_torch(smoke: dict[str, Any]) -> None:
    assert smoke["quick"] is True
    assert smoke["failures"] == []
    assert smoke["verdicts"] == []  # a smoke run judges nothing
    cases: list[dict[str, Any]] = smoke["cases"]
    assert [c["id"] for c in cases] == [c.id for c in catalogue(quick=True)]
    for case in cases:
        for system in (NBREMOTE, TORCH):
            outcome = smoke["results"][case["id"]][system]
            assert outcome["status"] == "ok", (case["id"], system, outcome["error"])
            assert outcome["summary"]["n"] > 0, (case["id"], system)
    # TensorPipe's default transport polls busily: its idle world is found and stopped during the others' blocks
    # (and its own blocks above still ran: it went on each time)
    assert any(note.startswith("torch: its world kept") and "stopped (SIGSTOP)" in note for note in smoke["notes"]), \
        smoke["notes"]


@pytest.mark.timeout(420)
def test_quick_run_echoes_are_bit_exact(smoke: dict[str, Any]) -> None:
    echoes = [c["id"] for c in smoke["cases"] if c["kind"] == "echo"]
    assert echoes
    for case_id in echoes:
        for system, outcome in smoke["results"][case_id].items():
            if outcome["status"] == "ok":
                assert outcome["info"]["bit_exact"] is True, (case_id, system)
        assert smoke["results"][case_id][NBREMOTE]["info"]["bit_exact"] is True


@pytest.mark.timeout(420)
def test_quick_run_ipyparallel_runs_or_says_why_not(smoke: dict[str, Any]) -> None:
    installed = importlib.util.find_spec("ipyparallel") is not None
    small = smoke["results"]["small"][IPP]
    if installed:
        assert small["status"] == "ok", small["error"]
    else:
        assert small["status"] == "skipped"
        assert "not installed" in small["skipped"]



def test_the_soak_runs_briefly_with_a_kill_and_checks_every_result() -> None:
    """A smoke run of benchmarks/soak.py (two minutes by default; here 3 s with a kill each second)."""
    proc = subprocess.run([sys.executable, str(BENCH / "soak.py"), "--seconds", "3", "--workers", "2",
                           "--kill-every", "1"], capture_output=True, text=True, timeout=100, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "calls/s over 2 workers" in proc.stdout and "wrong result" not in proc.stdout, proc.stdout
    assert "RSS MB (private / shared memory), start -> end:" in proc.stdout


@pytest.mark.timeout(120)
def test_the_snapshot_benchmark_runs_and_restores_every_time() -> None:
    """A smoke run of benchmarks/bench_snapshot.py with a small model (10.5 M parameters by default): every
    figure printed with its ratio, and every restart restored the model (the benchmark asserts it)."""
    proc = subprocess.run([sys.executable, str(BENCH / "bench_snapshot.py"), "--width", "64", "--layers", "2",
                           "--rounds", "2"], capture_output=True, text=True, timeout=110, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "x a train step" in proc.stdout and "x a plain restart" in proc.stdout, proc.stdout


@pytest.mark.timeout(120)
def test_the_call_profile_pairs_every_hop_of_every_call(tmp_path: Path) -> None:
    """A smoke run of benchmarks/profile_call.py: every call's stamps were found on both sides and paired, and
    the hops of a call add up to its whole time (each hop is the gap between two stamps of that call)."""
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(BENCH / "profile_call.py"), "--calls", "60", "--json", str(out)],
                          capture_output=True, text=True, timeout=100, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    # On a quiet machine all 60 pair. On a busy one, some do not: a sender descheduled between a send and its
    # stamp (counted as "reordered"), and calls that found a stage missing (30 of 60 once, under load 5-7; the
    # cause is not known). Enough must pair for the sums below to mean something.
    assert result["calls"] >= 20, f"only {result['calls']} of 60 calls had every stage seen on both sides"
    hops = result["hops_us"]
    assert "driver -> worker: wire, wake-up, take it off" in hops and "worker: encode the reply" in hops
    for i, total in enumerate(result["total_us"]):
        parts = [values[i] for values in hops.values()]
        assert all(p >= 0 for p in parts) and sum(parts) == pytest.approx(total, abs=0.01)
    assert "whole call (rpc_sync returned)" in proc.stdout


@pytest.mark.timeout(120)
def test_the_wire_floor_is_measured_for_every_transport_and_a_call() -> None:
    """A smoke run of benchmarks/bench_wire.py: every transport's echo sent back what it got (the benchmark
    checks each trip), and every case has a round trip and a ratio, hot and after idle."""
    proc = subprocess.run([sys.executable, str(BENCH / "bench_wire.py"), "--quick"], capture_output=True, text=True,
                          timeout=110, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[2:]}
    assert sorted(rows) == sorted(["zmq-tcp", "zmq-ipc", "unix", "unix-poll", "nbremote"]), proc.stdout
    for cells in rows.values():
        assert len(cells) == 4 and float(cells[0]) > 0 and float(cells[2]) > 0, proc.stdout
    assert rows["zmq-ipc"][1] == rows["zmq-ipc"][3] == "1.00x"


@pytest.mark.timeout(240)
def test_ab_compares_two_checkouts_side_by_side_with_torch() -> None:
    """A smoke run of benchmarks/ab.py with this checkout on both sides: each side's driver and worker
    imported its own tree (checked inside), every case was measured on all three sides, and the paired
    ratios are printed. Nothing about speed is asserted."""
    proc = subprocess.run([sys.executable, str(BENCH / "ab.py"), "--base", str(ROOT), "--new", str(ROOT),
                           "--rounds", "2", "--cases", "small,train"], capture_output=True, text=True, timeout=220,
                          cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("small", "train"))]
    assert sorted((r[0], r[1]) for r in rows) == sorted((c, s) for c in ("small", "train")
                                                         for s in ("base", "new", "torch"))
    assert all(float(r[2]) > 0 for r in rows)
    assert "base/new" in proc.stdout and "new/torch" in proc.stdout


@pytest.mark.timeout(240)
def test_the_step_profile_times_every_phase_against_torch_from_the_same_first_loss(tmp_path: Path) -> None:
    """A smoke run of benchmarks/profile_step.py: both libraries start from the same weights and data (same first
    loss), every phase is timed on both, and nbremote's median step is laid out event by event across the
    driver and both workers, ending where the step ends."""
    out = tmp_path / "step.json"
    proc = subprocess.run([sys.executable, str(BENCH / "profile_step.py"), "--steps", "20", "--json", str(out)],
                          capture_output=True, text=True, timeout=220, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    nbr, torch = result["nbremote"], result["torch"]
    assert nbr["first_loss"] == pytest.approx(torch["first_loss"], rel=1e-6)
    for side in (nbr, torch):
        assert set(side["phases_us"]) == {"forward", "backward", "optimizer step", "leave the context", "whole step"}
        assert all(len(v) == 20 and min(v) > 0 for v in side["phases_us"].values())
        assert len(side["step_us"]) == 20
    events = nbr["median_step"]
    assert {proc for proc, _, _ in events} == {"driver", "worker1", "worker2"}
    assert [at for _, _, at in events] == sorted(at for _, _, at in events)
    assert "whole step" in proc.stdout and "the median step, event by event" in proc.stdout


@pytest.mark.timeout(240)
def test_the_step_profile_of_the_4_stage_model_lays_out_every_hop(tmp_path: Path) -> None:
    """A smoke run of ``profile_step.py --model train4`` (nbremote alone): every phase timed, and the median step
    laid out event by event across the driver and all four stages, its backward passing through each."""
    out = tmp_path / "train4.json"
    argv = ["--model", "train4", "--steps", "10", "--no-torch", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(BENCH / "profile_step.py"), *argv], capture_output=True, text=True,
                          timeout=220, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    nbr = result["nbremote"]
    assert result["torch"] is None
    assert all(len(v) == 10 and min(v) > 0 for v in nbr["phases_us"].values())
    events = nbr["median_step"]
    stages = {"worker1", "worker2", "worker3", "worker4"}
    assert {proc for proc, _, _ in events} == {"driver", *stages}
    assert {proc for proc, label, _ in events if label == "_backward_hop>"} == stages


@pytest.mark.timeout(240)
def test_the_parameter_server_profile_times_every_phase_and_turn_in_both_worlds(tmp_path: Path) -> None:
    """A smoke run of benchmarks/profile_ps.py: both trainers time every phase of every step, in nbremote and
    in torch, and the server's stamps give a turn per step and the hand-overs between them."""
    out = tmp_path / "ps.json"
    proc = subprocess.run([sys.executable, str(BENCH / "profile_ps.py"), "--steps", "10", "--json", str(out)],
                          capture_output=True, text=True, timeout=220, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    for side in (result["nbremote"], result["torch"]):
        assert set(side["phases_us"]) == {"wait for the turn", "forward", "backward", "optimizer step",
                                          "leave the context", "end the turn"}
        assert all(len(v) == 20 and min(v) > 0 for v in side["phases_us"].values())
        assert len(side["turn_us"]) == 20 and min(side["turn_us"]) > 0
        assert 0 < len(side["hand_over_us"]) < 20 and side["steps_per_s"] > 0
    assert "the turn (server)" in proc.stdout and "steps/s (both)" in proc.stdout


def test_ab_refuses_a_folder_that_is_not_a_checkout(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH / "ab.py"), "--base", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, cwd=str(ROOT))
    assert proc.returncode == 2 and "is not an nbremote checkout" in proc.stderr


# -- the Slurm comparison's arithmetic (its nbremote round runs against real jobs in test_slurm.py) ------------
def test_slurm_bench_splits_each_round_at_its_last_allocation(tmp_path: Path) -> None:
    import datetime
    import types

    import bench_slurm

    log = tmp_path / "log"
    log.mkdir()
    base = datetime.datetime(2026, 12, 6, 23, 20, 50)

    def stamp(seconds: float) -> str:  # slurmctld's stamp, to the ms
        return (base + datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]

    (log / "slurmctld.log").write_text(
        f"[{stamp(0.5)}] sched: Allocate JobId=7 NodeList=nbrnode1 #CPUs=1 Partition=debug\n"  # a round before
        f"[{stamp(3.054)}] sched/backfill: _start_job: Started JobId=19 in debug on nbrnode1\n"
        f"[{stamp(3.254)}] _slurm_rpc_kill_job: REQUEST_KILL_JOB JobId=20 uid 0\n"
        f"[{stamp(3.5)}] sched: Allocate JobId=20 NodeList=nbrnode2 #CPUs=1 Partition=debug\n")
    allocated = bench_slurm.allocations(types.SimpleNamespace(dir=tmp_path))
    t0 = base.timestamp() + 2.0
    assert len(allocated) == 3
    r = bench_slurm.with_allocation({"t0": t0, "ready_at": t0 + 2.1, "lines": 1}, allocated)
    assert r["ready_s"] == pytest.approx(2.1)
    assert r["alloc_s"] == pytest.approx(1.5, abs=1e-3)  # the last of this round's two allocations
    assert r["after_s"] == pytest.approx(0.6, abs=1e-3)
    assert bench_slurm.with_allocation({"error": "boom"}, allocated) == {"error": "boom"}


def test_slurm_bench_table_gives_medians_and_says_what_failed() -> None:
    import bench_slurm

    ok = [{"lines": 1, "ready_s": s, "alloc_s": s - 0.6, "after_s": 0.6} for s in (0.7, 0.6, 1.4)]
    ok[-1].update(call_ms=0.31, echo16_ms=154.0, lost_s=1.1)
    text = bench_slurm.table({"nbremote": ok, "dask": [{"error": "Traceback\nImportError: no dask"}],
                              "ipp": [*ok[:2], {"error": "x\nTimeoutError: engines"}]})
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()[2:]}
    assert "| 0.7 s (0.6-1.4) |" in rows["nbremote"] and "| 0.31 ms | 154 ms | 1.1 s |" in rows["nbremote"]
    assert "failed: ImportError: no dask" in rows["dask"]
    assert "1 of 3 rounds failed" in next(line for name, line in rows.items() if name.startswith("ipp"))
