"""The functions every system runs remotely, in a module of their own so each side imports them by name.

nbremote (cloudpickle) and torch.distributed.rpc both pickle a function of an importable module by
reference, so neither pays for shipping code here. This module must stay light (no numpy, no torch):
a worker imports it on its first call, and the world-start case times that call.
"""

from __future__ import annotations

from typing import Any


def noop() -> None:
    return None


def identity(x: Any) -> Any:
    return x
