"""Who is in the world: a member's name and rank (``WorkerInfo``), and the rule names follow."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["WorkerInfo", "check_name"]

_NAME = re.compile(r"^[A-Za-z0-9_:\-]{1,127}$")


@dataclass(frozen=True)
class WorkerInfo:
    """A member of the world: its unique ``name`` and its rank ``id`` (the driver is 0)."""

    name: str
    id: int

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


def check_name(name: object) -> str:
    """Worker names follow torch's rules: letters, digits, ``_``, ``:``, ``-``; 1 to 127 characters."""
    if not isinstance(name, str):
        raise TypeError(f"a worker name must be a str, got {type(name).__name__}")
    if not _NAME.match(name):
        raise ValueError(
            f"invalid worker name {name!r}: use 1-127 characters from letters, digits, '_', ':' and '-'")
    return name
