"""One rank of one of torch's tests, in whichever process holds that rank (the driver or a worker kernel).

torch runs a test by spawning ``world_size`` fresh processes, each of which runs the test method under
``dist_init``: ``init_rpc(name, backend=, rank=, world_size=, rpc_backend_options=)``, the body,
``shutdown()``. Here the processes are the running world -- the driver is ``worker0`` (rank 0), the
worker kernels ``worker1..3`` -- and a test runs on its first ``world_size`` ranks at once (4 for most
classes, 2 or 3 for some of ``remote_module_test``'s): the runner calls :func:`prepare` on every rank,
then :func:`run` on the test's ranks, under one deadline.

What stands in for a fresh process:

* the test's module is reloaded on every rank before the test (:func:`prepare`): its globals
  (``rpc_done``, ``VALUE_FUTURE``, ...) start as in a fresh process; reloading costs ~5 ms;
* the test class gets nbremote's fixture mixed in there (as ``rpc_utils.generate_tests`` mixes an
  agent's) and is put in the module under its name, so that it pickles by name like torch's generated
  classes do;
* ``common_utils.set_rng_seed()`` runs before the body, as ``MultiProcessTestCase.run_test`` does; a gloo
  process group a test made is destroyed; the default timeout is the world's again.

Start-up is nbremote's own (``rpc.init_rpc`` in a running world joins it, ``rpc.shutdown`` is torch's graceful
shutdown without the ending: ``nbremote.rpc._core.joining``), with what a test's world adds:

* ``init_rpc`` checks backend and options as the product does, and name, rank and world size against the
  *test's* world -- its first ``world_size`` ranks, which may be fewer than the running world's four -- then
  joins, collectively (torch's rendezvous); the barrier of its ``shutdown`` waits for those ranks (those of
  rank < ``world_size``); a test that gives no world size (torch's dynamic start-up) joins alone, and its
  barrier waits for the ranks that joined;
* ``shutdown`` without a join (or after its own) is torch's "RPC has not been initialized" here: the
  product's would end the world on rank 0, the driver;
* a rank that failed tells the barrier (``_fail``): the others leave it at once, naming it. The world keeps
  running for the next test.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import traceback
import unittest
from typing import Any

from nbremote.rpc._core import joining
from tests.conformance import shim

__all__ = ["install", "prepare", "rank_name", "run", "stack", "world_size_of"]

BARRIER_TIMEOUT = 60.0  # s a rank waits at shutdown for the others (the test's deadline is shorter)

_test: dict[str, Any] = {}  # this rank's test: "key", "world_size", "thread"


def rank_name(rank: int) -> str:
    return f"worker{rank}"  # torch's dist_utils.worker_name


# -- start-up: the product's, in the test's world -------------------------------------------------------------


def init_rpc(name: str, backend: object = None, rank: int = -1, world_size: int | None = None,
             rpc_backend_options: object = None) -> None:
    """torch's ``init_rpc`` in a process that is already a member of the running world: it joins."""
    from nbremote import rpc

    timeout = rpc._start_up_options(backend, rpc_backend_options)
    size = _test.get("world_size", len(rpc.workers()))
    joining.check(_agent(), name, None if rank == -1 else rank, world_size, size)
    joining.join(_agent(), None if world_size is None else size, timeout)  # torch's dynamic start-up: no rendezvous


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """torch's graceful ``shutdown``: the product's barrier among the test's ranks, without the ending."""
    from nbremote import rpc

    if _agent().joined is None:
        raise RuntimeError("RPC has not been initialized. Call torch.distributed.rpc.init_rpc first.")
    rpc.shutdown(graceful, timeout if timeout and timeout > 0 else BARRIER_TIMEOUT)


def _fail(key: str, rank: int, why: str) -> None:
    """On rank 0: ``rank`` failed in test ``key``; whoever waits at the barrier gives up at once, naming it.
    (A rank of an earlier test that overran may report late: its key is not this test's.)"""
    if key == _test.get("key"):
        joining.failed(rank_name(rank), why)


def _on_rank0(fn: Any, *args: Any) -> Any:
    from nbremote import rpc

    return rpc.rpc_sync(rank_name(0), fn, args=args, timeout=BARRIER_TIMEOUT)


def _agent() -> Any:
    from nbremote.rpc._core import current_agent

    return current_agent()


# -- a test on this rank -----------------------------------------------------------------------------------


def install() -> None:
    """Overlay torch's modules here (every rank, once, before any test module is imported)."""
    shim.install({"init_rpc": init_rpc, "shutdown": shutdown})


def world_size_of(module_name: str, class_name: str) -> int:
    """The ``world_size`` a test class asks for (a property that reads nothing of its instance)."""
    install()
    cls = getattr(importlib.import_module(module_name), class_name)
    return int(cls.world_size.fget(None))


def prepare(module_name: str, class_name: str, key: str, world_size: int, default_timeout: float) -> None:
    """Before a test: its module reloaded (fresh globals), its class made, this rank's state reset."""
    install()
    module = sys.modules.get(module_name)
    module = importlib.import_module(module_name) if module is None else importlib.reload(module)
    test_class = _test_class(getattr(module, class_name))
    setattr(module, test_class.__name__, test_class)
    _test.clear()
    _test.update(key=key, world_size=world_size)
    joining.reset(_agent())  # a join an earlier test left (it failed before its shutdown); on rank 0, its round
    import torch.distributed as dist

    if dist.is_initialized():  # a test's gloo group (initialize_pg): torch's harness destroys it at exit
        dist.destroy_process_group()
    _agent().default_timeout = default_timeout


def run(module_name: str, class_name: str, method: str, rank: int, file_name: str) -> dict[str, Any]:
    """Run ``class_name.method`` as rank ``rank``; what happened, as plain values."""
    from torch.testing._internal import common_utils

    cls = getattr(sys.modules[module_name], _composed_name(class_name))
    _test["thread"] = threading.get_ident()
    try:
        case = cls(method)
        case.rank = rank
        case.file_name = file_name
        common_utils.set_rng_seed()
        getattr(case, method)()
    except unittest.SkipTest as exc:
        return {"outcome": "skip", "type": "unittest.SkipTest", "message": str(exc), "tb": ""}
    except BaseException as exc:  # everything a rank raises is the test's result
        with contextlib.suppress(Exception):  # the others need not wait for this rank at shutdown
            _on_rank0(_fail, _test.get("key"), rank, f"its test raised {type(exc).__name__}")
        return {"outcome": "fail", "type": _qualified(exc), "message": str(exc),
                "tb": "".join(traceback.format_exception(exc))}
    return {"outcome": "pass"}


def stack() -> str:
    """Where this rank's test is now (for a rank that overran its deadline)."""
    frame = sys._current_frames().get(_test.get("thread", 0))
    return "".join(traceback.format_stack(frame)) if frame is not None else "(not running)"


def _qualified(exc: BaseException) -> str:
    t = type(exc)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _composed_name(class_name: str) -> str:
    return f"NbRemote{class_name}"


def _test_class(test_class: type) -> type:
    """torch's test class with nbremote's fixture mixed in."""
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture

    class NbRemoteFixture(RpcAgentTestFixture):
        rank: int
        file_name: str

        @property
        def rpc_backend(self) -> Any:
            return None  # nbremote has one transport: the kernels' channels

        @property
        def rpc_backend_options(self) -> Any:
            import torch.distributed.rpc as rpc

            return rpc.TensorPipeRpcBackendOptions(init_method=self.init_method)

        def get_shutdown_error_regex(self) -> str:
            return ".*"

        def get_timeout_error_regex(self) -> str:
            return "RPC ran for more than"

        def _handle_test_skip(self, message: str) -> None:  # skip_if_lt_x_gpu: a skip, not sys.exit
            raise unittest.SkipTest(message)

    name = _composed_name(test_class.__name__)
    return type(name, (test_class, NbRemoteFixture, TestCase), {"__module__": test_class.__module__,
                                                                 "__qualname__": name})
