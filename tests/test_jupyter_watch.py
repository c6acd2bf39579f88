"""Watching training without a browser: the module panel's history, the dashboard's live figures and task
stream, and the SVG they are drawn with.

Widgets are created outside a kernel (ipywidgets then uses a no-op comm): their traits and HTML values are
what a frontend would be sent. Recording is checked on the owner.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator

import pytest
import torch
from test_history import Two, every_step, train  # noqa: F401 (every_step: a fixture)

from nbremote import rpc
from nbremote.history import LEASE, ModuleHistory, ParameterHistory
from nbremote.jupyter import ModulePanel, WorkerDashboard
from nbremote.jupyter._activity import ActivityTrack
from nbremote.jupyter._history_view import metrics_html, parameter_columns
from nbremote.jupyter._svg import chart, sparkline, timeline
from nbremote.nn import ModuleSummary, ParameterInfo, RemoteModule

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("every_step")]  # each step recorded


@pytest.fixture
def net(world: list[str]) -> RemoteModule:
    return RemoteModule("worker3/cpu", Two)


@pytest.fixture
def panel(net: RemoteModule) -> Iterator[ModulePanel]:
    p = ModulePanel(net)
    yield p
    p.close()


def sparks(markup: str) -> list[str]:
    return re.findall(r'<svg class="nbremote-spark"[^>]*>.*?<polyline points="([^"]*)"', markup)


def test_a_live_panel_records_and_draws_each_step(panel: ModulePanel, net: RemoteModule) -> None:
    assert panel.history is not None and not panel.history.recording  # not live: nothing is recorded
    panel.set_auto_refresh(True, interval=0.2)
    assert panel.history.recording and "recorded on the worker as it trains" in panel.footer.value
    train(net, 3)
    deadline = time.monotonic() + 10
    while len(panel.history.parameter("a.weight").norm) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {p.name: len(p.norm) for p in panel.history.parameters} == {"a.weight": 3, "a.bias": 3, "b.weight": 3,
                                                                        "b.bias": 3}
    drawn = sparks(panel.table.value.split("nbremote-activations")[0])  # the parameter table's
    assert len(drawn) == 4 * 3 and all(len(points.split()) == 3 for points in drawn)
    assert "history: 3 step(s)" in panel.footer.value
    assert 'class="nbremote-activations"' in panel.table.value and "mean, last 3 forwards" in panel.table.value
    panel.set_auto_refresh(False)  # stops the owner's recording at once
    assert not net.remote_history().recording
    train(net, 1)
    assert len(net.remote_history().parameter("a.weight").norm) == 3


def test_closing_a_live_panel_stops_recording(net: RemoteModule) -> None:
    panel = ModulePanel(net, auto_refresh=True, interval=5)
    assert net.remote_history().recording
    panel.close()
    assert not net.remote_history().recording


def test_a_panel_no_frontend_shows_any_more_stops_renewing(panel: ModulePanel) -> None:
    panel.set_auto_refresh(True, interval=1)
    assert panel._lease() == LEASE
    panel._view_count = 1  # what the frontend reports when it shows the panel
    assert panel._lease() == LEASE
    panel._view_count = 0  # the output was cleared, the notebook closed
    assert panel._lease() is None


def test_flags_and_metrics_show_in_the_panel(panel: ModulePanel, net: RemoteModule) -> None:
    panel.set_auto_refresh(True, interval=5)
    train(net, 1, scale=math.nan)
    for i in range(4):
        net.log(loss=1.0 / (i + 1))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (not panel.flagged or len(panel.history.metrics.get("loss", ())) < 4):
        time.sleep(0.05)
        panel.refresh()
    assert panel.flagged == {name: ("nonfinite",) for name in ("a.weight", "a.bias", "b.weight", "b.bias")}
    assert panel.table.value.count('data-flag="nonfinite"') == 4 and "NaN/inf gradient" in panel.table.value
    assert 'data-metric="loss" data-n="4" data-last="0.25"' in panel.metrics.value


# -- the dashboard ----------------------------------------------------------------------------------------------


def stream_on() -> bool:
    from nbremote.rpc._core import current_agent

    return current_agent().server.tasks.on


def forward_there(net: RemoteModule) -> None:
    net(torch.ones(2, 4))


def test_the_task_stream_shows_the_forward_on_its_worker_and_who_called(net: RemoteModule) -> None:
    board = WorkerDashboard(auto_refresh=False, window=60)
    try:
        assert rpc.rpc_sync("worker3", stream_on)
        net(torch.ones(2, 4))
        rpc.rpc_sync("worker2", forward_there, args=(net,))
        # A worker records a task once the call has replied (the reply goes first): the read just after a
        # reply may come before that, and the next refresh shows it.
        deadline = time.monotonic() + 5
        board.refresh()
        while time.monotonic() < deadline and not any(t[2] == "forward_there" for t in board.tasks["worker2"]):
            time.sleep(0.05)
            board.refresh()
        ran = [(what, caller) for _, _, what, caller in board.tasks["worker3"]]
        assert ("Two.forward", "driver") in ran and ("Two.forward", "worker2") in ran
        assert ("forward_there", "driver") in [(w, c) for _, _, w, c in board.tasks["worker2"]]
        lane = re.search(r'data-worker="worker3">(.*?)</g>', board.stream.value)
        assert lane is not None and 'data-task="Two.forward"' in lane.group(1)
        assert "dashboard_activity" not in board.stream.value  # the dashboard's own reads are not drawn
        row = {r["worker"]: r for r in board.rows}["worker3"]
        assert row["rss"] > 10 * 2**20 and row["cpu"] is not None and row["calls_per_s"] is not None
        assert "Two.forward" in board.to_html()
    finally:
        board.close()
    assert not rpc.rpc_sync("worker3", stream_on) and not rpc.rpc_sync("worker2", stream_on)


def waits_for_a_device() -> None:
    time.sleep(0.05)  # waiting for the device: part of the call, not of the device's task
    with rpc.task("device"):
        time.sleep(0.1)


def test_a_call_marks_part_of_itself_as_a_task(world: list[str]) -> None:
    board = WorkerDashboard(auto_refresh=False, window=60)
    try:
        rpc.rpc_sync("worker2", waits_for_a_device)
        board.refresh()
        ran = {what: (seconds, caller) for _, seconds, what, caller in board.tasks["worker2"]}
        assert ran["device"][1] == "driver" and 0.1 <= ran["device"][0] < ran["waits_for_a_device"][0]
        fresh = WorkerDashboard(auto_refresh=False, window=60, fresh=True)  # shows only what ends from now on
        assert "device" not in [what for _, _, what, _ in fresh.tasks["worker2"]]
        fresh.close()  # ends its own lease: the first dashboard's holds
        assert rpc.rpc_sync("worker2", stream_on)
    finally:
        board.close()
    with rpc.task("not recorded"):  # the driver's stream: nobody reads it
        pass


def test_the_stream_is_empty_until_a_worker_answers_a_read(world: list[str]) -> None:
    """A worker whose reads all failed so far (one restarting: its read timed out) has a lane but no read to
    place it by: the stream waits, the dashboard's refresh goes on (it used to die in its thread)."""
    board = WorkerDashboard(auto_refresh=False, window=60)
    try:
        board._activity = {"worker2": ActivityTrack()}  # as a failed first read leaves it
        board.tasks = {"worker2": []}
        assert board.stream_html() == ""
    finally:
        board.close()


def test_activity_track_figures_and_window() -> None:
    def read(wall: float, cpu: float, served: int, tasks: list[rpc.Task]) -> rpc.WorkerActivity:
        return rpc.WorkerActivity("w", wall, cpu, 1, (), served, tuple(tasks))

    track = ActivityTrack()
    old, new = rpc.Task(90.0, 0.5, "f", "driver"), rpc.Task(99.0, 0.5, "g", "driver")
    track.add(read(100.0, 1.0, 10, [old, new]), window=5.0)
    assert track.cpu_percent is None and track.in_view() == [new]  # old ended before the window
    assert track.since == 99.0
    track.add(read(102.0, 2.0, 30, [new]), window=5.0)  # reads overlap: a task is kept once
    assert track.cpu_percent == 50.0 and track.calls_per_s == 10.0 and track.in_view() == [new]


# -- pure renderings -----------------------------------------------------------------------------------------------


def test_sparkline_scales_to_its_range_and_marks_a_nonfinite_end() -> None:
    points = sparks(sparkline([1.0, 2.0, 3.0], width=100, height=20))[0].split()
    assert points == ["2.0,18.0", "50.0,10.0", "98.0,2.0"]
    assert "<circle" not in sparkline([1.0, 2.0])
    marked = sparkline([1.0, math.nan])
    assert "<circle" in marked and len(sparks(marked)[0].split()) == 1
    assert sparks(sparkline([1e-6, 1e-3, 1.0], log=True, width=100, height=20))[0].split()[1] == "50.0,10.0"


def test_chart_uses_a_log_scale_for_values_spanning_decades() -> None:
    assert "(log)" in chart("loss", [(0.0, 10.0), (1.0, 0.01)])
    assert "(log)" not in chart("acc", [(0.0, 0.5), (1.0, 0.9)])
    assert 'data-last="0.9"' in chart("acc", [(0.0, 0.5), (1.0, 0.9)])


def test_parameter_columns_and_metrics_html() -> None:
    h = ModuleHistory("w", True, (ParameterHistory("fc.weight", (0, 1), (1.0, 1.1), (0.5, 0.0), (0.1, 0.0)),),
                      {"loss": ((0.0, 1.0), (1.0, 0.5))})
    columns = parameter_columns(h, ["fc.weight", "fc.bias"])
    assert list(columns) == ["L2 norm", "grad norm", "update |\u0394w|/|w|", "flags"]
    assert "vanishing gradient" in columns["flags"][0] and columns["flags"][1] == ""
    assert columns["L2 norm"][1] == ""  # a parameter with no record yet
    table = ModuleSummary("w", "Net", "torch", "cpu", True, (
        ParameterInfo("fc.weight", (2,), "float32", "cpu", True, 2, 1.1, 0.0),
        ParameterInfo("fc.bias", (1,), "float32", "cpu", True, 1, 1.0, None)), h).table_html(columns)
    heads = re.findall(r"<th[^>]*>([^<]*)</th>", table)
    assert heads[-2:] == ["update |\u0394w|/|w|", "flags"] and heads.count("L2 norm") == 1
    assert table.count('class="nbremote-spark"') == 3  # norm, grad norm and update of fc.weight
    assert metrics_html(ModuleHistory("w", False)) == "" and 'data-metric="loss"' in metrics_html(h)


def test_timeline_draws_a_bar_per_task_in_its_window() -> None:
    svg = timeline([("worker1", [(99.0, 0.5, "Stage.forward", "driver"), (80.0, 0.1, "old", "driver")]),
                    ("worker2", [])], now=100.0, window=10.0)
    assert svg.count("<rect") == 1 and 'data-task="Stage.forward"' in svg
    assert "Stage.forward \u00b7 1 call \u00b7 500.0 ms busy \u00b7 from driver" in svg
    # 10,000 calls of 0.1 ms in the window: a bar per run of 2-pixel buckets, not one per call
    many = [(90.0 + i * 0.001, 0.0001, "f" if i % 2 else "g", "driver") for i in range(10_000)]
    assert timeline([("w", many)], now=100.0, window=10.0).count("<rect") <= 640 // 2
    # four micro-batches back to back, each wide enough to see: four bars, not one
    batches = [(99.0 + 0.064 * i, 0.064, "device", "driver") for i in range(4)]
    assert timeline([("w", batches)], now=100.0, window=1.0).count('data-task="device"') == 4
    assert 'data-worker="worker2"' in svg
