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

Start-up, replaced by the running world (the overlay's ``init_rpc`` / ``shutdown``, see ``shim``):

* ``init_rpc`` checks that the name and rank it is given are this process's in the running world and
  that ``world_size`` fits in it (``RuntimeError`` otherwise, as torch's rendezvous would fail), and
  applies the one option nbremote has, ``rpc_backend_options.rpc_timeout``, as the default timeout;
* ``shutdown(graceful=True)`` is torch's graceful shutdown without the ending: each rank waits until its
  own calls are answered, then for the test's other ranks to get there (a barrier held by rank 0), twice,
  so that calls made by handlers while others waited are finished too; a rank that failed releases the
  others at once. ``graceful=False`` returns at once. The world keeps running for the next test.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import time
import traceback
import unittest
from typing import Any

from tests.conformance import shim

__all__ = ["install", "prepare", "rank_name", "run", "stack", "world_size_of"]

BARRIER_ROUNDS = 2
BARRIER_TIMEOUT = 60.0  # s a rank waits at shutdown for the others (the test's deadline is shorter)
_RUNNER_CALLS = {"prepare", "run", "stack", "_arrive", "_fail"}  # the runner's own calls (see _wait_idle)

_test: dict[str, Any] = {}  # this rank's test: "key", "world_size", "shutdowns" (how many so far)
_barrier_cond = threading.Condition()
_barriers: dict[Any, set[int]] = {}  # on rank 0: who arrived at each barrier of this test
_failed: list[int] = []  # on rank 0: ranks that failed in this test


def rank_name(rank: int) -> str:
    return f"worker{rank}"  # torch's dist_utils.worker_name


# -- start-up, replaced ------------------------------------------------------------------------------------


def init_rpc(name: str, backend: object = None, rank: int = -1, world_size: int | None = None,
             rpc_backend_options: object = None) -> None:
    """torch's ``init_rpc`` in a process that is already a member of the running world."""
    del backend  # nbremote has one transport
    from nbremote import rpc

    me = rpc.get_worker_info()
    members = len(rpc.workers())
    if name != me.name or rank not in (-1, me.id) or world_size not in (None, _test.get("world_size", members)):
        raise RuntimeError(
            f"init_rpc(name={name!r}, rank={rank}, world_size={world_size}) in the process that is "
            f"{me.name!r}, rank {me.id} of a running world of {members}")
    timeout = getattr(rpc_backend_options, "rpc_timeout", None)
    if isinstance(timeout, (int, float)) and timeout >= 0:
        _agent().default_timeout = float(timeout)


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """torch's graceful ``shutdown``, as a barrier of the test's ranks once each has no call pending."""
    del timeout
    if not graceful:
        return
    from nbremote import rpc

    rank = rpc.get_worker_info().id
    _test["shutdowns"] = _test.get("shutdowns", 0) + 1
    for round_ in range(BARRIER_ROUNDS):
        _wait_idle(BARRIER_TIMEOUT)
        _on_rank0(_arrive, (_test.get("key"), _test["shutdowns"], round_), rank)


def _arrive(key: Any, rank: int) -> None:
    """On rank 0: return once every rank of the test has arrived at barrier ``key`` (raise if one failed)."""
    size = _test["world_size"]
    with _barrier_cond:
        _barriers.setdefault(key, set()).add(rank)
        _barrier_cond.notify_all()
        if not _barrier_cond.wait_for(lambda: len(_barriers[key]) >= size or bool(_failed), BARRIER_TIMEOUT):
            raise RuntimeError(f"shutdown: rank {rank} waited {BARRIER_TIMEOUT:.0f} s at the barrier for ranks "
                               f"{sorted(set(range(size)) - _barriers[key])}")
        if len(_barriers[key]) < size:
            raise RuntimeError(f"shutdown: rank {rank} left the barrier: rank {_failed[0]} failed")


def _fail(key: str, rank: int) -> None:
    """On rank 0: ``rank`` failed in test ``key``; whoever waits at a barrier of this test gives up at once.
    (A rank of an earlier test that overran may report late: its key is not this test's.)"""
    with _barrier_cond:
        if key == _test.get("key"):
            _failed.append(rank)
            _barrier_cond.notify_all()


def _wait_idle(timeout: float) -> None:
    """Wait until this rank's calls are answered -- the test's: not the runner's own (``run`` and the barrier,
    which rank 0 has pending while the test runs), nor those an earlier, failed test left behind."""
    deadline = time.monotonic() + timeout
    earlier = _test.get("earlier_calls", set())
    while time.monotonic() < deadline:
        pending = [p.fut for cid, p in list(_agent().calls._pending.items())
                   if p.fn not in _RUNNER_CALLS and cid not in earlier]
        if not pending:
            return
        with contextlib.suppress(Exception):  # failures belong to whoever made the call
            pending[0].wait(max(0.0, deadline - time.monotonic()))


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
    _test.update(key=key, world_size=world_size, earlier_calls=set(_agent().calls._pending))
    import torch.distributed as dist

    if dist.is_initialized():  # a test's gloo group (initialize_pg): torch's harness destroys it at exit
        dist.destroy_process_group()
    _agent().default_timeout = default_timeout
    with _barrier_cond:
        _barriers.clear()
        _failed.clear()


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
            _on_rank0(_fail, _test.get("key"), rank)
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
