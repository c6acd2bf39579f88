"""What the driver can tell about its workers without asking them: :class:`WorkerStatus`, for dashboards.

A worker's status (kind, host, pid, state, calls) is built from what the driver knows, so a hung or busy
worker still gets a row. What only the worker knows (its devices, the RRefs it owns) it reports itself:
``nbremote.rpc._core.resources``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

WorkerKind = Literal["local", "kernelspec", "attached", "server", "slurm"]
WorkerState = Literal["starting", "idle", "busy", "dead"]


@dataclass(frozen=True)
class WorkerStatus:
    """One worker as the driver sees it (``rpc.worker_status()``)."""

    name: str
    rank: int
    kind: WorkerKind
    host: str
    pid: int | None
    state: WorkerState
    calls_in_flight: int
    calls_total: int
    log_path: str | None
    detail: str = ""  # why a dead worker died; what a starting worker is doing
