"""Idle CPUs that wake at once while messages flow: a Linux PM QoS request, held only around traffic.

Each message of a training step wakes a process that waited for it, on a CPU that went idle meanwhile.
On a virtual machine an idle vCPU halts: the host takes it back, and it returns slowly and runs cold.
On this project's 2-core VM, SGD's step on a ``Linear(256, 64)`` took 94-322 us after a 3 ms sleep
against 23-30 us hot; with the request below held while messages flowed, a small call took 0.56x and a
split model's training step 0.80x of their time without it. TensorPipe avoids halts by polling busily, always:
two cores taken while its world sits idle. nbremote instead asks the OS, while its messages flow, to
keep idle CPUs in their polling idle state: a request for 0 us of wake-up latency on
``/dev/cpu_dma_latency`` (the kernel's PM QoS interface; ``tuned``'s latency profiles use it too).
An idle CPU then loops in the kernel's idle loop, where a task that wakes runs at once. No process's
CPU time changes, and ``IDLE_S`` after the last message the request is withdrawn: an idle world asks for
nothing.

Every message a process sends renews its request (``touch``: a store and a test when held), so a worker
on another host keeps that host's CPUs quick too. Writing the device needs root (or a rule granting
it); where it is refused or absent (not Linux), nothing happens and nothing is retried.
``NBREMOTE_CPU_QOS=0`` turns it off. A forked child closes the request it inherited: it is not busy.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time

from nbremote.rpc._transport.switches import switched_on

__all__ = ["CPU_WAKE", "DEVICE", "IDLE_S", "CpuWake", "enabled_by_env"]

DEVICE = "/dev/cpu_dma_latency"
IDLE_S = 0.05  # s without a message sent before the request is withdrawn
_ZERO_US = struct.pack("=i", 0)


def enabled_by_env() -> bool:
    """``NBREMOTE_CPU_QOS`` (read in each process) does not turn the request off."""
    return switched_on("NBREMOTE_CPU_QOS")


class CpuWake:
    """One process's request: held while it sends messages, withdrawn ``idle_s`` after the last."""

    def __init__(self, device: str = DEVICE, idle_s: float = IDLE_S, *, enabled: bool | None = None) -> None:
        self.device, self.idle_s = device, idle_s
        self.possible = enabled_by_env() if enabled is None else enabled  # False once refused: never retried
        self.held = False
        self.busy = False  # a message was sent since the watcher last looked
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._watcher: threading.Thread | None = None
        os.register_at_fork(after_in_child=self._forget)

    def touch(self) -> None:
        """A message leaves this process: hold the request (the hot path: cheap unless it must be made)."""
        self.busy = True
        if not self.held and self.possible:
            self._hold()

    def _hold(self) -> None:
        with self._lock:
            if self.held or not self.possible:
                return
            try:
                fd = os.open(self.device, os.O_WRONLY | os.O_CLOEXEC)
            except OSError:  # not root, or no such device: this process never asks again
                self.possible = False
                return
            try:
                os.write(fd, _ZERO_US)
            except OSError:
                os.close(fd)
                self.possible = False
                return
            self._fd, self.held = fd, True
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="nbremote-cpuwake", daemon=True)
                self._watcher.start()
            self._wake.set()

    def _watch(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:  # a message in every idle_s keeps the request
                self.busy = False
                time.sleep(self.idle_s)
                if not self.busy:
                    break
            self.release()

    def release(self) -> None:
        """Withdraw the request now (the next message makes it again)."""
        with self._lock:
            fd, self._fd, self.held = self._fd, None, False
        if fd is not None:
            os.close(fd)  # closing the device is what withdraws a PM QoS request

    def _forget(self) -> None:
        """In a forked child: the inherited request is the parent's business, and its watcher is gone."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd, self.held, self.busy = None, False, False
        self._lock, self._wake, self._watcher = threading.Lock(), threading.Event(), None


CPU_WAKE = CpuWake()  # the process's one request (a PM QoS request is per open file; one is enough)
