"""The worker dashboard (``%remote_workers``): one row per worker, kept up to date, with stop/restart, and
the workers' task stream.

Rows come from ``rpc.worker_status()`` (the driver's view: asks no worker, so a hung worker still has a
row), ``rpc.worker_activity(name)`` (CPU %, resident memory, GPU memory where CUDA is initialised,
calls/s, and the tasks it ran: one call per live worker and refresh, not counted in the call counts) and
``rpc.worker_resources(name)`` (owned RRefs: every ``resources_every`` refreshes). Under the grid, the
*task stream*: a lane per worker, a bar per call it served in the last ``window`` seconds (since the
dashboard was made, with ``fresh=True``), named by what
ran (a RemoteModule's forward by its class: ``Stage.forward``), its duration and caller in the tooltip --
what notebook 4 draws by hand otherwise. Each read renews the worker's recording lease
(``nbremote.rpc._core.tasks``); closing the dashboard ends it, and one nobody shows any more stops renewing.
``rows`` is a trait of plain dicts, the dashboard's state for tests and scripts; the grid shows it.
Cells are created once per worker and then only their values change, so a refresh every second sends
a few small updates and creates no widgets. Stop and restart run on a thread: the click returns at
once and the next refresh shows the worker as starting.
"""

from __future__ import annotations

import contextlib
import html
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets
import traitlets

from nbremote import rpc
from nbremote.jupyter._activity import ActivityTrack
from nbremote.jupyter._live import LiveBox, Ticker
from nbremote.jupyter._svg import timeline

COLUMNS = ("worker", "kind", "host", "pid", "state", "CPU", "memory", "devices", "RRefs", "in flight", "calls",
           "calls/s")
# What the stream calls nbremote's own work (function names a user would not know)
TASK_NAMES = {"_backward_hop": "backward pass", "_local_step": "optimizer step", "summarize": "panel refresh",
              "read": "history read", "resources": "resources read", "log_metrics": "net.log",
              "fetch_value": "RRef fetch"}
LEASE = 10.0  # seconds a worker records its task stream after a read (a live dashboard renews it every refresh)
_STATE_COLOURS = {"idle": "#1b7f3b", "busy": "#b26a00", "starting": "#1f5fa8", "dead": "#b00020"}
NO_WORLD = "No workers yet: start some with %remote_workers start worker1 worker2"


def _bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def _device(d: rpc.DeviceInfo) -> str:
    if d.memory_used is None:
        return d.name
    total = f" / {_bytes(d.memory_total)}" if d.memory_total else ""
    return f"{d.name} ({_bytes(d.memory_used)}{total} in use)"


def describe(status: rpc.WorkerStatus, resources: rpc.WorkerResources | None,
             activity: ActivityTrack | None = None) -> dict[str, Any]:
    """One dashboard row as plain values (``None`` where the worker did not say)."""
    last = None if activity is None else activity.last
    devices = last.devices if last is not None else None if resources is None else resources.devices
    return {"worker": status.name, "rank": status.rank, "kind": status.kind, "host": status.host,
            "pid": status.pid, "state": status.state, "detail": status.detail,
            "cpu": None if activity is None else activity.cpu_percent, "rss": None if last is None else last.rss,
            "devices": None if devices is None else [_device(d) for d in devices],
            "rrefs": None if resources is None else resources.owned_rrefs,
            "in_flight": status.calls_in_flight, "calls": status.calls_total,
            "calls_per_s": None if activity is None else activity.calls_per_s, "log": status.log_path}


def _cells(row: dict[str, Any]) -> list[str]:
    state = f'<b style="color:{_STATE_COLOURS[row["state"]]}">{row["state"]}</b>'
    if row["detail"] and (row["state"] in ("dead", "starting") or row["kind"] == "slurm"):  # a job's id and time left
        state += f'<br><span style="font-size:10px">{html.escape(row["detail"])}</span>'
    unknown = '<span style="color:#888">?</span>'
    devices = unknown if row["devices"] is None else "<br>".join(html.escape(d) for d in row["devices"])
    cpu = unknown if row["cpu"] is None else f"{row['cpu']:.0f} %"
    rate = unknown if row["calls_per_s"] is None else f"{row['calls_per_s']:.0f}"
    return [f"<b>{html.escape(row['worker'])}</b>", html.escape(row["kind"]), html.escape(row["host"]),
            str(row["pid"] or "?"), state, cpu, unknown if row["rss"] is None else _bytes(row["rss"]), devices,
            unknown if row["rrefs"] is None else str(row["rrefs"]), str(row["in_flight"]), str(row["calls"]), rate]


class WorkerDashboard(LiveBox):
    """Every worker of this notebook's world, live (``WorkerDashboard()``; ``%remote_workers`` shows one)."""

    rows = traitlets.List(traitlets.Dict())
    tasks = traitlets.Dict()  # worker -> [(start, seconds, what, caller)] of the tasks in the window
    error = traitlets.Unicode("")

    def __init__(self, *, auto_refresh: bool = True, interval: float = 1.0, resources_every: int = 5,
                 window: float = 10.0, fresh: bool = False) -> None:
        self.interval = interval
        self.window = window
        self._since = time.time() if fresh else 0.0  # fresh: only tasks that end after it is made
        self.resources_every = max(1, resources_every)
        self._activity: dict[str, ActivityTrack] = {}
        self._reader = f"dashboard-{uuid.uuid4().hex[:8]}"  # its own lease on each worker's task stream
        self._seen = False  # whether a frontend ever reported a view of it
        self._lock = threading.RLock()
        self._closed = False  # a refresh after close (a button's, in its thread) would lease the streams again
        self._refreshes = 0
        self._resources: dict[str, rpc.WorkerResources] = {}
        self._row_cells: dict[str, list[widgets.HTML]] = {}
        self._row_buttons: dict[str, widgets.HBox] = {}
        self._shown: list[str] = []
        header = [widgets.HTML(f"<b>{c}</b>") for c in (*COLUMNS, "")]
        self._header = header
        self.grid = widgets.GridBox(header, layout=widgets.Layout(
            grid_template_columns=f"repeat({len(COLUMNS) + 1}, max-content)", grid_gap="2px 14px"))
        self.footer = widgets.HTML()
        self.stream = widgets.HTML()
        refresh = widgets.Button(description="refresh", icon="refresh", layout=widgets.Layout(width="96px"))
        refresh.on_click(lambda _: self.refresh(resources=True))
        super().__init__([self.grid, self.stream, widgets.HBox([refresh, self.footer])],
                         layout=widgets.Layout(border="1px solid #ccc", padding="6px", width="fit-content"))
        self.add_class("nbremote-dashboard")
        self._view_count = 0  # asks the frontend to report its views of the dashboard (see _lease)
        self.observe(lambda change: setattr(self, "_seen", self._seen or bool(change["new"])), names="_view_count")
        self.refresh(resources=True)
        if auto_refresh:
            self._ticker = Ticker(self.refresh, interval, "dashboard")

    def refresh(self, resources: bool | None = None) -> None:
        """Read every worker's status (and, every few refreshes or when asked, their resources)."""
        with self._lock:
            if self._closed:
                return
            self._refreshes += 1
            if resources is None:
                resources = self._refreshes % self.resources_every == 0
            if not rpc.is_initialized():
                self.rows = []
                self.error = ""
                self._render(NO_WORLD)
                return
            statuses = rpc.worker_status()
            errors = self._ask_activity(statuses)
            if resources:
                errors += self._ask_resources(statuses)
            self.error = "; ".join(errors)
            self.rows = [describe(s, self._resources.get(s.name), self._activity.get(s.name)) for s in statuses]
            self.tasks = {s.name: [(t.start, t.seconds, TASK_NAMES.get(t.what, t.what), t.caller)
                                   for t in self._activity[s.name].in_view()]
                          for s in statuses if s.name in self._activity}
            self._render(f"{len(statuses)} worker(s)")

    def _lease(self) -> float:
        """How long the workers should record their task streams from now: 0 once no frontend shows this."""
        return 0.0 if self._seen and not self._view_count else max(LEASE, 3 * self.interval)

    def _ask_activity(self, statuses: list[rpc.WorkerStatus]) -> list[str]:
        errors, lease = [], self._lease()
        for status in statuses:
            if status.state not in ("idle", "busy"):
                self._activity.pop(status.name, None)
                continue
            track = self._activity.setdefault(status.name, ActivityTrack(self._since))
            try:
                track.add(rpc.worker_activity(status.name, track.since, lease, timeout=2.0, reader=self._reader),
                          self.window)
            except Exception as exc:  # shown, and the last known figures stay
                errors.append(f"{status.name}: {exc}")
        return errors

    def _ask_resources(self, statuses: list[rpc.WorkerStatus]) -> list[str]:
        errors = []
        for status in statuses:
            if status.state in ("idle", "busy"):
                try:
                    self._resources[status.name] = rpc.worker_resources(status.name, timeout=2.0)
                except Exception as exc:  # shown, and the last known figures stay
                    errors.append(f"{status.name}: {exc}")
            else:
                self._resources.pop(status.name, None)
        return errors

    def stream_html(self) -> str:
        """The task stream: the last ``window`` seconds of every live worker, up to its newest read."""
        lanes = [(name, self.tasks.get(name, [])) for name in (r["worker"] for r in self.rows) if name in self.tasks]
        reads = [track.last.wall for track in self._activity.values() if track.last is not None]
        if not lanes or not reads:  # no worker answered a read yet (one restarting, say): nothing to place
            return ""
        return timeline(lanes, max(reads), self.window)

    def close(self) -> None:
        self.stop_ticker()
        with self._lock:  # after a refresh under way, before any other
            self._closed = True
            for name in list(self._activity):
                with contextlib.suppress(Exception):  # a worker gone records nothing anyway
                    rpc.worker_activity(name, lease=0, timeout=2.0, reader=self._reader)
            self._activity.clear()
        super().close()

    def _render(self, summary: str) -> None:
        names = [r["worker"] for r in self.rows]
        for row in self.rows:
            cells = self._row_cells.get(row["worker"])
            if cells is None:
                cells = self._row_cells[row["worker"]] = [widgets.HTML() for _ in COLUMNS]
                self._row_buttons[row["worker"]] = self._buttons(row["worker"])
            for cell, value in zip(cells, _cells(row), strict=True):
                if cell.value != value:
                    cell.value = value
        if names != self._shown:
            for gone in set(self._row_cells) - set(names):
                buttons = self._row_buttons.pop(gone)
                for w in [*self._row_cells.pop(gone), *buttons.children, buttons]:
                    w.close()
            self.grid.children = [*self._header, *(w for n in names for w in (*self._row_cells[n],
                                                                              self._row_buttons[n]))]
            self._shown = names
        stream = self.stream_html()
        if self.stream.value != stream:
            self.stream.value = stream
        error = f'<span style="color:#b00020">{html.escape(self.error)}</span> \u00b7 ' if self.error else ""
        self.footer.value = f'<span style="font-size:11px;color:#555">{error}{html.escape(summary)}</span>'

    def _buttons(self, name: str) -> widgets.HBox:
        stop = widgets.Button(description="stop", icon="stop", tooltip=f"rpc.remove_worker({name!r})",
                              layout=widgets.Layout(width="72px"))
        restart = widgets.Button(description="restart", icon="repeat", tooltip=f"rpc.restart_worker({name!r})",
                                 layout=widgets.Layout(width="84px"))
        stop.on_click(lambda _: self._in_background(f"stopping {name}", lambda: rpc.remove_worker(name)))
        restart.on_click(lambda _: self._in_background(f"restarting {name}", lambda: rpc.restart_worker(name)))
        return widgets.HBox([stop, restart])

    def _in_background(self, what: str, action: Callable[[], object]) -> threading.Thread:
        def run() -> None:
            try:
                action()
            except Exception as exc:
                self.error = f"{what} failed: {exc}"
            self.refresh(resources=True)

        thread = threading.Thread(target=run, name=f"nbremote-dashboard-{what}", daemon=True)
        thread.start()
        self.refresh()
        return thread

    def to_html(self) -> str:
        """The table as static HTML (for frontends without widgets)."""
        if not self.rows:
            return f"<p>{html.escape(NO_WORLD)}</p>"
        head = "".join(f'<th style="padding:2px 10px;text-align:left">{c}</th>' for c in COLUMNS)
        body = "".join("<tr>" + "".join(f'<td style="padding:2px 10px">{c}</td>' for c in _cells(r)) + "</tr>"
                       for r in self.rows)
        return (f'<table class="nbremote-dashboard"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
                + self.stream_html())

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        data: dict[str, Any] = super()._repr_mimebundle_(**kwargs)
        data["text/html"] = self.to_html()
        return data

    def __repr__(self) -> str:
        if not self.rows:
            return "WorkerDashboard(no workers)"
        return "WorkerDashboard(" + ", ".join(f"{r['worker']} {r['state']}" for r in self.rows) + ")"
