"""One program for both RPC libraries: the cases as written against torch.distributed.rpc's API.

nbremote mirrors that API (``rpc_sync``/``rpc_async``/``RemoteModule``/``dist_autograd``/
``DistributedOptimizer``), so :class:`ApiRunner` runs the very same code in nbremote's driver (this process)
and in rank 0 of a torch world (a spawned process, see ``_torchworld``): the two systems do identical work,
and each measures its own calls in its own process. Everything it calls remotely lives in ``_fns`` and
``_models``, imported by name on every side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import _fns
from _cases import Case
from _payload import make_payload, same_bits
from _system import CALL_TIMEOUT, OpSystem


@dataclass(frozen=True)
class RpcApi:
    """The parts of torch.distributed.rpc's API the cases use, from one library."""

    rpc: Any  # rpc_sync, rpc_async
    remote_module: Any
    dist_autograd: Any
    distributed_optimizer: Any


def nbremote_api() -> RpcApi:
    import nbremote.autograd
    from nbremote import rpc
    from nbremote.nn import RemoteModule
    from nbremote.optim import DistributedOptimizer

    return RpcApi(rpc, RemoteModule, nbremote.autograd, DistributedOptimizer)


def torch_api() -> RpcApi:
    import torch.distributed.autograd
    import torch.distributed.rpc
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer

    return RpcApi(torch.distributed.rpc, RemoteModule, torch.distributed.autograd, DistributedOptimizer)


class ApiRunner(OpSystem):
    """Runs call, echo, burst, module and train cases through ``api`` on ``workers``.

    ``noop`` is the function of the small call: ``_fns.noop`` (imported by name), or one defined in a
    ``__main__`` module to measure what a notebook user sees (cloudpickle ships it by value).
    """

    KINDS = ("call", "echo", "burst", "module", "train")

    def __init__(self, api: RpcApi, workers: Sequence[str], noop: Callable[[], None] = _fns.noop) -> None:
        super().__init__()
        self.api = api
        self.workers = list(workers)
        self.noop = noop

    def supports(self, case: Case) -> bool:
        return case.kind in self.KINDS

    def make(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        maker: Callable[[Case], tuple[dict[str, Any], Callable[[], Any]]] = getattr(self, f"_make_{case.kind}")
        return maker(case)

    # -- per kind: (what the check found, one timed sample) ----------------------------------------------
    def _call(self, fn: Callable[..., Any], *args: Any, to: str | None = None) -> Any:
        return self.api.rpc.rpc_sync(to or self.workers[0], fn, args=args, timeout=CALL_TIMEOUT)

    def _make_call(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        return {}, lambda: self._call(self.noop)

    def _make_echo(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        x = make_payload(case.nbytes, case.payload)
        info = {"bit_exact": same_bits(self._call(_fns.identity, x), x)}
        return info, lambda: self._call(_fns.identity, x)

    def _make_burst(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        workers = self.workers[: case.workers]
        rpc_async = self.api.rpc.rpc_async

        def burst() -> None:
            futures = [rpc_async(workers[i % len(workers)], _fns.noop, timeout=CALL_TIMEOUT)
                       for i in range(case.inflight)]
            for future in futures:
                future.wait()

        return {"in_flight": case.inflight}, burst

    def _make_module(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        import torch
        from _models import SeededLinear, linear_input

        rm = self.api.remote_module(f"{self.workers[0]}/cpu", SeededLinear)
        x = linear_input()
        out = rm(x)
        with torch.no_grad():
            expected = SeededLinear()(x)
        return {"same_as_local": bool(torch.equal(out.detach(), expected))}, lambda: rm(x)

    def _make_train(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        import torch
        from _models import LR, MOMENTUM, Head, Stage, data, mse

        api = self.api
        stage1 = api.remote_module(f"{self.workers[0]}/cpu", Stage, args=(64, 256, 1))
        stage2 = api.remote_module(f"{self.workers[1]}/cpu", Stage, args=(256, 64, 2))
        head = Head()
        params = stage1.remote_parameters() + stage2.remote_parameters() + [api.rpc.RRef(p) for p in head.parameters()]
        opt = api.distributed_optimizer(torch.optim.SGD, params, lr=LR, momentum=MOMENTUM)
        x, y = data()

        def step() -> float:
            with api.dist_autograd.context() as context_id:
                loss = mse(head(stage2(stage1(x))), y)
                api.dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            return float(loss.detach())

        return {"first_loss": step()}, step
