"""The panel, the dashboard and the wait status, without a browser: widget state after real remote changes.

Widgets are created outside a kernel (ipywidgets then uses a no-op comm), so their traits and child
widgets' values are what a frontend would be sent; every remote fact is checked on the owner.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import remote_fns as fns
import torch
from ipython_shell import open_shell, run
from test_jupyter_module import Small, owner_norms, sgd_step

import nbremote.autograd as dist_autograd
from nbremote import rpc
from nbremote.jupyter import ModulePanel, WorkerDashboard, wait_all
from nbremote.jupyter._dashboard import COLUMNS
from nbremote.nn import RemoteModule, last_report
from nbremote.optim import DistributedOptimizer

pytestmark = pytest.mark.timeout(90)


def owner_training(module_rref: rpc.RRef[Any]) -> bool:
    return bool(module_rref.local_value().training)


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def net(world: list[str]) -> RemoteModule:
    torch.manual_seed(0)
    return RemoteModule("worker1/cpu", Small, args=(4,))


@pytest.fixture
def panel(net: RemoteModule) -> Iterator[ModulePanel]:
    p = ModulePanel(net)
    yield p
    p.close()


# -- the panel -------------------------------------------------------------------------------------------------


def test_panel_shows_class_worker_device_and_parameters(panel: ModulePanel) -> None:
    assert panel.summary is not None and panel.error == ""
    assert (panel.summary.type_name, panel.summary.worker, panel.device, panel.training) == ("Small", "worker1",
                                                                                            "cpu", True)
    assert "<b>Small</b> on <b>worker1</b>" in panel.heading.value
    assert panel.table.value.count("<tr>") == 1 + 4 + 1 and "total (4)" in panel.table.value
    assert panel.mode_buttons.value == "train" and panel.device_menu.value == "cpu"
    assert list(panel.device_menu.options) == panel.devices == [d.name for d in rpc.worker_resources("worker1").devices]


def test_eval_from_the_widget_changes_the_remote_module(panel: ModulePanel, net: RemoteModule) -> None:
    panel.mode_buttons.value = "eval"  # what a click sends
    assert rpc.rpc_sync("worker1", owner_training, args=(net.module_rref,)) is False
    assert panel.training is False and panel.summary is not None and panel.summary.mode == "eval"
    panel.mode_buttons.value = "train"
    assert rpc.rpc_sync("worker1", owner_training, args=(net.module_rref,)) is True


def test_eval_in_code_shows_after_refresh(panel: ModulePanel, net: RemoteModule) -> None:
    net.eval()
    panel.refresh()
    assert panel.mode_buttons.value == "eval" and panel.training is False
    assert rpc.rpc_sync("worker1", owner_training, args=(net.module_rref,)) is False  # the refresh acted on nothing


def test_norms_change_after_a_remote_optimizer_step(panel: ModulePanel, net: RemoteModule) -> None:
    assert panel.summary is not None
    before = [p.norm for p in panel.summary.parameters]
    assert all(p.grad_norm is None for p in panel.summary.parameters)
    rpc.rpc_sync("worker1", sgd_step, args=(net.module_rref,))
    panel.refresh()
    truth = rpc.rpc_sync("worker1", owner_norms, args=(net.module_rref,))
    after = panel.summary.parameters
    assert [p.norm for p in after] != before
    assert [(p.norm, p.grad_norm) for p in after] == [pytest.approx(truth[p.name]) for p in after]
    assert f"{after[0].norm:.4g}" in panel.table.value


def test_gradient_norms_of_distributed_training_show(panel: ModulePanel, net: RemoteModule) -> None:
    """Distributed autograd keeps gradients in its context, not .grad: the panel shows the last step's."""
    local = Small(4)
    local.load_state_dict(net.remote_state_dict())
    opt = DistributedOptimizer(torch.optim.SGD, net.remote_parameters(), lr=0.5)
    x = torch.ones(8, 4)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [net(x).pow(2).sum()])
        opt.step(context_id)
    local(x).pow(2).sum().backward()
    panel.refresh()
    assert panel.summary is not None
    grad_norms = {p.name: p.grad_norm for p in panel.summary.parameters}
    assert grad_norms == {n: pytest.approx(float(p.grad.norm())) for n, p in local.named_parameters()}
    assert all(g is None for _, g in rpc.rpc_sync("worker1", owner_norms, args=(net.module_rref,)).values())


def test_a_weight_change_on_the_worker_shows(panel: ModulePanel, net: RemoteModule) -> None:
    net.remote_load_state_dict({k: torch.zeros_like(v) for k, v in net.remote_state_dict().items()})
    panel.refresh()
    assert panel.summary is not None and panel.summary.norm == 0.0


def test_forward_latency_and_count_are_shown(panel: ModulePanel, net: RemoteModule) -> None:
    net(torch.ones(2, 4))
    net(torch.ones(2, 4))
    panel.refresh()
    assert panel.forward_calls == 2 and panel.forward_latency is not None
    assert "2 forward call(s)" in panel.footer.value and " ms" in panel.footer.value


def test_device_menu_moves_the_module(panel: ModulePanel, net: RemoteModule) -> None:
    if "cuda:0" not in panel.devices:
        pytest.skip("the worker has no CUDA device: the menu lists cpu only (checked above)")
    panel.device_menu.value = "cuda:0"
    assert net.device == "cuda:0" and panel.device == "cuda:0"
    assert {p.device for p in panel.summary.parameters} == {"cuda:0"}  # type: ignore[union-attr]
    panel.device_menu.value = "cpu"
    assert net.device == "cpu"


def test_auto_refresh_keeps_the_panel_live_while_the_main_thread_is_busy(panel: ModulePanel,
                                                                        net: RemoteModule) -> None:
    panel.set_auto_refresh(True, interval=0.2)
    assert panel.auto_box.value is True and "auto-refresh every 0.2 s" in panel.footer.value
    assert panel.summary is not None
    before = panel.summary.norm
    # a "training cell": the main thread trains and sleeps, and never calls refresh
    for _ in range(3):
        rpc.rpc_sync("worker1", sgd_step, args=(net.module_rref,))
    net.eval()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (panel.summary.norm == before or panel.training):
        time.sleep(0.1)  # busy: no widget message could be handled here
    assert panel.summary.norm != before and panel.training is False and panel.mode_buttons.value == "eval"
    panel.auto_box.value = False  # the checkbox turns it off
    assert panel._ticker is None


def test_panel_of_a_dead_worker_shows_the_error(world: list[str]) -> None:
    rpc.add_worker("mortal")
    try:
        net = RemoteModule("mortal/cpu", Small)
        panel = ModulePanel(net)
        os.kill(rpc.rpc_sync("mortal", fns.pid), signal.SIGKILL)
        assert eventually(lambda: rpc.worker_status()[-1].state == "dead")
        panel.refresh()
        assert "cannot read Small on 'mortal'" in panel.error and "gone" in panel.error
        assert "color:#b00020" in panel.footer.value
        panel.mode_buttons.value = "eval"
        assert panel.error.startswith("module.eval() failed")
        panel.close()
    finally:
        rpc.remove_worker("mortal")


# -- the dashboard ------------------------------------------------------------------------------------------------


def test_dashboard_rows_describe_the_workers(world: list[str]) -> None:
    board = WorkerDashboard(auto_refresh=False)
    try:
        rows = {r["worker"]: r for r in board.rows}
        assert set(world) <= set(rows)
        row = rows["worker2"]
        assert (row["kind"], row["state"], row["devices"][0]) == ("local", "idle", "cpu")
        assert row["pid"] == rpc.rpc_sync("worker2", fns.pid) and row["rrefs"] is not None
        assert len(board.grid.children) == (len(COLUMNS) + 1) * (1 + len(rows))  # header + cells and buttons each
    finally:
        board.close()


def test_dashboard_updates_itself_and_shows_a_dead_worker(world: list[str]) -> None:
    rpc.add_worker("fragile")
    board = WorkerDashboard(interval=0.2)
    try:
        assert eventually(lambda: any(r["worker"] == "fragile" and r["state"] == "idle" for r in board.rows))
        fut = rpc.rpc_async("fragile", fns.sleep, args=(1.5,))
        assert eventually(lambda: any(r["worker"] == "fragile" and r["in_flight"] == 1 for r in board.rows))
        fut.wait()
        os.kill(rpc.rpc_sync("fragile", fns.pid), signal.SIGKILL)
        assert eventually(lambda: any(r["worker"] == "fragile" and r["state"] == "dead" for r in board.rows))
        assert "dead" in board.to_html() and "exited" in board.to_html()
    finally:
        board.close()
        rpc.remove_worker("fragile")


def test_dashboard_buttons_restart_and_stop(world: list[str]) -> None:
    rpc.add_worker("buttons")
    board = WorkerDashboard(auto_refresh=False)
    try:
        old_pid = rpc.rpc_sync("buttons", fns.pid)
        stop, restart = board._row_buttons["buttons"].children
        restart.click()

        def restarted() -> bool:
            row = {s.name: s for s in rpc.worker_status()}.get("buttons")
            return row is not None and row.state == "idle" and row.pid != old_pid

        assert eventually(restarted)
        assert rpc.rpc_sync("buttons", fns.pid) != old_pid
        stop.click()
        assert eventually(lambda: "buttons" not in [w.name for w in rpc.workers()])
        assert eventually(lambda: "buttons" not in [r["worker"] for r in board.rows])
        assert "buttons" not in board._row_cells
    finally:
        board.close()
        if "buttons" in [w.name for w in rpc.workers()]:
            rpc.remove_worker("buttons")


def test_the_dashboards_restart_button_restores_a_lost_workers_module(world: list[str]) -> None:
    rpc.add_worker("phoenix")
    board = WorkerDashboard(auto_refresh=False)
    try:
        net = RemoteModule("phoenix/cpu", torch.nn.Linear, args=(4, 2))
        saved = net.snapshot()
        os.kill(rpc.rpc_sync("phoenix", fns.pid), signal.SIGKILL)
        assert eventually(lambda: any(s.name == "phoenix" and s.state == "dead" for s in rpc.worker_status()), 30)
        _, restart = board._row_buttons["phoenix"].children
        restart.click()  # the same rpc.restart_worker: the module comes back from its snapshot

        seen: list[BaseException] = []

        def restored() -> bool:
            try:
                return bool(net(torch.ones(1, 4)).shape == (1, 2))
            except Exception as exc:
                seen[:] = [exc]
                return False

        assert eventually(restored, timeout=60), (
            f"not restored: board.error={board.error!r}; last call: {seen!r}; "
            f"report: {last_report('phoenix')!r}; status: {rpc.worker_status()!r}")
        state = net.remote_state_dict()
        assert all(torch.equal(state[k], saved.state[k]) for k in saved.state) and not board.error
    finally:
        board.close()
        if "phoenix" in [w.name for w in rpc.workers()]:
            rpc.remove_worker("phoenix")


# -- progress ------------------------------------------------------------------------------------------------------


def test_a_long_wait_shows_a_status_that_is_finalised(world: list[str]) -> None:
    with open_shell() as shell:
        ran = run(shell, "from nbremote import rpc\nimport remote_fns\n"
                         "rpc.rpc_sync('worker2', remote_fns.sleep, args=(2.8,))")
        assert ran.error is None
        texts = [d["data"]["text/plain"] for d in ran.displays]
        assert texts[0].startswith("\u23f3 waiting for sleep on worker2: ")
        assert texts[-1].startswith("\u2713 sleep on worker2 done in 2.") and ran.displays[-1]["update"]
        ran = run(shell, "rpc.rpc_sync('worker2', remote_fns.sleep, args=(0.2,))")
        assert ran.displays == []  # short waits show nothing


def test_wait_all_shows_a_progress_bar_and_returns_values(world: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    futures = [rpc.rpc_async(w, fns.sleep, args=(0.1 * i,)) for i, w in enumerate(world * 2)]
    assert wait_all(futures, desc="naps") == [0.1 * i for i in range(6)]
    err = capsys.readouterr().err
    assert "naps" in err and "6/6" in err
    with pytest.raises(ZeroDivisionError):
        wait_all([rpc.rpc_async("worker1", fns.fail, args=("zero", "boom"))])
