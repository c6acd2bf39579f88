"""ipyparallel as a system, when it is installed: a local cluster of 3 engines driven from this process.

Small call and echo are ``view.apply_sync(fn, ...)`` on engine 0; a burst is ``apply_async`` round robin
over direct views of 1 or 3 engines, waited for with ``get()``. ipyparallel ships a function's code object
by value and imports its module on the engine for its globals: its normal path, whatever the function, so
the engines get this directory on ``sys.path`` as nbremote's and torch's workers do. It is optional:
without it the system reports itself skipped.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import _fns
from _cases import IPP, Case
from _payload import make_payload, same_bits
from _system import CALL_TIMEOUT, OpSystem


def unavailable() -> str | None:
    """Why ipyparallel cannot take part, or None when it can."""
    try:
        import ipyparallel  # noqa: F401 -- only whether it imports
    except ImportError as exc:
        return f"ipyparallel is not installed (`pip install ipyparallel` to include it; {exc})"
    return None


class IpyParallel(OpSystem):
    name = IPP

    def __init__(self, engines: int = 3) -> None:
        super().__init__()
        self.engines = engines
        self.start_seconds: float | None = None  # cluster start to all engines registered, for the notes
        self._cluster: Any = None
        self._client: Any = None
        self._views: list[Any] = []

    def start(self) -> None:
        import ipyparallel as ipp

        t0 = time.perf_counter()
        self._cluster = ipp.Cluster(n=self.engines, log_level=logging.ERROR)
        self._client = self._cluster.start_and_connect_sync(activate=False)
        self._client.wait_for_engines(self.engines, timeout=120, interactive=False)
        self.start_seconds = time.perf_counter() - t0
        self._views = [self._client[i] for i in sorted(self._client.ids)[: self.engines]]
        here = os.path.dirname(os.path.abspath(_fns.__file__))
        self._client[:].execute(f"import sys\nif {here!r} not in sys.path: sys.path.insert(0, {here!r})", block=True)

    def supports(self, case: Case) -> bool:
        return case.kind in ("call", "echo", "burst")

    def _apply(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._views[0].apply_async(fn, *args).get(timeout=CALL_TIMEOUT)

    def make(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        if case.kind == "call":
            return {}, lambda: self._apply(_fns.noop)
        if case.kind == "echo":
            x = make_payload(case.nbytes, case.payload)
            return {"bit_exact": same_bits(self._apply(_fns.identity, x), x)}, lambda: self._apply(_fns.identity, x)
        return {}, self._burst_op(case)

    def _burst_op(self, case: Case) -> Callable[[], None]:
        views = self._views[: case.workers]

        def burst() -> None:
            results = [views[i % len(views)].apply_async(_fns.noop) for i in range(case.inflight)]
            for result in results:
                result.get(timeout=CALL_TIMEOUT)

        return burst

    def close(self) -> None:
        client, cluster = self._client, self._cluster
        self._client = self._cluster = None
        self._views = []
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.stop_cluster_sync()
