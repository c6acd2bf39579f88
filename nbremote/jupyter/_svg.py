"""Small inline SVG pictures for the widgets: sparklines, metric charts, a task timeline -- pure functions.

The widgets are ipywidgets ``HTML`` (no custom JavaScript, ARCHITECTURE's decision 10), and SVG inside
HTML is what every frontend renders, exported notebooks included. Each function returns markup for
plain values, so tests read the numbers a picture was drawn from (``data-*`` attributes and ``points``)
without a browser. Non-finite values are left out of a line and marked.
"""

from __future__ import annotations

import html
import math
import zlib
from collections.abc import Sequence

__all__ = ["chart", "colour", "sparkline", "timeline"]

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")


def colour(name: str) -> str:
    """A stable colour per name (the same function gets the same colour on every refresh and worker)."""
    return PALETTE[zlib.crc32(name.encode()) % len(PALETTE)]


def _scale(values: Sequence[float], log: bool) -> tuple[list[tuple[int, float]], float, float]:
    """(index, value on the drawn scale) of the finite (and, on a log scale, positive) values; their range."""
    kept = [(i, math.log10(v) if log else v) for i, v in enumerate(values)
            if math.isfinite(v) and (v > 0 or not log)]
    if not kept:
        return [], 0.0, 1.0
    low, high = min(v for _, v in kept), max(v for _, v in kept)
    return kept, low, high if high > low else low + 1.0


def _points(values: Sequence[float], width: float, height: float, log: bool, pad: float = 2.0) -> str:
    kept, low, high = _scale(values, log)
    dx = (width - 2 * pad) / max(len(values) - 1, 1)
    dy = (height - 2 * pad) / (high - low)
    return " ".join(f"{pad + i * dx:.1f},{height - pad - (v - low) * dy:.1f}" for i, v in kept)


def sparkline(values: Sequence[float], *, width: int = 96, height: int = 20, log: bool = False,
              stroke: str = "#1f5fa8", title: str = "") -> str:
    """A line of ``values`` (oldest first) scaled to its own range; a red dot ends it when the last is not finite."""
    points = _points(values, width, height, log)
    bad = bool(values) and not math.isfinite(values[-1])
    mark = f'<circle cx="{width - 3}" cy="{height / 2}" r="2.5" fill="#b00020"/>' if bad else ""
    tip = f"<title>{html.escape(title)}</title>" if title else ""
    return (f'<svg class="nbremote-spark" width="{width}" height="{height}" data-n="{len(values)}">{tip}'
            f'<polyline points="{points}" fill="none" stroke="{stroke}" stroke-width="1.2"/>{mark}</svg>')


def _number(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def chart(name: str, points: Sequence[tuple[float, float]], *, width: int = 260, height: int = 90) -> str:
    """One metric's stream (``(time, value)`` oldest first) as a line with its name, range and last value; a
    log scale when its positive values span more than two decades (a loss, typically)."""
    values = [v for _, v in points]
    positive = [v for v in values if math.isfinite(v) and v > 0]
    log = len(positive) == len(values) and bool(positive) and max(positive) > 100 * min(positive)
    top = 16
    line = _points(values, width, height - top, log)
    finite = [v for v in values if math.isfinite(v)]
    span = f"{_number(min(finite))} \u2026 {_number(max(finite))}" if finite else "no finite value"
    last = _number(values[-1]) if values else "\u2014"
    return (f'<svg class="nbremote-chart" width="{width}" height="{height}" data-metric="{html.escape(name)}" '
            f'data-n="{len(values)}" data-last="{last}" style="border:1px solid #eee">'
            f'<text x="4" y="12" font-size="11" font-family="sans-serif"><tspan font-weight="bold">'
            f'{html.escape(name)}</tspan> {last} \u00b7 {len(values)} points \u00b7 {span}{" (log)" if log else ""}'
            f'</text><g transform="translate(0,{top})"><polyline points="{line}" fill="none" stroke="{colour(name)}" '
            f'stroke-width="1.5"/></g></svg>')


Task = tuple[float, float, str, str]  # (start, seconds, what, caller): start on the wall clock


def timeline(lanes: Sequence[tuple[str, Sequence[Task]]], now: float, window: float, *, width: int = 640,
             lane_height: int = 22) -> str:
    """Dask's task stream: one lane per worker, a bar per task over the last ``window`` seconds before ``now``,
    coloured by what ran; its label inside when it fits, everything in its tooltip."""
    label_width = 70
    plot = width - label_width - 4
    height = lane_height * len(lanes) + 16
    parts = [f'<svg class="nbremote-tasks" width="{width}" height="{height}" style="border:1px solid #eee">']
    for row, (worker, tasks) in enumerate(lanes):
        y = row * lane_height + 2
        parts.append(f'<text x="4" y="{y + lane_height / 2 + 4}" font-size="11" font-family="sans-serif">'
                     f'{html.escape(worker)}</text><g class="nbremote-lane" data-worker="{html.escape(worker)}">')
        for start, seconds, what, caller in tasks:
            x0 = label_width + max(0.0, (start - now + window) / window) * plot
            x1 = label_width + min(1.0, (start + seconds - now + window) / window) * plot
            if x1 < label_width:
                continue
            w = max(x1 - x0, 1.0)
            tip = f"{what} \u00b7 {seconds * 1000:.1f} ms \u00b7 from {caller}"
            parts.append(f'<rect x="{x0:.1f}" y="{y}" width="{w:.1f}" height="{lane_height - 4}" fill="{colour(what)}" '
                         f'data-task="{html.escape(what)}"><title>{html.escape(tip)}</title></rect>')
            if w > 7 * len(what):
                parts.append(f'<text x="{x0 + 3:.1f}" y="{y + lane_height / 2 + 3}" font-size="10" fill="white" '
                             f'font-family="sans-serif" pointer-events="none">{html.escape(what)}</text>')
        parts.append("</g>")
    axis_y = lane_height * len(lanes) + 12
    for k in range(int(window) + 1):
        x = label_width + k / window * plot
        parts.append(f'<text x="{x:.0f}" y="{axis_y}" font-size="9" fill="#777" text-anchor="middle" '
                     f'font-family="sans-serif">{k - int(window)} s</text>')
    parts.append("</svg>")
    return "".join(parts)
