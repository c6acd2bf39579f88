"""The modules the benchmark builds remotely, importable by name in every process.

``SeededLinear`` is the RemoteModule case's ``Linear(16, 16)``; the split model (``Stage`` x 2 on two
workers, ``Head`` local) is the training case's; ``MLPStage`` x 4 on four workers the 4-stage cases'
(``MLPShard`` the same stage as torch's pipeline example writes it); ``PSModel`` and ``PSTrainer`` the
parameter server's. Each seeds its own weights, so whichever process builds it gets the same numbers, and
every system's first output or loss can be checked against the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

BATCH = 32  # both cases
LR, MOMENTUM = 0.01, 0.9  # the training case's SGD


class SeededLinear(nn.Linear):
    """``Linear(16, 16)`` with the same weights wherever it is built."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(16, 16)


def linear_input() -> torch.Tensor:
    return torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(1))


class Stage(nn.Module):
    def __init__(self, n_in: int, n_out: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the same weights in whichever process builds it
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Head(nn.Module):
    def __init__(self, seed: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 64, generator=generator), torch.randn(BATCH, 1, generator=generator)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def split_model(api: Any, workers: Sequence[str]) -> tuple[Callable[[], torch.Tensor], Any, torch.Tensor]:
    """The split model built with ``api`` (nbremote's or torch's): a ``Stage`` on each of two workers, the
    ``Head`` here, SGD over all three; (its forward over ``data()``, its DistributedOptimizer, the target)."""
    stage1 = api.remote_module(f"{workers[0]}/cpu", Stage, args=(64, 256, 1))
    stage2 = api.remote_module(f"{workers[1]}/cpu", Stage, args=(256, 64, 2))
    head = Head()
    params = stage1.remote_parameters() + stage2.remote_parameters() + [api.rpc.RRef(p) for p in head.parameters()]
    opt = api.distributed_optimizer(torch.optim.SGD, params, lr=LR, momentum=MOMENTUM)
    x, y = data()
    return lambda: head(stage2(stage1(x))), opt, y


# -- the 4-stage model: an MLP over four workers, batch 64, with compute that matters -------------------------

STAGES4 = 4
BATCH4 = 64
WIDTH4 = 256


class MLPStage(nn.Module):
    """One of the 4-stage model's stages: 256 -> 512 -> 256, tanh after each layer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(WIDTH4, 2 * WIDTH4)
        self.fc2 = nn.Linear(2 * WIDTH4, WIDTH4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc2(torch.tanh(self.fc1(x))))


class MLPShard(MLPStage):
    """A stage as torch's pipeline example writes its shards: it takes an RRef to its input and fetches it
    (from the previous stage directly), and a lock keeps micro-batches from running it at once."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        import threading

        self._lock = threading.Lock()

    def forward(self, x_rref: Any) -> torch.Tensor:  # type: ignore[override]
        x = x_rref.to_here()
        with self._lock:
            return super().forward(x)

    def parameter_rrefs(self) -> list[Any]:
        from torch.distributed.rpc import RRef

        return [RRef(p) for p in self.parameters()]


def data4() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return torch.randn(BATCH4, WIDTH4, generator=generator), torch.randn(BATCH4, WIDTH4, generator=generator)


def mlp4_model(api: Any, workers: Sequence[str]) -> tuple[Callable[[], torch.Tensor], Any, torch.Tensor]:
    """The 4-stage model built with ``api``: an ``MLPStage`` on each of four workers, SGD over all four; (its
    forward over ``data4()``, a plain loop in which each activation comes back here and goes out again, its
    DistributedOptimizer, the target)."""
    stages = [api.remote_module(f"{w}/cpu", MLPStage, args=(10 + i,)) for i, w in enumerate(workers[:STAGES4])]
    opt = api.distributed_optimizer(torch.optim.SGD, [p for s in stages for p in s.remote_parameters()],
                                    lr=LR, momentum=MOMENTUM)
    x, y = data4()

    def forward() -> torch.Tensor:
        h = x
        for stage in stages:
            h = stage(h)
        return h

    return forward, opt, y


# -- the parameter server: two trainers, each running its own loop against one model on a worker ----------



class PSModel(nn.Module):
    """The parameter server's model: the split model's two stages and head, in one module. Trainers take
    turns on it for a whole step (``turn``), the fix upstream proposed for its example's race: a step's
    in-place update would otherwise change what another trainer's backward still needs."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.net = nn.Sequential(Stage(64, 256, 1), Stage(256, 64, 2), Head())
        self.turn = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _library(name: str) -> tuple[Any, Any, Any]:
    """(rpc, dist_autograd, DistributedOptimizer) of the library a trainer runs with."""
    if name == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as trpc
        from torch.distributed.optim import DistributedOptimizer

        return trpc, dist_autograd, DistributedOptimizer
    import nbremote.autograd as nbr_autograd
    from nbremote import rpc as nrpc
    from nbremote.optim import DistributedOptimizer as NbrOptimizer

    return nrpc, nbr_autograd, NbrOptimizer


def ps_forward(model_rref: Any, x: torch.Tensor) -> torch.Tensor:
    return model_rref.local_value()(x)


def ps_take_turn(model_rref: Any) -> None:
    model_rref.local_value().turn.acquire()


def ps_end_turn(model_rref: Any) -> None:
    model_rref.local_value().turn.release()


def ps_parameters(model_rref: Any, library: str) -> list[Any]:
    rpc, _, _ = _library(library)
    return [rpc.RRef(p) for p in model_rref.local_value().parameters()]


class PSTrainer:
    """Lives on a trainer: its optimizer over the server's parameters, and its data."""

    def __init__(self, server: str, model_rref: Any, library: str) -> None:
        self.rpc, self.dist_autograd, optimizer = _library(library)
        self.server, self.model_rref = server, model_rref
        params = self.rpc.rpc_sync(server, ps_parameters, args=(model_rref, library))
        self.opt = optimizer(torch.optim.SGD, params, lr=LR, momentum=MOMENTUM)
        self.x, self.y = data()

    def steps(self, n: int) -> float:
        loss = torch.zeros(())
        rpc, server, model = self.rpc, self.server, self.model_rref
        for _ in range(n):
            rpc.rpc_sync(server, ps_take_turn, args=(model,))
            try:
                with self.dist_autograd.context() as context_id:
                    loss = mse(rpc.rpc_sync(server, ps_forward, args=(model, self.x)), self.y)
                    self.dist_autograd.backward(context_id, [loss])
                    self.opt.step(context_id)
            finally:
                rpc.rpc_sync(server, ps_end_turn, args=(model,))
        return float(loss.detach())


def ps_run(trainer_rref: Any, n: int) -> float:
    return trainer_rref.local_value().steps(n)
