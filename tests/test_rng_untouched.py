"""nbremote draws from none of the user's random streams, in any process (issue 40).

A program that seeds Python's ``random``, numpy's global generator and torch's generator expects the
same draws whether or not nbremote runs beside it: its ids come from ``os.urandom``/``secrets``, and
what ipykernel and IPython do on its behalf (the driver's session check asks each worker for its
``kernel_info`` every second, whose banner picked a random "Tip" on the global stream) must not draw
either. Each test seeds, lets nbremote work (idle links, calls, RRefs, a RemoteModule trained with
distributed autograd), then compares the draws with those the same seeds give untouched.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_script

import nbremote.autograd as dist_autograd
from nbremote import rpc
from nbremote.nn import RemoteModule
from nbremote.optim import DistributedOptimizer
from nbremote.rpc._core import gradctx
from nbremote.rpc._wire import sessions

pytestmark = pytest.mark.timeout(120)

SEED = 40
IDLE_S = 5.0  # long enough for several of the driver's session checks (one a second per worker)


# -- run on every rank ------------------------------------------------------------------------------------


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def draws() -> dict[str, list[int]]:
    """A few values from each stream: equal lists mean equal states."""
    return {"random": [random.getrandbits(32) for _ in range(4)],
            "numpy": np.random.randint(0, 2**31, size=4).tolist(),
            "torch": torch.randint(0, 2**31, (4,)).tolist()}


def untouched(seed: int) -> dict[str, list[int]]:
    """What ``draws()`` gives right after ``seed_all(seed)``: the states are saved and put back around it."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        seed_all(seed)
        return draws()
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


def worker_activity(peer: str) -> float:
    """On a worker: calls of its own to a peer, an RRef there, and a distributed backward through it."""
    assert rpc.rpc_sync(peer, abs, args=(-3,)) == 3
    rref = rpc.remote(peer, list, args=([1, 2],))
    assert rref.to_here() == [1, 2]
    del rref
    with dist_autograd.context() as context_id:
        x = torch.ones(3, requires_grad=True)
        y = rpc.rpc_sync(peer, torch.mul, args=(x, 2.0))
        dist_autograd.backward(context_id, [y.sum()])
        return float(dist_autograd.get_gradients(context_id)[x].sum())


@contextlib.contextmanager
def who_draws() -> Iterator[list[str]]:
    """Record, in this process, every call into the global ``random`` by its module functions (how
    libraries reach it: ``random.random()``, ``random.randrange(...)``), with the thread and the stack, so
    that a shifted stream names its culprit instead of only showing the shift."""
    seen: list[str] = []
    names = ("random", "getrandbits", "randrange", "randint", "choice", "choices", "sample", "shuffle",
             "uniform", "gauss", "normalvariate", "randbytes", "triangular", "expovariate")
    saved = {name: getattr(random, name) for name in names}

    def watched(name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            stack = "".join(traceback.format_stack(limit=12)[:-1])
            seen.append(f"random.{name} in thread {threading.current_thread().name!r}:\n{stack}")
            return inner(*args, **kwargs)
        return call

    for name, inner in saved.items():
        setattr(random, name, watched(name, inner))
    try:
        yield seen
    finally:
        for name, inner in saved.items():
            setattr(random, name, inner)


# -- the tests ----------------------------------------------------------------------------------------------


def test_no_random_stream_is_drawn_from_in_the_driver_or_its_workers(world: list[str]) -> None:
    worker, peer = world[0], world[1]
    # Built before seeding: a module's initial weights are the user's own draws (on its worker).
    stage = RemoteModule(f"{worker}/cpu", torch.nn.Linear, args=(3, 2))
    expected = untouched(SEED)
    for name in (worker, peer):
        rpc.rpc_sync(name, seed_all, args=(SEED,))
    with who_draws() as seen:
        seed_all(SEED)

        time.sleep(IDLE_S)  # links idle but alive: heartbeats and session checks flow

        assert rpc.rpc_sync(worker, worker_activity, args=(peer,)) == 6.0
        assert rpc.rpc_sync(peer, abs, args=(-1,)) == 1
        opt = DistributedOptimizer(torch.optim.SGD, stage.remote_parameters(), lr=0.1)
        for _ in range(2):
            with dist_autograd.context() as context_id:
                loss = stage(torch.ones(4, 3)).sum()
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
        assert rpc.rpc_async(worker, abs, args=(-2,)).wait() == 2
        drawn_here = list(seen)

    got = {"driver": draws(), worker: rpc.rpc_sync(worker, draws), peer: rpc.rpc_sync(peer, draws)}
    assert got == {name: expected for name in got}, (
        "a random stream was drawn from (see which above); in the driver:\n" + "\n".join(drawn_here))


def test_who_draws_names_the_drawing_thread() -> None:
    """The tracer the driver's check relies on sees a draw made by another thread, and unwraps after."""
    with who_draws() as seen:
        thread = threading.Thread(target=lambda: random.randrange(10), name="drawer")
        thread.start()
        thread.join()
    assert len(seen) == 1 and "random.randrange in thread 'drawer'" in seen[0]
    assert random.randrange.__self__ is random._inst  # type: ignore[attr-defined]


def test_the_provisioners_loop_keeps_tornados_jitter_off_the_user_stream() -> None:
    """gateway_provisioners runs a jittered PeriodicCallback every 0.1 ms on nbremote's provisioner loop in the
    driver; tornado picked each delay with the global ``random``. The loop nbremote starts for provisioners
    gives tornado a generator of its own, and a jittered callback then leaves the user's stream alone."""
    import asyncio

    import tornado.ioloop

    from nbremote.rpc._kernels import provisioned

    provisioned._Loop()
    assert tornado.ioloop.random is not random

    async def tick_for_a_while() -> int:
        ticks = []
        callback = tornado.ioloop.PeriodicCallback(lambda: ticks.append(1), 1, jitter=0.5)
        callback.start()
        await asyncio.sleep(0.1)
        callback.stop()
        return len(ticks)

    random.seed(SEED)
    before = random.getstate()
    with who_draws() as seen:
        assert asyncio.run(tick_for_a_while()) > 5
    assert random.getstate() == before, seen


def test_context_ids_come_from_no_user_stream() -> None:
    random.seed(SEED)
    before = random.getstate()
    gradctx.Contexts(3)
    assert random.getstate() == before


def test_a_session_culls_its_replay_history_without_the_user_stream() -> None:
    """Past ``digest_history_size`` accepted messages a Session forgets a random tenth of their signatures:
    jupyter_client picks them with the global ``random``; a session nbremote uses picks with its own."""
    from jupyter_client.session import Session

    session = sessions.own_rng(Session(key=b"k", digest_history_size=100))
    random.seed(SEED)
    before = random.getstate()
    for i in range(300):
        session._add_digest(str(i).encode())
    assert random.getstate() == before
    assert 0 < len(session.digest_history) <= 100


def test_a_fresh_driver_draws_nothing_from_start_up_to_shutdown() -> None:
    """Importing nbremote, starting a world, training through it and shutting it down, all after seeding:
    what the driver's own start-up does (agent, autograd ids, kernels started) is covered here."""
    out = run_script(f"""
        import random, numpy as np, torch
        random.seed({SEED}); np.random.seed({SEED}); torch.manual_seed({SEED})
        import nbremote.autograd as dist_autograd
        from nbremote import rpc
        rpc.init_rpc("driver", workers=["worker1"])
        try:
            with dist_autograd.context() as ctx:
                x = torch.ones(2, requires_grad=True)
                dist_autograd.backward(ctx, [rpc.rpc_sync("worker1", torch.mul, args=(x, 3.0)).sum()])
        finally:
            rpc.shutdown()
        print([random.getrandbits(32) for _ in range(4)], np.random.randint(0, 2**31, size=4).tolist(),
              torch.randint(0, 2**31, (4,)).tolist())
    """, timeout=120)
    expected = untouched(SEED)
    assert out.stdout.strip().splitlines()[-1] == f"{expected['random']} {expected['numpy']} {expected['torch']}", (
        out.stderr[-3000:])


def test_untouched_restores_the_states() -> None:
    """The reference itself must not move this process's streams (it runs between the others' seeds)."""
    seed_all(SEED + 1)
    first = draws()
    seed_all(SEED + 1)
    untouched(SEED)
    assert draws() == first

