"""What the driver can tell about its workers: typed records for dashboards and scripts.

:class:`WorkerStatus` is the driver's own view of one worker (kind, host, pid, state, calls), built
without asking the worker anything, so a hung or busy worker still gets a row. :class:`WorkerResources`
is what only the worker knows (its devices and the memory in use on them, the RRefs it owns); it is
produced by :func:`resources`, which runs on the worker by RPC.

Devices come from the framework the worker has already imported (torch, else tensorplay): listing
GPUs must not import a framework into a worker that does not use one, nor create a CUDA context on
every device (``mem_get_info`` would). Memory figures therefore exist only where CUDA is initialised.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal

from nbremote.rpc import _state

WorkerKind = Literal["local", "kernelspec", "attached", "server"]
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


@dataclass(frozen=True)
class DeviceInfo:
    """A device of a worker; memory in bytes where the framework reports it (CUDA, once initialised)."""

    name: str
    memory_used: int | None = None
    memory_total: int | None = None


@dataclass(frozen=True)
class WorkerResources:
    """What a worker reports about itself (``rpc.worker_resources(name)``)."""

    worker: str
    devices: tuple[DeviceInfo, ...]
    owned_rrefs: int


def _cuda_devices(lib: Any) -> list[DeviceInfo]:
    cuda = getattr(lib, "cuda", None)
    if cuda is None or not cuda.is_available():
        return []
    initialised = bool(getattr(cuda, "is_initialized", lambda: False)())
    devices = []
    for index in range(int(cuda.device_count())):
        used = total = None
        if initialised:
            used = int(cuda.memory_allocated(index)) if hasattr(cuda, "memory_allocated") else None
            props = getattr(cuda, "get_device_properties", None)
            total = int(props(index).total_memory) if props is not None else None
        devices.append(DeviceInfo(f"cuda:{index}", used, total))
    return devices


def resources() -> WorkerResources:
    """Runs on the worker: its devices (cpu first) and how many RRef values it owns."""
    agent = _state.current()
    devices = [DeviceInfo("cpu")]
    for framework in ("torch", "tensorplay"):
        lib = sys.modules.get(framework)
        if lib is not None:
            devices += _cuda_devices(lib)
            break
    return WorkerResources(agent.name, tuple(devices), len(agent.table))
