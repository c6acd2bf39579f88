"""How the module panel draws a module's training history: sparkline columns, flags, metric charts.

Pure: a :class:`~nbremote.history.ModuleHistory` in, HTML out (see ``_svg``). Gradient norms and update
ratios span decades, so their sparklines use a log scale; weight norms move by a few percent, so theirs
is linear, scaled to its own range. A flagged parameter's flags stand in their own column, in red. The layers'
outputs (mean, standard deviation per forward) get a small table of their own under the parameters.
"""

from __future__ import annotations

import html
import math

from nbremote.history import ModuleHistory, ParameterHistory
from nbremote.jupyter._svg import chart, sparkline

__all__ = ["FLAG_TEXT", "activations_html", "metrics_html", "parameter_columns", "steps_shown"]

FLAG_TEXT = {"nonfinite": "NaN/inf gradient", "vanishing": "vanishing gradient", "exploding": "exploding gradient"}
_FLAG_TIPS = {"nonfinite": "the last gradient (or weight) holds a NaN or an infinity",
              "vanishing": "the last gradient's L2 norm is below 1e-7",
              "exploding": "the last gradient's L2 norm is above 1e3, or 20x the median of the steps before"}


def _last(values: tuple[float, ...]) -> str:
    if not values:
        return ""
    v = values[-1]
    return f"{v:.3g}" if math.isfinite(v) else str(v)


def _spark(values: tuple[float, ...], what: str, name: str, log: bool, value: bool = False) -> str:
    if not values:
        return ""
    title = f"{name}: {what} over the last {len(values)} steps, last {_last(values)}"
    number = f' <span style="font-size:11px">{_last(values)}</span>' if value else ""
    return f" {sparkline(values, log=log, title=title, width=80, height=16)}{number}"


def _flags(p: ParameterHistory) -> str:
    style = "background:#b00020;color:white;border-radius:3px;padding:0 4px;font-size:11px"
    return " ".join(f'<span class="nbremote-flag" data-flag="{f}" title="{html.escape(_FLAG_TIPS[f])}" '
                    f'style="{style}">{FLAG_TEXT[f]}</span>' for f in p.flags)


def parameter_columns(history: ModuleHistory, names: list[str]) -> dict[str, list[str]]:
    """The history in the parameter table, one cell per parameter in ``names`` order: sparklines beside the
    L2 norm and gradient norm, and columns of their own for the update ratio and the flags."""
    by_name = {p.name: p for p in history.parameters}
    empty = ParameterHistory("", (), (), (), ())
    params = [(n, by_name.get(n, empty)) for n in names]
    return {"L2 norm": [_spark(p.norm, "L2 norm", n, False) for n, p in params],
            "grad norm": [_spark(p.grad_norm, "gradient norm (log scale)", n, True) for n, p in params],
            "update |\u0394w|/|w|": [_spark(p.update_ratio, "update ratio (log scale)", n, True, value=True)
                                     for n, p in params],
            "flags": [_flags(p) for _, p in params]}


def steps_shown(history: ModuleHistory) -> int:
    """How many steps the sparklines span (for the panel's footer)."""
    return max((len(p.norm) for p in history.parameters), default=0)


def activations_html(history: ModuleHistory) -> str:
    """A table of the layers' outputs over their last forwards (mean and standard deviation), "" before any."""
    layers = [a for a in history.activations if a.mean]
    if not layers:
        return ""
    cell = "padding:2px 10px;border-bottom:1px solid #ddd;white-space:nowrap;font-family:monospace"
    head = "".join(f'<th style="{cell};text-align:left">{h}</th>'
                   for h in ("layer output", f"mean, last {max(len(a.mean) for a in layers)} forwards", "std"))
    rows = "".join(f'<tr><td style="{cell}">{html.escape(a.name)}</td>'
                   f'<td style="{cell}">{_spark(a.mean, "output mean", a.name, False, value=True)}</td>'
                   f'<td style="{cell}">{_spark(a.std, "output std", a.name, False, value=True)}</td></tr>'
                   for a in layers)
    return (f'<table class="nbremote-activations" style="border-collapse:collapse;font-size:12px;margin-top:6px">'
            f"<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")


def metrics_html(history: ModuleHistory) -> str:
    """One chart per metric given to ``RemoteModule.log``, side by side ("" when there is none)."""
    if not history.metrics:
        return ""
    charts = "".join(chart(name, points) for name, points in sorted(history.metrics.items()))
    return f'<div class="nbremote-metrics" style="display:flex;gap:8px;flex-wrap:wrap">{charts}</div>'
