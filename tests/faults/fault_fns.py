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
    return hashlib.sha256(np.ascontiguousarray(x).view(np.uint8).data).hexdigest()


def sleep_then(seconds: float, value: Any) -> Any:
    time.sleep(seconds)
    return value


def pid() -> int:
    return os.getpid()


_SERVED: list[int] = []


def echo_checked(seq: int, x: Any) -> tuple[int, Any, str]:
    """The load tests' call: note ``seq`` as served here, return it with ``x`` and the digest of ``x``."""
    _SERVED.append(seq)
    return seq, x, digest(x)


def served(clear: bool = False) -> list[int]:
    out = list(_SERVED)
    if clear:
        _SERVED.clear()
    return out


def rss_bytes() -> dict[str, int]:
    """This process's resident memory, in bytes: total, private (anon) and shared memory (shmem)."""
    import gc

    gc.collect()
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _rebuild_only_in(pid: int) -> OnlyHere:
    if os.getpid() != pid:
        raise RuntimeError(f"an OnlyHere object can only be rebuilt in process {pid}")
    return OnlyHere()


class OnlyHere:
    """Pickles, but unpickles only in the process that made it (a result the driver cannot load)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_only_in, (os.getpid(),)


def make_only_here() -> OnlyHere:
    return OnlyHere()


def make_lock() -> Any:
    import threading

    return threading.Lock()


def type_of(x: Any) -> str:
    return type(x).__name__


def touch(path: str) -> str:
    """Leave a side effect the security tests look for: proof that a message was run."""
    with open(path, "a") as f:
        f.write("ran\n")
    return path


def call_from_here(to: str, fn: Any, *args: Any) -> Any:
    """Runs on a worker: ``rpc_sync(to, fn, args)`` from there (a worker-to-worker call)."""
    from nbremote import rpc

    return rpc.rpc_sync(to, fn, args=args)
