"""Training across kernels: distributed autograd and DistributedOptimizer on real worker kernels.

Reference results come from training the same model, with the same weights and optimizer, in this one
process. Classes and functions the workers run live at this module's top level (workers import them
by name).
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time
from types import ModuleType
from typing import Any

import pytest
import tensorplay
import torch
from remote_fns import grown, settled_live_states

import nbremote.autograd as dist_autograd
from nbremote import rpc
from nbremote.errors import AutogradError, WorkerLostError
from nbremote.nn import RemoteModule
from nbremote.optim import DistributedOptimizer
from nbremote.rpc._core import current_agent

pytestmark = pytest.mark.timeout(90)

FRAMEWORKS = {"torch": torch, "tensorplay": tensorplay}


def _stage_classes(lib: ModuleType) -> tuple[type, type]:
    nn = lib.nn

    class Stage(nn.Module):  # type: ignore[name-defined,misc]
        def __init__(self, n_in: int, n_out: int) -> None:
            super().__init__()
            self.fc = nn.Linear(n_in, n_out)

        def forward(self, x: Any) -> Any:
            return lib.tanh(self.fc(x))

    class Head(nn.Module):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x: Any) -> Any:
            return self.fc(x)

    return Stage, Head


TorchStage, TorchHead = _stage_classes(torch)
TorchStage.__qualname__ = TorchStage.__name__ = "TorchStage"
TensorplayStage, TensorplayHead = _stage_classes(tensorplay)
TensorplayStage.__qualname__ = TensorplayStage.__name__ = "TensorplayStage"
STAGES = {"torch": TorchStage, "tensorplay": TensorplayStage}
HEADS = {"torch": TorchHead, "tensorplay": TensorplayHead}


# -- run on workers ---------------------------------------------------------------------------------------


def contexts_here() -> int:
    return len(current_agent().grad)


def gradients_of(module_rref: rpc.RRef[Any], context_id: int) -> list[Any]:
    """On the owner: the context's gradient of each of the module's parameters (None where it has none)."""
    grads = dist_autograd.get_gradients(context_id)
    return [grads.get(p) for p in module_rref.local_value().parameters()]


def grad_attributes(module_rref: rpc.RRef[Any]) -> list[Any]:
    return [p.grad for p in module_rref.local_value().parameters()]


def run_module(module_rref: rpc.RRef[Any], x: Any) -> Any:
    return module_rref.local_value()(x)


def consume_rref(h_rref: rpc.RRef[Any], module_rref: rpc.RRef[Any]) -> Any:
    """On worker2: fetch a tensor that worker1 holds (to_here) and run it through a module here."""
    return module_rref.local_value()(h_rref.to_here())


def train_from_here(stage: RemoteModule, xs: list[Any], lr: float) -> list[float]:
    """On a worker: open contexts here and train a module that lives on *another* worker."""
    opt = DistributedOptimizer(torch.optim.SGD, stage.remote_parameters(), lr=lr)
    losses = []
    for x in xs:
        with dist_autograd.context() as context_id:
            loss = (stage(x) ** 2).mean()
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(float(loss.detach()))
    return losses


def linear_forward(module_rref: rpc.RRef[Any], x: Any) -> Any:
    return module_rref.local_value()(x)


def trainer_loop(ps_module: rpc.RRef[Any], steps: int, lr: float) -> int:
    """A trainer worker: each step pushes a known gradient into the shared parameter server's module."""
    opt = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync(ps_module.owner(), parameter_rrefs, args=(ps_module,)),
                               lr=lr)
    x = torch.ones(2, 3)
    for _ in range(steps):
        with dist_autograd.context() as context_id:
            y = rpc.rpc_sync(ps_module.owner(), linear_forward, args=(ps_module, x))
            dist_autograd.backward(context_id, [y.sum()])
            opt.step(context_id)
    return steps


def parameter_rrefs(module_rref: rpc.RRef[Any]) -> list[rpc.RRef[Any]]:
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def make_linear(n_in: int, n_out: int, seed: int) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out)


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps, so a test can kill its worker mid-backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(30)
        return grad


class RefusingBackward(torch.autograd.Function):
    """Identity whose backward raises, as a bad custom layer's would."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ZeroDivisionError("this layer cannot go backward")


def refusing_stage(x: torch.Tensor) -> torch.Tensor:
    return RefusingBackward.apply(x * 2)


class SlowStage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SlowBackward.apply(self.fc(x))


class SlowSGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        time.sleep(30)
        return super().step(closure)


class ExplodingSGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        raise FloatingPointError("the optimizer refused this step")


def pid() -> int:
    return os.getpid()


class StampedStage(torch.nn.Module):
    """A ``Linear(4, 4)`` that stamps (CLOCK_MONOTONIC, one clock for every process) when its output's gradient
    is computed here and, if ``hold`` > 0, when the context takes its weight's gradient (the weight's
    accumulation post hook), which then holds the pass for ``hold`` seconds."""

    def __init__(self, hold: float) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.hold = hold
        self.stamps: dict[str, float] = {}
        self._node = self.fc.weight.view_as(self.fc.weight).grad_fn.next_functions[0][0]  # kept: one node
        if hold > 0:
            self._node.register_hook(self._accumulated)

    def _accumulated(self, *args: Any) -> None:
        self.stamps["weight"] = time.monotonic()
        time.sleep(self.hold)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        y.register_hook(lambda grad: self.stamps.__setitem__("output", time.monotonic()))
        return y


def stamps_of(module_rref: rpc.RRef[Any]) -> dict[str, float]:
    return dict(module_rref.local_value().stamps)


# -- fixtures and helpers -----------------------------------------------------------------------------------


def _settle(workers: list[str], expected: int = 0, timeout: float = 5.0) -> dict[str, int]:
    """Context counts on the driver and the workers once releases (fire and forget) have arrived."""
    deadline = time.monotonic() + timeout
    while True:
        counts = {"driver": contexts_here(), **{w: rpc.rpc_sync(w, contexts_here) for w in workers}}
        if all(c == expected for c in counts.values()) or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def _copy_into(lib: ModuleType, remote: RemoteModule, local: Any) -> None:
    local.load_state_dict(remote.remote_state_dict())


def _close(lib: ModuleType, a: Any, b: Any) -> bool:
    return bool(lib.allclose(a, b, atol=1e-5, rtol=1e-4))


# -- (1) a split model trains exactly like one process ---------------------------------------------------


@pytest.mark.parametrize("framework", ["torch", "tensorplay"])
def test_split_model_trains_like_one_process(world: list[str], framework: str) -> None:
    lib = FRAMEWORKS[framework]
    Stage, Head = STAGES[framework], HEADS[framework]
    lib.manual_seed(0)
    stage1 = RemoteModule("worker1/cpu", Stage, args=(8, 16))
    stage2 = RemoteModule("worker2/cpu", Stage, args=(16, 4))
    head = Head()
    local1, local2, local_head = Stage(8, 16), Stage(16, 4), Head()
    _copy_into(lib, stage1, local1)
    _copy_into(lib, stage2, local2)
    local_head.load_state_dict(head.state_dict())

    params = stage1.remote_parameters() + stage2.remote_parameters() + [rpc.RRef(p) for p in head.parameters()]
    opt = DistributedOptimizer(lib.optim.SGD, params, lr=0.1, momentum=0.9)
    local_params = [*local1.parameters(), *local2.parameters(), *local_head.parameters()]
    local_opt = lib.optim.SGD(local_params, lr=0.1, momentum=0.9)
    x = lib.randn((16, 8))
    target = lib.randn((16, 1))

    losses = []
    for _ in range(4):
        with dist_autograd.context() as context_id:
            loss = ((head(stage2(stage1(x))) - target) ** 2).mean()
            dist_autograd.backward(context_id, [loss])
            head_grads = dist_autograd.get_gradients(context_id)
            opt.step(context_id)
            # stage1's output reached worker2 through the driver, as it was: its gradient skips the driver
            assert rpc.rpc_sync("worker2", senders_here, args=(context_id,)) == {"worker1"}
        assert len(head_grads) == 2 and all(p in head_grads for p in head.parameters())
        assert all(p.grad is None for p in head.parameters()), "gradients live in the context, not in .grad"
        for p in local_params:
            p.grad = None
        local_loss = ((local_head(local2(local1(x))) - target) ** 2).mean()
        local_loss.backward()
        local_opt.step()
        assert _close(lib, loss.detach(), local_loss.detach())
        losses.append(float(loss.detach()))

    assert losses[-1] < losses[0]
    for remote, local in ((stage1, local1), (stage2, local2)):
        state = remote.remote_state_dict()
        for name, value in local.state_dict().items():
            assert _close(lib, state[name], value), f"{remote.on}: {name} differs from one-process training"
    for p, q in zip(head.parameters(), local_head.parameters(), strict=True):
        assert _close(lib, p.detach(), q.detach())
    assert rpc.rpc_sync("worker1", grad_attributes, args=(stage1.module_rref,)) == [None, None]
    assert _settle(["worker1", "worker2"]) == {"driver": 0, "worker1": 0, "worker2": 0}


def senders_here(context_id: int) -> set[str]:
    """Who sent this process tensors that require grad in the context (where its activations came from)."""
    ctx = current_agent().grad.get(context_id)
    return set() if ctx is None else {recv.sender for recv in ctx.recvs.values()}


def test_a_pipeline_of_remote_forwards_trains_like_one_process(world: list[str]) -> None:
    """Three stages on three workers, four micro-batches in flight: each stage's output stays on its worker
    (``remote_forward``) and the next stage's worker fetches it from there; the driver only gets the last
    stage's outputs, and one backward trains every stage as one process would."""
    torch.manual_seed(0)
    sizes = [(4, 8), (8, 8), (8, 2)]
    stages = [RemoteModule(f"worker{i}/cpu", TorchStage, args=size) for i, size in enumerate(sizes, start=1)]
    locals_ = [TorchStage(*size) for size in sizes]
    for remote, local in zip(stages, locals_, strict=True):
        _copy_into(torch, remote, local)
    opt = DistributedOptimizer(torch.optim.SGD, [p for s in stages for p in s.remote_parameters()], lr=0.2)
    local_opt = torch.optim.SGD([p for m in locals_ for p in m.parameters()], lr=0.2)
    x = torch.randn(16, 4)
    for _ in range(3):
        with dist_autograd.context() as context_id:
            futures = []
            for chunk in x.split(4):
                h1 = stages[0].remote_forward(chunk)
                h2 = stages[1].remote_forward(h1)
                futures.append(stages[2].forward_async(h2))
            out = torch.cat(rpc.wait_all(futures))
            loss = out.pow(2).mean()
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
            assert senders_here(context_id) == {"worker3"}, "activations must go from stage to stage directly"
            assert rpc.rpc_sync("worker3", senders_here, args=(context_id,)) == {"worker2"}
        local_opt.zero_grad()
        local_loss = locals_[2](locals_[1](locals_[0](x))).pow(2).mean()
        local_loss.backward()
        local_opt.step()
        assert _close(torch, loss.detach(), local_loss.detach())
    for remote, local in zip(stages, locals_, strict=True):
        state = remote.remote_state_dict()
        assert all(_close(torch, state[k], v) for k, v in local.state_dict().items()), remote.on
    assert _settle(["worker1", "worker2", "worker3"]) == {"driver": 0, "worker1": 0, "worker2": 0, "worker3": 0}


def test_backward_and_step_trains_the_split_model_and_a_pipeline_as_backward_then_step(world: list[str]) -> None:
    """Owners stepping as the pass reaches them give the parameters backward() + step() give: the split model
    (three owners, the driver's head among them) and a pipeline of micro-batches, against one process."""
    torch.manual_seed(3)
    stage1, stage2, head = (RemoteModule("worker1/cpu", TorchStage, args=(8, 16)),
                            RemoteModule("worker2/cpu", TorchStage, args=(16, 4)), TorchHead())
    local = torch.nn.Sequential(TorchStage(8, 16), TorchStage(16, 4), TorchHead())
    _copy_into(torch, stage1, local[0])
    _copy_into(torch, stage2, local[1])
    local[2].load_state_dict(head.state_dict())
    params = stage1.remote_parameters() + stage2.remote_parameters() + [rpc.RRef(p) for p in head.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9)
    x, target = torch.randn(16, 8), torch.randn(16, 1)
    for _ in range(3):
        with dist_autograd.context() as context_id:
            loss = ((head(stage2(stage1(x))) - target) ** 2).mean()
            opt.backward_and_step(context_id, [loss])
        local_opt.zero_grad()
        local_loss = ((local(x) - target) ** 2).mean()
        local_loss.backward()
        local_opt.step()
        assert _close(torch, loss.detach(), local_loss.detach())
    for remote, mirror in ((stage1, local[0]), (stage2, local[1])):
        state = remote.remote_state_dict()
        assert all(_close(torch, state[k], v) for k, v in mirror.state_dict().items()), remote.on
    assert all(_close(torch, p.detach(), q.detach()) for p, q in zip(head.parameters(), local[2].parameters(),
                                                                     strict=True))
    # a pipeline: each stage gets every micro-batch's gradients in one hop
    pipe_opt = DistributedOptimizer(torch.optim.SGD, stage1.remote_parameters() + stage2.remote_parameters(), lr=0.1)
    local_pipe = torch.optim.SGD([*local[0].parameters(), *local[1].parameters()], lr=0.1)
    with dist_autograd.context() as context_id:
        out = torch.cat(rpc.wait_all([stage2.forward_async(stage1.remote_forward(c)) for c in x.split(4)]))
        pipe_opt.backward_and_step(context_id, [out.pow(2).mean()])
    local_pipe.zero_grad()
    local[1](local[0](x)).pow(2).mean().backward()
    local_pipe.step()
    state = stage1.remote_state_dict()
    assert all(_close(torch, state[k], v) for k, v in local[0].state_dict().items())


def test_backward_and_step_refuses_an_owner_the_pass_reaches_twice(world: list[str]) -> None:
    """The driver's parameter goes to two workers, so the pass comes back to the driver twice: after it
    stepped. The pass fails, saying why and what to use instead."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = DistributedOptimizer(torch.optim.SGD, [rpc.RRef(w)], lr=0.1)
    with dist_autograd.context() as context_id:
        a = rpc.rpc_sync("worker1", torch.mul, args=(w, 2.0))
        b = rpc.rpc_sync("worker2", torch.mul, args=(w, 3.0))
        with pytest.raises(AutogradError, match=r"reached 'driver' a second time.*dist_autograd.backward, then"):
            opt.backward_and_step(context_id, [(a + b).sum()])
    with dist_autograd.context() as context_id:  # the plain way works for the same model
        a = rpc.rpc_sync("worker1", torch.mul, args=(w, 2.0))
        b = rpc.rpc_sync("worker2", torch.mul, args=(w, 3.0))
        dist_autograd.backward(context_id, [(a + b).sum()])
        assert torch.equal(dist_autograd.get_gradients(context_id)[w], torch.full((3,), 5.0))


@pytest.mark.timeout(240)
def test_a_thousand_steps_leave_nothing_behind(world: list[str]) -> None:
    """1,000 steps of the split model: the contexts, passes, pending calls, RRefs and futures of every process
    are counted before and after (not timed); none grows with the number of steps."""
    stage1 = RemoteModule("worker1/cpu", TorchStage, args=(8, 16))
    stage2 = RemoteModule("worker2/cpu", TorchStage, args=(16, 4))
    head = TorchHead()
    params = stage1.remote_parameters() + stage2.remote_parameters() + [rpc.RRef(p) for p in head.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.01, momentum=0.9)
    x, target = torch.randn(16, 8), torch.randn(16, 1)

    def steps(n: int) -> None:
        for _ in range(n):
            with dist_autograd.context() as context_id:
                dist_autograd.backward(context_id, [((head(stage2(stage1(x))) - target) ** 2).mean()])
                opt.step(context_id)

    steps(50)
    before = settled_live_states(["worker1", "worker2"])
    steps(1000)
    after = settled_live_states(["worker1", "worker2"])
    assert not grown(before, after), f"grew over 1,000 steps: before {before}, after {after}"


# -- (2) gradients through an RRef that another worker consumed --------------------------------------------


def test_gradients_reach_worker1_through_an_rref_worker2_consumed(world: list[str]) -> None:
    torch.manual_seed(1)
    m1 = rpc.remote("worker1", make_linear, args=(3, 4, 11))
    m2 = rpc.remote("worker2", make_linear, args=(4, 2, 12))
    local1, local2 = make_linear(3, 4, 11), make_linear(4, 2, 12)
    x = torch.randn(5, 3)
    with dist_autograd.context() as context_id:
        h = rpc.remote("worker1", run_module, args=(m1, x))  # the activation stays on worker1
        out = rpc.rpc_sync("worker2", consume_rref, args=(h, m2))  # worker2 fetches it from worker1
        dist_autograd.backward(context_id, [out.pow(2).sum()])
        grads1 = rpc.rpc_sync("worker1", gradients_of, args=(m1, context_id))
        grads2 = rpc.rpc_sync("worker2", gradients_of, args=(m2, context_id))
    local2(local1(x)).pow(2).sum().backward()
    for got, p in zip(grads1 + grads2, [*local1.parameters(), *local2.parameters()], strict=True):
        assert got is not None and torch.allclose(got, p.grad, atol=1e-6)


def test_a_tensor_sent_to_a_worker_and_its_result_sent_back(world: list[str]) -> None:
    w = torch.randn(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        y = rpc.rpc_sync("worker3", torch.matmul, args=(w, w))  # w crosses twice; the product comes back
        dist_autograd.backward(context_id, [y.sum()])
        grad = dist_autograd.get_gradients(context_id)[w]
    w.grad = None
    (w @ w).sum().backward()
    assert torch.allclose(grad, w.grad)


def test_a_result_passed_back_in_two_calls_gets_the_gradients_of_both(world: list[str]) -> None:
    """t3 comes back from worker1 and is passed on, as received, in two later calls there: both copies name
    t3's send on worker1 as their origin (``agf``), so their gradients meet in one slot -- and must add up
    (torch's _workload_thread; before, the second overwrote the first)."""
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        t3 = rpc.rpc_sync("worker1", torch.add, args=(t1, t2))
        t4 = rpc.rpc_sync("worker1", torch.mul, args=(t2, t3))
        t5 = rpc.rpc_sync("worker1", torch.matmul, args=(t3, t4))
        t6 = rpc.rpc_sync("worker1", torch.add, args=(t4, t5))
        dist_autograd.backward(context_id, [t6.sum()])
        grads = dist_autograd.get_gradients(context_id)
    l3 = t1 + t2
    l4 = t2 * l3
    expected = torch.autograd.grad([(l4 + l3 @ l4).sum()], [t1, t2])
    assert torch.allclose(grads[t1], expected[0]) and torch.allclose(grads[t2], expected[1])


# -- (3) a context opened on a worker ------------------------------------------------------------------------


def test_a_context_opened_on_a_worker_trains_a_module_on_another_worker(world: list[str]) -> None:
    torch.manual_seed(2)
    stage = RemoteModule("worker1/cpu", TorchStage, args=(4, 4))
    before = stage.remote_state_dict()
    xs = [torch.randn(8, 4) for _ in range(5)]
    losses = rpc.rpc_sync("worker3", train_from_here, args=(stage, xs, 0.5))  # the handle travels to worker3
    assert losses[-1] < losses[0]
    local = TorchStage(4, 4)
    local.load_state_dict(before)
    opt = torch.optim.SGD(local.parameters(), lr=0.5)
    for x in xs:
        opt.zero_grad()
        (local(x) ** 2).mean().backward()
        opt.step()
    after = stage.remote_state_dict()
    assert all(torch.allclose(after[k], v, atol=1e-6) for k, v in local.state_dict().items())
    assert _settle(["worker1", "worker3"]) == {"driver": 0, "worker1": 0, "worker3": 0}


# -- (4) a parameter server with concurrent trainers ------------------------------------------------------


def test_two_trainers_update_one_parameter_server_with_no_lost_update(world: list[str]) -> None:
    ps = rpc.remote("worker1", make_linear, args=(3, 2, 5))
    w0 = rpc.rpc_sync("worker1", run_module, args=(ps, torch.eye(3))).detach()  # x @ W^T + b for x = I
    steps, lr = 15, 0.01
    trainers = [rpc.rpc_async(t, trainer_loop, args=(ps, steps, lr)) for t in ("worker2", "worker3")]
    assert [f.wait() for f in trainers] == [steps, steps]
    w1 = rpc.rpc_sync("worker1", run_module, args=(ps, torch.eye(3))).detach()
    # each step: loss = sum(ones(2,3) @ W^T + b), so dW = 2 everywhere and db = 2; SGD moves each by -lr * 2
    per_step = torch.full_like(w0, -lr * 2) + torch.full((2,), -lr * 2)  # W entries and bias, seen through x = I
    assert torch.allclose(w1 - w0, 2 * steps * per_step, atol=1e-5), "an update was lost"
    assert _settle(["worker1", "worker2", "worker3"]) == {"driver": 0, "worker1": 0, "worker2": 0, "worker3": 0}


# -- (6) errors ---------------------------------------------------------------------------------------------


def test_backward_needs_a_live_context(world: list[str]) -> None:
    w = torch.ones(2, requires_grad=True)
    with dist_autograd.context() as context_id:
        pass
    with pytest.raises(AutogradError, match=rf"Could not find autograd context with id: {context_id} on 'driver'"):
        dist_autograd.backward(context_id, [w.sum()])
    with pytest.raises(AutogradError, match="Could not find autograd context with id: 12345"):
        dist_autograd.backward(12345, [w.sum()])
    with pytest.raises(AutogradError, match="get_gradients: Could not find autograd context"):
        dist_autograd.get_gradients(context_id)
    with pytest.raises(TypeError, match="context_id is the int"):
        dist_autograd.backward("7", [w.sum()])  # type: ignore[arg-type]


def test_bad_roots_are_refused(world: list[str]) -> None:
    w = torch.ones(3, requires_grad=True)
    with dist_autograd.context() as context_id:
        with pytest.raises(AutogradError, match=r"roots\[0\] of shape \(3,\) is not a scalar"):
            dist_autograd.backward(context_id, [w * 2])
        with pytest.raises(AutogradError, match=r"requires_grad not set on roots\[1\]"):
            dist_autograd.backward(context_id, [w.sum(), torch.ones(1).sum()])
        with pytest.raises(AutogradError, match="No tensors provided"):
            dist_autograd.backward(context_id, [])
        with pytest.raises(AutogradError, match=r"roots\[0\] does not have a valid gradient function"):
            dist_autograd.backward(context_id, [torch.ones((), requires_grad=True)])  # a leaf, as torch
        with pytest.raises(TypeError, match=r"roots\[0\] is a str"):
            dist_autograd.backward(context_id, ["loss"])
        dist_autograd.backward(context_id, w.sum())  # a single tensor is accepted too
        assert torch.equal(dist_autograd.get_gradients(context_id)[w], torch.ones(3))


def test_contexts_do_not_nest_in_one_thread(world: list[str]) -> None:
    with dist_autograd.context() as outer:
        nested = f"Already have an autograd context id for this thread: context {outer}"
        with pytest.raises(AutogradError, match=nested), dist_autograd.context():
            pass
        other: list[int] = []

        def in_another_thread() -> None:
            with dist_autograd.context() as context_id:
                other.append(context_id)

        t = threading.Thread(target=in_another_thread)
        t.start()
        t.join()
        assert other and other[0] != outer, "another thread may open its own context"


def test_a_second_backward_needs_retain_graph(world: list[str]) -> None:
    w = torch.randn(3, requires_grad=True)
    with dist_autograd.context() as context_id:
        y = rpc.rpc_sync("worker2", torch.mul, args=(w, 3.0)).sum()
        dist_autograd.backward(context_id, [y], retain_graph=True)
        dist_autograd.backward(context_id, [y])  # after a retained one, once more is fine
        assert torch.allclose(dist_autograd.get_gradients(context_id)[w], torch.full((3,), 6.0))
        with pytest.raises(AutogradError, match=r"backward through the graph a second time.*retain_graph=True"):
            dist_autograd.backward(context_id, [y])


def test_an_error_in_a_hop_two_workers_away_is_raised_with_its_type_and_where(world: list[str]) -> None:
    """The chain driver -> worker1 -> worker2: worker2's backward raises; the root gets the error with its own
    type, the worker named and its traceback, and the world trains on afterwards."""
    w = torch.randn(3, requires_grad=True)
    with dist_autograd.context() as context_id:
        h = rpc.rpc_sync("worker1", torch.mul, args=(w, 3.0))
        y = rpc.rpc_sync("worker2", refusing_stage, args=(h,)).sum()
        with pytest.raises(ZeroDivisionError, match="cannot go backward") as raised:
            dist_autograd.backward(context_id, [y])
    assert any("worker2" in note for note in getattr(raised.value, "__notes__", []))
    assert "cannot go backward" in str(raised.value.__cause__)
    with dist_autograd.context() as context_id:
        y = rpc.rpc_sync("worker2", torch.mul, args=(rpc.rpc_sync("worker1", torch.mul, args=(w, 3.0)), 2.0)).sum()
        dist_autograd.backward(context_id, [y])
        assert torch.equal(dist_autograd.get_gradients(context_id)[w], torch.full((3,), 6.0))


def test_contexts_are_released_everywhere_also_when_the_body_raises(world: list[str]) -> None:
    w = torch.randn(2, requires_grad=True)
    with pytest.raises(KeyError, match="boom"), dist_autograd.context():
        x = rpc.rpc_sync("worker1", torch.mul, args=(w, 2.0))
        rpc.rpc_sync("worker2", torch.add, args=(x, 1.0))
        rpc.rpc_sync("worker3", os.getpid)
        raise KeyError("boom")
    assert _settle(world) == dict.fromkeys(["driver", *world], 0)


def test_leaving_a_context_tells_its_workers_at_once(world: list[str]) -> None:
    """The release leaves as the context is left, not with the next message to each worker: riding with the
    next step's call, it made each worker forget the old context first, on that step's path."""
    w = torch.randn(2, requires_grad=True)
    with dist_autograd.context():
        rpc.rpc_sync("worker1", torch.mul, args=(w, 2.0))
        rpc.rpc_sync("worker2", torch.mul, args=(w, 3.0))
    routes = [current_agent().peers.route(name) for name in ("worker1", "worker2")]
    assert [len(link.outbox) for link in routes if link is not None] == [0, 0], "the release waits to ride along"
    assert _settle(["worker1", "worker2"]) == {"driver": 0, "worker1": 0, "worker2": 0}


def test_a_hop_passes_the_gradients_on_before_its_parameters_take_theirs(world: list[str]) -> None:
    """worker2's hop sends worker1 its gradient first, then gives its own parameters theirs (with their hooks):
    worker1's part of the pass runs meanwhile, not after. (The other order kept ~150 us a hop, cold, on the
    pass's path.) Every gradient still arrives before backward returns."""
    stage1 = RemoteModule("worker1/cpu", StampedStage, args=(0.0,))
    stage2 = RemoteModule("worker2/cpu", StampedStage, args=(0.5,))
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [stage2(stage1(torch.ones(2, 4))).sum()])
        grads = [rpc.rpc_sync(w, gradients_of, args=(m.module_rref, context_id))
                 for w, m in (("worker1", stage1), ("worker2", stage2))]
    assert all(g is not None for per_stage in grads for g in per_stage)
    first = rpc.rpc_sync("worker1", stamps_of, args=(stage1.module_rref,))
    second = rpc.rpc_sync("worker2", stamps_of, args=(stage2.module_rref,))
    assert first["output"] < second["weight"] + 0.5, (
        f"worker1's part began {first['output'] - second['weight']:.3f} s after worker2's weight took its gradient")


def test_a_roots_one_hop_reports_to_the_thread_that_waits(world: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The root's one hop goes on its waiting thread's own socket, and the hop's report comes back there: the
    thread that waits in ``backward`` receives it itself, with no hand-over from the receiving thread. When
    that hop started others (a chain), the reports come the usual way, and the last wakes it: a slice of
    pumping its socket made seconds long shows a wake-up it would miss."""
    from nbremote.rpc._core import future, replies

    takers: list[int] = []
    hop_over = replies.hop_over

    def recorded(*args: Any) -> None:
        takers.append(threading.get_ident())
        hop_over(*args)

    monkeypatch.setattr(replies, "hop_over", recorded)
    monkeypatch.setattr(future, "PUMP_SLICE", 5.0)
    me = threading.get_ident()
    stage = RemoteModule("worker1/cpu", TorchStage, args=(4, 4))
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [stage(torch.ones(2, 4)).sum()])
    assert takers == [me], "the report was not received by the thread that waited for it"
    takers.clear()
    stage1 = RemoteModule("worker1/cpu", StampedStage, args=(0.3,))  # its report comes last, 0.3 s later
    stage2 = RemoteModule("worker2/cpu", StampedStage, args=(0.0,))
    with dist_autograd.context() as context_id:
        started = time.monotonic()
        dist_autograd.backward(context_id, [stage2(stage1(torch.ones(2, 4))).sum()])
        took = time.monotonic() - started
        assert all(g is not None for g in rpc.rpc_sync("worker1", gradients_of, args=(stage1.module_rref, context_id)))
    assert len(takers) == 2 and me not in takers, "a report that was not the last came to the waiting thread"
    assert took < 2.5, f"backward took {took:.1f} s: the wait missed the report that came by another thread"


def test_optimizer_errors_name_the_worker(world: list[str]) -> None:
    stage = RemoteModule("worker2/cpu", TorchStage, args=(2, 2))
    with pytest.raises(ValueError, match="Invalid learning rate") as info:
        DistributedOptimizer(torch.optim.SGD, stage.remote_parameters(), lr=-1.0)
    assert "worker 'worker2'" in str(info.value.__notes__)
    with pytest.raises(TypeError, match=r"params_rref\[0\] is a Parameter, not an RRef"):
        DistributedOptimizer(torch.optim.SGD, list(torch.nn.Linear(1, 1).parameters()), lr=0.1)
    with pytest.raises(TypeError, match="optimizer_class must be an optimizer class"):
        DistributedOptimizer("SGD", stage.remote_parameters())  # type: ignore[arg-type]
    opt = DistributedOptimizer(ExplodingSGD, stage.remote_parameters(), lr=0.1)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [stage(torch.ones(1, 2)).sum()])
        with pytest.raises(FloatingPointError, match="refused this step") as step_info:
            opt.step(context_id)
    assert "worker 'worker2'" in str(step_info.value.__notes__)
    with pytest.raises(AutogradError, match=f"DistributedOptimizer.step: Could not find autograd context with id: "
                                            f"{context_id}"):
        opt.step(context_id)


def test_parameters_without_a_gradient_are_skipped(world: list[str]) -> None:
    used = RemoteModule("worker3/cpu", TorchStage, args=(2, 2))
    unused = RemoteModule("worker3/cpu", TorchStage, args=(2, 2))
    before_used, before_unused = used.remote_state_dict(), unused.remote_state_dict()
    opt = DistributedOptimizer(torch.optim.SGD, used.remote_parameters() + unused.remote_parameters(), lr=0.5)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [used(torch.ones(3, 2)).sum()])
        opt.step(context_id)
    assert not torch.equal(used.remote_state_dict()["fc.weight"], before_used["fc.weight"])
    after_unused = unused.remote_state_dict()
    assert all(torch.equal(after_unused[k], v) for k, v in before_unused.items())


# -- (7) a worker dying mid-backward / mid-step ---------------------------------------------------------------


@pytest.fixture
def victim(world: list[str]) -> Any:
    rpc.add_worker("victim")
    try:
        yield "victim", rpc.rpc_sync("victim", pid)
    finally:
        rpc.remove_worker("victim")


def _fails_fast_when_killed(victim_pid: int, run: Any) -> tuple[BaseException | None, float]:
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            run()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    time.sleep(1.0)  # the victim is now sleeping inside its part of the work
    killed = time.monotonic()
    os.kill(victim_pid, signal.SIGKILL)
    thread.join(20)
    return (outcome[0] if outcome else TimeoutError("still running")), time.monotonic() - killed


def test_a_worker_killed_mid_backward_fails_it_fast(world: list[str], victim: tuple[str, int]) -> None:
    name, victim_pid = victim
    slow = RemoteModule(f"{name}/cpu", SlowStage)
    fast = RemoteModule("worker1/cpu", TorchStage, args=(4, 4))
    contexts: list[int] = []

    def run() -> None:
        with dist_autograd.context() as context_id:
            contexts.append(context_id)
            loss = slow(fast(torch.randn(2, 4))).sum()
            dist_autograd.backward(context_id, [loss])

    error, elapsed = _fails_fast_when_killed(victim_pid, run)
    assert isinstance(error, WorkerLostError) and error.worker == name, repr(error)
    assert elapsed < 3.0, f"the backward took {elapsed:.1f} s to fail after the kill"
    assert _settle(["worker1"]) == {"driver": 0, "worker1": 0}, "the context must be released on the survivors"


def test_a_worker_killed_mid_step_fails_it_fast(world: list[str], victim: tuple[str, int]) -> None:
    name, victim_pid = victim
    stage = RemoteModule(f"{name}/cpu", TorchStage, args=(2, 2))
    other = RemoteModule("worker2/cpu", TorchStage, args=(2, 2))
    opt = DistributedOptimizer(SlowSGD, stage.remote_parameters(), lr=0.1)
    other_opt = DistributedOptimizer(torch.optim.SGD, other.remote_parameters(), lr=0.1)

    def run() -> None:
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [(stage(torch.ones(1, 2)) + other(torch.ones(1, 2))).sum()])
            other_opt.step(context_id)
            opt.step(context_id)

    error, elapsed = _fails_fast_when_killed(victim_pid, run)
    assert isinstance(error, WorkerLostError) and error.worker == name, repr(error)
    assert elapsed < 3.0
    assert _settle(["worker2"]) == {"driver": 0, "worker2": 0}


def test_autograd_module_is_importable_where_torch_is_not_loaded() -> None:
    assert importlib.import_module("nbremote.autograd").__all__ == ["backward", "context", "get_gradients",
                                                                    "last_gradient"]


@pytest.mark.parametrize("framework", ["torch", "tensorplay"])
def test_no_grad_of_the_caller_reaches_the_remote_forward(world: list[str], framework: str) -> None:
    lib = FRAMEWORKS[framework]
    stage = RemoteModule("worker1/cpu", STAGES[framework], args=(3, 2))
    x = lib.ones((4, 3))
    assert stage(x).requires_grad, "by default the remote forward records gradients, as a local one would"
    with lib.no_grad():
        out = stage(x)
        out_async = stage.forward_async(x).wait()
    assert not out.requires_grad and not out_async.requires_grad
