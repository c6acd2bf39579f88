"""nbremote as a system: this process is the driver, its workers local kernels.

:class:`NbremoteWorld` holds one world (``driver`` + ``worker1..4``) for every case but world start, and
runs the cases through :class:`ApiRunner`, the program torch runs too. :class:`NbremoteAlias` runs the
small call on the same world with a function defined in ``__main__``, as in a notebook. nbremote keeps one
world per process, so :class:`NbremoteStart` (world start) runs only once the persistent world is closed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import _fns
from _apirunner import ApiRunner, nbremote_api
from _cases import NBREMOTE, Case
from _system import CALL_TIMEOUT, Block, System


def _names(n: int) -> list[str]:
    return [f"worker{i}" for i in range(1, n + 1)]


class NbremoteWorld(ApiRunner):
    name = NBREMOTE

    def __init__(self, workers: int = 4) -> None:
        super().__init__(nbremote_api(), _names(workers))
        self.running = False

    def start(self) -> None:
        self.api.rpc.init_rpc("driver", workers=self.workers)
        self.running = True

    def pids(self) -> list[int]:
        import os

        rpc = self.api.rpc
        return [rpc.rpc_sync(w, os.getpid) for w in self.workers] if self.running else []

    def close(self) -> None:
        if self.running:
            self.running = False
            # Not graceful: every call made here was waited for, except after a failure, when draining the
            # calls still pending could take CALL_TIMEOUT each.
            self.api.rpc.shutdown(graceful=False)


class NbremoteAlias(ApiRunner):
    """The small call on ``world`` with another function (one that cloudpickle ships by value)."""

    def __init__(self, world: NbremoteWorld, name: str, noop: Callable[[], None]) -> None:
        super().__init__(world.api, world.workers, noop=noop)
        self.world = world
        self.name = name

    def start(self) -> None:
        if not self.world.running:
            raise RuntimeError("nbremote's world did not start")

    def supports(self, case: Case) -> bool:
        return case.kind == "call"


class NbremoteStart(System):
    """World start: ``init_rpc`` with N local workers until a call to each has returned, then ``shutdown``."""

    name = NBREMOTE

    def supports(self, case: Case) -> bool:
        return case.kind == "start"

    def block(self, case: Case) -> Block:
        from nbremote import rpc

        names = _names(case.workers)
        t0 = time.perf_counter()
        rpc.init_rpc("driver", workers=names)
        ok = False
        try:
            t_init = time.perf_counter()
            for future in [rpc.rpc_async(n, _fns.noop, timeout=CALL_TIMEOUT) for n in names]:
                future.wait()
            t_ready = time.perf_counter()
            ok = True
        finally:
            t_stop = time.perf_counter()
            rpc.shutdown(graceful=ok)
            t_end = time.perf_counter()
        return Block([t_ready - t0], {"init_rpc alone": t_init - t0, "shutdown": t_end - t_stop})
