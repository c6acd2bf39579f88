"""What the notebook panel shows of a RemoteModule, and live class reloading, on real worker kernels.

``remote_summary`` is compared with the module's real state on its owner (read by functions of this
module run there); ``reload`` is checked by the weights the new module really holds. Module classes
live at this module's top level, so workers import them by name.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from nbremote import rpc
from nbremote.nn import RemoteModule
from nbremote.nn._reload import ReloadMismatchError, ReloadReport
from nbremote.nn._summary import ModuleSummary, ParameterInfo, rows, table_html, to_html, to_text

pytestmark = pytest.mark.timeout(60)


class Small(torch.nn.Module):
    def __init__(self, n: int = 4, *, hidden: int = 3) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(n, hidden)
        self.out = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x)))


class SmallPlusHead(Small):
    """Small with one more layer: reloading Small into it leaves the head as initialised."""

    def __init__(self, n: int = 4, *, hidden: int = 3) -> None:
        super().__init__(n, hidden=hidden)
        self.head = torch.nn.Linear(1, 1)


class SmallWider(torch.nn.Module):
    """``fc`` changed shape, ``out`` is gone, ``other`` is new."""

    def __init__(self, n: int = 4, *, hidden: int = 3) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(n, hidden + 2)
        self.other = torch.nn.Linear(2, 2)


class Broken(torch.nn.Module):
    def __init__(self, n: int = 4, *, hidden: int = 3) -> None:
        super().__init__()
        raise RuntimeError("a typo in the edited class")


# -- run on the owner ----------------------------------------------------------------------------------


def sgd_step(module_rref: rpc.RRef[Any]) -> None:
    """One real optimizer step on the owner (leaves gradients in .grad)."""
    module = module_rref.local_value()
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    opt.zero_grad()
    module(torch.ones(8, 4)).pow(2).sum().backward()
    opt.step()


def owner_norms(module_rref: rpc.RRef[Any]) -> dict[str, tuple[float, float | None]]:
    module = module_rref.local_value()
    return {n: (float(p.norm()), None if p.grad is None else float(p.grad.norm()))
            for n, p in module.named_parameters()}


@pytest.fixture
def net(world: list[str]) -> RemoteModule:
    torch.manual_seed(0)
    return RemoteModule("worker1/cpu", Small, args=(4,), kwargs={"hidden": 3})


# -- the summary -------------------------------------------------------------------------------------------


def test_summary_describes_the_remote_module(net: RemoteModule) -> None:
    summary = net.remote_summary()
    assert (summary.worker, summary.type_name, summary.framework, summary.device) == ("worker1", "Small", "torch",
                                                                                      "cpu")
    assert summary.training is True
    assert [(p.name, p.shape, p.dtype, p.device, p.requires_grad, p.numel) for p in summary.parameters] == [
        ("fc.weight", (3, 4), "float32", "cpu", True, 12), ("fc.bias", (3,), "float32", "cpu", True, 3),
        ("out.weight", (1, 3), "float32", "cpu", True, 3), ("out.bias", (1,), "float32", "cpu", True, 1)]
    truth = rpc.rpc_sync("worker1", owner_norms, args=(net.module_rref,))
    for p in summary.parameters:
        assert p.norm == pytest.approx(truth[p.name][0]) and p.grad_norm is None
    assert summary.numel == summary.trainable == 19 and summary.grad_norm is None


def test_norms_and_grad_norms_follow_an_optimizer_step(net: RemoteModule) -> None:
    before = {p.name: p.norm for p in net.remote_summary().parameters}
    rpc.rpc_sync("worker1", sgd_step, args=(net.module_rref,))
    after = net.remote_summary()
    truth = rpc.rpc_sync("worker1", owner_norms, args=(net.module_rref,))
    assert any(before[p.name] != pytest.approx(p.norm) for p in after.parameters)
    for p in after.parameters:
        assert (p.norm, p.grad_norm) == (pytest.approx(truth[p.name][0]), pytest.approx(truth[p.name][1]))
    assert after.grad_norm == pytest.approx(math.sqrt(sum(g**2 for _, g in truth.values() if g is not None)))


def test_summary_follows_mode_and_frozen_parameters(net: RemoteModule) -> None:
    net.eval()
    assert net.remote_summary().training is False
    rpc.rpc_sync("worker1", freeze_fc, args=(net.module_rref,))
    summary = net.remote_summary()
    assert [p.requires_grad for p in summary.parameters] == [False, False, True, True]
    assert summary.trainable == 4 and summary.numel == 19


def freeze_fc(module_rref: rpc.RRef[Any]) -> None:
    module_rref.local_value().fc.requires_grad_(False)


def test_forward_stats_count_sync_and_async_forwards(net: RemoteModule) -> None:
    assert net.forward_stats == (0, None)
    net(torch.ones(2, 4))
    net.forward_async(torch.ones(2, 4)).wait()
    stats = net.forward_stats
    assert stats.calls == 2 and stats.last_latency is not None and stats.last_latency > 0


def test_html_repr_shows_the_parameter_table(net: RemoteModule) -> None:
    page = net._repr_html_()
    assert "<b>Small</b> on <b>worker1</b>" in page and page.count("<tr>") == 1 + 4 + 1
    for name in ("fc.weight", "fc.bias", "out.weight", "out.bias"):
        assert f">{name}</td>" in page
    assert repr(net) == "RemoteModule(Small on worker1/cpu)"


def test_html_repr_of_a_handle_whose_worker_is_gone(world: list[str]) -> None:
    rpc.add_worker("shortlived")
    net = RemoteModule("shortlived/cpu", Small)
    rpc.remove_worker("shortlived")
    page = net._repr_html_()
    assert page.startswith("<pre>RemoteModule(Small on shortlived/cpu): cannot read the remote module")


# -- reloading ---------------------------------------------------------------------------------------------


def test_reload_carries_the_trained_weights_and_the_mode(net: RemoteModule) -> None:
    rpc.rpc_sync("worker1", sgd_step, args=(net.module_rref,))
    net.eval()
    trained = net.remote_state_dict()
    old_rref = net.module_rref
    report = net.reload(SmallPlusHead)
    assert isinstance(report, ReloadReport)
    assert report.loaded == ("fc.weight", "fc.bias", "out.weight", "out.bias")
    assert report.missing == ("head.weight", "head.bias") and not report.unexpected and not report.mismatched
    assert "missing from the old state, left as initialised: head.weight, head.bias" in str(report)
    assert net.module_rref is not old_rref and net.module_type == "SmallPlusHead"
    state = net.remote_state_dict()
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    assert net.training is False
    assert net(torch.ones(1, 4)).shape == (1, 1)
    assert net.remote_summary().type_name == "SmallPlusHead"


def test_reload_names_dropped_and_reshaped_keys(net: RemoteModule) -> None:
    report = net.reload(SmallWider)
    assert report.loaded == ()
    assert [m[0] for m in report.mismatched] == ["fc.weight", "fc.bias"]
    assert report.mismatched[0][1:] == ((3, 4), (5, 4))
    assert report.unexpected == ("out.weight", "out.bias") and report.missing == ("other.weight", "other.bias")
    assert "fc.weight (3, 4) -> (5, 4)" in str(report) and "not in the new class, dropped: out.weight" in str(report)


def test_reload_keeps_the_constructor_arguments(net: RemoteModule) -> None:
    net.reload(SmallPlusHead)
    assert [p.shape for p in net.remote_summary().parameters][:2] == [(3, 4), (3,)]  # hidden=3 again
    net.reload(SmallPlusHead, kwargs={"hidden": 6})
    assert [p.shape for p in net.remote_summary().parameters][:2] == [(6, 4), (6,)]


def test_a_failing_reload_leaves_the_old_module_working(net: RemoteModule) -> None:
    x = torch.ones(1, 4)
    expected, old_rref = net(x), net.module_rref
    with pytest.raises(RuntimeError, match="a typo in the edited class") as info:
        net.reload(Broken)
    assert any("the old module is still in place" in note for note in info.value.__notes__)
    assert net.module_rref is old_rref and net.module_type == "Small"
    assert torch.equal(net(x), expected)


def test_strict_reload_refuses_a_mismatch_and_keeps_the_old_module(net: RemoteModule) -> None:
    old_rref = net.module_rref
    with pytest.raises(ReloadMismatchError, match=r"head.weight.*strict=False"):
        net.reload(SmallPlusHead, strict=True)
    assert net.module_rref is old_rref
    assert net.reload(Small, strict=True).complete


def test_reload_of_a_handle_without_a_constructor_needs_one(net: RemoteModule) -> None:
    other = RemoteModule.init_from_module_rref("worker1/cpu", net.get_module_rref())
    with pytest.raises(ValueError, match="pass module_cls= and args="):
        other.reload()
    assert other.reload(Small, args=(4,)).complete


def test_reload_refuses_another_framework(net: RemoteModule) -> None:
    tensorplay = pytest.importorskip("tensorplay")
    with pytest.raises(TypeError, match="a handle keeps its framework"):
        net.reload(tensorplay.nn.Linear, args=(4, 3))


# -- pure: the renderings ----------------------------------------------------------------------------------

SUMMARY = ModuleSummary("w", "Net", "torch", "cuda:0", False, (
    ParameterInfo("fc.weight", (2, 3), "float16", "cuda:0", True, 6, 3.0, 4.0),
    ParameterInfo("fc.bias", (2,), "float16", "cuda:0", False, 2, 4.0, None)))


def test_rows_and_totals() -> None:
    assert rows(SUMMARY) == [
        ("fc.weight", "(2, 3)", "float16", "cuda:0", "yes", "6", "3", "4"),
        ("fc.bias", "(2,)", "float16", "cuda:0", "no", "2", "4", "\u2014"),
        ("total (2)", "", "", "", "6 trainable", "8", "5", "4")]


def test_text_and_html_renderings() -> None:
    text = to_text(SUMMARY)
    assert text.splitlines()[0] == "Net on w/cuda:0 (eval mode)"
    assert text.splitlines()[2].split() == ["fc.weight", "(2,", "3)", "float16", "cuda:0", "yes", "6", "3", "4"]
    page = to_html(SUMMARY)
    assert "<b>eval</b> mode" in page and table_html(SUMMARY) in page
    assert to_html(ModuleSummary("w", "<Odd>", "torch", "cpu", True, ())).count("&lt;Odd&gt;") == 1
