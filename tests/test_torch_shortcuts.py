"""The two places where nbremote calls torch more directly than torch's Python API would, both run cold
on every distributed step (``frameworks._torch``), do exactly what the API does.

* An owner's optimizer step without torch's wrappers (``plain_step``): the same update, and whatever the
  wrappers are there for -- step hooks, the profiler's range, an LR scheduler's counter -- still served,
  by the wrapped ``step`` itself whenever one of them is in use.
* A local pass's gradients by the autograd engine's own call (``gradients``): the same gradients and
  errors as ``torch.autograd.grad``, and tensor subclasses still through ``grad``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.optim.optimizer as torch_optimizer
from torch import nn

from nbremote.frameworks import gradients, optimizer_step

pytestmark = pytest.mark.timeout(60)

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "SGD momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "SGD nesterov, weight decay": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "AdamW amsgrad": lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))


def _train(model: nn.Module, step: Callable[[], Any], steps: int = 5) -> None:
    x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        ((model(x) - y) ** 2).mean().backward()
        step()


@pytest.fixture
def wrappers_ran(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the graph breaks torch's ``_use_grad_for_differentiable`` wrapper marks: two per wrapped step."""
    import torch._dynamo

    marks: list[int] = []
    original = torch._dynamo.graph_break
    monkeypatch.setattr(torch._dynamo, "graph_break", lambda *a, **k: (marks.append(1), original(*a, **k))[1])
    yield marks


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_unwrapped_step_is_the_same_update(name: str, wrappers_ran: list[int]) -> None:
    fast_model, plain_model = _model(), _model()
    fast, plain = OPTIMIZERS[name](fast_model.parameters()), OPTIMIZERS[name](plain_model.parameters())
    step = optimizer_step(fast)
    _train(fast_model, step)
    assert wrappers_ran == [], "nothing needed the wrappers: the body alone should have run"
    _train(plain_model, plain.step)
    assert wrappers_ran, "the plain step() runs through its wrappers"
    for a, b in zip(fast_model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert str(fast.state_dict()) == str(plain.state_dict())  # momentum buffers, step counts: all kept
    assert torch.is_grad_enabled(), "the caller's grad mode is restored"


def test_step_hooks_of_the_optimizer_and_global_ones_are_called(wrappers_ran: list[int]) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = optimizer_step(optimizer)
    seen: list[str] = []
    own_pre = optimizer.register_step_pre_hook(lambda *_: seen.append("pre"))
    own_post = optimizer.register_step_post_hook(lambda *_: seen.append("post"))
    _train(model, step, steps=2)
    assert seen == ["pre", "post"] * 2
    own_pre.remove()
    own_post.remove()
    seen.clear()
    global_pre = torch_optimizer.register_optimizer_step_pre_hook(lambda *_: seen.append("global pre"))
    try:
        _train(model, step, steps=1)
    finally:
        global_pre.remove()
    assert seen == ["global pre"]
    wrappers_ran.clear()
    _train(model, step, steps=1)  # no hook left: the fast way again
    assert wrappers_ran == []


def test_the_profiler_still_sees_the_step() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    step = optimizer_step(optimizer)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        _train(model, step, steps=1)
    assert "Optimizer.step#Adam.step" in {event.key for event in profile.key_averages()}


def test_an_lr_scheduler_counts_the_steps() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = optimizer_step(optimizer)  # made before the scheduler patches the instance's step
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" if the step was not counted
        _train(model, step, steps=1)
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_an_optimizer_with_its_own_step_keeps_it() -> None:
    class Clipped(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            for group in self.param_groups:
                torch.nn.utils.clip_grad_norm_(group["params"], 1.0)
            return super().step(closure)

    optimizer = Clipped(_model().parameters(), lr=0.1)
    assert optimizer_step(optimizer) == optimizer.step  # a subclass's step, not the built-in body


# -- gradients ----------------------------------------------------------------------------------------------


def _graph() -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)  # as a tensor received by RPC: a leaf
    layer = nn.Linear(6, 3)
    unused = nn.Parameter(torch.zeros(2))
    out = torch.tanh(layer(x))
    return out, [x, layer.weight, layer.bias, unused], torch.randn(4, 3)


def test_gradients_are_torchs_own() -> None:
    out, leaves, grad = _graph()
    found = gradients(torch, [out], leaves, [grad])
    expected = torch.autograd.grad([out], leaves, grad_outputs=[grad], retain_graph=True, allow_unused=True)
    assert found[-1] is None and expected[-1] is None  # an input the outputs do not depend on
    for a, b in zip(found[:-1], expected[:-1], strict=True):
        assert torch.equal(a, b)
    again = gradients(torch, [out], leaves[:1], [grad])  # the graph was retained
    assert torch.equal(again[0], expected[0])


def test_a_gradient_of_the_wrong_shape_is_refused() -> None:
    out, leaves, _ = _graph()
    with pytest.raises(RuntimeError, match=r"\[5, 3\]"):
        gradients(torch, [out], leaves, [torch.randn(5, 3)])


def test_tensor_subclasses_still_go_through_grad() -> None:
    seen: list[str] = []

    class Traced(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(getattr(func, "__name__", str(func)))
            return super().__torch_function__(func, types, args, kwargs or {})

    out, leaves, grad = _graph()
    found = gradients(torch, [out.as_subclass(Traced)], leaves[:3], [grad])
    assert "grad" in seen, "a subclass's __torch_function__ sees torch.autograd.grad, as without nbremote"
    expected = torch.autograd.grad([out], leaves[:3], grad_outputs=[grad], retain_graph=True)
    for a, b in zip(found, expected, strict=True):
        assert torch.equal(a.as_subclass(torch.Tensor), b)
