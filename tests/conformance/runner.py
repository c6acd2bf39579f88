"""The driver's side: start the world, find torch's tests, run each on every rank with a deadline.

The world is the one torch's suites are written for: four ranks named ``worker0``..``worker3``; here
``worker0`` is this process (the driver, rank 0) and the others are worker kernels it starts. Every
rank installs the overlay (``shim``) before it imports a test module. Each test runs on all four ranks
at once (``ranks.run``): rank 0 on a thread of this process, the others as an RPC to their kernel,
all under one deadline. A test that overruns it is cancelled where it runs (the RPC's own timeout
on the workers, an asynchronous ``KeyboardInterrupt`` on rank 0) and the world is restarted, so a
hang cannot spill into the next test.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import sys
import tempfile
import threading
import time
import unittest
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from tests.conformance import ranks

__all__ = ["FILES", "Result", "Test", "World", "discover"]

#: the files torch's suite is made of (its test modules, by the short name reports use)
FILES = {
    "rpc_test.py": "torch.testing._internal.distributed.rpc.rpc_test",
    "dist_autograd_test.py": "torch.testing._internal.distributed.rpc.dist_autograd_test",
    "dist_optimizer_test.py": "torch.testing._internal.distributed.rpc.dist_optimizer_test",
    "remote_module_test.py": "torch.testing._internal.distributed.nn.api.remote_module_test",
    "examples/parameter_server_test.py": "torch.testing._internal.distributed.rpc.examples.parameter_server_test",
    "examples/reinforcement_learning_rpc_test.py":
        "torch.testing._internal.distributed.rpc.examples.reinforcement_learning_rpc_test",
}
WORLD_SIZE = 4  # what torch's RpcAgentTestFixture asks for
WORKERS = [ranks.rank_name(rank) for rank in range(1, WORLD_SIZE)]
PREPARE_TIMEOUT = 30.0
GRACE = 5.0  # s past the deadline a cancelled rank 0 gets to unwind before the world is restarted


@dataclass(frozen=True)
class Test:
    file: str  # a key of FILES
    cls: str
    method: str

    @property
    def module(self) -> str:
        return FILES[self.file]

    @property
    def id(self) -> str:
        return f"{self.cls}.{self.method}"


@dataclass
class Result:
    test: Test
    outcome: str  # "pass", "fail", "skip", "deadline"
    seconds: float
    error: str = ""  # "type: message" of the rank that failed first (the others often just wait for it)
    rank: int | None = None
    tb: str = ""
    ranks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def overran(self) -> bool:
        """Some rank ran past the deadline: what it left running may disturb later tests."""
        return any(o.get("outcome") == "deadline" for o in self.ranks)


def discover(files: list[str]) -> list[Test]:
    """Every test method of every test class the files define, in the order torch's loader gives them."""
    from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture

    loader = unittest.TestLoader()
    tests = []
    for file in files:
        module = importlib.import_module(FILES[file])
        for name, obj in vars(module).items():
            if (isinstance(obj, type) and issubclass(obj, RpcAgentTestFixture) and obj.__module__ == module.__name__
                    and obj is not RpcAgentTestFixture):
                tests += [Test(file, name, method) for method in loader.getTestCaseNames(obj)]  # type: ignore[arg-type]
    return tests


class World:
    """The four ranks: this process and three worker kernels, restarted after a hang."""

    def __init__(self, default_timeout: float = 60.0) -> None:
        self.default_timeout = default_timeout
        self.starts = 0
        self._sizes: dict[tuple[str, str], int] = {}

    def start(self) -> None:
        from nbremote import rpc

        # Workers inherit the environment: torch's TestCase would append "to execute this test, run ..." to
        # every error message.
        os.environ["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
        ranks.install()
        rpc.init_rpc(ranks.rank_name(0), workers=WORKERS, rpc_timeout=self.default_timeout)
        for worker in WORKERS:
            rpc.rpc_sync(worker, ranks.install, timeout=PREPARE_TIMEOUT)
        self.starts += 1

    def stop(self) -> None:
        from nbremote import rpc

        if rpc.is_initialized():
            from nbremote.rpc._core import current_agent, joining

            joining.reset(current_agent())  # rank 0's join, if a test left it: else shutdown would only leave it
            rpc.shutdown(graceful=False)

    def restart(self) -> None:
        self.stop()
        self.start()

    def run(self, test: Test, deadline: float) -> Result:
        """``test`` on its ranks; its outcome."""
        from nbremote import rpc

        size = self._world_size(test)
        fd, file_name = tempfile.mkstemp(prefix="nbremote-conformance-")  # torch's per-test init file
        os.close(fd)
        started = time.monotonic()
        try:
            prepare = (test.module, test.cls, f"{test.id}#{started}", size, self.default_timeout)
            ranks.prepare(*prepare)
            rpc.wait_all([rpc.rpc_async(w, ranks.prepare, args=prepare, timeout=PREPARE_TIMEOUT) for w in WORKERS])
            args = (test.module, test.cls, test.method)
            futures = [rpc.rpc_async(ranks.rank_name(rank), ranks.run, args=(*args, rank, file_name), timeout=deadline)
                       for rank in range(1, size)]
            rank0 = _Rank0(lambda: ranks.run(*args, 0, file_name))
            rank0.join(deadline)
            outcomes: list[dict[str, Any]] = [rank0.outcome or _overran(0, deadline, ranks.stack())]
            for rank, fut in enumerate(futures, start=1):
                try:
                    outcomes.append(fut.wait(max(0.0, deadline - (time.monotonic() - started)) + GRACE))
                except Exception:  # the RPC's timeout: the rank overran the deadline; where was it?
                    try:
                        where = rpc.rpc_sync(ranks.rank_name(rank), ranks.stack, timeout=GRACE)
                    except Exception as exc:
                        where = f"(no stack: {exc})"
                    outcomes.append(_overran(rank, deadline, where))
            if rank0.outcome is None:
                rank0.cancel()
        finally:
            with contextlib.suppress(OSError):
                os.unlink(file_name)
        return _verdict(test, outcomes, time.monotonic() - started)

    def _world_size(self, test: Test) -> int:
        key = (test.module, test.cls)
        if key not in self._sizes:
            self._sizes[key] = ranks.world_size_of(test.module, test.cls)
        return self._sizes[key]


class _Rank0:
    """Rank 0's part of a test, on a thread of the driver (so that the deadline can be enforced)."""

    def __init__(self, body: Callable[[], dict[str, Any]]) -> None:
        self.outcome: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, args=(body,), name="conformance-rank0", daemon=True)
        self._thread.start()

    def _run(self, body: Callable[[], dict[str, Any]]) -> None:
        self.outcome = body()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def cancel(self) -> None:
        ident = self._thread.ident
        if ident is not None and self._thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt))
            self._thread.join(GRACE)


def _overran(rank: int, deadline: float, stack: str) -> dict[str, Any]:
    return {"outcome": "deadline", "type": "deadline", "message": f"rank {rank} overran {deadline:.0f} s",
            "tb": f"rank {rank} was at:\n{stack}"}


def _verdict(test: Test, outcomes: list[dict[str, Any]], seconds: float) -> Result:
    kinds = [o["outcome"] for o in outcomes]
    if all(k == "pass" for k in kinds):
        return Result(test, "pass", seconds, ranks=outcomes)
    if "skip" in kinds:
        o = outcomes[kinds.index("skip")]
        return Result(test, "skip", seconds, f"unittest.SkipTest: {o['message']}", kinds.index("skip"), ranks=outcomes)
    # The first rank that failed on its own: others often only fail waiting for it (at shutdown's barrier).
    order = sorted(range(len(outcomes)), key=lambda r: (kinds[r] != "fail", _at_barrier(outcomes[r]), r))
    rank = order[0]
    o = outcomes[rank]
    outcome = "deadline" if kinds[rank] == "deadline" else "fail"
    return Result(test, outcome, seconds, f"{o.get('type')}: {o.get('message')}", rank, o.get("tb", ""), outcomes)


def _at_barrier(outcome: dict[str, Any]) -> bool:
    from nbremote.rpc._core.gathering import JOIN_PREFIX, PREFIX  # how the product's barriers say they gave up

    return str(outcome.get("message", "")).startswith((PREFIX, JOIN_PREFIX))


@contextlib.contextmanager
def quiet(log_path: str) -> Iterator[TextIO]:
    """Send what the tests print -- every rank's output arrives here, and torch's C++ writes to the file
    descriptors themselves -- to ``log_path``; yields a stream to the real stdout, for progress."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log_path, "w") as log, os.fdopen(os.dup(saved[0]), "w") as progress:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield progress
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
