"""Snapshots of RemoteModules on real kernels: what they hold (weights, Adam's moments), when they are taken,
where they go (memory, a directory, an fsspec URL), and what a snapshot that does not fit does (nothing).
Recovery after a lost worker is in ``tests/faults/test_recovery.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import remote_fns as fns
import torch
from conftest import run_script

import nbremote.autograd as dist_autograd
from nbremote import rpc
from nbremote.errors import SnapshotError
from nbremote.nn import DirectoryStore, RemoteModule, Snapshot
from nbremote.optim import DistributedOptimizer

pytestmark = pytest.mark.timeout(120)


class Net(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, width)
        self.fc2 = torch.nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def train(net: RemoteModule, opt: DistributedOptimizer, steps: int, seed: int = 0) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        with dist_autograd.context() as ctx:
            loss = net(torch.randn(8, 4, generator=gen)).pow(2).mean()
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        losses.append(loss.item())
    return losses


def equal_states(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_snapshot_holds_the_weights_and_adams_moments_of_its_step(world: list[str]) -> None:
    net = RemoteModule("worker1/cpu", Net)
    opt = DistributedOptimizer(torch.optim.Adam, net.remote_parameters(), lr=0.01)
    train(net, opt, 3)
    snap = net.snapshot()
    assert isinstance(snap, Snapshot) and snap.step == 3 and snap.worker == "worker1" and snap.module_type == "Net"
    assert equal_states(snap.state, net.remote_state_dict())
    local = opt.remote_optimizers[0]
    part = snap.optimizers[local._id]
    live = rpc.rpc_sync("worker1", fns.optimizer_state, args=(local._id,))
    assert sorted(part.positions) == sorted(live) == [0, 1, 2, 3]
    for pos, state in live.items():
        assert state.keys() == part.state[pos].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(state[k], part.state[pos][k]) for k in state)
    assert part.groups[0]["lr"] == 0.01
    train(net, opt, 1)  # the snapshot is a copy: training on does not change it
    assert not torch.equal(snap.state["fc1.weight"], net.remote_state_dict()["fc1.weight"])
    assert "Net from worker1 at step 3" in repr(snap)


def test_snapshot_every_n_steps_is_versioned_by_step_and_memory_is_bounded(world: list[str]) -> None:
    net = RemoteModule("worker2/cpu", Net, snapshot_every=2)
    opt = DistributedOptimizer(torch.optim.SGD, net.remote_parameters(), lr=0.1)
    assert net.snapshots is not None and net.snapshots.steps() == []
    train(net, opt, 7)
    assert net.snapshots.steps() == [4, 6], "every 2nd step, the last 2 kept"
    six = net.snapshots.get()
    assert six.step == 6 and net.snapshots.get(4).step == 4
    with pytest.raises(SnapshotError, match="no snapshot of step 2 in memory"):
        net.snapshots.get(2)
    loaded = net.load_snapshot(step=4)  # back to step 4, in place
    assert loaded.step == 4 and equal_states(net.remote_state_dict(), net.snapshots.get(4).state)


def test_a_snapshot_that_does_not_fit_is_refused_naming_the_keys_and_the_weights_stay(world: list[str]) -> None:
    net = RemoteModule("worker3/cpu", Net)
    before = net.remote_state_dict()
    wider = RemoteModule("worker3/cpu", Net, kwargs={"width": 16}).snapshot()
    with pytest.raises(SnapshotError, match=r"other shapes.*fc1\.weight \(16, 4\) -> \(8, 4\)") as info:
        net.load_snapshot(wider)
    assert "fc2.weight" in str(info.value) and "weights were kept" in str(info.value)
    linear = RemoteModule("worker3/cpu", torch.nn.Linear, args=(4, 8)).snapshot()
    with pytest.raises(SnapshotError, match=r"is of a Linear .* is a Net"):
        net.load_snapshot(linear)
    renamed = Snapshot(linear.worker, "Net", 0, True, {"fc1.weight": torch.zeros(8, 4), "extra": torch.zeros(1)})
    with pytest.raises(SnapshotError, match=r"missing from the snapshot: fc1\.bias, fc2\.weight, fc2\.bias; "
                                            r"not in the module: extra"):
        net.load_snapshot(renamed)
    assert equal_states(net.remote_state_dict(), before)
    assert net(torch.ones(1, 4)).shape == (1, 2)


def test_snapshots_to_an_fsspec_url_keep_what_they_are_told(world: list[str]) -> None:
    pytest.importorskip("fsspec")
    net = RemoteModule("worker1/cpu", Net, snapshot_every=1, snapshot_to="memory://nbremote-test/net")
    opt = DistributedOptimizer(torch.optim.SGD, net.remote_parameters(), lr=0.1)
    train(net, opt, 3)
    store = DirectoryStore("memory://nbremote-test/net")
    assert store.steps() == [1, 2, 3] and equal_states(store.get().state, net.remote_state_dict())
    with pytest.raises(SnapshotError, match="no snapshot of step 9"):
        store.get(9)


def test_a_snapshot_in_a_directory_survives_its_driver_and_loads_into_a_new_world(world: list[str],
                                                                                  tmp_path: Path) -> None:
    where = tmp_path / "net"
    script = f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        import nbremote.autograd as dist_autograd
        from nbremote import rpc
        from nbremote.nn import RemoteModule
        from nbremote.optim import DistributedOptimizer
        from test_snapshots import Net, train

        rpc.init_rpc("first", workers=["w"])
        net = RemoteModule("w/cpu", Net, snapshot_every=2, snapshot_to={str(where)!r})
        opt = DistributedOptimizer(torch.optim.Adam, net.remote_parameters(), lr=0.01)
        train(net, opt, 4)
        print("done", flush=True)
        rpc.shutdown()
    """
    done = run_script(script, timeout=120)
    assert "done" in done.stdout, done.stderr[-3000:]
    assert DirectoryStore(where).steps() == [2, 4]
    saved = DirectoryStore(where).get()
    net = RemoteModule("worker2/cpu", Net)
    opt = DistributedOptimizer(torch.optim.Adam, net.remote_parameters(), lr=0.01)
    loaded = net.load_snapshot(where, optimizer=opt)
    assert loaded.step == 4 and equal_states(net.remote_state_dict(), saved.state)
    local = opt.remote_optimizers[0]
    live = rpc.rpc_sync("worker2", fns.optimizer_state, args=(local._id,))
    (part,) = saved.optimizers.values()
    assert sorted(live) == sorted(part.state)
    assert all(torch.equal(live[pos][k], part.state[pos][k]) for pos in live for k in live[pos])
