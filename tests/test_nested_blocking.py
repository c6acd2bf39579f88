"""Handlers that block on nested calls must not starve the pool that serves those calls (issue 21).

Every ``rpc_sync`` made inside a call is a handler thread waiting for a reply that another handler has
to produce. With a fixed cap on a pool's threads, enough of them waiting at once left no thread for the
calls they waited for: A->B->A nesting deeper than the cap stalled every time, and torch's
``test_async_dist_autograd`` (60 concurrent backward passes against rank 0) stalled in 10 of 15 runs with
rank 0's 128 threads all blocked and 154 calls queued, when each backward hop was a nested call. Hops are
notifications now (``nbremote.autograd``), so the second holds no thread while it waits, and the pool's
accounting of blocked threads (``_core.pool``) is what lets the first finish; both are checked here, with
their answers (each rank's pool grows past 128 threads while its handlers wait, then shrinks back).
"""

from __future__ import annotations

import pytest
import remote_fns as fns
import torch

from nbremote import rpc
from nbremote.rpc._core import current_agent

pytestmark = pytest.mark.timeout(240)


def test_sixty_concurrent_backward_passes_against_one_rank(world: list[str]) -> None:
    """torch's test_async_dist_autograd: 20 threads on each of the three workers, every pass through the driver."""
    futures = [rpc.rpc_async(w, fns.backward_storm, args=("driver", 20), timeout=180) for w in world]
    checked = [f.wait() for f in futures]
    assert checked == [20, 20, 20]  # every pass finished, each with the gradients local autograd gives


def test_deep_nesting_past_the_pool_cap(world: list[str]) -> None:
    """driver -> worker1 -> driver -> ... 300 hops deep: 150 handlers of each side wait at once, more than the
    128 threads a pool may run."""
    depth = 300
    route = rpc.rpc_sync("worker1", fns.ping_pong, args=("driver", depth), timeout=180)
    assert route == ["worker1", "driver"] * (depth // 2) + ["worker1"]
    # The pool grew while its handlers waited, and what it counted as blocked went back to zero.
    assert current_agent()._executor.blocked == 0


def test_a_handler_blocked_on_a_torch_future_is_no_nbremote_wait(world: list[str]) -> None:
    """Only nbremote's waits are known to the pool; a torch future waited on in a handler still works."""
    assert rpc.rpc_sync("worker2", fns.wait_on_torch_future, args=("worker3",)) == 42
    assert torch.futures.wait_all([rpc.rpc_async("worker1", fns.add, args=(1, 2))]) == [3]
