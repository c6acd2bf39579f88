"""Functions the fault tests run on workers (importable there as ``faults.fault_fns``)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

_KEPT: list[Any] = []


def keep(value: Any) -> int:
    """Hold ``value`` (e.g. an RRef owned by another worker) here; returns its slot."""
    _KEPT.append(value)
    return len(_KEPT) - 1


def kept_to_here(slot: int) -> Any:
    return _KEPT[slot].to_here()


def drop_kept() -> None:
    _KEPT.clear()


def big_result(n_bytes: int, flag: str) -> Any:
    """A tensor of ``n_bytes``; touches ``flag`` just before returning it, so the caller can kill this
    process while the result is being sent."""
    import torch

    t = torch.ones(n_bytes // 4, dtype=torch.float32)
    Path(flag).touch()
    return t


def swallow(x: Any) -> int:
    """Receive an argument and return its size (a 64 MB argument's transfer is the point)."""
    return int(getattr(x, "nbytes", 0) or x.numel() * x.element_size())


def digest(x: Any) -> str:
    """SHA-256 of an array's or tensor's bytes (what the load tests compare with the driver's)."""
    if hasattr(x, "numpy"):
        x = x.numpy()
    return hashlib.sha256(np.ascontiguousarray(x).view(np.uint8)).hexdigest()


def sleep_then(seconds: float, value: Any) -> Any:
    time.sleep(seconds)
    return value


def pid() -> int:
    return os.getpid()
