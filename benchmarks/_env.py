"""Where the figures come from: versions, cores, and how busy the machine was without us."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time
from typing import Any

PACKAGES = ("nbremote", "torch", "numpy", "pyzmq", "ipykernel", "jupyter_client", "cloudpickle", "ipyparallel")


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def cpu_seconds(*pids: int) -> float:
    """CPU time (user + system, every thread) the processes ``pids`` have used so far (``/proc``; 10 ms ticks)."""
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_busy(window: float = 0.5) -> float | None:
    """Fraction of all cores busy over ``window`` seconds (Linux ``/proc/stat``), while this script idles."""
    try:
        with open("/proc/stat") as f:
            before = [int(v) for v in f.readline().split()[1:]]
        time.sleep(window)
        with open("/proc/stat") as f:
            after = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    delta = [b - a for a, b in zip(before, after, strict=True)]
    idle = delta[3] + delta[4]  # idle + iowait
    return 1 - idle / sum(delta) if sum(delta) else None


def load(when: str) -> dict[str, Any]:
    """How busy the machine is while this script idles: other processes inflate every figure."""
    return {"when": when, "cpu_busy": cpu_busy(), "loadavg_1min": os.getloadavg()[0], "cores": os.cpu_count()}


def load_note(sample: dict[str, Any]) -> str:
    busy = sample["cpu_busy"]
    text = f"load {sample['when']}: load average {sample['loadavg_1min']:.2f} on {sample['cores']} cores"
    if busy is None:
        return text
    flag = "  <- BUSY: other processes compete for the cores, figures are inflated" if busy > 0.2 else ""
    return f"{text}, CPU busy (other processes) {busy:.0%}{flag}"


def environment() -> dict[str, Any]:
    return {"versions": versions(), "platform": platform.platform(), "cores": os.cpu_count(),
            "machine": platform.machine(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
