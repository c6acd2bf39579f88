"""The values a module's training history travels as, and its flags: plain records, pure functions.

Recorded on the owner (``nbremote.history``), sent by RPC, read by the panel and by tests with plain values.
Flags are computed on read from the newest gradient norms; their thresholds are these constants:

* ``nonfinite``: the newest gradient (or weight) has a NaN or an infinity;
* ``vanishing``: the newest gradient norm is below :data:`VANISHING` (1e-7) -- zero included: the
  parameter no longer learns (a dead ReLU layer, a detached branch, an unused parameter);
* ``exploding``: the newest gradient norm is above :data:`EXPLODING` (1e3), or above :data:`SPIKE` (20)
  times the median of the norms recorded before it (at least 8 of them).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

__all__ = ["EXPLODING", "SPIKE", "VANISHING", "ActivationHistory", "ModuleHistory", "ParameterHistory", "flags"]

VANISHING = 1e-7
EXPLODING = 1e3
SPIKE = 20.0
_SPIKE_BASE = 8  # norms needed before a spike can be judged against their median


def flags(grad_norms: tuple[float, ...], norms: tuple[float, ...] = ()) -> tuple[str, ...]:
    """The flags of one parameter, from its recorded gradient norms (oldest first) and weight norms."""
    if not grad_norms:
        return ()
    last = grad_norms[-1]
    if not math.isfinite(last) or (norms and not math.isfinite(norms[-1])):
        return ("nonfinite",)
    if last < VANISHING:
        return ("vanishing",)
    earlier = [g for g in grad_norms[:-1] if math.isfinite(g)]
    if last > EXPLODING or (len(earlier) >= _SPIKE_BASE and last > SPIKE * statistics.median(earlier) > 0):
        return ("exploding",)
    return ()


@dataclass(frozen=True)
class ParameterHistory:
    """One parameter's last steps, oldest first (``step`` counts the steps recorded for it)."""

    name: str
    step: tuple[int, ...]
    norm: tuple[float, ...]
    grad_norm: tuple[float, ...]
    update_ratio: tuple[float, ...]

    @property
    def flags(self) -> tuple[str, ...]:
        return flags(self.grad_norm, self.norm)


@dataclass(frozen=True)
class ActivationHistory:
    """The output of one leaf module (a layer) over its last forwards, oldest first: mean and standard deviation."""

    name: str
    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass(frozen=True)
class ModuleHistory:
    """What the owner recorded for a module: its parameters' rings, its metric streams, whether it records."""

    worker: str
    recording: bool
    parameters: tuple[ParameterHistory, ...] = ()
    metrics: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)  # name -> ((time, value),)
    activations: tuple[ActivationHistory, ...] = ()

    def parameter(self, name: str) -> ParameterHistory:
        for p in self.parameters:
            if p.name == name:
                return p
        raise KeyError(f"no parameter {name!r} in the history of a module on {self.worker!r}")

    @property
    def flagged(self) -> dict[str, tuple[str, ...]]:
        """Parameter name -> its flags, for the parameters that have any."""
        return {p.name: p.flags for p in self.parameters if p.flags}
