"""The echo cases' payloads, built the same in every process (seeded), and the bit-exact check."""

from __future__ import annotations

from typing import Any

import numpy as np


def make_payload(nbytes: int, kind: str) -> Any:
    """``nbytes`` of float32 as a numpy array or a torch CPU tensor; the same numbers for the same size."""
    array = np.random.default_rng(nbytes).standard_normal(nbytes // 4, dtype=np.float32)
    if kind == "numpy":
        return array
    if kind == "torch":
        import torch

        return torch.from_numpy(array)
    raise ValueError(f"unknown payload kind {kind!r} (numpy or torch)")


def as_bytes(x: Any) -> np.ndarray:
    """The payload's bytes as a uint8 array, without a copy (a torch CPU tensor through its numpy view)."""
    array = x if isinstance(x, np.ndarray) else x.detach().numpy()
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def same_bits(a: Any, b: Any) -> bool:
    """Same type, dtype, shape and bytes (NaN-safe, unlike ==)."""
    if type(a) is not type(b) or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return bool(np.array_equal(as_bytes(a), as_bytes(b)))
