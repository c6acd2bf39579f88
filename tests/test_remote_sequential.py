"""``RemoteSequential``: stages on real workers, each sending its output on to the next, the last one back
to the caller, in one-way messages. It trains exactly like one process, micro-batches included; an error
keeps its type and reaches the caller wherever it happens, a hop that cannot be loaded where it arrives
included; a lost worker or a chain that never finishes fails the call in time; nothing is left waiting,
and pipelined steps leave nothing behind on any process."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
from remote_fns import grown, settled_live_states

import nbremote.autograd as dist_autograd
from nbremote import rpc
from nbremote.errors import RPCTimeoutError, SerializationError, WorkerLostError
from nbremote.nn import RemoteModule, RemoteSequential
from nbremote.nn._sequential import _chains
from nbremote.optim import DistributedOptimizer
from nbremote.rpc._core import current_agent

pytestmark = pytest.mark.timeout(120)


class Stage(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Sleepy(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(5)
        return x


class Refuses(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyError(f"no stage for a batch of {len(x)}")


def _refuse_to_load(what: str) -> None:
    raise ValueError(f"{what} cannot be loaded here")


class Unloadable:
    """Pickles anywhere; unpickling it raises."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse_to_load, ("an Unloadable",))


class Poisons(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Unloadable:
        return Unloadable()


def _shapes() -> list[tuple[int, int]]:
    return [(6, 8), (8, 5), (5, 3)]


def _open_chains() -> int:
    return len(_chains(current_agent())._open)


def test_a_pipeline_of_micro_batches_trains_like_one_process(world: list[str]) -> None:
    stages = [RemoteModule(f"{w}/cpu", Stage, args=(*shape, i))
              for i, (w, shape) in enumerate(zip(world, _shapes(), strict=True))]
    pipe = RemoteSequential(stages)
    assert len(pipe) == 3 and pipe[1] is stages[1] and list(pipe) == stages
    assert "Stage on worker1/cpu -> Stage on worker2/cpu -> Stage on worker3/cpu" in repr(pipe)
    local = torch.nn.Sequential(*[Stage(*shape, i) for i, shape in enumerate(_shapes())])
    opt = DistributedOptimizer(torch.optim.SGD, pipe.remote_parameters(), lr=0.1, momentum=0.9)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9)
    x, target = torch.randn(12, 6), torch.randn(12, 3)
    for _ in range(3):
        with dist_autograd.context() as context_id:
            out = torch.cat(rpc.wait_all([pipe.forward_async(chunk) for chunk in x.chunk(4)]))
            loss = ((out - target) ** 2).mean()
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        local_opt.zero_grad()
        local_loss = ((local(x) - target) ** 2).mean()
        local_loss.backward()
        local_opt.step()
        assert torch.allclose(loss.detach(), local_loss.detach(), atol=1e-6)
    for stage, twin in zip(stages, local, strict=True):
        for name, value in twin.state_dict().items():
            assert torch.allclose(stage.remote_state_dict()[name], value, atol=1e-6), f"{stage.on}: {name}"
    assert _open_chains() == 0


def test_a_call_works_outside_a_context_and_no_grad_reaches_every_stage(world: list[str]) -> None:
    pipe = RemoteSequential(*[RemoteModule(f"{w}/cpu", Stage, args=(*s, i))
                              for i, (w, s) in enumerate(zip(world, _shapes(), strict=True))])
    x = torch.randn(4, 6)
    expected = torch.nn.Sequential(*[Stage(*s, i) for i, s in enumerate(_shapes())])(x)
    assert torch.allclose(pipe(x), expected.detach(), atol=1e-6)
    with torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad
    assert _open_chains() == 0


@pytest.mark.parametrize("where", [0, 1, 2])
def test_an_error_in_any_stage_reaches_the_caller_with_its_type(world: list[str], where: int) -> None:
    stages = [RemoteModule(f"{w}/cpu", Stage, args=(4, 4, i)) for i, w in enumerate(world)]
    stages[where] = RemoteModule(f"{world[where]}/cpu", Refuses)
    pipe = RemoteSequential(stages)
    with dist_autograd.context(), pytest.raises(KeyError, match="no stage for a batch of 3"):
        pipe.forward_async(torch.randn(3, 4)).wait(30)
    assert _open_chains() == 0


def test_a_hop_that_cannot_be_loaded_where_it_arrives_fails_the_call_at_once(world: list[str]) -> None:
    """worker2's output reaches worker3 in a one-way message that worker3 cannot unpickle: worker3 tells the
    caller, which gets the SerializationError naming both workers, at once, not at the chain's timeout."""
    pipe = RemoteSequential(RemoteModule("worker1/cpu", Stage, args=(4, 4, 0)), RemoteModule("worker2/cpu", Poisons),
                            RemoteModule("worker3/cpu", Stage, args=(4, 4, 1)))
    start = time.monotonic()
    with pytest.raises(SerializationError, match=r"'worker3' cannot load the call .*_stage that 'worker2' sent.*"
                                                 r"an Unloadable cannot be loaded here") as error:
        pipe.forward_async(torch.randn(2, 4)).wait(30)
    assert time.monotonic() - start < 5
    assert "raised on worker 'worker3'" in "".join(getattr(error.value, "__notes__", []))
    assert _open_chains() == 0
    assert rpc.rpc_sync("worker3", os.getpid) > 0  # and it serves on


def test_pipelined_steps_leave_nothing_behind_on_any_process(world: list[str]) -> None:
    """200 training steps of a 3-stage pipeline over 4 micro-batches: the contexts, passes, pending calls, RRefs
    and futures of every process are counted before and after (not timed); none grows with the steps."""
    pipe = RemoteSequential([RemoteModule(f"{w}/cpu", Stage, args=(*shape, i))
                             for i, (w, shape) in enumerate(zip(world, _shapes(), strict=True))])
    opt = DistributedOptimizer(torch.optim.SGD, pipe.remote_parameters(), lr=0.01)
    x, target = torch.randn(12, 6), torch.randn(12, 3)

    def steps(n: int) -> None:
        for _ in range(n):
            with dist_autograd.context() as context_id:
                out = torch.cat(rpc.wait_all([pipe.forward_async(chunk) for chunk in x.chunk(4)]))
                dist_autograd.backward(context_id, [((out - target) ** 2).mean()])
                opt.step(context_id)

    steps(20)
    before = settled_live_states(world)
    steps(200)
    after = settled_live_states(world)
    assert not grown(before, after), f"grew over 200 steps: before {before}, after {after}"
    assert all(c["contexts"] == 0 for c in after.values()), after
    assert _open_chains() == 0


def test_an_input_that_cannot_be_sent_is_refused_at_once(world: list[str]) -> None:
    pipe = RemoteSequential(RemoteModule("worker1/cpu", Stage, args=(4, 4, 0)))
    with pytest.raises(SerializationError, match="lock"):
        pipe.forward_async(threading.Lock())
    assert _open_chains() == 0


def test_bad_stages_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one RemoteModule"):
        RemoteSequential()
    with pytest.raises(TypeError, match=r"stage 1 is a Linear, not a RemoteModule.*RemoteModule\('worker1/cpu'"):
        RemoteSequential([RemoteModule("worker1/cpu", Stage, args=(2, 2, 0)), torch.nn.Linear(2, 2)])


def test_a_chain_that_does_not_come_back_times_out(world: list[str]) -> None:
    agent = current_agent()
    pipe = RemoteSequential(RemoteModule("worker1/cpu", Stage, args=(4, 4, 0)), RemoteModule("worker2/cpu", Sleepy))
    saved, agent.default_timeout = agent.default_timeout, 1.0
    try:
        future = pipe.forward_async(torch.randn(2, 4))
    finally:
        agent.default_timeout = saved
    start = time.monotonic()
    with pytest.raises(RPCTimeoutError, match=r"more than 1000 ms.*Sleepy on worker2"):
        future.wait(30)
    assert time.monotonic() - start < 3
    assert _open_chains() == 0
    time.sleep(4.5)  # worker2's stage finishes meanwhile; its late result is dropped, and worker2 serves on
    assert rpc.rpc_sync("worker2", os.getpid) > 0


@pytest.fixture
def victim(world: list[str]) -> Any:
    rpc.add_worker("victim")
    try:
        yield "victim", rpc.rpc_sync("victim", os.getpid)
    finally:
        rpc.remove_worker("victim")


def test_a_stage_worker_killed_mid_chain_fails_the_call_fast(world: list[str], victim: tuple[str, int]) -> None:
    name, victim_pid = victim
    pipe = RemoteSequential(RemoteModule("worker1/cpu", Stage, args=(4, 4, 0)), RemoteModule(f"{name}/cpu", Sleepy),
                            RemoteModule("worker2/cpu", Stage, args=(4, 4, 1)))
    future = pipe.forward_async(torch.randn(2, 4))
    threading.Event().wait(1.0)  # the victim sleeps in its stage now
    killed = time.monotonic()
    os.kill(victim_pid, signal.SIGKILL)
    with pytest.raises(WorkerLostError) as error:
        future.wait(20)
    assert error.value.worker == name and "RemoteSequential" in str(error.value)
    assert time.monotonic() - killed < 5
    assert _open_chains() == 0
