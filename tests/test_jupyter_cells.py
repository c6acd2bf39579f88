"""``rpc.run_cell``: notebook code run in worker kernels' own namespaces, output streamed back.

Output is observed in two ways: through ``on_output`` (what arrived, and when), and through the default
handler, which writes labelled text on this process's stdout / stderr (captured with ``capfd``-style
``capsys``).
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from typing import Any

import pytest
import remote_fns as fns

from nbremote import rpc
from nbremote.rpc._driver.cells import _StopButton

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """An ``on_output`` handler that keeps every message with the time it arrived."""

    def __init__(self) -> None:
        self.messages: list[tuple[float, str, str, dict[str, Any]]] = []

    def __call__(self, worker: str, msg_type: str, content: dict[str, Any]) -> None:
        self.messages.append((time.monotonic(), worker, msg_type, content))

    def text(self, worker: str) -> str:
        return "".join(c.get("text", "") for _, w, t, c in self.messages if w == worker and t == "stream")


def test_cells_run_in_the_workers_own_namespace(world: list[str]) -> None:
    rec = Recorder()
    rpc.run_cell(["worker1", "worker2"], "import os\ncounter = globals().get('counter', 0) + 1", on_output=rec)
    rpc.run_cell("worker1", "counter += 10", on_output=rec)
    rpc.run_cell(["worker1", "worker2"], "print(counter, os.getpid())", on_output=rec)
    assert rec.text("worker1").split()[0] == "11" and rec.text("worker2").split()[0] == "1"
    assert int(rec.text("worker1").split()[1]) == rpc.rpc_sync("worker1", fns.pid)


def test_default_output_is_labelled_per_worker(world: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    run = rpc.run_cell(["worker1", "worker2"], "import sys\nprint('hi')\nprint('oops', file=sys.stderr)\n6 * 7")
    out, err = capsys.readouterr()
    assert "[worker1] hi\n" in out and "[worker2] hi\n" in out
    assert "[worker1] oops\n" in err and "[worker2] oops\n" in err
    assert "Out[" in out and "]: 42" in out
    assert {o.status for o in run.outcomes.values()} == {"ok"}


def test_output_streams_while_the_cell_runs(world: list[str]) -> None:
    rec = Recorder()
    rpc.run_cell("worker3", "import time\nprint('first', flush=True)\ntime.sleep(1.5)\nprint('second')",
                 on_output=rec)
    ended = time.monotonic()
    first = next(t for t, _, kind, c in rec.messages if kind == "stream" and "first" in c["text"])
    assert ended - first > 1.0, "the first line arrived only when the cell ended"


def test_rich_displays_and_widget_fallbacks_arrive(world: list[str]) -> None:
    rec = Recorder()
    code = ("from IPython.display import HTML, display\n"
            "display(HTML('<b>bold</b>'))\n"
            "import ipywidgets\n"
            "display(ipywidgets.IntSlider(3))\n")
    rpc.run_cell("worker1", code, on_output=rec)
    bundles = [c["data"] for _, _, kind, c in rec.messages if kind == "display_data"]
    assert bundles[0]["text/html"] == "<b>bold</b>"
    assert "IntSlider" in bundles[1]["text/plain"]


def test_an_error_fails_the_run_and_names_the_worker(world: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(rpc.RemoteCellError, match=r"worker2: ZeroDivisionError: division by zero") as info:
        rpc.run_cell(["worker1", "worker2"], "import os\nif os.environ.get('X') is None and "
                     "__import__('nbremote').rpc.get_worker_info().name == 'worker2': 1 / 0")
    assert info.value.worker == "worker2"
    assert info.value.outcomes["worker1"].status == "ok"
    assert info.value.outcomes["worker2"].ename == "ZeroDivisionError"
    assert info.value._render_traceback_() == [f"RemoteCellError: {info.value}"]
    err = capsys.readouterr().err
    assert "[worker2]" in err and "ZeroDivisionError" in err and "[worker1]" not in err


def test_background_run_returns_a_handle_and_rpcs_are_served_meanwhile(world: list[str]) -> None:
    rec = Recorder()
    run = rpc.run_cell("worker2", "import time\ntime.sleep(1.5)\nprint('finished')", background=True, on_output=rec)
    assert not run.done() and "running" in repr(run)
    t0 = time.monotonic()
    assert rpc.rpc_sync("worker2", fns.add, args=(1, 2)) == 3
    assert time.monotonic() - t0 < 1.0, "an RPC waited behind the running cell"
    with pytest.raises(TimeoutError, match="still running on worker2"):
        run.wait(0.1)
    outcomes = run.wait(10)
    assert outcomes["worker2"].status == "ok" and rec.text("worker2") == "finished\n"
    assert "done" in repr(run)


@pytest.fixture
def stop_button() -> None:
    """The stop button's SIGINT reaches Python's own handler, as in a kernel running a cell: a handler an
    earlier test left installed fails here at once, rather than as a cell that runs on to the timeout."""
    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.SIG_IGN:  # inherited: e.g. pytest started as a background job of a script
        pytest.skip("this test run ignores SIGINT (started in the background by a shell without job control?), "
                    "so the stop button cannot reach it; runs where pytest is started in the foreground")
    assert handler is signal.default_int_handler, f"SIGINT's handler is {handler!r}: an earlier test left it set"


@pytest.mark.usefixtures("stop_button")
def test_the_stop_button_interrupts_the_remote_cell(world: list[str]) -> None:
    rec = Recorder()
    timer = threading.Timer(0.7, os.kill, args=(os.getpid(), signal.SIGINT))  # what the stop button does
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        rpc.run_cell("worker3", "import time\nfor _ in range(600): time.sleep(0.1)", on_output=rec)
    assert time.monotonic() - t0 < 5
    errors = [c for _, _, kind, c in rec.messages if kind == "error"]
    assert errors and errors[0]["ename"] == "KeyboardInterrupt"
    assert rpc.run_cell("worker3", "1", on_output=rec).outcomes["worker3"].status == "ok"


class _PressesStopInItsFinalizer:
    """Garbage whose finalizer is running when the stop button is pressed: Python raises the KeyboardInterrupt
    in the finalizer, and drops it there ("Exception ignored in ..."), as it drops any finalizer's error."""

    def __init__(self) -> None:
        self.cycle = self  # reclaimed by the cyclic collector, in whichever thread allocates at the time

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the press: Python runs the SIGINT handler before kill returns


@pytest.mark.usefixtures("stop_button")
def test_the_stop_button_stops_the_cell_when_its_interrupt_lands_in_a_finalizer(world: list[str]) -> None:
    """Issue 38: in a long session the collector runs finalizers in the waiting thread at any moment; a
    press that lands in one must stop the cell all the same, not be dropped with the finalizer's error."""
    rec = Recorder()

    def collect_on_first_output(worker: str, msg_type: str, content: dict[str, Any]) -> None:
        rec(worker, msg_type, content)
        if msg_type == "stream" and "ready" in content.get("text", ""):
            _PressesStopInItsFinalizer()
            gc.collect()  # its finalizer runs here, in run_cell's waiting thread

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        rpc.run_cell("worker3", "import time\nprint('ready', flush=True)\nfor _ in range(150): time.sleep(0.1)",
                     on_output=collect_on_first_output)
    assert time.monotonic() - t0 < 10, "the press was noticed only when the cell ended"
    errors = [c for _, _, kind, c in rec.messages if kind == "error"]
    assert errors and errors[0]["ename"] == "KeyboardInterrupt"
    assert rpc.run_cell("worker3", "1", on_output=rec).outcomes["worker3"].status == "ok"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "run_cell left its handler installed"


@pytest.mark.usefixtures("stop_button")
def test_the_stop_buttons_handler_counts_a_press_raises_at_the_second_and_is_put_back() -> None:
    with _StopButton() as button:
        signal.raise_signal(signal.SIGINT)  # counted, for the loop's next poll; nothing raised where it lands
        assert button.presses == 1
        with pytest.raises(KeyboardInterrupt):  # pressed again: out of whatever holds the thread
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def theirs(signum: int, frame: object) -> None:
        del signum, frame

    previous = signal.signal(signal.SIGINT, theirs)
    try:
        with _StopButton():  # a handler someone installed keeps the decision
            assert signal.getsignal(signal.SIGINT) is theirs
        assert signal.getsignal(signal.SIGINT) is theirs
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_worker_dying_mid_cell_ends_the_run(world: list[str]) -> None:
    rpc.add_worker("doomed")
    try:
        pid = rpc.rpc_sync("doomed", fns.pid)
        run = rpc.run_cell("doomed", "import time\ntime.sleep(30)", background=True, on_output=lambda *a: None)
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(rpc.RemoteCellError, match="doomed: lost"):
            run.wait(10)
    finally:
        rpc.remove_worker("doomed")


def test_bad_arguments(world: list[str]) -> None:
    with pytest.raises(ValueError, match="driver itself"):
        rpc.run_cell("driver", "1")
    with pytest.raises(ValueError, match="at least one worker"):
        rpc.run_cell([], "1")
    with pytest.raises(ValueError, match="twice"):
        rpc.run_cell(["worker1", 1], "1")
