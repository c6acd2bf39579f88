"""Samples, summaries, paired ratios and verdicts: pure functions over plain values.

A system's result in one case is an :class:`Outcome`: its samples kept *per round*. Round ``r`` of every
system in a case (and in the other cases of its group) ran back to back, so a burst of load elsewhere on the
machine hits both sides of a round alike. :func:`paired_ratio` therefore takes the median, over rounds, of
the ratio of the two systems' round medians, where a ratio of two overall medians would let drift between
rounds leak in. The overall median and p90 are over every sample of every round.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from _cases import NBREMOTE, Case, Target


@dataclass
class Outcome:
    """What one system did in one case. ``error`` may come with the rounds it finished before failing."""

    system: str
    rounds: list[list[float]] = field(default_factory=list)  # seconds, one list per round
    extra: dict[str, list[float]] = field(default_factory=dict)  # named side figures, one per sample
    info: dict[str, Any] = field(default_factory=dict)  # what its checks found (bit_exact, first_loss, ...)
    error: str | None = None
    skipped: str | None = None
    prepare_s: float = 0.0  # warm-up and checks, untimed: shown in the progress lines, kept in the JSON

    @property
    def samples(self) -> list[float]:
        return [s for r in self.rounds for s in r]

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else "error" if self.error else "ok"


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not samples:
        raise ValueError("percentile of no samples")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(samples: Sequence[float]) -> dict[str, float]:
    if not samples:
        return {"n": 0}
    return {"n": len(samples), "median": statistics.median(samples), "p90": percentile(samples, 90),
            "min": min(samples), "max": max(samples), "mean": statistics.fmean(samples)}


def paired_ratio(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float | None:
    """Median over rounds of median(a's round) / median(b's round); None without a common round.

    Not strict: a system that failed has fewer rounds, and its rounds are still the first ones.
    """
    pairs = [(statistics.median(x), statistics.median(y)) for x, y in zip(a, b, strict=False) if x and y]
    ratios = [x / y for x, y in pairs if y > 0]
    return statistics.median(ratios) if ratios else None


def ratio_to(results: Mapping[str, Mapping[str, Outcome]], case: Case, system: str, against: str) -> float | None:
    """Paired ratio of ``system`` to ``against`` (a system of the same case, or ``case:<id>``'s same system)."""
    mine = results.get(case.id, {}).get(system)
    if against.startswith("case:"):
        other = results.get(against.removeprefix("case:"), {}).get(system)
    else:
        other = results.get(case.id, {}).get(against)
    if mine is None or other is None:
        return None
    return paired_ratio(mine.rounds, other.rounds)


@dataclass
class Verdict:
    case: str
    target: str
    ratio: float | None  # None: a side is missing, so the target could not be judged
    met: bool | None

    def text(self) -> str:
        if self.ratio is None:
            return f"{self.target}: n/a"
        return f"{self.target}: {'yes' if self.met else 'NO'}"


def judge(case: Case, target: Target, results: Mapping[str, Mapping[str, Outcome]]) -> Verdict:
    ratio = ratio_to(results, case, NBREMOTE, target.against)
    return Verdict(case.id, target.text, ratio, None if ratio is None else ratio <= target.limit)


def verdicts(cases: Sequence[Case], results: Mapping[str, Mapping[str, Outcome]]) -> list[Verdict]:
    return [judge(c, t, results) for c in cases for t in c.targets]
