"""The RemoteModule panel: what a remote module is, where, in which mode, with which weights — live.

A :class:`ModulePanel` is an ipywidgets ``VBox`` (no custom JavaScript). Its state is a set of traits
filled from the public API alone (``remote_summary()``, ``forward_stats``, ``rpc.worker_resources``),
so tests read the traits without a browser. The controls act through the same API: the mode buttons
call ``train()`` / ``eval()``, the device menu ``remote_to()``; after every action the panel re-reads
the remote module, so what it shows is the remote state, never the control's own idea of it.
``auto_refresh`` re-reads it from a thread of the driver (see ``_live``), which keeps the panel live
while a training cell occupies the notebook's main thread.

**Training history.** The same one call per refresh brings the module's history (``nbremote.history``:
per parameter, norm / gradient norm / update ratio over the last steps, flags, the ``net.log`` metrics),
drawn as sparkline columns and charts (``_history_view``). While auto-refresh is on, each refresh renews
the owner's recording lease (``max(LEASE, 3 intervals)``); turning it off or closing the panel ends it at
once, and a panel nobody shows any more -- the frontend reports its views (``_view_count``), and the count
fell to 0 after it had been shown -- stops renewing it, so recording stops within the lease.

Widget changes made by a refresh must not act on the module again: ``_syncing`` marks them, and
the observers ignore changes made while it is set. Refreshes are serialised by a lock (a click and
the refresh thread may overlap).
"""

from __future__ import annotations

import contextlib
import html
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import ipywidgets as widgets
import traitlets

from nbremote import history, rpc
from nbremote.history import ModuleHistory
from nbremote.jupyter._history_view import activations_html, metrics_html, parameter_columns, steps_shown
from nbremote.jupyter._live import LiveBox, Ticker
from nbremote.nn import ModuleSummary, RemoteModule

MODES = ("train", "eval")


def _latency(seconds: float | None) -> str:
    return "\u2014" if seconds is None else f"{seconds * 1000:.1f} ms"


class ModulePanel(LiveBox):
    """A live view and controls for one :class:`~nbremote.nn.RemoteModule` (``ModulePanel(net)``)."""

    summary = traitlets.Instance(ModuleSummary, allow_none=True)  # the last remote state read
    training = traitlets.Bool(allow_none=True, default_value=None)
    device = traitlets.Unicode("")
    devices = traitlets.List(traitlets.Unicode())  # the worker's devices, as the device menu lists them
    forward_calls = traitlets.Int(0)
    forward_latency = traitlets.Float(allow_none=True, default_value=None)  # seconds
    error = traitlets.Unicode("")  # why the last refresh or action failed ("" when it did not)
    refreshed = traitlets.Unicode("")  # wall-clock time of the last successful refresh
    history = traitlets.Instance(ModuleHistory, allow_none=True)  # what the owner recorded of training
    flagged = traitlets.Dict()  # parameter name -> its flags, for the flagged ones

    def __init__(self, module: RemoteModule, *, auto_refresh: bool = False, interval: float = 1.0) -> None:
        self.module = module
        self.interval = interval
        self._lock = threading.RLock()
        self._sync_depth = 0
        self.heading = widgets.HTML()
        self.mode_buttons = widgets.ToggleButtons(options=MODES, value=None,
                                                  tooltips=["module.train()", "module.eval()"],
                                                  style={"button_width": "64px"})
        self.device_menu = widgets.Dropdown(options=[], description="device", layout=widgets.Layout(width="180px"))
        self.refresh_button = widgets.Button(description="refresh", icon="refresh", tooltip="read the remote module",
                                             layout=widgets.Layout(width="96px"))
        self.auto_box = widgets.Checkbox(value=False, description="auto-refresh", indent=False,
                                         layout=widgets.Layout(width="120px"))
        self.metrics = widgets.HTML()
        self.table = widgets.HTML()
        self.footer = widgets.HTML()
        self._shown = False  # whether a frontend ever reported a view of this panel
        self._reader = f"panel-{uuid.uuid4().hex[:8]}"  # its own lease on the owner's recording
        mode_label = widgets.Label("mode", layout=widgets.Layout(width="40px"))
        controls = widgets.HBox([mode_label, self.mode_buttons, self.device_menu, self.refresh_button, self.auto_box],
                                layout=widgets.Layout(align_items="center"))
        super().__init__([self.heading, controls, self.metrics, self.table, self.footer],
                         layout=widgets.Layout(border="1px solid #ccc", padding="6px", width="fit-content"))
        self.add_class("nbremote-panel")
        self.mode_buttons.observe(self._on_mode, names="value")
        self.device_menu.observe(self._on_device, names="value")
        self.refresh_button.on_click(lambda _: self.refresh())
        self.auto_box.observe(self._on_auto, names="value")
        self._view_count = 0  # asks the frontend to report how many views of the panel it shows
        self.observe(self._on_views, names="_view_count")
        self.refresh()
        if auto_refresh:
            self.set_auto_refresh(True)

    # -- reading the remote module ---------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the remote module (one call) and the worker's devices, and show them."""
        with self._lock:
            try:
                summary = self.module.remote_summary(history=True, lease=self._lease(), reader=self._reader)
                devices = [d.name for d in rpc.worker_resources(self.module.on).devices]
            except Exception as exc:  # a dead or busy worker is something to show, not to raise
                self._show_error(f"cannot read {self.module.module_type} on {self.module.on!r}: {exc}")
                return
            if summary.device not in devices:
                devices.append(summary.device)
            stats = self.module.forward_stats
            with self._syncing():
                self.summary, self.training, self.devices = summary, summary.training, devices
                self.device = summary.device
                self.forward_calls, self.forward_latency = stats.calls, stats.last_latency
                self.error, self.refreshed = "", time.strftime("%H:%M:%S")
                self.history = summary.history
                self.flagged = {} if summary.history is None else summary.history.flagged
                self.heading.value = summary.header_html()
                self.metrics.value = "" if summary.history is None else metrics_html(summary.history)
                if summary.history is None:
                    self.table.value = summary.table_html()
                else:
                    names = [p.name for p in summary.parameters]
                    self.table.value = (summary.table_html(parameter_columns(summary.history, names))
                                        + activations_html(summary.history))
                self.mode_buttons.value = summary.mode
                self.device_menu.options = devices
                self.device_menu.value = summary.device
            self._show_footer()

    def _lease(self) -> float | None:
        """How long the owner should record from now: while live and shown; None (read only) otherwise."""
        if self._ticker is None or (self._shown and not self._view_count):
            return None
        return max(history.LEASE, 3 * self.interval)

    def _on_views(self, change: dict[str, Any]) -> None:
        self._shown = self._shown or bool(change["new"])

    def _stop_recording(self) -> None:
        with contextlib.suppress(Exception):  # a dead worker records nothing anyway
            self.module.remote_history(lease=0, reader=self._reader)

    def _show_footer(self) -> None:
        auto = f" \u00b7 auto-refresh every {self.interval:g} s" if self._ticker is not None else ""
        if self.history is not None and (self.history.recording or steps_shown(self.history)):
            steps = steps_shown(self.history)
            auto += f" \u00b7 history: {steps} step(s)"
            if self.history.recording:
                auto += ", recorded on the worker as it trains"
        text = (f"last forward {_latency(self.forward_latency)} \u00b7 {self.forward_calls} forward call(s) "
                f"\u00b7 refreshed {self.refreshed}{auto}")
        if self.error:
            text = f'<span style="color:#b00020">{html.escape(self.error)}</span><br>{text}'
        self.footer.value = f'<span style="font-size:11px;color:#555">{text}</span>'

    def _show_error(self, message: str) -> None:
        self.error = message
        self._show_footer()

    @contextlib.contextmanager
    def _syncing(self) -> Iterator[None]:
        self._sync_depth += 1
        try:
            yield
        finally:
            self._sync_depth -= 1

    # -- acting on it ----------------------------------------------------------------------------------
    def _act(self, what: str, action: Any) -> None:
        with self._lock:
            try:
                action()
            except Exception as exc:
                self._show_error(f"{what} failed: {exc}")
                return
        self.refresh()

    def _on_mode(self, change: dict[str, Any]) -> None:
        if self._sync_depth or change["new"] is None:
            return
        self._act(f"module.{change['new']}()", lambda: self.module.train(change["new"] == "train"))

    def _on_device(self, change: dict[str, Any]) -> None:
        if self._sync_depth or not change["new"] or change["new"] == self.device:
            return
        self._act(f"remote_to({change['new']!r})", lambda: self.module.remote_to(change["new"]))

    def _on_auto(self, change: dict[str, Any]) -> None:
        if not self._sync_depth:
            self.set_auto_refresh(bool(change["new"]))

    def set_auto_refresh(self, on: bool, interval: float | None = None) -> None:
        """Refresh from a thread every ``interval`` seconds (live while cells run), or stop doing so."""
        if interval is not None:
            self.interval = interval
        was_on = self._ticker is not None
        self.stop_ticker()
        if on:
            self._ticker = Ticker(self.refresh, self.interval, f"panel-{self.module.on}")
        elif was_on:
            self._stop_recording()
        with self._syncing():
            self.auto_box.value = on
        if on and not was_on:
            self.refresh()  # recording starts now, not one interval later
        else:
            self._show_footer()

    def close(self) -> None:
        if self._ticker is not None:
            self.stop_ticker()
            self._stop_recording()
        super().close()

    def __repr__(self) -> str:
        return f"ModulePanel({self.module!r})"
