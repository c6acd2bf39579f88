"""The work itself in this process, for orientation: the RemoteModule's forward and the training step local."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _cases import LOCAL, Case
from _system import OpSystem


class Local(OpSystem):
    name = LOCAL

    def supports(self, case: Case) -> bool:
        return case.kind in ("module", "train")

    def make(self, case: Case) -> tuple[dict[str, Any], Callable[[], Any]]:
        return self._forward() if case.kind == "module" else self._training()

    @staticmethod
    def _forward() -> tuple[dict[str, Any], Callable[[], Any]]:
        from _models import SeededLinear, linear_input

        module, x = SeededLinear(), linear_input()
        return {}, lambda: module(x)

    @staticmethod
    def _training() -> tuple[dict[str, Any], Callable[[], Any]]:
        import torch
        from _models import LR, MOMENTUM, Head, Stage, data, mse
        from torch import nn

        model = nn.Sequential(Stage(64, 256, 1), Stage(256, 64, 2), Head())
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        x, y = data()

        def step() -> float:
            opt.zero_grad()
            loss = mse(model(x), y)
            loss.backward()
            opt.step()
            return float(loss.detach())

        return {"first_loss": step()}, step
