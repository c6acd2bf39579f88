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

import numpy as np

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
BUCKET = 2  # pixels: a row's calls are drawn by the buckets of pixels they fall in (at most width/2 bars a row)
ROWS = 5  # rows per worker: its busiest functions, the rest together as "other"


def _runs(tasks: Sequence[Task], t0: float, window: float, n: int) -> list[tuple[int, int, int, float]]:
    """Runs of consecutive buckets some call covers: (first, last, calls started in it, their busy seconds).
    A run is cut where a call at least 3 buckets long starts, so back-to-back calls one can see stay apart,
    while a worker serving 1,000 short calls a second draws a few hundred bars, not 10,000 (numpy: a
    dashboard refresh with 10 s of a busy worker in view takes ~1 ms here, a Python loop took ~15 ms)."""
    if not tasks:
        return []
    times = np.array([(t[0], t[1]) for t in tasks], dtype=np.float64)
    first = (times[:, 0] - t0) / window * n
    last = (times[:, 0] + times[:, 1] - t0) / window * n
    keep = (last >= 0) & (first < n)
    if not keep.any():
        return []
    b0 = np.clip(first[keep], 0, n - 1).astype(np.int64)
    b1 = np.clip(last[keep], 0, n - 1).astype(np.int64)
    cover = np.zeros(n + 1, dtype=np.int64)
    np.add.at(cover, b0, 1)
    np.add.at(cover, b1 + 1, -1)
    covered = np.cumsum(cover[:n]) > 0
    calls = np.bincount(b0, minlength=n)
    busy = np.bincount(b0, weights=times[keep, 1], minlength=n)
    cuts = np.zeros(n, dtype=bool)
    cuts[b0[b1 - b0 >= 2]] = True
    starts = covered & (~np.concatenate(([False], covered[:-1])) | cuts)
    ends = covered & (~np.concatenate((covered[1:], [False])) | np.concatenate((cuts[1:], [False])))
    return [(int(a), int(b), int(calls[a:b + 1].sum()), float(busy[a:b + 1].sum()))
            for a, b in zip(np.flatnonzero(starts), np.flatnonzero(ends), strict=True)]


def _rows(tasks: Sequence[Task]) -> list[tuple[str, list[Task]]]:
    """A worker's tasks by what ran, busiest first: :data:`ROWS` rows, the rest in the last as "other"."""
    by_what: dict[str, list[Task]] = {}
    for task in tasks:
        by_what.setdefault(task[2], []).append(task)
    ordered = sorted(by_what.items(), key=lambda item: -sum(t[1] for t in item[1]))
    if len(ordered) > ROWS:
        ordered = [*ordered[:ROWS - 1], ("other", [t for _, ts in ordered[ROWS - 1:] for t in ts])]
    return ordered


def timeline(lanes: Sequence[tuple[str, Sequence[Task]]], now: float, window: float, *, width: int = 720,
             row_height: int = 14) -> str:
    """Dask's task stream: a lane per worker over the last ``window`` seconds before ``now``, a row in it per
    function it ran (its busiest :data:`ROWS`), bars where it ran, coloured by function; each bar's calls,
    busy time and callers in its tooltip."""
    label_width = 200
    plot = width - label_width - 8
    n = max(1, int(plot / BUCKET))
    rows = [(worker, _rows(tasks)) for worker, tasks in lanes]
    # colours by name, in sorted order: distinct within the picture, the same for a function on every worker
    names = sorted({what for _, whats in rows for what, _ in whats})
    colours = {what: PALETTE[i % len(PALETTE)] for i, what in enumerate(names)}
    height = sum(max(1, len(r)) * row_height + 6 for _, r in rows) + 14
    parts = [f'<svg class="nbremote-tasks" width="{width}" height="{height}" style="border:1px solid #eee">']
    y = 2
    for worker, whats in rows:
        parts.append(f'<g class="nbremote-lane" data-worker="{html.escape(worker)}">'
                     f'<text x="4" y="{y + 11}" font-size="11" font-weight="bold" font-family="sans-serif">'
                     f'{html.escape(worker)}</text>')
        for what, tasks in whats:
            parts.append(f'<text x="{label_width - 4}" y="{y + 10}" font-size="10" text-anchor="end" '
                         f'font-family="monospace" fill="#444">{html.escape(what[-24:])}</text>')
            who = ", ".join(sorted({t[3] for t in tasks}))
            runs = _runs(tasks, now - window, window, n)
            for k, (first, last, count, seconds) in enumerate(runs):
                gap = 1 if k + 1 < len(runs) and runs[k + 1][0] == last + 1 else 0  # a call one can see starts next
                calls = f"{count} call{'s' if count != 1 else ''}" if count else "still running"
                tip = f"{what} \u00b7 {calls} \u00b7 {seconds * 1000:.1f} ms busy \u00b7 from {who}"
                width = (last - first + 1) * BUCKET - gap
                parts.append(f'<rect x="{label_width + first * BUCKET}" y="{y}" width="{width}" '
                             f'height="{row_height - 3}" fill="{colours[what]}" data-task="{html.escape(what)}">'
                             f'<title>{html.escape(tip)}</title></rect>')
            y += row_height
        y += 6 + (0 if whats else row_height)
        parts.append("</g>")
    step = 1 if window <= 10 else 5 if window <= 60 else 30
    ticks = [window * k / 4 for k in range(5)] if window < 2 else [float(k) for k in range(0, int(window) + 1, step)]
    for tick in ticks:
        parts.append(f'<text x="{label_width + tick / window * plot:.0f}" y="{y + 8}" font-size="9" fill="#777" '
                     f'text-anchor="middle" font-family="sans-serif">{tick - window:.3g} s</text>')
    parts.append("</svg>")
    return "".join(parts)
