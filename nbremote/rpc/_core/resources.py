"""What a member reports about itself: its devices and the RRefs it owns (``rpc.worker_resources(name)``);
its CPU time, memory and recent tasks (``rpc.worker_activity(name)``, what the live dashboard reads).

:func:`resources` runs on the member asked, by RPC. Devices come from the framework it has already
imported (torch, else tensorplay): listing GPUs must not import a framework into a worker that does not
use one, nor create a CUDA context on every device (``mem_get_info`` would). Memory figures therefore
exist only where CUDA is initialised.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import psutil

from nbremote.rpc._core import current
from nbremote.rpc._core.tasks import Task

__all__ = ["DeviceInfo", "WorkerActivity", "WorkerResources", "dashboard_activity", "resources"]


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


@dataclass(frozen=True)
class WorkerActivity:
    """A worker's activity now (``rpc.worker_activity(name)``): CPU time and wall clock (two reads give the
    CPU %), resident memory, its devices (GPU memory in use where CUDA is initialised), calls served while the
    task stream was recorded, and the tasks that ended since the time asked for."""

    worker: str
    wall: float  # time.time() when read
    cpu_seconds: float  # the process's CPU time so far, every thread
    rss: int  # bytes
    devices: tuple[DeviceInfo, ...]
    served: int
    tasks: tuple[Task, ...]


def dashboard_activity(since: float, lease: float, reader: str = "") -> WorkerActivity:
    """Runs on the worker: its activity; ``reader``'s lease on the task stream is ``lease`` more seconds (0: none).
    ipykernel depends on psutil, so every kernel has it."""
    agent = current.current()
    log = agent.server.tasks
    log.renew(lease, reader)
    process = psutil.Process()
    times = process.cpu_times()
    return WorkerActivity(agent.name, time.time(), times.user + times.system, process.memory_info().rss,
                          _devices(), log.served, log.since(since))


def _devices() -> tuple[DeviceInfo, ...]:
    devices = [DeviceInfo("cpu")]
    for framework in ("torch", "tensorplay"):
        lib = sys.modules.get(framework)
        if lib is not None:
            devices += _cuda_devices(lib)
            break
    return tuple(devices)


def resources() -> WorkerResources:
    """Runs on the worker: its devices (cpu first) and how many RRef values it owns."""
    agent = current.current()
    return WorkerResources(agent.name, _devices(), len(agent.table))
