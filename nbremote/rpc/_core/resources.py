"""What a member reports about itself (``rpc.worker_resources(name)``): its devices and the RRefs it owns.

:func:`resources` runs on the member asked, by RPC. Devices come from the framework it has already
imported (torch, else tensorplay): listing GPUs must not import a framework into a worker that does not
use one, nor create a CUDA context on every device (``mem_get_info`` would). Memory figures therefore
exist only where CUDA is initialised.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from nbremote.rpc._core import current

__all__ = ["DeviceInfo", "WorkerResources", "resources"]


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
    agent = current.current()
    devices = [DeviceInfo("cpu")]
    for framework in ("torch", "tensorplay"):
        lib = sys.modules.get(framework)
        if lib is not None:
            devices += _cuda_devices(lib)
            break
    return WorkerResources(agent.name, tuple(devices), len(agent.table))
