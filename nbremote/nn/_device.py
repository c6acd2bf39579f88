"""Where a RemoteModule lives: the ``remote_device`` string and the error for a missing device.

A remote device names a worker and a device on it::

    "worker1/cuda:0"    worker by name, explicit device
    "worker1/cpu"
    "worker1"           the device defaults to "cpu"
    "rank:1/cpu"        worker by rank (the driver is rank 0 unless init_rpc gave it another;
                        workers take the other ranks in joining order)

Devices are ``cpu``, ``cuda`` and ``cuda:<index>``, the placements RemoteModule can move tensors to and
from; anything else (``cpu2``, ``foo``, ``cuda:x``) is refused here, before any message is sent, rather
than failing later inside a framework on the worker.

:func:`parse_remote_device` is pure (no RPC, no framework import) so it is unit-tested with plain
strings. Whether the device *exists* can only be answered by the worker; that check raises
:class:`nbremote.errors.RemoteDeviceError` (re-exported here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nbremote.errors import RemoteDeviceError

__all__ = ["ACCEPTED_FORMS", "RemoteDevice", "RemoteDeviceError", "parse_remote_device"]

ACCEPTED_FORMS = '"<worker>/<device>", "<worker>" (device cpu), "rank:<N>/<device>" or "rank:<N>"'

# A worker name is anything without a slash or whitespace; "rank:<N>" is reserved for ranks.
_WORKER = re.compile(r"[^/\s]+")
_RANK = re.compile(r"rank:(\d+)")
_DEVICE = re.compile(r"cpu|cuda(?::(\d+))?")


@dataclass(frozen=True)
class RemoteDevice:
    """A parsed ``remote_device``: ``worker`` is a name (str) or a rank (int); ``device`` is normalised."""

    worker: str | int
    device: str = "cpu"

    @property
    def device_type(self) -> str:
        """``"cpu"`` or ``"cuda"``."""
        return self.device.partition(":")[0]

    @property
    def device_index(self) -> int | None:
        """The CUDA index, ``None`` for ``"cpu"`` and for a bare ``"cuda"`` (the current device)."""
        _, _, index = self.device.partition(":")
        return int(index) if index else None

    def __str__(self) -> str:
        worker = f"rank:{self.worker}" if isinstance(self.worker, int) else self.worker
        return f"{worker}/{self.device}"


def _malformed(text: str, why: str) -> ValueError:
    return ValueError(f"malformed remote_device {text!r}: {why}; accepted forms are {ACCEPTED_FORMS}")


def parse_remote_device(text: str) -> RemoteDevice:
    """Parse ``"<worker>[/<device>]"`` or ``"rank:<N>[/<device>]"``; raise ``ValueError`` otherwise."""
    if not isinstance(text, str):
        raise TypeError(f"remote_device must be a str such as 'worker1/cpu', got {type(text).__name__}")
    parts = text.split("/")
    if len(parts) > 2:
        raise _malformed(text, "more than one '/'")
    worker_part = parts[0]
    if not worker_part:
        raise _malformed(text, "the worker name is empty")
    if not _WORKER.fullmatch(worker_part):
        raise _malformed(text, f"{worker_part!r} is not a worker name (no whitespace allowed)")
    worker: str | int = worker_part
    if worker_part.startswith("rank:"):
        rank = _RANK.fullmatch(worker_part)
        if rank is None:
            raise _malformed(text, f"{worker_part!r} is not 'rank:<non-negative integer>'")
        worker = int(rank.group(1))
    if len(parts) == 1:
        return RemoteDevice(worker)
    device = parts[1]
    if not device:
        raise _malformed(text, "the device after '/' is empty")
    match = _DEVICE.fullmatch(device)
    if match is None:
        raise _malformed(text, f"unknown device {device!r} (use 'cpu', 'cuda' or 'cuda:<index>')")
    if match.group(1) is not None:
        device = f"cuda:{int(match.group(1))}"  # "cuda:01" -> "cuda:1"
    return RemoteDevice(worker, device)
