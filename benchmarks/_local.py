"""The work itself in this process, for orientation: the RemoteModule's forward and the training step local."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _cases import LOCAL, Case
from _system import OpSystem


class Local(OpSystem):
    name = LOCAL

    def supports(self, case: Case) -> bool:
        return case.kind in ("module", "train", "fused", "train4", "pipe4", "pipe4rref", "ps")

    def make(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        if case.kind == "module":
            return self._forward()
        if case.kind in ("train4", "pipe4", "pipe4rref"):
            return self._training4()
        if case.kind == "ps":
            return self._server()
        return self._training()

    @staticmethod
    def _forward() -> tuple[dict[str, Any], Callable[[], Any]]:
        from _models import SeededLinear, linear_input

        module, x = SeededLinear(), linear_input()
        return {}, lambda: module(x)

    @staticmethod
    def _training() -> tuple[dict[str, Any], Callable[[], Any]]:
        from _models import Head, Stage, data
        from torch import nn

        return _sgd_steps(nn.Sequential(Stage(64, 256, 1), Stage(256, 64, 2), Head()), *data())

    @staticmethod
    def _training4() -> tuple[dict[str, Any], Callable[[], Any]]:
        """The 4-stage model's step in one process (pipelined or not, the same arithmetic)."""
        from _models import STAGES4, MLPStage, data4
        from torch import nn

        return _sgd_steps(nn.Sequential(*(MLPStage(10 + i) for i in range(STAGES4))), *data4())

    @staticmethod
    def _server() -> tuple[dict[str, Any], Callable[[], Any]]:
        """The parameter server's work in one process: both trainers' steps, one after the other."""
        from _cases import PS_STEPS
        from _models import PSModel, data

        first, step = _sgd_steps(PSModel(), *data())
        return first, lambda: [step() for _ in range(2 * PS_STEPS)]


def _sgd_steps(model: Any, x: Any, y: Any) -> tuple[dict[str, Any], Callable[[], Any]]:
    """A training step of ``model`` in one process, as the cases' (SGD with momentum, MSE): its first loss, and it."""
    import torch
    from _models import LR, MOMENTUM, mse

    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def step() -> float:
        opt.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return {"first_loss": step()}, step
