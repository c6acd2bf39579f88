"""Whole-driver lifecycles, each in a fresh driver process: shutdown, re-init, driver death, the demo."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, pid_alive, run_script

pytestmark = pytest.mark.timeout(120)


def _wait_dead(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def test_local_workers_share_the_cores_unless_their_environment_says_otherwise() -> None:
    """Two local workers started together get half the cores each (at least 1): forked by the zygote, which
    had imported torch, they are told so at the fork. A worker whose environment names a count keeps it (its
    own env: started the usual way, its torch reads it at import); the driver's threads are not touched."""
    proc = run_script("""
        import json, os
        import torch
        import nbremote
        from nbremote import rpc

        def threads():
            import torch
            return torch.get_num_threads()

        before = torch.get_num_threads()
        rpc.init_rpc("driver", workers=["w1", "w2"])
        shared = [rpc.rpc_sync(w, threads) for w in ("w1", "w2")]
        cores = len(os.sched_getaffinity(0))  # (torch runs no more threads than that)
        rpc.add_worker("mine", nbremote.LocalKernel(env={**os.environ, "OMP_NUM_THREADS": str(cores)}))
        mine = rpc.rpc_sync("mine", threads)
        driver = torch.get_num_threads()
        rpc.shutdown()
        print(json.dumps({"cores": cores, "shared": shared, "mine": mine,
                          "driver": [before, driver]}))
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["shared"] == [max(1, out["cores"] // 2)] * 2
    assert out["mine"] == out["cores"]  # not the share of 3 workers
    assert out["driver"][0] == out["driver"][1]


def test_shutdown_waits_for_calls_then_refuses_new_ones() -> None:
    proc = run_script("""
        import json, os, time
        from nbremote import rpc
        from nbremote.errors import NotInitializedError
        rpc.init_rpc("driver", workers=["worker1", "worker2"])
        pids = [rpc.rpc_sync(w, os.getpid) for w in ("worker1", "worker2")]
        fut = rpc.rpc_async("worker1", time.sleep, args=(1.0,))
        t0 = time.monotonic()
        rpc.shutdown()
        waited = time.monotonic() - t0
        out = {"pids": pids, "waited": waited, "result": repr(fut.wait())}
        for name, call in [("rpc_sync", lambda: rpc.rpc_sync("worker1", os.getpid)),
                           ("remote", lambda: rpc.remote("worker1", os.getpid)),
                           ("get_worker_info", lambda: rpc.get_worker_info()),
                           ("shutdown", lambda: rpc.shutdown())]:
            try:
                call()
                out[name] = "no error"
            except NotInitializedError as exc:
                out[name] = str(exc)
        rpc.init_rpc("driver", workers=["worker1"])       # a new world after shutdown
        out["again"] = rpc.rpc_sync("worker1", sum, args=([1, 2],))
        try:
            rpc.init_rpc("driver", workers=["worker2"])
        except RuntimeError as exc:
            out["twice"] = str(exc)
        rpc.shutdown()
        print(json.dumps(out))
    """)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["result"] == "None" and out["waited"] >= 0.8
    for name in ("rpc_sync", "remote", "get_worker_info", "shutdown"):
        assert "not initialized" in out[name] and "init_rpc" in out[name], out[name]
    assert out["again"] == 3
    assert "already initialized" in out["twice"] and "shutdown" in out["twice"]
    assert _wait_dead(out["pids"], 5) == []


def kill_driver_and_wait_for_workers(seconds: float) -> tuple[list[int], float]:
    """SIGKILL a driver with two workers; the worker pids still alive after ``seconds``, and how long
    the others took to exit (also used by the fault-injection suite's table)."""
    code = ("import os, sys, time\nfrom nbremote import rpc\n"
            "rpc.init_rpc('driver', workers=['worker1', 'worker2'])\n"
            "print(*[rpc.rpc_sync(w, os.getpid) for w in ('worker1', 'worker2')], flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(5)
        survivors = _wait_dead(pids, seconds)
        return survivors, time.monotonic() - killed
    finally:
        proc.kill()


def test_worker_kernels_exit_when_the_driver_is_killed() -> None:
    survivors, _ = kill_driver_and_wait_for_workers(5)
    assert survivors == [], "worker kernels outlived their driver"


def test_failed_start_leaves_nothing_behind(tmp_path: Path) -> None:
    proc = run_script(f"""
        import nbremote
        from nbremote import rpc
        from nbremote.errors import WorkerStartError
        try:
            rpc.init_rpc("driver", workers={{"good": None,
                                            "bad": nbremote.AttachedKernel({str(tmp_path / 'nope.json')!r})}})
        except WorkerStartError as exc:
            print("error:", exc.worker, exc)
        print("initialized:", rpc.is_initialized())
    """)
    assert proc.returncode == 0, proc.stderr
    assert "error: bad" in proc.stdout and "unreadable" in proc.stdout
    assert "initialized: False" in proc.stdout


def _nbremote(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the ``nbremote`` command as a user would (the console script, else ``python -m nbremote.cli``)."""
    exe = Path(sys.executable).with_name("nbremote")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "nbremote.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=100, cwd=str(ROOT))


def _check_demo(proc: subprocess.CompletedProcess[str], workers: int, steps: int) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    losses = [float(x) for x in re.findall(r"^  step +\d+  loss (\d+\.\d+)$", out, re.M)]
    assert len(losses) >= min(steps, 10), out
    fell = re.search(rf"^loss fell from (\d+\.\d+) to (\d+\.\d+) after {steps} step", out, re.M)
    assert fell is not None, out
    assert float(fell[1]) == losses[0] and float(fell[2]) < losses[0], out  # from step 1's loss to a lower one
    names = [f"worker{i}" for i in range(1, workers + 1)]
    for name in names:  # each worker's parameter table, the text of the module panel
        assert re.search(rf"^Stage on {name}/cpu \(train mode\)\nparameter +shape +dtype", out, re.M), out
    assert len(re.findall(r"^total \(2\) ", out, re.M)) == workers
    pids = [int(p) for p in re.findall(r"worker\d+ \(pid (\d+)\)", out)]
    assert len(pids) == workers and _wait_dead(pids, 5) == []
    assert out.rstrip().endswith("worker processes left: none"), out
    assert proc.stderr.strip() == "", proc.stderr  # kernel chatter goes to log files, not the terminal


def test_demo_trains_a_split_model_and_leaves_no_process() -> None:
    proc = _nbremote("demo")
    _check_demo(proc, workers=2, steps=30)
    losses = [float(x) for x in re.findall(r"^  step +\d+  loss (\d+\.\d+)$", proc.stdout, re.M)]
    assert losses[-1] < losses[0] / 5, proc.stdout
    assert "head Linear 8->32 (here, in the driver)" in proc.stdout
    assert "Stage 32->32 on worker1/cpu -> Stage 32->1 on worker2/cpu" in proc.stdout


def test_demo_with_tensorplay_and_three_workers() -> None:
    _check_demo(_nbremote("demo", "--workers", "3", "--steps", "6", "--framework", "tensorplay"), workers=3, steps=6)


def test_demo_tour_shows_the_rpc_layer() -> None:
    proc = _nbremote("demo", "--tour")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"call -> worker1 \(pid \d+\)", out) and re.search(r"call -> worker2 \(pid \d+\)", out)
    assert "sum of squares 0..99 = 328350" in out
    assert "RRef passed worker1 -> worker2: worker2" in out and "owned by worker1" in out
    assert "remote error arrived as ZeroDivisionError" in out and "traceback from worker2" in out
    assert "worker processes left: none" in out
    assert proc.stderr.strip() == "", proc.stderr


def test_demo_help_explains_the_options_and_bad_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from nbremote import cli

    with pytest.raises(SystemExit) as done:
        cli.main(["demo", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for option in ("--workers N", "--steps N", "--framework {torch,tensorplay}", "--tour"):
        assert option in text, text
    assert "no worker process is left" in text
    for bad, why in ((["--workers", "0"], "must be at least 1"), (["--steps", "x"], "not a whole number"),
                     (["--framework", "jax"], "invalid choice")):
        with pytest.raises(SystemExit) as done:
            cli.main(["demo", *bad])
        assert done.value.code == 2 and why in capsys.readouterr().err


def test_readme_quickstart_runs() -> None:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block is not None, "README has no python quickstart block"
    proc = run_script(block.group(1) + "\nprint('quickstart ok')\n")
    assert proc.returncode == 0, proc.stderr
    assert "[worker1] squaring 7" in proc.stdout and "quickstart ok" in proc.stdout


def test_readme_training_example_runs_and_the_loss_falls() -> None:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Training across kernels\n\n```python\n(.*?)```", text, re.S)
    assert block is not None, "README has no training example"
    proc = run_script(block.group(1))
    assert proc.returncode == 0, proc.stderr
    losses = [float(line.rsplit(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 10 and losses[-1] < losses[0], proc.stdout


def test_public_api_matches_all() -> None:
    import nbremote
    import nbremote.autograd
    import nbremote.errors
    import nbremote.history
    import nbremote.nn
    import nbremote.optim
    import nbremote.rpc

    for module in (nbremote, nbremote.rpc, nbremote.errors, nbremote.nn, nbremote.autograd, nbremote.optim,
                   nbremote.history):
        exported = {n for n in dir(module) if not n.startswith("_")}  # dir(): nbremote names the RPC layer lazily
        declared = set(module.__all__) - {"__version__"}
        assert declared <= exported, f"{module.__name__}.__all__ names missing objects"
        public_defs = {n for n in exported
                       if getattr(getattr(module, n), "__module__", "").startswith(module.__name__)
                       and not isinstance(getattr(module, n), type(os))}
        missing = public_defs - declared
        assert not missing, f"{module.__name__} defines public names not in __all__: {missing}"
