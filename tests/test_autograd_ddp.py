"""DistributedDataParallel inside ``nbremote.autograd.backward`` all-reduces, as under torch's engine (issue 40).

Two trainers (worker1, worker2) hold a DDP-wrapped ``Linear`` and a gloo group between them; a stage on
worker3 (a ``RemoteModule``) feeds both. Each step, in each trainer, the loss's local gradient of the
replica alone is computed first (``autograd.grad``, which runs no hooks), then the distributed backward:
the context must hold the average of the two replicas' local gradients -- the same tensor on both --
and after ``DistributedOptimizer`` steps the replicas must still be equal. Before the fix each trainer
kept its own gradient and the replicas drifted apart, without a word.

The whole DDP+RPC program (torch's tutorial) against torch itself is in ``test_examples``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import run_script

import nbremote.autograd as dist_autograd
from nbremote import rpc
from nbremote.nn import RemoteModule
from nbremote.optim import DistributedOptimizer

pytestmark = pytest.mark.timeout(120)

STEPS = 4


# -- run on the trainers ------------------------------------------------------------------------------------


def ddp_steps(rank: int, stage: RemoteModule, steps: int) -> dict[str, Any]:
    """Train a DDP replica fed by ``stage``; per step, the replica's own gradient and the context's."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(rank)  # different initial weights: DDP's broadcast from rank 0 must make them equal
    fc = torch.nn.Linear(4, 3)
    model = DistributedDataParallel(fc)
    params = [fc.weight, fc.bias]
    opt = DistributedOptimizer(torch.optim.SGD, [*stage.remote_parameters(), *map(rpc.RRef, params)], lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)
    out: dict[str, Any] = {"own": [], "context": [], "dot_grad": []}
    for _ in range(steps):
        x = torch.randn(5, 2, generator=data)
        with dist_autograd.context() as context_id:
            loss = model(stage(x)).pow(2).mean()
            out["own"].append([g.clone() for g in torch.autograd.grad(loss, params, retain_graph=True)])
            dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)
            out["context"].append([grads[p].clone() for p in params])
            out["dot_grad"].append([p.grad for p in params])
            opt.step(context_id)
    out["weights"] = [p.detach().clone() for p in params]
    return out


# -- the tests ----------------------------------------------------------------------------------------------


@pytest.fixture
def trainers(world: list[str]) -> Iterator[list[str]]:
    names = world[:2]
    rpc.init_process_group(names, "gloo")
    try:
        yield names
    finally:
        rpc.destroy_process_group(names)


def test_ddp_gradients_are_averaged_inside_a_distributed_backward(world: list[str], trainers: list[str]) -> None:
    stage = RemoteModule(f"{world[2]}/cpu", torch.nn.Linear, args=(2, 4))
    futures = [rpc.rpc_async(name, ddp_steps, args=(rank, stage, STEPS)) for rank, name in enumerate(trainers)]
    first, second = (fut.wait() for fut in futures)
    for step in range(STEPS):
        for i, name in enumerate(("weight", "bias")):
            mine, theirs = first["context"][step][i], second["context"][step][i]
            assert torch.equal(mine, theirs), f"step {step}: the replicas' {name} gradients differ"
            average = (first["own"][step][i] + second["own"][step][i]) / 2
            assert torch.allclose(mine, average, rtol=1e-6, atol=1e-7), (
                f"step {step}: the {name} gradient is not the replicas' average (DDP did not all-reduce)")
            assert not torch.equal(first["own"][step][i], second["own"][step][i])  # else the check proves nothing
            assert first["dot_grad"][step][i] is None  # the context keeps gradients, .grad is left alone
    for mine, theirs in zip(first["weights"], second["weights"], strict=True):
        assert torch.equal(mine, theirs), "the DDP replicas drifted apart"


def test_a_ddp_module_made_before_the_first_pass_is_found() -> None:
    """nbremote starts recording DDP modules at its first backward pass in a process; one made earlier is
    found then, by a single scan (a fresh process: in the shared workers a pass has run long ago)."""
    out = run_script("""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        early = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        from nbremote.frameworks import _ddp
        plain = torch.nn.Linear(2, 2)
        found = _ddp.data_parallel([*early.module.parameters(), *plain.parameters()])  # the first: a scan
        later = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))  # recorded as it is made
        print(found == [early], _ddp.data_parallel(list(later.module.parameters())) == [later],
              _ddp.data_parallel(list(plain.parameters())) == [])
        before = len(_ddp._managed)
        del later
        import gc; gc.collect()
        print(len(_ddp._managed) == before - 2)  # a module that is gone leaves no entries behind
        dist.destroy_process_group()
    """)
    assert out.stdout.split() == ["True", "True", "True", "True"], out.stderr[-2000:]
