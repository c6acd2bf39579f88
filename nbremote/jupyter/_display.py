"""Displaying a RemoteModule in a notebook shows its panel.

IPython's mime-bundle formatter is told about ``RemoteModule`` (and its framework variants, which are
subclasses) at ``%load_ext nbremote``. The bundle it returns has three views of one refresh: the
panel widget (JupyterLab renders this one), an HTML table (frontends without widgets, exported
notebooks) and ``text/plain`` = ``repr(module)``, which is deterministic (consoles, nbval). One panel
is kept per handle (weakly), so displaying a module twice shows the same live panel twice.
"""

from __future__ import annotations

import weakref
from typing import Any

from nbremote.jupyter._panel import ModulePanel
from nbremote.nn import RemoteModule

_panels: weakref.WeakKeyDictionary[RemoteModule, ModulePanel] = weakref.WeakKeyDictionary()


def panel_for(module: RemoteModule) -> ModulePanel:
    """The panel that displaying ``module`` shows (made on first use, refreshed on every later use)."""
    panel = _panels.get(module)
    if panel is None or panel.comm is None:  # never made, or closed
        panel = _panels[module] = ModulePanel(module)
    else:
        panel.refresh()
    return panel


def module_bundle(module: RemoteModule) -> dict[str, Any]:
    """The mime bundle of a displayed RemoteModule."""
    panel = panel_for(module)
    data: dict[str, Any] = panel._repr_mimebundle_()
    data["text/plain"] = repr(module)
    if panel.summary is not None:
        data["text/html"] = panel.summary.to_html()
    return data


def register(shell: Any) -> None:
    shell.display_formatter.mimebundle_formatter.for_type(RemoteModule, module_bundle)


def unregister(shell: Any) -> None:
    shell.display_formatter.mimebundle_formatter.pop(RemoteModule, None)
