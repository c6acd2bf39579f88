"""After a worker is lost: what was not restored fails at once and says so; what had a snapshot comes back
in place (``rpc.restart_worker``), bit for bit, and training goes on."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from nbremote import rpc
from nbremote.errors import RRefLostError
from nbremote.nn import RemoteModule

from . import fault_fns as ffns
from .conftest import failure_of

pytestmark = pytest.mark.timeout(120)

FAST = 2.5  # s: "at once", with slack for this loaded 2-core machine


def test_handles_of_a_restarted_worker_without_snapshots_fail_at_once(world: list[str], victim: str,
                                                                      record: Callable[..., None]) -> None:
    net = RemoteModule(f"{victim}/cpu", torch.nn.Linear, args=(4, 2))
    rref = rpc.remote(victim, list, args=([1, 2],))
    slot = rpc.rpc_sync("worker1", ffns.keep, args=(rref,))  # a copy held by another worker
    assert rref.to_here() == [1, 2]
    try:
        rpc.restart_worker(victim)
        restarted = time.monotonic()
        exc, to_error = failure_of(lambda: net(torch.ones(1, 4)), restarted)
        assert isinstance(exc, RRefLostError) and exc.worker == victim, repr(exc)
        assert "restart_worker('victim')" in str(exc) and "had no snapshot" in str(exc), str(exc)
        assert to_error < FAST, "a module of an earlier kernel must fail at once, not after the call timeout"
        for use in (net.remote_parameters, net.remote_state_dict, lambda: net.train(False)):
            lost, _ = failure_of(use, restarted)
            assert isinstance(lost, RRefLostError) and "had no snapshot" in str(lost), repr(lost)
        for use in (rref.to_here, lambda: rpc.rpc_sync("worker1", ffns.kept_to_here, args=(slot,))):
            t0 = time.monotonic()
            lost, elapsed = failure_of(use, t0)
            assert isinstance(lost, RRefLostError) and lost.worker == victim, repr(lost)
            assert "earlier kernel of 'victim'" in str(lost) and elapsed < FAST, (str(lost), elapsed)
        # the new kernel works: new values, new modules
        assert rpc.remote(victim, list, args=([3],)).to_here() == [3]
        assert RemoteModule(f"{victim}/cpu", torch.nn.Linear, args=(4, 2))(torch.ones(1, 4)).shape == (1, 2)
    finally:
        rpc.rpc_sync("worker1", ffns.drop_kept)
    record("use of a module/RRef made before rpc.restart_worker (no snapshot)", "RRefLostError at once", exc,
           to_error, None, "the module and values of the old kernel (named)")
