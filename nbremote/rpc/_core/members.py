"""Who is in the world: a member's name and rank (``WorkerInfo``), and the rule names follow."""

from __future__ import annotations

import re
from dataclasses import dataclass

from nbremote.errors import also_runtime_error

__all__ = ["WorkerInfo", "check_name"]

_NAME = re.compile(r"^[A-Za-z0-9_:\-]{1,127}$")


@dataclass(frozen=True)
class WorkerInfo:
    """A member of the world: its unique ``name`` (checked by :func:`check_name`) and its rank ``id`` (the
    driver is 0)."""

    name: str
    id: int

    def __post_init__(self) -> None:
        check_name(self.name)

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


def check_name(name: object) -> str:
    """Worker names follow torch's rules: letters, digits, ``_``, ``:``, ``-``; 1 to 127 characters.

    A bad one is a ``ValueError`` that is also a ``RuntimeError`` (torch's type), its message in torch's words.
    """
    if not isinstance(name, str):
        raise TypeError(f"a worker name must be a str, got {type(name).__name__}")
    if not _NAME.match(name):
        why = ("must be non-empty" if not name else "must be shorter than 128 characters" if len(name) > 127
               else "Worker name must match ^[A-Za-z0-9-_:]*$")
        raise also_runtime_error(ValueError(
            f"invalid worker name {name[:40]!r}{'...' if len(name) > 40 else ''}: {why} (1-127 characters from "
            "letters, digits, '_', ':' and '-')"))
    return name
