"""The magics, parsed and executed in an IPython shell with real worker kernels.

Cells run in an in-process ``InteractiveShell`` with ``%load_ext nbremote`` (see ``ipython_shell``);
what they print and display is captured. Bad lines are checked for their one-line usage error; the
parsers themselves are also tested on plain strings.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import pytest
import remote_fns as fns
from conftest import run_script
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from ipython_shell import Ran, open_shell, run

from nbremote import rpc
from nbremote.jupyter._parse import (
    USAGE,
    BuildCommand,
    MagicUsageError,
    ReloadCommand,
    parse_cell,
    parse_module,
    parse_workers,
)
from nbremote.nn import RemoteModule

pytestmark = pytest.mark.timeout(90)

NET_CELL = """
import torch
class Net(torch.nn.Module):
    def __init__(self, n=4, hidden=3):
        super().__init__()
        self.fc = torch.nn.Linear(n, hidden)
    def forward(self, x):
        return self.fc(x)
"""


@pytest.fixture(scope="module")
def shell(world: list[str]) -> Iterator[InteractiveShell]:
    with open_shell() as sh:
        assert run(sh, NET_CELL).error is None
        yield sh


def ok(ran: Ran) -> Ran:
    assert ran.error is None, f"{ran.error!r}\n{ran.out}\n{ran.err}"
    return ran


# -- every bad line gets a one-line usage error ---------------------------------------------------------------

BAD_LINES = [
    ("%remote_workers frobnicate", "unknown action 'frobnicate'", "remote_workers"),
    ("%remote_workers start", "'start' needs at least one worker name", "remote_workers"),
    ("%remote_workers start w --kernel", "option --kernel needs a value", "remote_workers"),
    ("%remote_workers start w --kernel k --attach f.json", "pick one", "remote_workers"),
    ("%remote_workers start a b --attach f.json", "attach one worker at a time", "remote_workers"),
    ("%remote_workers start w --ssh host", "give --attach CONNECTION_FILE too", "remote_workers"),
    ("%remote_workers stop w --kernel k", "unknown option '--kernel' for 'stop'", "remote_workers"),
    ("%remote_workers start 'unclosed", "cannot split", "remote_workers"),
    ("%remote_module", "missing the worker and the class", "remote_module"),
    ("%remote_module worker1/cpu", "missing the class to build on worker1/cpu", "remote_module"),
    ("%remote_module worker1/gpu Net", "unknown device 'gpu'", "remote_module"),
    ("%remote_module a/b/c Net", "more than one '/'", "remote_module"),
    ("%remote_module worker1/cpu Net(", "is not a Python expression", "remote_module"),
    ("%remote_module --reload", "--reload needs the variable holding the module", "remote_module"),
    ("%remote_module --frob net", "unknown option '--frob'", "remote_module"),
    ("%%remote\nprint(1)", "name at least one worker", "remote"),
    ("%%remote --fast worker1\nprint(1)", "unknown option '--fast'", "remote"),
    ("%%remote worker1 worker1\nprint(1)", "named twice", "remote"),
]


@pytest.mark.parametrize(("line", "problem", "magic"), BAD_LINES, ids=[b[0] for b in BAD_LINES])
def test_bad_lines_get_a_one_line_usage_error(shell: InteractiveShell, line: str, problem: str, magic: str) -> None:
    ran = run(shell, line)
    assert isinstance(ran.error, UsageError)
    lines = ran.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("UsageError: ") and problem in lines[0]
    assert lines[0].endswith(f"Usage: {USAGE[magic]}")
    assert "Traceback" not in ran.out + ran.err


@pytest.mark.parametrize(("line", "message"), [
    ("%remote_module worker1/cpu Undefined", "'Undefined' is not defined in this notebook"),
    ("%remote_module worker1/cpu Net(1 / 0)", "evaluating '1 / 0' failed: ZeroDivisionError"),
    ("%remote_module worker1/cpu 42", "'42' is a int, not a Module class or factory"),
    ("%remote_module --reload nothing_here", "'nothing_here' holds nothing, not a RemoteModule"),
    ("%remote_workers start worker1", "worker1 already in the world"),
])
def test_lines_that_parse_but_cannot_run_get_a_usage_error(shell: InteractiveShell, line: str, message: str) -> None:
    ran = run(shell, line)
    assert isinstance(ran.error, UsageError) and message in ran.err and "Traceback" not in ran.out + ran.err


def test_api_errors_in_magics_are_one_line(shell: InteractiveShell) -> None:
    ran = run(shell, "%remote_workers stop nobody")
    assert type(ran.error).__name__ == "UnknownWorkerError"
    shown = (ran.out + ran.err).strip().splitlines()
    assert shown == ["UnknownWorkerError: no worker 'nobody' to remove (known: driver, worker1, worker2, worker3)"] \
        or (len(shown) == 1 and shown[0].startswith("UnknownWorkerError: no worker 'nobody'"))


def test_a_constructor_error_shows_the_workers_traceback_and_one_line(shell: InteractiveShell) -> None:
    ran = run(shell, "%remote_module worker1/cpu Net(hidden=-1)")
    shown = ran.out + ran.err
    assert isinstance(ran.error, RuntimeError)
    assert "Traceback on worker 'worker1':" in shown and "negative dimension" in shown
    assert "_magics.py" not in shown and "interactiveshell.py" not in shown


# -- %remote_module ------------------------------------------------------------------------------------------


def test_remote_module_builds_from_the_notebooks_class_with_evaluated_arguments(shell: InteractiveShell) -> None:
    ok(run(shell, "width = 5\nnet = %remote_module worker1/cpu Net(4, hidden=width)"))
    net = shell.user_ns["net"]
    assert isinstance(net, RemoteModule) and net.remote_device == "worker1/cpu"
    assert [p.shape for p in net.remote_summary().parameters] == [(5, 4), (5,)]
    ok(run(shell, "args = (3,)\nkw = {'hidden': 2}\nby_rank = %remote_module rank:2/cpu Net(*args, **kw)"))
    assert shell.user_ns["by_rank"].on == "worker2"
    assert [p.shape for p in shell.user_ns["by_rank"].remote_summary().parameters] == [(2, 3), (2,)]


def test_remote_module_as_an_expression_is_the_cells_value(shell: InteractiveShell) -> None:
    # IPython expands a line magic at the start of a statement or after "=": as the cell's last
    # expression, its value is the cell's result (shown as the panel), and `_` holds it afterwards.
    ran = ok(run(shell, "%remote_module worker3/cpu Net"))
    assert isinstance(ran.result.result, RemoteModule) and ran.result.result.on == "worker3"
    ok(run(shell, "sizes = [p.numel for p in _.remote_summary().parameters]"))
    assert shell.user_ns["sizes"] == [12, 3]


def test_remote_module_starts_a_missing_worker_with_a_notice(shell: InteractiveShell) -> None:
    try:
        ran = ok(run(shell, "fresh = %remote_module newcomer/cpu Net"))
        notice = "nbremote: started worker 'newcomer' (a local kernel running this Python)"
        assert ran.out.strip().splitlines() == [notice]
        assert shell.user_ns["fresh"].on == "newcomer" and "newcomer" in [w.name for w in rpc.workers()]
    finally:
        shell.user_ns.pop("fresh", None)
        rpc.remove_worker("newcomer")


def test_displaying_a_module_shows_panel_html_and_a_deterministic_text(shell: InteractiveShell) -> None:
    ok(run(shell, "shown = %remote_module worker1/cpu Net"))
    ran = ok(run(shell, "display(shown)"))
    data = ran.displays[-1]["data"]
    assert data["text/plain"] == "RemoteModule(Net on worker1/cpu)"
    assert "application/vnd.jupyter.widget-view+json" in data
    assert ">fc.weight</td>" in data["text/html"] and ">fc.bias</td>" in data["text/html"]


def test_reload_after_redefining_the_class(shell: InteractiveShell) -> None:
    ok(run(shell, "net = %remote_module worker2/cpu Net(4, hidden=3)\nnet.eval()\nbefore = net.remote_state_dict()"))
    ok(run(shell, NET_CELL.replace("self.fc = torch.nn.Linear(n, hidden)",
                                   "self.fc = torch.nn.Linear(n, hidden)\n        self.extra = torch.nn.Linear(3, 3)")))
    ran = ok(run(shell, "%remote_module --reload net"))
    assert ran.out.startswith("nbremote: reloaded Net on worker2/cpu (was Net): 2 tensor(s) carried over; missing")
    assert "extra.weight, extra.bias" in ran.out
    ok(run(shell, "after = net.remote_state_dict()\n"
                  "kept = all(torch.equal(after[k], before[k]) for k in before)\n"
                  "has_extra = 'extra.weight' in after"))
    assert shell.user_ns["kept"] and shell.user_ns["has_extra"] and shell.user_ns["net"].training is False
    broken = NET_CELL.replace("super().__init__()", "super().__init__()\n        raise ValueError('half-edited')")
    ok(run(shell, broken))
    ran = run(shell, "%remote_module --reload net")
    assert isinstance(ran.error, ValueError) and "half-edited" in ran.out + ran.err
    assert "the old module is still in place" in ran.out + ran.err
    ok(run(shell, "y = net(torch.ones(1, 4))"))
    assert tuple(shell.user_ns["y"].shape) == (1, 3)
    ok(run(shell, NET_CELL))  # leave the class as the other tests expect it


# -- %%remote ------------------------------------------------------------------------------------------------------


def test_remote_cell_runs_in_the_workers_and_labels_output(shell: InteractiveShell) -> None:
    cell = "%%remote worker1 worker2\nimport sys\nmarker = 7\nprint('hello')\nprint('warn', file=sys.stderr)"
    ran = ok(run(shell, cell))
    assert "[worker1] hello" in ran.out and "[worker2] hello" in ran.out
    assert "[worker1] warn" in ran.err and "[worker2] warn" in ran.err
    ran = ok(run(shell, "%%remote worker1\nmarker * 6"))
    assert "[worker1] Out[" in ran.out and "]: 42" in ran.out


def test_remote_cell_rich_output_is_displayed(shell: InteractiveShell) -> None:
    ran = ok(run(shell, "%%remote worker3\nfrom IPython.display import HTML\nHTML('<i>rich</i>')"))
    assert any(d["data"].get("text/html") == "<i>rich</i>" for d in ran.displays)
    assert "[worker3] Out[" in ran.out


def test_remote_cell_error_fails_the_cell_with_the_workers_traceback(shell: InteractiveShell) -> None:
    ran = run(shell, "%%remote worker2\nundefined_name + 1")
    assert isinstance(ran.error, rpc.RemoteCellError)
    assert "[worker2]" in ran.err and "NameError" in ran.err
    assert "RemoteCellError: the cell failed on worker2: NameError" in ran.out + ran.err
    assert "_cells.py" not in ran.out + ran.err


def test_remote_cell_in_background_returns_a_handle(shell: InteractiveShell) -> None:
    ran = ok(run(shell, "%%remote worker3 --bg\nimport time\ntime.sleep(1)\nprint('late')"))
    handle = ran.result.result
    assert isinstance(handle, rpc.CellRun) and not handle.done()
    assert rpc.rpc_sync("worker3", fns.whoami) == "worker3"
    assert handle.wait(10)["worker3"].status == "ok"


# -- %remote_workers -----------------------------------------------------------------------------------------------


def test_remote_workers_start_restart_stop(shell: InteractiveShell) -> None:
    ran = ok(run(shell, "%remote_workers start extra1 extra2 --kernel python3"))
    assert ran.out.strip() == "nbremote: started extra1, extra2 (kernelspec 'python3')"
    rows = {s.name: s for s in rpc.worker_status()}
    assert rows["extra1"].kind == rows["extra2"].kind == "kernelspec"
    pid = rows["extra1"].pid
    assert ok(run(shell, "%remote_workers restart extra1")).out.strip() == "nbremote: restarted extra1"
    assert {s.name: s for s in rpc.worker_status()}["extra1"].pid != pid
    assert ok(run(shell, "%remote_workers stop extra1 extra2")).out.strip() == "nbremote: stopped extra1, extra2"
    assert {"extra1", "extra2"}.isdisjoint(w.name for w in rpc.workers())


def test_remote_workers_shows_the_dashboard(shell: InteractiveShell) -> None:
    ran = ok(run(shell, "%remote_workers"))
    data = ran.displays[-1]["data"]
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["text/plain"].startswith("WorkerDashboard(worker1 idle, worker2 idle, worker3 idle")
    assert "<td" in data["text/html"] and "worker3" in data["text/html"]
    reader = shell.magics_manager.registry["RemoteMagics"].dashboard._reader
    assert reader in rpc.rpc_sync("worker3", task_stream_readers)  # the dashboard reads the task streams
    shell.run_line_magic("unload_ext", "nbremote")  # ... until the extension goes: then it stops and lets go
    try:
        assert reader not in rpc.rpc_sync("worker3", task_stream_readers)
    finally:
        shell.run_line_magic("load_ext", "nbremote")


def task_stream_readers() -> list[str]:
    """Whose lease on this worker's task stream holds (other tests' dashboards may hold one too)."""
    import time

    from nbremote.rpc._core import current_agent

    tasks = current_agent().server.tasks
    with tasks._lock:
        return [r for r, until in tasks._leases.items() if until > time.monotonic()]


def test_starting_the_first_worker_starts_the_world_as_driver() -> None:
    proc = run_script("""
        from IPython.core.interactiveshell import InteractiveShell
        from nbremote import rpc
        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "nbremote")
        shell.run_line_magic("remote_workers", "start solo")
        print([(w.name, w.id) for w in rpc.workers()])
        rpc.shutdown()
    """, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "nbremote: started solo (local kernels)" in proc.stdout
    assert "[('driver', 0), ('solo', 1)]" in proc.stdout
    assert proc.stderr == ""


# -- the parsers, on plain strings ------------------------------------------------------------------------------


def test_parse_workers() -> None:
    assert parse_workers("  ").action == "show"
    cmd = parse_workers("start a b --kernel=python3")
    assert (cmd.action, cmd.names, cmd.kernel) == ("start", ("a", "b"), "python3")
    cmd = parse_workers("start gpu --attach '/tmp/my kernel.json' --ssh me@host")
    assert (cmd.names, cmd.attach, cmd.ssh) == (("gpu",), "/tmp/my kernel.json", "me@host")
    assert parse_workers("interrupt w1").action == "interrupt"
    cmd = parse_workers("start w1 w2 --server http://h:8888/ --token t0k --kernel python3")
    assert (cmd.names, cmd.server, cmd.token, cmd.kernel) == (("w1", "w2"), "http://h:8888/", "t0k", "python3")
    assert parse_workers("start w1 --server=here").server == "here"
    with pytest.raises(MagicUsageError, match="--token is a Jupyter server's"):
        parse_workers("start w1 --token t0k")
    with pytest.raises(MagicUsageError, match="pick one"):
        parse_workers("start w1 --server here --attach k.json")


def test_parse_module() -> None:
    cmd = parse_module("worker1/cuda:0 MyNet(10, *more, hidden=32)")
    assert isinstance(cmd, BuildCommand) and str(cmd.place) == "worker1/cuda:0"
    assert ast.unparse(cmd.factory) == "MyNet" and [ast.unparse(a) for a in cmd.args] == ["10", "*more"]
    assert [(k.arg, ast.unparse(k.value)) for k in cmd.keywords] == [("hidden", "32")]
    cmd = parse_module("rank:1 models.MyNet")
    assert isinstance(cmd, BuildCommand) and (cmd.place.worker, cmd.place.device) == (1, "cpu")
    assert ast.unparse(cmd.factory) == "models.MyNet" and cmd.args == ()
    assert parse_module("--reload net") == ReloadCommand("net")
    with pytest.raises(MagicUsageError, match=r"unknown device 'tpu'.*\. Usage: net = %remote_module"):
        parse_module("w/tpu Net")


def test_parse_cell() -> None:
    assert parse_cell("w1 w2").workers == ("w1", "w2")
    assert parse_cell("--bg w1").background and parse_cell("w1 --background").background
