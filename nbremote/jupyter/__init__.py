"""``nbremote.jupyter``: the notebook layer — magics, a live RemoteModule panel, a worker dashboard, progress.

``%load_ext nbremote`` (or ``load_ipython_extension(get_ipython())``) registers:

* the magics ``%remote_workers`` (dashboard; ``start`` / ``stop`` / ``restart`` / ``interrupt``),
  ``%remote_module`` (``net = %remote_module worker1/cpu MyNet(10, hidden=32)``, ``--reload net``) and
  ``%%remote worker1 [worker2 ...] [--bg]`` (run the cell in the workers' kernels);
* a display formatter: a RemoteModule shown in a cell is its :class:`ModulePanel` (one per module:
  :func:`panel_for` returns the panel that displaying the module shows, e.g. to act on it from code);
* the long-wait status: a call waited on for more than ~2 s shows worker, function and elapsed time.

Everything here is a thin adapter over the public API (``nbremote.rpc``, ``nbremote.nn``): what a widget
shows is a trait filled from that API, so tests read the traits without a browser. Private modules:
``_parse`` (magic lines, pure), ``_magics``, ``_panel``, ``_dashboard``, ``_display`` (the formatter),
``_progress`` (wait status and :func:`wait_all`) and ``_live`` (the refresh thread that keeps widgets
live while a cell runs).
"""

from __future__ import annotations

from typing import Any

from nbremote import rpc
from nbremote.jupyter import _display
from nbremote.jupyter._dashboard import WorkerDashboard
from nbremote.jupyter._display import panel_for
from nbremote.jupyter._magics import RemoteMagics
from nbremote.jupyter._panel import ModulePanel
from nbremote.jupyter._progress import WaitStatus, wait_all

__all__ = [
    "ModulePanel",
    "RemoteMagics",
    "WaitStatus",
    "WorkerDashboard",
    "load_ipython_extension",
    "panel_for",
    "unload_ipython_extension",
    "wait_all",
]


def load_ipython_extension(shell: Any) -> None:
    """Register the magics, the RemoteModule display and the long-wait status in ``shell``."""
    shell.register_magics(RemoteMagics)
    _display.register(shell)
    rpc.set_wait_hook(WaitStatus())


def unload_ipython_extension(shell: Any) -> None:
    """Undo :func:`load_ipython_extension` (magics stay registered, as IPython has no way to drop them); the
    dashboard ``%remote_workers`` showed stops refreshing and ends its leases on the workers' task streams."""
    magics = shell.magics_manager.registry.get(RemoteMagics.__name__)
    if magics is not None and magics.dashboard is not None:
        magics.dashboard.close()
        magics.dashboard = None
    _display.unregister(shell)
    rpc.set_wait_hook(None)
