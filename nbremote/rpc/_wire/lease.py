"""Leases: a worker frees what a caller held there once it has stopped hearing from that caller.

A kernel nbremote started dies with its driver. A kernel it did not start (attached, provisioned,
server-hosted) outlives a driver that crashed, and would keep the driver's values (RRefs, modules),
autograd contexts and links forever. So every caller renews a lease on each kernel it opened a link to
(a ``lease`` envelope every ``RENEW_SECONDS``, from its IO thread, whatever its main thread is doing),
and a worker that has not heard from a caller for ``LEASE_SECONDS`` treats it as gone: the tokens it
held are dropped (values no one else holds are freed), its autograd contexts released, its links
closed; a new driver can then attach and bootstrap the kernel afresh.

A worker only counts time it could have heard in: when it is itself stalled (its IO thread's ticks
stop: a C extension holding the GIL while it loads, a SIGSTOP), the stall is added to every lease.

What a user sees: a driver paused (SIGSTOP, a debugger) for longer than the lease finds, when it
resumes, its RRefs and modules on that worker gone ("not held ... any more"); the worker itself is
fine. Ten seconds is far above any pause of a live process's IO thread.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["LEASE_SECONDS", "RENEW_SECONDS", "Leases", "renew_every"]

# Read when a worker starts; NBREMOTE_LEASE_SECONDS (in the kernel's environment) changes it. A worker
# tells its callers its lease in its handshake; they renew four times per lease (at most every 2 s).
LEASE_SECONDS = float(os.environ.get("NBREMOTE_LEASE_SECONDS") or 10.0)
RENEW_SECONDS = 2.0


def renew_every(lease: object) -> float:
    """How often to renew a lease of ``lease`` seconds (what a worker's ack says; the default if absent)."""
    seconds = float(lease) if isinstance(lease, (int, float)) and lease > 0 else LEASE_SECONDS
    return min(RENEW_SECONDS, seconds / 4)


class Leases:
    """When each caller holding state here was last heard from (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._heard: dict[str, float] = {}

    def hold(self, caller: str) -> None:
        """``caller`` opened a link to us: its lease starts now."""
        with self._lock:
            self._heard[caller] = time.monotonic()

    def heard(self, caller: str) -> None:
        if caller in self._heard:  # a plain dict write: cheap enough for every message
            self._heard[caller] = time.monotonic()

    def forget(self, caller: str) -> None:
        with self._lock:
            self._heard.pop(caller, None)

    def extend(self, seconds: float) -> None:
        """This process itself was stalled for ``seconds`` (the GIL held by an import, SIGSTOP, a suspended
        machine): it could hear no one meanwhile, so nobody's lease counts that time."""
        with self._lock:
            for caller in self._heard:
                self._heard[caller] += seconds

    def expired(self, now: float, seconds: float = LEASE_SECONDS) -> list[str]:
        with self._lock:
            gone = [caller for caller, last in self._heard.items() if now - last > seconds]
            for caller in gone:
                del self._heard[caller]
            return gone
