"""torch's start-up, unchanged, inside a running world (issue 40).

A ported program's ``run_worker(rank, world_size)`` -- ``init_rpc(name, rank=, world_size=, ...)``, its work,
``shutdown()`` -- runs as written on every member: ``init_rpc`` joins the world the process is already in (its
name, rank and world size checked; with a world size it returns once the program's other ranks have joined, as
torch's rendezvous does), ``shutdown`` waits for the other members at the driver's barrier without ending the
world; the driver may take any rank. A join alone (to check what it checks) gives no world size: torch's dynamic
start-up, which waits for nobody. Real kernels: the session's world (driver rank 0,
worker1..worker3), a worker of a test's own where one dies, a fresh driver process for a driver of rank 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import own_worker, run_script

from nbremote import rpc
from nbremote.rpc._core import current_agent, joining

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _no_program_left(world: list[str]) -> Iterator[None]:
    """Whatever a test leaves joined is forgotten: the next test (and the session's shutdown) starts afresh."""
    yield
    for w in [w.name for w in rpc.workers()]:
        if w != "driver":
            with contextlib.suppress(Exception):  # a worker a test killed
                rpc.rpc_sync(w, _reset, timeout=10)
    _reset()


def _reset() -> None:
    joining.reset(current_agent())
    current_agent().default_timeout = 60.0


def _joins(name: str, **how: Any) -> str:
    """``init_rpc(name, **how)`` where it runs; the error it raised (type: message), or "joined"."""
    try:
        rpc.init_rpc(name, **how)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    rpc.shutdown(graceful=False)
    return "joined"


def test_init_rpc_in_a_worker_checks_name_rank_and_world_size(world: list[str]) -> None:
    def asks(**how: Any) -> str:
        return str(rpc.rpc_sync("worker1", _joins, args=(how.pop("name", "worker1"),), kwargs=how))

    assert asks(rank=1) == "joined"  # alone: a world size would wait for the other ranks (see below)
    assert asks() == "joined"  # torch's dynamic start-up: no rank, no size
    wrong_name = asks(name="worker2", rank=1, world_size=4)
    assert wrong_name.startswith("RuntimeError: init_rpc(name='worker2', rank=1, world_size=4): the name differs")
    assert "'worker2' is not unique: it is rank 2's name" in wrong_name
    for said in (wrong_name, asks(rank=2, world_size=4), asks(rank=1, world_size=3)):
        # the world's actual values, and what to call instead
        assert "this process is 'worker1', rank 1, of a running world of 4" in said, said
        assert "'driver': 0, 'worker1': 1, 'worker2': 2, 'worker3': 3" in said, said
        assert "rpc.init_rpc('worker1', rank=1, world_size=4)" in said, said
    assert "the rank differs" in asks(rank=2, world_size=4)
    assert "the world size differs" in asks(rank=1, world_size=3)
    assert asks(name="bad name", rank=1).startswith("ValueError: invalid worker name")
    assert asks(rank=1, backend="TENSORPIPE").startswith("TypeError: Argument backend must be a member of BackendType")
    assert not current_agent().gathering.open()  # none of it is left joined at the driver  # type: ignore[union-attr]


def test_init_rpc_applies_the_options_timeout_and_refuses_a_second_one(world: list[str]) -> None:
    def program() -> tuple[float, str, bool]:
        opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=7)
        rpc.init_rpc("worker2", rank=2, rpc_backend_options=opts)
        timeout = rpc.get_rpc_timeout()
        again = _joins("worker2", rank=2, world_size=4)
        rpc.shutdown(graceful=False)  # returns at once: nobody waits for worker2 now
        return timeout, again, rpc.is_initialized()

    timeout, again, still = rpc.rpc_sync("worker2", program)
    assert timeout == 7.0 and still  # the process is still a member after its program's shutdown
    assert again.startswith("RuntimeError: init_rpc(name='worker2', rank=2, world_size=4): RPC is already initialized")
    assert "call rpc.shutdown() first" in again


def _fails_after_init_rpc() -> None:
    rpc.init_rpc("worker3", rank=3)
    raise ValueError("the program's own bug")


def test_a_program_that_failed_before_its_shutdown_leaves_no_join_behind(world: list[str]) -> None:
    """As a fresh process of torch's would, the next run of a program that raised on a worker starts afresh; and
    a rank that waited for the failed one at the barrier is told at once, naming it."""
    with pytest.raises(ValueError, match="the program's own bug"):
        rpc.rpc_sync("worker3", _fails_after_init_rpc)
    waiting = rpc.rpc_async("worker1", _shuts_down, args=(1, 30.0, None))
    time.sleep(0.5)
    assert rpc.rpc_sync("worker3", _joins, args=("worker3",), kwargs={"rank": 3}) == "joined"
    said = waiting.wait(15)
    assert "'worker3' failed: its program ended without calling rpc.shutdown()" in said, said


def test_the_driver_joins_too_and_a_second_world_is_refused(world: list[str]) -> None:
    with pytest.raises(RuntimeError, match=r"already initialized as 'driver'; call rpc\.shutdown"):
        rpc.init_rpc("driver", workers=["w9"])  # a start-up line: a second world
    with pytest.raises(RuntimeError, match=r"the rank differs; this process is 'driver', rank 0"):
        rpc.init_rpc("driver", rank=1, world_size=4)
    with pytest.raises(RuntimeError, match="already initialized"):
        rpc.init_rpc("driver")  # a start-up line run again: no program's rank, so no join
    rpc.init_rpc("driver", rank=0)  # a ported run_worker(0) in the driver
    assert current_agent().joined is not None
    rpc.shutdown(graceful=False)  # the program's end, not the world's
    assert rpc.rpc_sync("worker1", os.getpid) > 0


def _program(rank: int, world_size: int, work: float) -> dict[str, Any]:
    """torch's shape: init_rpc, some work (with a call it does not wait for), shutdown."""
    name = "driver" if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world_size)
    time.sleep(work)
    nxt = f"worker{rank % (world_size - 1) + 1}"
    fut = rpc.rpc_async(nxt, time.sleep, args=(0.5,))  # outstanding work: shutdown waits for it
    arrived = time.time()
    rpc.shutdown()
    return {"arrived": arrived, "left": time.time(), "call_done": fut.done(), "member": rpc.is_initialized()}


def test_shutdown_waits_for_every_rank_and_its_own_calls_without_ending_the_world(world: list[str]) -> None:
    works = {0: 0.1, 1: 0.0, 2: 1.0, 3: 0.3}
    futs = {r: rpc.rpc_async(f"worker{r}", _program, args=(r, 4, works[r])) for r in (1, 2, 3)}
    mine = _program(0, 4, works[0])
    out = {0: mine, **{r: f.wait() for r, f in futs.items()}}
    last = max(o["arrived"] for o in out.values())
    for r, o in out.items():
        assert o["left"] >= last, (r, out)  # nobody left before the slowest rank arrived
        assert o["call_done"] and o["member"], (r, o)
    assert out[1]["left"] - out[1]["arrived"] >= 0.9  # the quick rank waited for the slow one
    assert [rpc.rpc_sync(w, os.getpid) > 0 for w in world] == [True] * 3  # the world goes on
    # and a second round of the same program
    futs = {r: rpc.rpc_async(f"worker{r}", _program, args=(r, 4, 0.0)) for r in (1, 2, 3)}
    _program(0, 4, 0.0)
    assert all(f.wait()["member"] for f in futs.values())


def _never_shuts_down(rank: int) -> str:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=4)
    return "returned without rpc.shutdown()"


def _shuts_down(rank: int, timeout: float, world_size: int | None = 4) -> str:
    name = "driver" if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world_size)
    try:
        rpc.shutdown(timeout=timeout)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_member_that_never_calls_shutdown_is_named_at_the_deadline(world: list[str]) -> None:
    never = rpc.rpc_async("worker3", _never_shuts_down, args=(3,))
    futs = [rpc.rpc_async(f"worker{r}", _shuts_down, args=(r, 2.0)) for r in (1, 2)]
    t0 = time.monotonic()
    said = [_shuts_down(0, 2.0), *(f.wait() for f in futs)]
    assert time.monotonic() - t0 < 15
    assert never.wait(5) == "returned without rpc.shutdown()"
    for s in said:
        assert s.startswith("rpc.shutdown() in"), said
        assert "'worker3' (rank 3: joined, has not called rpc.shutdown())" in s, said


def test_a_rank_that_has_not_joined_is_named_too(world: list[str]) -> None:
    """The driver is the one rank a collective join does not wait for (its world's start-up was its init_rpc);
    at the shutdown barrier it is awaited, and named when it never comes."""
    futs = [rpc.rpc_async(f"worker{r}", _shuts_down, args=(r, 1.0)) for r in (1, 2, 3)]
    for said in (f.wait(30) for f in futs):
        assert "did not get there" in said, said
        assert "and 'driver' (rank 0: has not called rpc.init_rpc) did not get there" in said, said


def _joins_at(rank: int, world_size: int, before: float) -> tuple[float, float]:
    """A rank's start-up after ``before`` seconds of other work: (when init_rpc was called, when it returned)."""
    time.sleep(before)
    called = time.time()
    rpc.init_rpc("driver" if rank == 0 else f"worker{rank}", rank=rank, world_size=world_size)
    joined = time.time()
    rpc.shutdown()
    return called, joined


def _joins_as(name: str, rank: int) -> str:
    try:
        rpc.init_rpc(name, rank=rank, world_size=4)
    except RuntimeError as exc:
        return str(exc)
    rpc.shutdown(graceful=False)
    return "joined"


def test_a_refused_rank_fails_the_rendezvous_for_every_rank(world: list[str]) -> None:
    """As torch's rendezvous: the ranks that joined do not wait for the refused one forever, and each is told why."""
    futs = {r: rpc.rpc_async(f"worker{r}", _joins_as, args=(f"worker{r}", r)) for r in (1, 2)}
    time.sleep(0.5)  # they wait for worker3
    assert not any(f.done() for f in futs.values())
    mine = rpc.rpc_sync("worker3", _joins_as, args=("worker1", 3))  # a program's bug: rank 3 takes rank 1's name
    assert mine.startswith("init_rpc(name='worker1', rank=3, world_size=4): the name differs; 'worker1' is not "
                           "unique"), mine
    for r, f in futs.items():
        said = f.wait(15)
        assert said.startswith(f"rpc.init_rpc in 'worker{r}' gave up waiting for the other ranks to join: 'worker3' "
                               "failed: init_rpc(name='worker1', rank=3"), said
    assert not current_agent().gathering.open()  # type: ignore[union-attr]
    # the program fixed and run again at once, the refused rank last: the ranks told of it take it as the last run's
    futs = {r: rpc.rpc_async(f"worker{r}", _joins_as, args=(f"worker{r}", r)) for r in (1, 2)}
    time.sleep(0.5)
    assert not any(f.done() for f in futs.values()), {r: f.wait() for r, f in futs.items() if f.done()}
    assert rpc.rpc_sync("worker3", _joins_as, args=("worker3", 3)) == "joined"
    assert [f.wait(15) for f in futs.values()] == ["joined", "joined"]


def test_init_rpc_with_a_world_size_returns_once_every_rank_has_joined(world: list[str]) -> None:
    """torch's static init_rpc is a rendezvous: what a rank's run_worker did before it (seeding, a process group)
    is done before any other rank's init_rpc returns, so no call of theirs can find it undone."""
    before = {0: 0.0, 1: 0.0, 2: 1.0, 3: 0.4}
    futs = {r: rpc.rpc_async(f"worker{r}", _joins_at, args=(r, 4, before[r])) for r in (1, 2, 3)}
    times = {0: _joins_at(0, 4, before[0]), **{r: f.wait(30) for r, f in futs.items()}}
    last_call = max(called for called, _ in times.values())
    assert min(joined for _, joined in times.values()) >= last_call, times
    assert times[2][0] - times[1][0] >= 0.9, times  # worker2 did come a second later


@pytest.fixture
def doomed() -> Iterator[str]:
    yield from own_worker("doomed")


def _joins_then_dies(name: str) -> None:
    rpc.init_rpc(name)
    threading.Timer(0.5, os._exit, args=(3,)).start()


def test_a_member_that_dies_releases_the_barrier_naming_it(world: list[str], doomed: str) -> None:
    rpc.rpc_sync(doomed, _joins_then_dies, args=(doomed,))

    def waits() -> str:
        rpc.init_rpc("worker1")  # torch's dynamic start-up: the barrier waits for those that joined
        try:
            rpc.shutdown(timeout=30)
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    t0 = time.monotonic()
    said = rpc.rpc_sync("worker1", waits)
    assert time.monotonic() - t0 < 15, said  # at once, not at the deadline
    assert said.startswith("rpc.shutdown() in 'worker1' gave up waiting for the world's other members"), said
    assert f"{doomed!r} (rank " in said and "is gone" in said, said


def test_the_drivers_final_shutdown_waits_for_the_programs_that_joined() -> None:
    out = run_script("""
        import time
        from nbremote import rpc

        def run_worker(rank, world_size):  # torch's passive rank: init_rpc, then shutdown at once
            rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
            rpc.shutdown()
            return time.time()

        rpc.init_rpc("worker0", rank=0, world_size=3)
        futs = [rpc.rpc_async(f"worker{r}", run_worker, args=(r, 3)) for r in (1, 2)]
        time.sleep(1.0)  # the master's work, outside any run_worker
        done = [f.done() for f in futs]
        t = time.time()
        rpc.shutdown()  # the driver's last: it is rank 0 of their program, then the world ends
        print(done, all(f.wait() >= t for f in futs), rpc.is_initialized())
    """, timeout=90)
    assert out.stdout.strip().splitlines()[-1] == "[False, False] True False", out.stdout + out.stderr[-3000:]


def test_a_driver_of_rank_2_and_torchs_run_worker_on_every_rank() -> None:
    """torch's program shape, as written: a master of rank 2, trainers 0 and 1, a parameter server 3; the master
    drives training through the trainers, which update parameters the server holds (RRefs)."""
    out = run_script("""
        import json, os
        import torch
        from nbremote import rpc

        class PS:
            def __init__(self):
                self.w = torch.zeros(2)
            def add(self, grad):
                self.w += grad
                return self.w.clone()

        def train_step(ps_rref, rank):
            return ps_rref.rpc_sync().add(torch.full((2,), float(rank + 1))).tolist()

        def run_worker(rank, world_size):
            opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=30)
            if rank == 2:
                rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=opts)
                ps = rpc.remote("ps", PS)
                for _ in range(3):
                    for t in ("trainer0", "trainer1"):
                        rpc.rpc_sync(t, train_step, args=(ps, int(t[-1])))
                result = ps.to_here().w.tolist()
            elif rank == 3:
                rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=opts)
                result = None
            else:
                rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
                result = None
            info = [rpc.get_worker_info().id, rpc.get_worker_info("master").id, rpc.get_rpc_timeout()]
            rpc.shutdown()
            return result, info

        rpc.init_rpc("master", rank=2, world_size=4, workers=["trainer0", "trainer1", "ps"])
        out = {"workers": [[w.name, w.id] for w in rpc.workers()],
               "status": [[s.name, s.rank] for s in rpc.worker_status()],
               "by_rank": [rpc.rpc_sync(r, rpc.get_worker_info).name for r in (0, 1, 2, 3)],
               "driver_by_rank": rpc.rpc_sync("trainer0", rpc.rpc_sync, args=(2, rpc.get_worker_info)).name}
        futs = [rpc.rpc_async(n, run_worker, args=(r, 4)) for n, r in (("trainer0", 0), ("trainer1", 1), ("ps", 3))]
        mine = run_worker(2, 4)
        out["programs"] = [f.wait() for f in futs] + [mine]
        out["added"] = rpc.add_worker("late").id
        out["restarted"] = rpc.restart_worker("trainer1").id
        rpc.shutdown()
        print(json.dumps(out))
    """, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["workers"] == [["trainer0", 0], ["trainer1", 1], ["master", 2], ["ps", 3]]
    assert got["status"] == [["trainer0", 0], ["trainer1", 1], ["ps", 3]]
    assert got["by_rank"] == ["trainer0", "trainer1", "master", "ps"]
    assert got["driver_by_rank"] == "master"
    assert got["programs"][:3] == [[None, [0, 2, 30.0]], [None, [1, 2, 30.0]], [None, [3, 2, 30.0]]]
    assert got["programs"][3] == [[9.0, 9.0], [2, 2, 30.0]]  # 3 steps of trainer0 (+1) and trainer1 (+2)
    assert got["added"] == 4 and got["restarted"] == 1


# -- the barrier's bookkeeping, with plain values (no kernels) ----------------------------------------------------


def _gathering(ranks: dict[str, int], lost: dict[str, str] | None = None, host: str | None = None) -> Any:
    from nbremote.rpc._core.gathering import Gathering

    return Gathering(lambda: dict(ranks), lambda n: (lost or {}).get(n), host)


def test_a_collective_join_waits_for_every_rank_but_the_host_and_names_who_did_not_come() -> None:
    g = _gathering({"a": 0, "b": 1, "c": 2}, host="a")
    rnd = g.join("b", 1, 3)
    done: list[str] = []
    t = threading.Thread(target=lambda: (g.wait_joined("b", rnd, 5), done.append("b")))
    t.start()
    time.sleep(0.3)
    assert not done  # c has not joined; a, the host, is not waited for
    assert g.join("c", 2, 3) == rnd
    g.wait_joined("c", rnd, 5)
    t.join(5)
    assert done == ["b"] and g.open() and g.round == rnd  # the round goes on, to its barrier

    g = _gathering({"a": 0, "b": 1, "c": 2}, host="a")
    rnd = g.join("b", 1, 3)
    with pytest.raises(RuntimeError, match=r"^rpc.init_rpc in 'b' waited 0 s for the other ranks of world_size=3, "
                                           r"and 'c' \(rank 2: has not called rpc.init_rpc\) did not join"):
        g.wait_joined("b", rnd, 0.2)
    assert not g.open() and g.round == rnd + 1  # the round failed for all

    g = _gathering({"a": 0, "b": 1, "c": 2, "d": 3}, host="a")
    g.refuse("c", "init_rpc(name='b', ...): the name differs")  # before b came: b fails as soon as it has joined
    rnd = g.join("b", 1, 4)
    with pytest.raises(RuntimeError, match=r"join: 'c' failed: init_rpc\(name='b', ...\): the name differs"):
        g.wait_joined("b", rnd, 5)
    assert g.round == rnd + 1
    rnd = g.join("d", 3, 4)  # d comes late, but within REFUSAL_HOLD: it is told too, rather than wait for c in vain
    with pytest.raises(RuntimeError, match=r"join: 'c' failed"):
        g.wait_joined("d", rnd, 5)
    rnd = g.join("b", 1, 4)  # b, told already, comes again: a new run, in which c may yet come
    g.join("c", 2, 4)
    g.join("d", 3, 4)
    g.wait_joined("b", rnd, 5)

    g = _gathering({"a": 0, "b": 1, "c": 2}, lost={"c": "its kernel died"}, host="a")
    rnd = g.join("b", 1, 3)
    with pytest.raises(RuntimeError, match=r"gave up waiting for the other ranks to join: 'c' \(rank 2\) is gone: its "
                                           "kernel died"):
        g.wait_joined("b", rnd, 5)


def test_the_barrier_releases_step_by_step_once_every_awaited_rank_arrived() -> None:
    g = _gathering({"a": 0, "b": 1})
    rnd = g.join("a", 0, 2)
    assert g.join("b", 1, 2) == rnd and g.open()
    done: list[str] = []
    t = threading.Thread(target=lambda: (g.arrive("a", 0, 5, rnd), g.arrive("a", 1, 5, rnd), done.append("a")))
    t.start()
    time.sleep(0.3)
    assert not done  # b has not arrived
    g.arrive("b", 0, 5, rnd)
    g.arrive("b", 1, 5, rnd)
    t.join(5)
    assert done == ["a"] and not g.open() and g.round == rnd + 1


def test_the_barrier_refuses_two_world_sizes_and_names_a_lost_or_missing_rank() -> None:
    g = _gathering({"a": 0, "b": 1, "c": 2}, lost={"c": "its kernel died"})
    rnd = g.join("a", 0, 3)
    with pytest.raises(RuntimeError, match="world_size=2, but the members that joined before it gave world_size=3"):
        g.join("b", 1, 2)
    with pytest.raises(RuntimeError, match=r"'c' \(rank 2\) is gone: its kernel died"):
        g.arrive("a", 0, 5, rnd)
    g = _gathering({"a": 0, "b": 1})
    rnd = g.join("a", 0, 2)
    with pytest.raises(RuntimeError, match=r"'b' \(rank 1: has not called rpc.init_rpc\) did not get there"):
        g.arrive("a", 0, 0.2, rnd)


def test_a_failure_of_an_old_round_leaves_the_current_one_alone_and_leaving_ends_an_empty_round() -> None:
    g = _gathering({"a": 0, "b": 1})
    old = g.join("a", 0, None)
    g.leave("a", old)  # graceful=False: nobody left joined, the round is over
    assert not g.open() and g.round == old + 1
    rnd = g.join("b", 1, None)
    g.fail("a", "its program ended", old)  # the round it joined is over: no effect on this one
    assert g.open()
    g.arrive("b", 0, 5, rnd)
    g.arrive("b", 1, 5, rnd)
    assert not g.open()
