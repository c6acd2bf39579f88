"""The seam between the harness and the systems it compares.

A :class:`System` is started once and kept alive for the whole run; the harness then drives it case by case:
``prepare`` (warm-up and correctness checks, untimed), one ``block`` per round, ``finish``. A system that
cannot do a case says so in ``supports``; one that breaks raises, and the harness records the error.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from _cases import Case

# Seconds before a call counts as lost: far above any figure here (the slowest, a 64 MB numpy echo through
# torch, which pickles it in-band, took ~6 s on 2 busy cores), yet a lost reply costs the run 30 s rather
# than torch's and nbremote's default 60 s per call.
CALL_TIMEOUT = 30.0


@dataclass
class Block:
    samples: list[float]  # seconds
    extra: dict[str, float] = field(default_factory=dict)  # side figures of this block, by name


class System:
    """Base of every system: supports nothing, needs no preparation, holds nothing."""

    name = "?"

    def start(self) -> None:
        """Start what the system needs (processes, kernels); may return before it is ready."""

    def wait_ready(self) -> None:
        """Wait until what ``start`` began can take calls, so that slow starts overlap."""

    def supports(self, case: Case) -> bool:
        return False

    def prepare(self, case: Case) -> dict[str, Any]:
        """Warm up and check the case's results once, outside the timing; returns what the checks found."""
        return {}

    def block(self, case: Case) -> Block:
        raise NotImplementedError

    def finish(self, case: Case) -> None:
        """Drop what ``prepare`` built for the case."""

    def close(self) -> None:
        """End everything the system started (processes, kernels, sockets); safe to call twice."""

    def pids(self) -> list[int]:
        """The processes the system runs besides this one (its idle CPU is measured; see ``_harness``)."""
        return []


class OpSystem(System):
    """A system whose sample in a case is one operation, built by ``make`` and timed back to back."""

    def __init__(self) -> None:
        self._ops: dict[str, Callable[[], Any]] = {}  # by case id

    def make(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        """What the case's checks found, and the operation one sample times."""
        raise NotImplementedError

    def prepare(self, case: Case) -> dict[str, Any]:
        info, op = self.make(case)
        self._ops[case.id] = op
        timed(op, case.warmup)
        return info

    def block(self, case: Case) -> Block:
        if case.kind == "burst":
            gc.collect()  # a burst leaves 1,000 futures behind: collect between bursts, not during one
        return Block(timed(self._ops[case.id], case.block))

    def finish(self, case: Case) -> None:
        self._ops.pop(case.id, None)


def timed(fn: Callable[[], Any], n: int) -> list[float]:
    """Wall times (seconds) of ``n`` back-to-back calls of ``fn``."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times
