"""What a RemoteModule handle offers to watch its module train: the owner's record of it, and metric streams.

A mixin of :class:`~nbremote.nn.RemoteModule`. The recording happens on the owner (:mod:`nbremote.history`);
these methods read it and feed it, and the module panel shows both.
"""

from __future__ import annotations

import time
from typing import Any

from nbremote import history, rpc
from nbremote.history import ModuleHistory
from nbremote.rpc._core import current_agent, introspection

__all__ = ["Watched"]


class Watched:
    """``remote_history()`` and ``log(**metrics)`` for a handle with ``on`` and ``module_rref``."""

    on: str
    module_rref: rpc.RRef[Any]

    def remote_history(self, lease: float | None = None, *, reader: str = "") -> ModuleHistory:
        """What the owner recorded of the module's training: each parameter's norm, gradient norm and update
        ratio over its last steps, the metrics given to :meth:`log`, and flags (see :mod:`nbremote.history`).

        Recording is off until asked for: ``lease=seconds`` records every optimizer step for that long from
        now (each call renews it; the live panel does so on every refresh), ``lease=0`` stops, ``None``
        only reads. Each ``reader`` (a name) has its own lease: recording goes on while any holds.
        """
        with introspection():  # looking at the module is not a call a status display should count
            result: ModuleHistory = rpc.rpc_sync(self.on, history.read, args=(self.module_rref, lease, reader))
        return result

    def log(self, **metrics: Any) -> None:
        """Add a point to metric streams of this module that its panel plots live: ``net.log(loss=loss)``.

        Values are numbers (a one-element tensor is read with ``float``). They are kept on the module's
        owner, the last :data:`~nbremote.history.METRIC_POINTS` of each, wherever the loop runs; the call
        sends them without waiting for a reply.
        """
        values = {}
        for name, value in metrics.items():
            try:
                values[name] = float(value)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise TypeError(f"{self!r}.log({name}=...) takes a number or a one-element tensor, not "
                                f"{type(value).__name__} ({exc})") from None
        if values:
            current_agent().notify(self.on, history.log_metrics, (self.module_rref._id, time.time(), values))
