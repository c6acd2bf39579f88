"""What a RemoteModule looks like right now: plain records, and their text and HTML renderings.

:class:`ModuleSummary` is filled on the owner (``_inspect.summarize``) in one call and travels back as
plain values; everything here is pure, so the renderings are tested with hand-made records. The HTML
is a self-contained table with inline styles (no JavaScript, no stylesheet), used by
``RemoteModule._repr_html_`` and by the notebook panel, so both always show the same thing.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nbremote.history import ModuleHistory


@dataclass(frozen=True)
class ParameterInfo:
    """One parameter of a remote module; ``grad_norm`` is None where it has no gradient."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    requires_grad: bool
    numel: int
    norm: float
    grad_norm: float | None


@dataclass(frozen=True)
class ModuleSummary:
    """A remote module's class, placement, mode and parameters (``RemoteModule.remote_summary()``)."""

    worker: str
    type_name: str
    framework: str
    device: str
    training: bool
    parameters: tuple[ParameterInfo, ...]
    history: ModuleHistory | None = None  # when asked for (``remote_summary(history=True)``)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.parameters)

    @property
    def trainable(self) -> int:
        """Elements of the parameters that require a gradient."""
        return sum(p.numel for p in self.parameters if p.requires_grad)

    @property
    def norm(self) -> float:
        """L2 norm of all parameters together."""
        return math.sqrt(sum(p.norm**2 for p in self.parameters))

    @property
    def grad_norm(self) -> float | None:
        """L2 norm of all gradients together, None when no parameter has one."""
        grads = [p.grad_norm for p in self.parameters if p.grad_norm is not None]
        return math.sqrt(sum(g**2 for g in grads)) if grads else None

    @property
    def mode(self) -> str:
        return "train" if self.training else "eval"

    def to_text(self) -> str:
        """A fixed-width table (for consoles and logs)."""
        return to_text(self)

    def to_html(self) -> str:
        """Header line and parameter table, for frontends without widgets."""
        return to_html(self)

    def header_html(self) -> str:
        """One line: class, worker, device, mode, parameter count."""
        return header_html(self)

    def table_html(self, extra: Mapping[str, Sequence[str]] | None = None) -> str:
        """The parameter table with its totals row (``extra``: see :func:`table_html`)."""
        return table_html(self, extra)


def number(value: float | None) -> str:
    """Norms as people read them: 4 significant digits, an em dash for "none"."""
    return "\u2014" if value is None else f"{value:.4g}"


def shape(value: tuple[int, ...]) -> str:
    return str(tuple(value))


COLUMNS = ("parameter", "shape", "dtype", "device", "requires_grad", "elements", "L2 norm", "grad norm")


def rows(summary: ModuleSummary) -> list[tuple[str, ...]]:
    """The parameter table as strings, one row per parameter, then the totals row."""
    body = [(p.name, shape(p.shape), p.dtype, p.device, "yes" if p.requires_grad else "no", f"{p.numel:,}",
             number(p.norm), number(p.grad_norm)) for p in summary.parameters]
    total = (f"total ({len(summary.parameters)})", "", "", "", f"{summary.trainable:,} trainable", f"{summary.numel:,}",
             number(summary.norm), number(summary.grad_norm))
    return [*body, total]


def to_text(summary: ModuleSummary) -> str:
    """A fixed-width table (for consoles and logs)."""
    table = [COLUMNS, *rows(summary)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = [f"{summary.type_name} on {summary.worker}/{summary.device} ({summary.mode} mode)"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    return "\n".join(lines)


_CELL = "padding:2px 10px;text-align:{align};border-bottom:1px solid #ddd;white-space:nowrap;{extra}"
_NUMERIC = {5, 6, 7}


def table_html(summary: ModuleSummary, extra: Mapping[str, Sequence[str]] | None = None) -> str:
    """The parameter table alone (the panel puts its controls around it). ``extra``: heading -> one cell of
    ready HTML per parameter (the panel's history sparklines), appended inside the column of that heading if
    the table has one, else in a column of its own; nothing in the totals row."""
    def cell(tag: str, text: str, i: int, extra: str = "", markup: str = "") -> str:
        style = _CELL.format(align="right" if i in _NUMERIC else "left", extra=extra)
        return f'<{tag} style="{style}">{html.escape(text)}{markup}</{tag}>'

    added = {k: v for k, v in (extra or {}).items() if k not in COLUMNS}
    heads = (*COLUMNS, *added)
    markup = {heads.index(k): v for k, v in (extra or {}).items()}  # column -> HTML per parameter
    head = "".join(cell("th", c, i) for i, c in enumerate(heads))
    table_rows = [(*r, *("" for _ in added)) for r in rows(summary)]
    body = ["<tr>" + "".join(cell("td", c, i, "font-family:monospace;", markup[i][k] if i in markup else "")
                             for i, c in enumerate(r)) + "</tr>" for k, r in enumerate(table_rows[:-1])]
    body.append("<tr>" + "".join(cell("td", c, i, "font-weight:bold;") for i, c in enumerate(table_rows[-1])) + "</tr>")
    return ('<table class="nbremote-parameters" style="border-collapse:collapse;font-size:12px">'
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def header_html(summary: ModuleSummary) -> str:
    return (f"<b>{html.escape(summary.type_name)}</b> on <b>{html.escape(summary.worker)}</b> \u00b7 "
            f"device <b>{html.escape(summary.device)}</b> \u00b7 <b>{summary.mode}</b> mode \u00b7 "
            f"{summary.numel:,} parameters")


def to_html(summary: ModuleSummary) -> str:
    """Header line and parameter table, for frontends without widgets."""
    return f'<div class="nbremote-module"><div>{header_html(summary)}</div>{table_html(summary)}</div>'
