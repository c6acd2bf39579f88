"""The transport's on/off switches in the environment, read in each process where it decides: a feature is
on unless its variable says ``0``, ``false``, ``no`` or ``off`` (``NBREMOTE_SHM``, ``NBREMOTE_SHELL_PATH``,
``NBREMOTE_CPU_QOS``)."""

from __future__ import annotations

import os

__all__ = ["switched_on"]


def switched_on(variable: str) -> bool:
    """``variable`` does not turn its feature off (unset: on)."""
    return os.environ.get(variable, "1").strip().lower() not in ("0", "false", "no", "off")
