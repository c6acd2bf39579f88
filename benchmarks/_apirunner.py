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
    """Runs the call, echo, burst, module and training cases through ``api`` on ``workers``.

    ``noop`` is the function of the small call: ``_fns.noop`` (imported by name), or one defined in a
    ``__main__`` module to measure what a notebook user sees (cloudpickle ships it by value).
    """

    KINDS = ("call", "echo", "burst", "module", "train", "fused", "train4", "pipe4", "pipe4rref", "ps")

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
        from _models import mse, split_model

        api = self.api
        forward, opt, y = split_model(api, self.workers)
        fused = case.kind == "fused" and not self._torch  # torch has no fused step: it runs the plain one

        def step() -> float:
            with api.dist_autograd.context() as context_id:
                loss = mse(forward(), y)
                if fused:  # each owner steps as soon as the backward pass is through with it
                    opt.backward_and_step(context_id, [loss])
                else:
                    api.dist_autograd.backward(context_id, [loss])
                    opt.step(context_id)
            return float(loss.detach())

        return {"first_loss": step()}, step

    _make_fused = _make_train

    # -- the 4-stage model, plain and pipelined, and the parameter server ---------------------------------------
    @property
    def _torch(self) -> bool:
        return str(self.api.rpc.__name__).startswith("torch")

    def _step(self, forward: Callable[[], Any], target: Any, opt: Any) -> Callable[[], float]:
        """One training step: ``forward()`` inside a distributed autograd context, MSE against ``target``."""
        from _models import mse

        dist_autograd = self.api.dist_autograd

        def step() -> float:
            with dist_autograd.context() as context_id:
                loss = mse(forward(), target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            return float(loss.detach())

        return step

    def _make_train4(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        from _models import mlp4_model

        forward, opt, y = mlp4_model(self.api, self.workers)
        step = self._step(forward, y, opt)
        return {"first_loss": step()}, step

    def _make_pipe4(self, case: Case, *, rrefs: bool = False) -> tuple[dict[str, Any], Callable[[], Any]]:
        import torch
        from _cases import MICRO_BATCHES as MICRO
        from _models import BATCH4, LR, MOMENTUM, STAGES4, MLPShard, MLPStage, data4

        x, y = data4()
        chunks = x.split(BATCH4 // MICRO)
        rpc = self.api.rpc
        if self._torch:  # torch's pipeline example: RRefs to shards, each fetching its input's RRef
            shards = [rpc.remote(w, MLPShard, args=(10 + i,)) for i, w in enumerate(self.workers[:STAGES4])]
            params = [p for shard in shards for p in shard.rpc_sync().parameter_rrefs()]

            def forward() -> Any:
                futures = []
                for chunk in chunks:
                    h = rpc.RRef(chunk)
                    for shard in shards[:-1]:
                        h = shard.remote().forward(h)
                    futures.append(shards[-1].rpc_async().forward(h))
                return torch.cat(torch.futures.wait_all(futures))
        elif rrefs:  # nbremote, the same pattern: a stage's output stays on its worker (remote_forward)
            stages = [self.api.remote_module(f"{w}/cpu", MLPStage, args=(10 + i,))
                      for i, w in enumerate(self.workers[:STAGES4])]
            params = [p for s in stages for p in s.remote_parameters()]

            def forward() -> Any:
                futures = []
                for chunk in chunks:
                    h = chunk
                    for stage in stages[:-1]:
                        h = stage.remote_forward(h)
                    futures.append(stages[-1].forward_async(h))
                return torch.cat(rpc.wait_all(futures))
        else:  # nbremote's pipeline: RemoteSequential, each stage calling the next with its output
            from nbremote.nn import RemoteSequential

            pipe = RemoteSequential([self.api.remote_module(f"{w}/cpu", MLPStage, args=(10 + i,))
                                     for i, w in enumerate(self.workers[:STAGES4])])
            params = pipe.remote_parameters()

            def forward() -> Any:
                return torch.cat(rpc.wait_all([pipe.forward_async(chunk) for chunk in chunks]))

        opt = self.api.distributed_optimizer(torch.optim.SGD, params, lr=LR, momentum=MOMENTUM)
        step = self._step(forward, y, opt)
        return {"first_loss": step()}, step

    def _make_pipe4rref(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        return self._make_pipe4(case, rrefs=True)

    def _make_ps(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        from _cases import PS_STEPS
        from _models import PSModel, PSTrainer, ps_run

        rpc = self.api.rpc
        server, trainers = self.workers[0], self.workers[1:3]
        model = rpc.remote(server, PSModel)
        library = "torch" if self._torch else "nbremote"
        handles = [rpc.remote(t, PSTrainer, args=(server, model, library)) for t in trainers]
        first = rpc.rpc_sync(trainers[0], ps_run, args=(handles[0], 1), timeout=CALL_TIMEOUT)  # alone: repeatable

        def run() -> None:
            futures = [rpc.rpc_async(t, ps_run, args=(h, PS_STEPS), timeout=CALL_TIMEOUT)
                       for t, h in zip(trainers, handles, strict=True)]
            for future in futures:
                future.wait()

        return {"first_loss": first}, run
