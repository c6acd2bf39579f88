"""Per-layer training history recorded on the owner (``nbremote.history``), on real worker kernels.

Every figure is checked against the module's real state on its owner, read by functions of this module
run there. Module classes live at this module's top level, so workers import them by name.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import tensorplay
import torch

import nbremote.autograd as dist_autograd
from nbremote import history, rpc
from nbremote.history import ModuleHistory, flags
from nbremote.nn import RemoteModule
from nbremote.optim import DistributedOptimizer

pytestmark = pytest.mark.timeout(90)


class Two(torch.nn.Module):
    """Two layers; ``scale`` multiplies ``b``'s output, so scale=0 gives ``a`` a zero gradient and nan a NaN one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * scale


class TwoTP(tensorplay.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tensorplay.manual_seed(0)
        self.a = tensorplay.nn.Linear(4, 4)
        self.b = tensorplay.nn.Linear(4, 1)

    def forward(self, x: Any) -> Any:
        return self.b(tensorplay.tanh(self.a(x)))


# -- run on the owner ----------------------------------------------------------------------------------


def owner_norms(module_rref: rpc.RRef[Any]) -> dict[str, float]:
    return {n: float(p.detach().norm()) for n, p in module_rref.local_value().named_parameters()}


def recorder_active() -> bool:
    return history.recorder.active


def set_budget(budget: float) -> float:
    """Runs on a worker: recording's share of the time between steps (1.0: every step); returns the old one."""
    old, history.recorder.budget = history.recorder.budget, budget
    return old


@pytest.fixture
def every_step(world: list[str]) -> Iterator[None]:
    """Workers record every step (the pace would thin out the fast steps of these tests)."""
    old = [rpc.rpc_sync(w, set_budget, args=(1.0,)) for w in world]
    yield
    for w, budget in zip(world, old, strict=True):
        rpc.rpc_sync(w, set_budget, args=(budget,))


def local_loop(module_rref: rpc.RRef[Any], steps: int) -> tuple[list[int], int, int]:
    """A plain torch loop in the owner's kernel (as a ``%%remote`` cell runs one): ``steps`` steps; returns the
    ring lengths and the bytes traced in this module's allocations after the first 1,000 steps and at the end."""
    import tracemalloc

    module = module_rref.local_value()
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    x = torch.ones(2, 4)
    tracemalloc.start()
    try:
        first = 0
        for i in range(steps):
            opt.zero_grad()
            module(x).sum().backward()
            opt.step()
            if i == 999:
                first = _traced()
        last = _traced()
    finally:
        tracemalloc.stop()
    rings = [len(p.norm) for p in history.recorder.history(module, None).parameters]
    return rings, first, last


def _traced() -> int:
    import tracemalloc

    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, history.__file__)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


# -- helpers on the driver ----------------------------------------------------------------------------------


def train(net: RemoteModule, steps: int, scale: float = 1.0, lr: float = 0.1) -> None:
    lib = torch if net.framework == "torch" else tensorplay
    opt = DistributedOptimizer(lib.optim.SGD, net.remote_parameters(), lr=lr)
    x = lib.ones(8, 4)
    for _ in range(steps):
        with dist_autograd.context() as ctx:
            out = net(x, scale) if scale != 1.0 else net(x)
            dist_autograd.backward(ctx, [out.sum()])
            opt.step(ctx)


def points(h: ModuleHistory) -> dict[str, int]:
    return {p.name: len(p.norm) for p in h.parameters}


@pytest.fixture
def net(world: list[str], every_step: None) -> RemoteModule:
    return RemoteModule("worker3/cpu", Two)


# -- recording follows the watch ----------------------------------------------------------------------------


def test_nothing_is_recorded_until_a_reader_watches(net: RemoteModule) -> None:
    train(net, 2)
    h = net.remote_history()
    assert not h.recording and points(h) == {"a.weight": 0, "a.bias": 0, "b.weight": 0, "b.bias": 0}
    assert not rpc.rpc_sync("worker3", recorder_active)


def test_each_step_records_norm_gradient_norm_and_update_ratio(net: RemoteModule) -> None:
    assert net.remote_history(lease=30).recording
    before = rpc.rpc_sync("worker3", owner_norms, args=(net.module_rref,))
    train(net, 3)
    h = net.remote_history(lease=0)
    after = rpc.rpc_sync("worker3", owner_norms, args=(net.module_rref,))
    assert points(h) == {"a.weight": 3, "a.bias": 3, "b.weight": 3, "b.bias": 3}
    for name, value in after.items():
        p = h.parameter(name)
        assert p.step == (0, 1, 2)
        assert p.norm[-1] == pytest.approx(value, rel=1e-5)
        assert all(g > 0 for g in p.grad_norm)
        assert all(0 < u < math.inf for u in p.update_ratio)
    # the first update of b.bias is lr * its gradient (SGD): |dw| = 0.1 * |g|, relative to |w| before
    bias = h.parameter("b.bias")
    assert bias.update_ratio[0] == pytest.approx(0.1 * bias.grad_norm[0] / before["b.bias"], rel=1e-4)
    assert not h.recording and not h.flagged


def test_each_layers_output_is_recorded_at_each_forward(net: RemoteModule) -> None:
    x = torch.linspace(-1, 1, 32).reshape(8, 4)
    net(x)  # not watched: nothing recorded
    net.remote_history(lease=30)
    net(x)
    net(2 * x)
    h = net.remote_history(lease=0)
    net(x)  # not watched any more: the hooks are gone
    local = Two()
    local.load_state_dict(net.remote_state_dict())
    a = local.a(x).detach()
    layers = {act.name: act for act in net.remote_history().activations}
    assert set(layers) == {"a", "b"} and [len(act.mean) for act in h.activations] == [2, 2]
    assert layers["a"].mean[0] == pytest.approx(float(a.mean()), abs=1e-6)
    assert layers["a"].std[0] == pytest.approx(float(a.std(correction=0)), rel=1e-5)
    assert layers["a"].mean[1] != layers["a"].mean[0]


def test_a_lapsed_lease_stops_recording_and_removes_the_hooks(net: RemoteModule) -> None:
    net.remote_history(lease=0.3)
    assert rpc.rpc_sync("worker3", recorder_active)
    time.sleep(0.6)
    train(net, 2)  # the first step notices the lapsed lease
    h = net.remote_history()
    assert not h.recording and set(points(h).values()) == {0}
    assert not rpc.rpc_sync("worker3", recorder_active)


def test_each_reader_has_its_own_lease(net: RemoteModule) -> None:
    assert net.remote_history(lease=30, reader="panel A").recording
    assert net.remote_history(lease=30, reader="panel B").recording
    assert net.remote_history(lease=0, reader="panel A").recording  # B still watches: closing A leaves it
    train(net, 1)
    assert not net.remote_history(lease=0, reader="panel B").recording
    assert len(net.remote_history().parameter("a.weight").norm) == 1


def test_the_ring_is_bounded_and_memory_flat_over_10000_steps(net: RemoteModule) -> None:
    net.remote_history(lease=120)
    try:
        rings, first, last = rpc.rpc_sync("worker3", local_loop, args=(net.module_rref, 10_000), timeout=80)
    finally:
        net.remote_history(lease=0)
    assert rings == [history.STEPS] * 4
    # what history.py holds after 1,000 steps is what it holds after 10,000: full rings, nothing growing
    assert last - first < 4096, (first, last)
    assert net.remote_history().parameter("a.weight").step[-1] == 9_999


def test_a_nan_gradient_is_flagged(net: RemoteModule) -> None:
    net.remote_history(lease=30)
    train(net, 1, scale=math.nan)
    h = net.remote_history(lease=0)
    assert h.flagged == {"a.weight": ("nonfinite",), "a.bias": ("nonfinite",), "b.weight": ("nonfinite",),
                         "b.bias": ("nonfinite",)}


def test_a_zero_gradient_is_flagged_vanishing(net: RemoteModule) -> None:
    net.remote_history(lease=30)
    train(net, 2, scale=0.0)
    h = net.remote_history(lease=0)
    assert h.flagged == {"a.weight": ("vanishing",), "a.bias": ("vanishing",), "b.weight": ("vanishing",),
                         "b.bias": ("vanishing",)}
    assert h.parameter("a.weight").update_ratio == (0.0, 0.0)


def test_the_pace_thins_out_a_fast_loop_and_says_which_steps(world: list[str]) -> None:
    net = RemoteModule("worker3/cpu", Two)
    net.remote_history(lease=60)
    try:
        rings, _, _ = rpc.rpc_sync("worker3", local_loop, args=(net.module_rref, 3_000), timeout=80)
    finally:
        steps = net.remote_history(lease=0).parameter("a.weight").step
    # a local step takes well under a millisecond: recording each would cost far more than 1 % of it
    assert 0 < rings[0] < 3_000 and len(steps) == rings[0]
    assert steps[0] == 0 and list(steps) == sorted(set(steps)) and steps[-1] > 2_000


def test_flag_thresholds() -> None:
    assert flags(()) == ()
    assert flags((1.0, math.inf)) == ("nonfinite",)
    assert flags((1.0,), (math.nan,)) == ("nonfinite",)
    assert flags((1.0, 0.0)) == ("vanishing",)
    assert flags((1.0, 5e-8)) == ("vanishing",)
    assert flags((2e3,)) == ("exploding",)
    assert flags((1.0,) * 8 + (25.0,)) == ("exploding",)  # 25x the median of the 8 before
    assert flags((1.0,) * 7 + (25.0,)) == ()  # too few before it to judge a spike
    assert flags((1.0,) * 8 + (15.0,)) == ()


def test_tensorplay_modules_record_too(every_step: None) -> None:
    net = RemoteModule("worker2/cpu", TwoTP)
    net.remote_history(lease=30)
    train(net, 3)
    h = net.remote_history(lease=0)
    after = rpc.rpc_sync("worker2", owner_norms, args=(net.module_rref,))
    assert points(h) == {"a.weight": 3, "a.bias": 3, "b.weight": 3, "b.bias": 3}
    assert h.parameter("b.weight").norm[-1] == pytest.approx(after["b.weight"], rel=1e-5)
    assert all(u > 0 for p in h.parameters for u in p.update_ratio)
    assert [(a.name, len(a.std)) for a in h.activations] == [("a", 3), ("b", 3)]


def worker_trains(net: RemoteModule, steps: int) -> None:
    """Runs on another worker: the training loop, against the module on its owner."""
    train(net, steps)


def test_a_training_loop_on_a_worker_is_recorded(net: RemoteModule) -> None:
    net.remote_history(lease=30)
    rpc.rpc_sync("worker2", worker_trains, args=(net, 2))
    assert points(net.remote_history(lease=0)) == {"a.weight": 2, "a.bias": 2, "b.weight": 2, "b.bias": 2}


def test_logged_metrics_arrive_in_order_wherever_the_loop_runs(net: RemoteModule) -> None:
    for i in range(5):
        net.log(loss=torch.tensor(1.0 / (i + 1)), step=i)
    rpc.rpc_sync("worker2", _log_there, args=(net,))
    # notifications need not be served before a later call: wait until all six points are there
    deadline = time.monotonic() + 10
    while len(net.remote_history().metrics.get("loss", ())) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    metrics = net.remote_history().metrics
    assert [v for _, v in metrics["loss"]] == pytest.approx([1.0, 0.5, 1 / 3, 0.25, 0.2, 0.125])
    assert [v for _, v in metrics["step"]] == [0, 1, 2, 3, 4]
    with pytest.raises(TypeError, match=r"log\(loss=...\) takes a number"):
        net.log(loss="low")


def _log_there(net: RemoteModule) -> None:
    net.log(loss=0.125)
